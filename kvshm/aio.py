"""The asyncio client: many requests in flight on one connection.

:class:`AsyncClient` has the methods of :class:`kvshm.Client`, each a coroutine. It
drives the same operation generators (``kvshm.client._Session``) as the sync client, so
the protocol is written once; what differs is the driver:

* One ZeroMQ DEALER socket (``zmq.asyncio``) per client, and a reader task that hands
  each reply to the future of the request with the same request id. A reply nobody waits
  for (its request was cancelled or timed out) is dropped.
* Every wait is bounded by the client's ``timeout`` and raises
  :class:`~kvshm.errors.ServerUnavailable` naming the server. A lost connection (the
  server died) fails every waiter at once; a timeout does too, and the next call
  reconnects. A same-host client also watches what the kernel proves
  (:mod:`kvshm.zmq_ctrl.serverwatch`): a server gone or replaced between calls is found
  before the send (a restart is then transparent), and during a wait within ``POLL_S``.
* Cancellation is safe. When a call is cancelled (``task.cancel()``,
  ``asyncio.wait_for``, ``asyncio.timeout``) after its LOOKUP or ALLOC went out, RELEASE
  or ABORT of that request id is queued and rides on the next request (any call,
  ``stats()`` or :meth:`AsyncClient.flush`). The server handles one connection's
  requests in order, so it applies the RELEASE after the LOOKUP it names, even when the
  LOOKUP's reply is still on its way. A cancelled put is aborted unless its COMMIT had
  already been sent.
* Copies larger than ``copy_threshold`` bytes run in a worker thread (the GIL released),
  so the event loop keeps serving other requests. A call cancelled during its copy waits
  for the copy to finish before the blocks are released or aborted, then raises
  CancelledError.

Use one AsyncClient per event loop. Works with uvloop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import time
import warnings
from typing import Any, Callable, Sequence

import zmq
import zmq.asyncio

from kvshm import localread
from kvshm.client import (
    _DONE,
    _HELLO_THROW,
    IDLE_FLUSH_S,
    Key,
    OpGen,
    _curve_setup,
    _door_token,
    _gone_unsent,
    _operator_token,
    count_of,
    found_of,
    prefix_of,
    _Drive,
    _Reply,
    _Req,
    _Restarted,
    _Session,
)
from kvshm.errors import (
    AuthenticationFailed,
    KeyNotFound,
    KvshmError,
    ProtocolError,
    ServerUnavailable,
)
from kvshm.zmq_ctrl.channel import check_resolvable, dealer_options, endpoint_of, ipc_denied
from kvshm.zmq_ctrl.protocol import DecodeError, Op, Status, decode_reply, encode_request
from kvshm.zmq_ctrl.serverwatch import IDLE_S, POLL_S, ServerGone

__all__ = ["AsyncClient"]

log = logging.getLogger(__name__)

_MONITOR_EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


_step = _Drive.step


def _copy_bytes(req: _Req, reply: _Reply) -> int:
    """Bytes the generator will copy when it gets ``reply`` (0 if it copies nothing)."""
    if reply.status != Status.OK:
        return 0
    if req.op == Op.ALLOC:
        sizes = req.body.get("sizes")
    elif req.op in (Op.LOOKUP, Op.GET):
        sizes = reply.body.get("sizes")
    else:
        return 0
    if not isinstance(sizes, list):
        return 0
    return sum(s for s in sizes if type(s) is int and s > 0)


class _Conn:
    """One DEALER socket, its reader and monitor tasks, and the requests waiting on it."""

    def __init__(self, client: "AsyncClient", endpoint: str) -> None:
        self.client = client
        self.endpoint = endpoint
        self.waiting: dict[int, asyncio.Future[tuple[int, dict[str, Any], list[Any]]]] = {}
        self.failed: BaseException | None = None
        # what the kernel proves about a same-host server (kvshm.zmq_ctrl.serverwatch;
        # set after a local HELLO): checked before a send after IDLE_S idle, and every
        # POLL_S while replies are awaited
        self.watch: Any = None
        self.last = 0.0             # time.monotonic() of the last reply
        self._tick: asyncio.TimerHandle | None = None
        why = ipc_denied(endpoint)      # (libzmq retries EACCES silently: said at once)
        if why is not None:
            raise ServerUnavailable(f"cannot connect to kvshm server at "
                                    f"{client._where(endpoint)}: {why}")
        s = client._ctx.socket(zmq.DEALER)
        self.monitor: Any = None
        try:
            dealer_options(s)    # one routing id per connection; CONNECT_TIMEOUT_MS
            if client._socket_setup is not None:
                client._socket_setup(s)
            if not endpoint.startswith("inproc://"):
                # a lost connection (the server died) or a refused handshake ends every
                # wait at once, with the reason, instead of a timeout
                self.monitor = s.get_monitor_socket(_MONITOR_EVENTS)
            s.connect(endpoint)
        except BaseException:
            self._close_sockets(s)
            raise
        self.sock = s
        loop = asyncio.get_running_loop()
        self.reader = loop.create_task(self._read())
        self.watcher = loop.create_task(self._watch()) if self.monitor is not None else None

    # ------------------------------------------------------------------ tasks

    async def _read(self) -> None:
        sock = self.sock
        while True:
            try:
                msg = await sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                return
            except zmq.ZMQError as exc:
                self.fail(ServerUnavailable, f"receive from kvshm server at "
                          f"{self.client._where(self.endpoint)} failed: {exc}")
                return
            try:
                status, rid, body = decode_reply(msg[0].buffer)
            except DecodeError as exc:
                self.fail(ProtocolError, f"bad reply from "
                          f"{self.client._where(self.endpoint)}: {exc}")
                return
            self.last = time.monotonic()
            fut = self.waiting.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result((status, body, msg[1:]))
            elif fut is None:
                # a request sent without a wait (write-behind PLACE/RESERVE), or of a
                # cancelled or timed-out one (dropped there)
                self.client._session.late_reply(rid, status, body)

    async def send(self, op: int, body: dict[str, Any], frames: Sequence[Any],
                   epoch: int, rid: int) -> None:
        """Send a request whose reply nobody awaits (it goes to the session's
        ``late_reply``)."""
        if self.failed is not None:
            raise type(self.failed)(str(self.failed))
        try:
            await self.sock.send_multipart([encode_request(op, rid, epoch, body), *frames],
                                           copy=False)
        except zmq.ZMQError as exc:
            self.fail(ServerUnavailable, f"cannot send to kvshm server at "
                      f"{self.client._where(self.endpoint)}: {exc}")
            raise ServerUnavailable(str(self.failed)) from None
        except BaseException as exc:
            self.fail(ServerUnavailable, f"connection to kvshm server at "
                      f"{self.client._where(self.endpoint)} dropped after a failed "
                      f"send ({exc!r})")
            raise

    async def _watch(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        closed_in_handshake = 0
        while True:
            try:
                ev = parse_monitor_message(await self.monitor.recv_multipart())
            except asyncio.CancelledError:
                return
            except zmq.ZMQError:
                return
            where = self.client._where(self.endpoint)
            event = ev["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                # the peer closed mid-handshake: a dying server (a DISCONNECTED follows),
                # or a CURVE server refusing a wrong server key (it happens again on the
                # reconnect): as kvshm.zmq_ctrl.channel.Channel
                closed_in_handshake += 1
                if closed_in_handshake < 2:
                    continue
            if event == zmq.EVENT_DISCONNECTED:
                if closed_in_handshake:
                    continue     # the reconnect tells which (else the timeout ends it)
                self.fail(ServerUnavailable, f"lost the connection to kvshm server at "
                          f"{where} (server gone?)")
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.fail(AuthenticationFailed, f"kvshm server at {where} refused the "
                          "connection: the server does not accept this client's CURVE key")
            else:
                self.fail(AuthenticationFailed, f"kvshm server at {where} refused the "
                          "connection: the security handshake failed: the server needs "
                          "CURVE (curve_server_key=...) or the key given is not the "
                          "server's")
            return

    # ------------------------------------------------------------------ requests

    async def request(self, op: int, body: dict[str, Any], frames: Sequence[Any],
                      epoch: int, rid: int) -> tuple[int, dict[str, Any], list[Any]]:
        if self.failed is not None:
            raise type(self.failed)(str(self.failed))
        loop = asyncio.get_running_loop()
        if self.watch is not None and time.monotonic() - self.last > IDLE_S:
            why = self.watch.gone()
            if why is not None:       # not sent: nothing was done (as STALE_EPOCH)
                msg = f"kvshm server at {self.client._where(self.endpoint)} is gone: {why}"
                self.fail(ServerGone, msg)
                raise ServerGone(msg, sent=False)
        fut: asyncio.Future[tuple[int, dict[str, Any], list[Any]]] = loop.create_future()
        self.waiting[rid] = fut
        timeout = self.client.timeout
        timer = loop.call_later(timeout, self._expire, rid, fut)
        try:
            try:
                await self.sock.send_multipart([encode_request(op, rid, epoch, body),
                                                *frames], copy=False)
            except zmq.ZMQError as exc:
                self.fail(ServerUnavailable, f"cannot send to kvshm server at "
                          f"{self.client._where(self.endpoint)}: {exc}")
            except BaseException as exc:
                # a frame failed after earlier parts went out: the socket holds a
                # half-sent message the next send would complete; this connection is done
                self.fail(ServerUnavailable, f"connection to kvshm server at "
                          f"{self.client._where(self.endpoint)} dropped after a failed "
                          f"send ({exc!r})")
                raise
            if self.watch is not None and self._tick is None:
                self._tick = loop.call_later(POLL_S, self._check)
            return await fut
        finally:
            timer.cancel()
            if self.waiting.get(rid) is fut:
                del self.waiting[rid]

    def _check(self) -> None:
        """While replies are awaited: fail them at once when the server is proven gone."""
        self._tick = None
        if self.failed is not None or not self.waiting:
            return
        why = self.watch.gone()
        if why is not None:
            self.fail(ServerGone, f"kvshm server at {self.client._where(self.endpoint)} is "
                      f"gone: {why}")
            return
        self._tick = asyncio.get_running_loop().call_later(POLL_S, self._check)

    def _expire(self, rid: int, fut: asyncio.Future[Any]) -> None:
        if fut.done():
            return
        # No reply within the timeout: the server is dead or stuck. Fail every request
        # on this connection (their replies would be as late); the next call reconnects.
        self.fail(ServerUnavailable, f"no reply from kvshm server at "
                  f"{self.client._where(self.endpoint)} within {self.client.timeout:g} s")

    def fail(self, cls: type[BaseException], message: str) -> None:
        """Fail every waiter with ``cls(message)`` and close the sockets (idempotent)."""
        if self.failed is None:
            self.failed = cls(message)
        waiting, self.waiting = self.waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(cls(message))
        self.client._conn_failed(self)
        self._shutdown()

    def _shutdown(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        for t in (self.reader, self.watcher):
            if t is not None and not t.done() and t is not _current_task():
                t.cancel()
        self._close_sockets(self.sock)

    def _close_sockets(self, s: Any) -> None:
        if self.monitor is not None:
            try:
                s.disable_monitor()
            except zmq.ZMQError:
                pass
            _force_close(self.monitor)
            self.monitor = None
        _force_close(s)

    async def aclose(self, message: str) -> None:
        self.fail(KvshmError, message)
        loop = asyncio.get_running_loop()
        tasks = [t for t in (self.reader, self.watcher)
                 if t is not None and not t.done() and t.get_loop() is loop]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _force_close(sock: Any) -> None:
    """Close a zmq.asyncio socket, also when its event loop is gone."""
    try:
        sock.close(0)
    except Exception as exc:   # the loop it was registered with is closed
        log.debug("closing a socket: %s", exc)
        if not sock.closed:
            zmq.Socket.close(sock, 0)


def _current_task() -> Any:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


class AsyncClient:
    """asyncio kvshm client: the methods of :class:`kvshm.Client`, as coroutines.

    Parameters
    ----------
    address, transport, timeout, lazy_commit, curve_server_key, curve_keypair, rdma
        As :class:`kvshm.Client`. ``timeout`` (seconds) bounds every await.
    write_behind : bool or int
        As :class:`kvshm.Client`: same-host puts copy into reserved blocks and send
        PLACE without awaiting its reply (the copy runs inline on the event loop).
    context : zmq.asyncio.Context or zmq.Context, optional
        A plain Context is shadowed; default ``zmq.asyncio.Context.instance()``.
    copy_threshold : int
        Copies of more bytes than this (one call's total) run in a worker thread so the
        event loop goes on; smaller ones run inline. Default 1 MiB.
    copy_threads : int
        Worker threads for those copies. Default 4.

    Notes
    -----
    Nothing is sent until the first call (or :meth:`connect`, or ``async with``).
    Requests of many coroutines share the connection; each reply goes to its own
    request. Cancelling a call releases its pins and pending writes (see the module
    docstring). Use the client from one event loop; :meth:`close` it (or ``async
    with``).

    Examples
    --------
    >>> async with kvshm.AsyncClient(address) as c:            # doctest: +SKIP
    ...     await c.put_batch(keys, values)
    ...     got = await asyncio.gather(*(c.get_batch(ks) for ks in groups))
    """

    def __init__(self, address: str = "127.0.0.1:12345", transport: str = "auto",
                 timeout: float = 5.0, *, lazy_commit: bool = False,
                 curve_server_key: bytes | str | None = None,
                 curve_keypair: tuple[bytes, bytes] | str | None = None,
                 context: zmq.Context | None = None, rdma: Any = None,
                 copy_threshold: int = 1 << 20, copy_threads: int = 4,
                 token: bytes | None = None, token_file: str | None = None,
                 write_behind: bool | int = False) -> None:
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {copy_threads}")
        self.address = address
        self.timeout = float(timeout)
        self.copy_threshold = int(copy_threshold)
        self._base_endpoint = endpoint_of(address)
        check_resolvable(self._base_endpoint)
        self._session = _Session(transport, lazy_commit, rdma,
                                 _door_token(self._base_endpoint, token, token_file),
                                 write_behind)
        self._session.operator_token = _operator_token(self._base_endpoint, None)
        self._socket_setup = _curve_setup(curve_server_key, curve_keypair)
        if context is None:
            self._ctx: zmq.asyncio.Context = zmq.asyncio.Context.instance()
        elif isinstance(context, zmq.asyncio.Context):
            self._ctx = context
        else:
            self._ctx = zmq.asyncio.Context.shadow(context.underlying)
        self._conn: _Conn | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hello_lock: asyncio.Lock | None = None
        self._hello_gen = 0
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=copy_threads, thread_name_prefix="kvshm-aio-copy")
        self._closed = False
        self._idle_handle: asyncio.TimerHandle | None = None
        self._idle_tasks: set[asyncio.Task[None]] = set()

    # ---------------------------------------------------------------- plumbing

    def _where(self, endpoint: str) -> str:
        return self.address if endpoint == self._base_endpoint else \
            f"{self.address} ({endpoint})"

    def _bind_loop(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._hello_lock = asyncio.Lock()
        elif self._loop is not loop:
            raise RuntimeError("this AsyncClient belongs to another event loop; make one "
                               "client per loop")
        assert self._hello_lock is not None
        return self._hello_lock

    def _conn_failed(self, conn: _Conn) -> None:
        if self._conn is conn:
            self._conn = None
            self._session.need_hello = True

    async def _ready(self) -> None:
        if self._closed:
            raise KvshmError("client is closed")
        self._session.check_owner()
        lock = self._bind_loop()
        if self._session.need_hello or self._conn is None:
            async with lock:
                if self._session.need_hello or self._conn is None:
                    await self._hello(fresh=True)

    async def _hello(self, *, fresh: bool) -> None:
        """Say HELLO (lock held). ``fresh``: on a new connection to the address given,
        then move to the server's ipc endpoint when the shm mover is used."""
        s = self._session
        s.need_hello = True
        if fresh or self._conn is None:
            old, self._conn = self._conn, None
            if old is not None:
                old.fail(ServerUnavailable, f"reconnecting to kvshm server at {self.address}")
            if s.last_watch is not None:       # raises when proven gone, none listening
                await asyncio.get_running_loop().run_in_executor(
                    None, s.check_gone, self._base_endpoint)
            self._conn = _Conn(self, self._base_endpoint)
        for _ in range(4):
            await self._hello_exchange()
            # a same-host client proves its liveness file; transport="auto" with RDMA on
            # both sides offers a QP (docs/RDMA.md): each is one more HELLO
            if not s.hello_again():
                break
            ipc = s.ipc_for_proof(self._conn.endpoint if self._conn else "")
            if fresh and ipc is not None:
                # the HELLO with the proof goes on the server's ipc endpoint (a new
                # connection, so a new routing id: its session is opened there)
                old, self._conn = self._conn, _Conn(self, ipc)
                assert old is not None
                old.fail(ServerUnavailable, "moved to the ipc endpoint")
        if self._conn is not None:
            self._conn.watch = s.server_watch(self._conn.endpoint)
        self._hello_gen += 1

    async def _hello_exchange(self) -> None:
        s = self._session
        conn = self._conn
        assert conn is not None
        rid = s.new_id()
        hb = s.hello_body()
        # the queued settle lists ride on it: applied to the old session first
        body = s.hello_piggyback(hb)
        try:
            st, body, frames = await conn.request(Op.HELLO, body, (), s.epoch, rid)
        except BaseException:
            if body is not hb:
                # its lazy COMMITs go again on the next HELLO (as Client._hello_locked)
                com = body.get("commit")
                if com:
                    s.hello_commits = [r for r in s.hello_commits if r not in com]
                s.requeue(body, failed=True)
            raise
        # attaching the segment pre-faults it: off the event loop. A cancel waits for it
        # (two HELLOs must never change the session at once).
        fut = asyncio.get_running_loop().run_in_executor(
            self._executor, s.apply_hello, _Reply(rid, st, body, frames), self.address)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                try:
                    await asyncio.wait({fut})
                except asyncio.CancelledError:
                    pass
            if not fut.cancelled():
                fut.exception()
            raise

    async def _roundtrip(self, drive: _Drive, req: _Req) -> _Reply:
        if self._closed:
            raise KvshmError("client is closed")
        s = self._session
        if req.noreply is not None:
            if s.need_hello or self._conn is None:
                await self._ready()
            conn = self._conn
            rid, body = drive.prepare(req)
            req.noreply(rid)
            try:
                if conn is None:
                    raise ServerUnavailable(f"not connected to kvshm server at "
                                            f"{self.address}")
                await conn.send(req.op, body, req.frames, s.epoch, rid)
            except BaseException:
                drive.failed()
                s.need_hello = True
                s.unsent(rid)         # not sent: this call's exception says so
                raise
            return _Reply(rid, Status.OK, {}, [])
        for attempt in range(3):
            if s.need_hello or self._conn is None:
                await self._ready()
            hello_gen = self._hello_gen
            conn = self._conn
            rid, body = drive.prepare(req)
            try:
                if conn is None:
                    s.need_hello = True
                    raise ServerUnavailable(f"not connected to kvshm server at {self.address}")
                st, rbody, rframes = await conn.request(req.op, body, req.frames, s.epoch,
                                                        rid)
            except BaseException as exc:
                if not _gone_unsent(exc):
                    # timed out, lost, cancelled: the server may hold what this request
                    # made; RELEASE/ABORT it with the next request
                    drive.failed()
                    raise
                # the same-host server is gone and the request was not sent: as
                # STALE_EPOCH (HELLO at the address, go again)
                st, rbody, rframes = Status.STALE_EPOCH, {}, []
            reply = _Reply(rid, st, rbody, rframes)
            what = drive.after(req, reply)
            if what == _DONE:
                return reply
            assert self._hello_lock is not None
            async with self._hello_lock:
                if self._hello_gen == hello_gen or s.need_hello:
                    await self._hello(fresh=self._conn is None)
            if what == _HELLO_THROW:
                raise _Restarted(f"kvshm server at {self.address} restarted during the "
                                 "operation")
        raise ServerUnavailable(f"kvshm server at {self.address} keeps forgetting this "
                                "client's session; retry")

    def run_op(self, gen: OpGen) -> Any:
        """Drive an operation generator to its result (a coroutine): the public seam
        for code that composes operations (see :meth:`kvshm.Client.run_op`)."""
        return self._run(gen)

    @property
    def session(self) -> _Session:
        """The protocol state the operation generators take (keys, limits, movers)."""
        return self._session

    async def _run(self, gen: OpGen, check: bool = True) -> Any:
        try:
            s = self._session
            if check and (s.wb_lost or s.wb_refused):
                s.raise_wb_errors()
            await self._ready()
        except BaseException:
            gen.close()
            raise
        drive = _Drive(self._session, gen)
        done, val = drive.start()
        while not done:
            req = val
            try:
                reply = await self._roundtrip(drive, req)
            except _Restarted as exc:
                done, val = _step(gen.throw, exc)
                continue
            except BaseException:
                drive.close()
                raise
            if _copy_bytes(req, reply) > self.copy_threshold:
                done, val = await self._step_in_thread(drive, reply)
            else:
                done, val = _step(gen.send, reply)
        self._arm_idle_flush()
        return val

    def _arm_idle_flush(self) -> None:
        # as Client: queued RELEASE/COMMIT go out by themselves once the client is idle
        if self._closed or self._idle_handle is not None or \
                not self._session.piggyback_pending():
            return
        loop = asyncio.get_running_loop()
        self._idle_handle = loop.call_later(IDLE_FLUSH_S, self._idle_flush)

    def _idle_flush(self) -> None:
        self._idle_handle = None
        if self._closed or not self._session.piggyback_pending():
            return

        async def flush() -> None:
            try:
                await self._run(self._session.op_simple(Op.COMMIT, {}, "flush"),
                                check=False)
            except Exception as exc:
                log.debug("idle flush to %s failed: %s", self.address, exc)

        task = asyncio.get_running_loop().create_task(flush())
        self._idle_tasks.add(task)
        task.add_done_callback(self._idle_tasks.discard)

    async def _step_in_thread(self, drive: _Drive, reply: _Reply) -> tuple[bool, Any]:
        cf = self._executor.submit(_step, drive.gen.send, reply)
        fut = asyncio.wrap_future(cf)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not cf.cancel():
                # The copy is running: its blocks may be released or reused only after
                # it ends. Wait (a repeated cancel does not cut this short).
                while not fut.done():
                    try:
                        await asyncio.wait({fut})
                    except asyncio.CancelledError:
                        pass
                if not fut.cancelled():
                    fut.exception()       # retrieved: the cancel wins
            drive.close()
            raise

    # ---------------------------------------------------------------- lifecycle

    async def connect(self) -> "AsyncClient":
        """Say HELLO now (otherwise the first call does). Returns self.

        Raises
        ------
        ServerUnavailable, AuthenticationFailed, TransportError
            As :class:`kvshm.Client`.
        """
        await self._ready()
        return self

    async def ping(self) -> dict[str, Any]:
        """Say HELLO again; returns the server's HELLO reply."""
        await self._ready()
        assert self._hello_lock is not None
        async with self._hello_lock:
            await self._hello(fresh=self._conn is None)
        return dict(self._session.hello)

    async def close(self) -> None:
        """Send queued releases/commits (best effort), close the socket, unmap the pool.

        Calls still in flight fail with KvshmError. Idempotent.
        """
        if self._closed:
            return
        if self._idle_handle is not None:
            self._idle_handle.cancel()
            self._idle_handle = None
        if self._loop is not None and self._loop is not asyncio.get_running_loop():
            self._close_now()      # from another loop: no flush, just let go
            return
        s = self._session
        # lazy COMMITs queued again by a request that failed (a HELLO due, or the
        # connection gone): the flush says that HELLO and sends them (else the BYE,
        # skipped then, would not carry them and those writes, reported done, were lost)
        owed = (sum(1 for rid in s.commits if rid in s.lazy_rids)
                if s.need_hello or self._conn is None else 0)
        if s.piggyback_pending() and (owed or (not s.need_hello and self._conn is not None)):
            try:
                await self._run(s.op_commit_flush(), check=False)
                s.raise_wb_errors()
            except KvshmError as exc:
                log.log(logging.WARNING if s.wb is not None or owed else logging.DEBUG,
                        "flush at close failed: %s", exc)
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None and conn.failed is None and not conn.waiting:
            bye = s.bye()       # nothing in flight: end the session now
            if bye is not None:
                # best effort, a short wait: the server ends the session at once
                from kvshm.zmq_ctrl.ops_session import BYE_WAIT_S

                try:
                    await asyncio.wait_for(conn.request(Op.BYE, bye[1], (), bye[0],
                                                        s.new_id()), BYE_WAIT_S)
                except (KvshmError, asyncio.TimeoutError) as exc:
                    log.debug("BYE at close: %s", exc)
        if conn is not None:
            await conn.aclose("client is closed")
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
        s.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _close_now(self, wait: bool = True) -> None:
        """Close without awaiting anything (no flush): sockets, threads, the mapping."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.failed = conn.failed or KvshmError("client is closed")
            conn._close_sockets(conn.sock)
        self._executor.shutdown(wait=wait)
        self._session.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        try:
            self._close_now(wait=False)
        except Exception:
            pass
        warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2)

    def __repr__(self) -> str:
        return f"<kvshm.AsyncClient {self.address} transport={self.transport}>"

    @property
    def transport(self) -> str:
        """The mover in use: "shm", "rdma" or "tcp" (known after the first call)."""
        return self._session.transport_name

    @property
    def server_info(self) -> dict[str, Any]:
        """The server's last HELLO reply."""
        return dict(self._session.hello)

    # ---------------------------------------------------------------- writes

    async def put(self, key: Key, value: Any, *, checksum: bool = False) -> None:
        """Store ``value`` under ``key`` (see :meth:`kvshm.Client.put`)."""
        await self._run(self._session.op_put_batch([key], [value], checksum))

    async def put_batch(self, keys: Sequence[Key], values: Sequence[Any], *,
                        checksum: bool = False, pin_ttl: float | None = None) -> Any:
        """Store many values with one ALLOC and one COMMIT (see
        :meth:`kvshm.Client.put_batch`, also for ``pin_ttl``). Do not modify the buffers
        until it returns."""
        if pin_ttl is not None:
            from kvshm import handoff

            return await self._run(handoff.op_put_pinned(self._session, keys, values,
                                                         checksum, pin_ttl, self.address))
        await self._run(self._session.op_put_batch(keys, values, checksum))
        return None

    async def pin(self, keys: Sequence[Key], ttl: float) -> Any:
        """See :meth:`kvshm.Client.pin`."""
        from kvshm import handoff

        return await self._run(handoff.op_pin(self._session, keys, ttl, self.address))

    async def renew(self, handoff: Any, ttl: float) -> float | None:
        """See :meth:`kvshm.Client.renew`."""
        from kvshm import handoff as h

        return await self._run(h.op_renew(self._session, handoff, ttl))  # type: ignore[no-any-return]

    async def unpin(self, handoff: Any) -> bool:
        """See :meth:`kvshm.Client.unpin`."""
        from kvshm import handoff as h

        return await self._run(h.op_unpin(self._session, handoff))  # type: ignore[no-any-return]

    # ---------------------------------------------------------------- reads

    async def get(self, key: Key, *, verify: bool = False) -> bytes:
        """The value of ``key``. Raises KeyNotFound on a miss."""
        sizes, data = await self._run(self._session.op_lookup_copy([key], None, verify))
        if sizes[0] < 0:
            raise KeyNotFound(f"key {key!r} not found")
        return data[0]  # type: ignore[no-any-return]

    async def get_into(self, key: Key, out: Any, *, verify: bool = False) -> int:
        """Copy the value of ``key`` into ``out``; returns its size in bytes."""
        sizes, _ = await self._run(self._session.op_lookup_copy([key], [out], verify))
        if sizes[0] < 0:
            raise KeyNotFound(f"key {key!r} not found")
        return sizes[0]  # type: ignore[no-any-return]

    async def get_batch(self, keys: Sequence[Key], *,
                        verify: bool = False) -> list[bytes | None]:
        """Values of ``keys``, None for each miss."""
        _, data = await self._run(self._session.op_lookup_copy(keys, None, verify))
        return data  # type: ignore[no-any-return]

    async def get_batch_into(self, keys: Sequence[Key], outs: Sequence[Any], *,
                             verify: bool = False) -> list[int]:
        """Copy each value into ``outs[i]``; sizes in bytes, -1 for a miss."""
        sizes, _ = await self._run(self._session.op_lookup_copy(keys, outs, verify))
        return sizes  # type: ignore[no-any-return]

    # ---------------------------------------------------------------- paged KV

    async def put_pages(self, keys: Sequence[Key], kv: Any, page_ids: Any, *,
                        layout: str = "auto") -> None:
        """Store pages of a paged KV tensor (see :func:`kvshm.paged.put_pages`)."""
        from kvshm import paged

        await self._run(paged.op_put_pages(self._session, keys, kv, page_ids, layout))

    async def get_pages_into(self, keys: Sequence[Key], kv: Any, page_ids: Any, *,
                             layout: str = "auto") -> list[bool]:
        """Fill pages of a paged KV tensor (see :func:`kvshm.paged.get_pages_into`)."""
        from kvshm import paged

        return await self._run(  # type: ignore[no-any-return]
            paged.op_get_pages_into(self._session, keys, kv, page_ids, layout))

    # ---------------------------------------------------------------- queries

    async def _simple(self, op: int, body: dict[str, Any], what: str) -> Any:
        return await self._run(self._session.op_simple(op, body, what))

    async def _keys(self, keys: Sequence[Key]) -> list[bytes]:
        await self._ready()      # the server's key limits
        return self._session.keys(keys)

    async def exists(self, key: Key) -> bool:
        return (await self.exists_batch([key]))[0]

    async def exists_batch(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key is present (committed, or written behind by this client)."""
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)       # (an iterator: own_flags would use it up first)
        own = self._session.own_flags(keys)
        if own is not None:
            return [a or b for a, b in zip(own, await self._exists(keys))]
        return await self._exists(keys)

    async def _exists(self, keys: Sequence[Key]) -> list[bool]:
        lr = self._session.local_reader()
        if lr is not None and localread.fits(keys, self._session.limits):
            found = lr.exists_batch(keys)   # same host: no round trip
            if found is not None:
                return found  # type: ignore[no-any-return]
        bkeys = await self._keys(keys)
        if not bkeys:
            return []
        return found_of(await self._simple(Op.EXISTS, {"keys": bkeys}, "exists"), len(bkeys))

    async def match_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys of ``keys`` the store holds."""
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)       # (an iterator: own_flags would use it up first)
        if self._session.own_flags(keys) is not None:
            found = await self.exists_batch(keys)
            return found.index(False) if False in found else len(found)
        lr = self._session.local_reader()
        if lr is not None and localread.fits(keys, self._session.limits):
            n = lr.match_prefix(keys)       # same host: no round trip
            if n >= 0:
                return n  # type: ignore[no-any-return]
        bkeys = await self._keys(keys)
        if not bkeys:
            return 0
        body = {"keys": bkeys}
        return prefix_of(await self._simple(Op.MATCH_PREFIX, body, "match_prefix"), len(bkeys))

    async def delete(self, keys: Key | Sequence[Key]) -> int:
        """Remove keys. Returns how many were removed."""
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        bkeys = await self._keys(keys)
        if not bkeys:
            return 0
        if self._session.wb is not None:
            self._session.wb.placed.drop(bkeys)   # the DELETE follows the PLACE
        return count_of(await self._simple(Op.DELETE, {"keys": bkeys}, "delete"), "DELETE",
                        len(bkeys))

    async def evict(self, to_ratio: float) -> int:
        """Evict LRU entries until usage <= ``to_ratio``. Returns entries evicted."""
        if not 0.0 <= to_ratio <= 1.0:
            raise ValueError(f"to_ratio must be in [0, 1], got {to_ratio}")
        return count_of(await self._simple(Op.EVICT, {"ratio": float(to_ratio)}, "evict"),
                        "EVICT")

    async def list_keys(self, prefix: Any = b"", limit: int | None = None,
                        page: int = 10_000) -> list[bytes]:
        """Committed keys starting with ``prefix`` (see :meth:`kvshm.Client.list_keys`)."""
        p = prefix.encode() if isinstance(prefix, str) else bytes(prefix)
        out: list[bytes] = []
        while limit is None or len(out) < limit:
            n = page if limit is None else min(page, limit - len(out))
            body = await self._simple(Op.LIST, {"prefix": p, "start": len(out),
                                                "limit": max(1, n)}, "list")
            out.extend(body["keys"])
            if not body["more"]:
                break
        return out

    async def purge(self) -> int:
        """Remove every entry. Returns entries removed."""
        if self._session.wb is not None:
            self._session.wb.placed.clear()
        return count_of(await self._simple(Op.PURGE, {}, "purge"), "PURGE")

    async def stats(self, *, verify: bool = False, latency: bool = False) -> dict[str, Any]:
        """Server statistics (see :meth:`kvshm.Client.stats`). Carries queued
        releases/aborts/commits, so the figures include them."""
        body = {"verify": verify, "latency": latency}
        return (await self._simple(Op.STATS, body, "stats"))["stats"]

    async def flush(self) -> None:
        """Send queued RELEASE/ABORT/COMMIT now (one round trip). Raises LeaseExpired if
        a lazy commit came too late, WriteRefused / WritesLost for writes made behind
        (``write_behind``, as :class:`kvshm.Client`) that were not stored."""
        if self._session.piggyback_pending():
            await self._run(self._session.op_commit_flush())
        else:
            self._session.raise_lost_commits()
            self._session.raise_wb_errors()
