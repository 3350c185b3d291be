"""The client's side of the control channel: a DEALER socket with timeouts.

:class:`Channel` sends one request and waits for the reply with the same request id,
never longer than its timeout. On a timeout the socket is closed and a fresh one is made
for the next call, so a late reply or a queued request of a dead exchange can never be
mistaken for a new one. The routing id stays the same for the life of the channel, so
the server can name this client's grants across reconnects.

A same-host client sets :attr:`Channel.watch` (:class:`~kvshm.zmq_ctrl.serverwatch.
ServerWatch`): then a server the kernel proves gone or replaced ends a wait at once with
:class:`~kvshm.zmq_ctrl.serverwatch.ServerGone` instead of the timeout (checked before a
send after ``IDLE_S`` idle, and every ``POLL_S`` while waiting).

Transport: on ``tcp://`` and ``ipc://`` endpoints without CURVE the channel speaks ZMTP 3.x
itself (:mod:`kvshm.zmq_ctrl._zmtp`: a non-blocking stream socket, ``poll(2)`` waits on
the caller's thread, the NULL mechanism, a DEALER with the channel's routing id) to the
server's unchanged ROUTER, instead of going through libzmq's I/O thread. The semantics
are libzmq's: a request made while the server is down waits (reconnecting every slice)
until the server is up or the deadline passes; a connection the server closed is found
(a zero-timeout poll after 1 ms idle) and made again, with the same routing id, before the
next send; a forked child makes its own. Where they differ, they differ for the better:
a send respects the call's deadline (libzmq's blocks with no limit once its queue is
full). The server closing the connection while a reply is awaited ends the wait as
libzmq's: at the deadline (ServerUnavailable), or sooner when the watch proves the
server gone (ServerGone; looked at every slice once the close was seen); a ZMTP protocol
violation by the peer is a ProtocolError at once. ``KVSHM_ZMTP=0`` in the environment (read at import; also
:data:`ZMTP`) turns it off: libzmq carries every endpoint, as it carries CURVE ones,
``inproc://`` and the async client's (kvshm.aio) always.

A request may name where its reply's payload goes (:meth:`Channel.request`'s ``into``:
a batch GET into the caller's buffers): on the ZMTP transport the reply's value frames
are then received straight into those buffers (the kernel's one copy; no bytes object
per frame, no second copy, no page fault per fresh page) and come back as their lengths
(ints). ``KVSHM_ZMTP_INTO=0`` in the environment (read at import; also :data:`INTO`)
turns that off: the frames come back as ``bytes`` and the caller copies them, as on
libzmq, which never places them.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from typing import Any, Callable, Sequence, cast

import zmq

from kvshm.errors import AuthenticationFailed, ProtocolError, ServerUnavailable
from kvshm.limits import HELLO_REPLY_BOUND
from kvshm.zmq_ctrl.protocol import DecodeError, decode_reply, encode_request
from kvshm.zmq_ctrl.serverwatch import IDLE_S, POLL_S, ServerGone, ServerWatch

try:    # direct libzmq calls (kvshm.zmq_ctrl._zmqc); pyzmq's compiled layer without it
    from kvshm.zmq_ctrl import _zmqc
except ImportError:         # not built, or no libzmq symbols found: pyzmq does it
    _zmqc = None  # type: ignore[assignment]

__all__ = ["Channel", "endpoint_of"]

#: Longest blocking receive of one wait (s): between two, the monitor (handshake
#: failures), the server watch and the deadline are looked at. A reply ends the
#: receive at once; only a wait with no reply pays a wake-up per slice.
WAIT_SLICE_S = 0.05
#: Longest wait for a TCP connect to complete (ms; ZMQ_CONNECT_TIMEOUT), after which
#: libzmq abandons it and connects again RECONNECT_IVL (100 ms) later. Without it a lost
#: SYN is only sent again by the kernel 1 s later (TCP_TIMEOUT_INIT, RFC 6298), then 3 s,
#: 7 s: as long as a whole call's timeout. Seen on the cluster bed: after a partition
#: healed, the peer's kernel dropped the first SYN of the reconnection (TcpExt ListenDrops
#: 1), the call waited 1 s and the member was marked suspect although it was back. 500 ms
#: is ~1,000 LAN round trips, so a connect that is merely slow is not cut.
CONNECT_TIMEOUT_MS = 500
#: Most replies one :meth:`Channel.drain` hands on (the rest stay queued for the next
#: drain or request): a server that floods replies cannot hold a caller that only meant to
#: pick up what was there. Far above what one client has in flight (write-behind keeps a
#: few PLACEs and one RESERVE outstanding).
DRAIN_MAX = 4096
#: Frames of at least this many bytes are sent zero-copy (as pyzmq's copy_threshold).
ZERO_COPY_BYTES = zmq.COPY_THRESHOLD

# pyzmq's compiled socket methods, called with int flags: the Python layer above them
# (send_multipart's per-frame type checks and Flag enum arithmetic, Poller) costs more
# than the libzmq calls themselves
_psend = zmq.backend.Socket.send
_precv = zmq.backend.Socket.recv
_SNDMORE = int(zmq.SNDMORE)


def _send_pyzmq(sock: zmq.Socket, header: bytes, frames: Sequence[Any]) -> None:
    if not frames:
        _psend(sock, header, 0)
        return
    _psend(sock, header, _SNDMORE)
    last = len(frames) - 1
    for i, f in enumerate(frames):
        _psend(sock, f, 0 if i == last else _SNDMORE, False)


def _recv_pyzmq(sock: zmq.Socket) -> list[Any]:
    f = _precv(sock, 0, False)
    msg = [f]
    while f.more:
        f = _precv(sock, 0, False)
        msg.append(f)
    return msg


def _send_zmqc(sock: zmq.Socket, header: bytes, frames: Sequence[Any]) -> None:
    if not frames:
        _zmqc.send_parts(sock, (header,))
        return
    parts = [header, *frames]
    for f in frames:
        if memoryview(f).nbytes >= ZERO_COPY_BYTES:
            _zmqc.send_parts(sock, parts, 0, 1)     # values zero-copy, as pyzmq sends
            return
    _zmqc.send_parts(sock, parts)


def _recv_zmqc(sock: zmq.Socket) -> list[Any]:
    # (blocking: a message, never None)
    return cast("list[Any]", _zmqc.recv_multipart(sock, 0, ZERO_COPY_BYTES))


#: Whether :meth:`Channel.call1` is there (the one-key path in C, _zmqc built)
CALL1 = _zmqc is not None
#: Replies read, without waiting, at a wait's deadline before it ends in a timeout
#: (:meth:`Channel._expired`): a caller kept from running past its deadline (the GIL
#: held by an engine's scheduler thread, the CPU by its workers) finds its reply if it
#: came; bounded so that a flood of other requests' replies cannot hold a call.
LAST_LOOK = 1024
#: A timed-out wait whose caller went this long (s) without running between two slices
#: says so in its ServerUnavailable (the server may not be the slow one).
KEPT_NOTE_S = 0.25
#: what :meth:`Channel.call1` returns when it sent nothing
NOT_SENT = object()
if _zmqc is not None:
    _call1, _recv1, _AGAIN, _PUT1 = _zmqc.call1, _zmqc.recv1, _zmqc.AGAIN, _zmqc.PUT1
    _SendFailed = _zmqc.SendFailed
_monotonic = time.monotonic

try:    # the ZMTP transport (kvshm.zmq_ctrl._zmtp); libzmq carries all without it
    from kvshm.zmq_ctrl import _zmtp
except ImportError:
    _zmtp = None  # type: ignore[assignment]
#: Whether tcp:// and ipc:// endpoints without CURVE use the ZMTP transport (the
#: environment's ``KVSHM_ZMTP``, read at import: ``0`` for libzmq); read when a channel
#: is made or moved (reset with an endpoint).
ZMTP = _zmtp is not None and os.environ.get("KVSHM_ZMTP", "1").strip() != "0"
#: Whether a request's ``into`` places its reply's payload straight into the caller's
#: buffers on the ZMTP transport (the environment's ``KVSHM_ZMTP_INTO``, read at import:
#: ``0`` turns it off); read at each request.
INTO = os.environ.get("KVSHM_ZMTP_INTO", "1").strip() != "0"
#: a close of a same-host server's connection while a reply is awaited: the server
#: watch is looked at (each slice) this long (s) for a proof that it is gone (ServerGone)
#: before ServerUnavailable (the close of a live server's connection, or a relay's cut)
CLOSE_WATCH_S = 1.0
#: a connection idle this long (ms) is polled for the server's close before a send:
#: 0, every send (one poll(2) of ~1 us beside a round trip of ~100 us): a close that came
#: just after the last reply (a relay cutting the link) is seen before the request goes
#: out on a dead connection, and the request goes on a new one instead
ALIVE_IDLE_MS = 0
# os.getpid() is a system call; this is the pid, kept right across fork()
_pid = [os.getpid()]


def _forked() -> None:
    _pid[0] = os.getpid()


os.register_at_fork(after_in_child=_forked)

#: send ``[header, *frames]``; receive one whole message, blocking up to RCVTIMEO
#: (zmq.Again then). Frames come back as ``bytes`` or buffer objects.
send_message, recv_message = ((_send_zmqc, _recv_zmqc) if _zmqc is not None
                              else (_send_pyzmq, _recv_pyzmq))


def _encode(op: int, req_id: int, epoch: int, body: Any) -> bytes:
    """A request's header frame: ``body`` packed (:func:`encode_request`), or ``body``
    itself when it is ``bytes``, the header already packed with this ``req_id`` and
    ``epoch`` (the parts of a pipelined batch, :meth:`Channel.request_many`)."""
    if type(body) is bytes:
        return body
    return encode_request(op, req_id, epoch, body)


def ipc_denied(endpoint: str) -> str | None:
    """Why this process may not connect to an ``ipc://`` endpoint's socket, or None.

    connect(2) on a Unix socket needs search permission on each directory of its path and
    write permission on the socket file (unix(7)); a refusal there (EACCES) lasts, unlike
    a path not made yet (a starting server: None here, the wait goes on). Checked with the
    process's effective ids (``os.stat`` and ``os.access``: two system calls, no
    connection made). None too for other endpoints and abstract (``@``) sockets, which
    have no permissions.
    """
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    path = endpoint[len("ipc://"):]
    try:
        os.stat(path)
    except PermissionError as exc:
        return f"permission denied: a directory of {path} is not searchable ({exc.strerror})"
    except OSError:
        return None
    eff = os.access in os.supports_effective_ids
    if not os.access(path, os.W_OK, effective_ids=eff):
        return f"permission denied: {path} is not writable by uid {os.geteuid()}"
    return None


def endpoint_of(address: str) -> str:
    """ZeroMQ endpoint for an address: ``host:port``, ``tcp://...`` or ``ipc://...``.

    Raises
    ------
    ValueError
        Not one of those forms.
    """
    if address.startswith("tcp://"):
        port = address.rpartition(":")[2]
        if port.isdigit() and not 0 < int(port) < 65536:
            raise ValueError(f"port {int(port)} is out of range (1-65535) in {address!r}")
    if address.startswith(("tcp://", "ipc://", "inproc://")):
        return address
    if "://" in address:
        raise ValueError(f"address must be 'host:port', 'tcp://host:port' or 'ipc://path', "
                         f"got {address!r} (kvshm speaks ZeroMQ, not "
                         f"{address.split('://', 1)[0]})")
    host, sep, port = address.rpartition(":")
    if sep and host and port.isdigit() and not 0 < int(port) < 65536:
        raise ValueError(f"port {int(port)} is out of range (1-65535) in {address!r}")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be 'host:port', 'tcp://host:port' or "
                         f"'ipc://path', got {address!r}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def check_resolvable(endpoint: str) -> None:
    """Raise ServerUnavailable at once for a tcp endpoint whose host does not resolve
    (instead of a timeout that blames the server)."""
    if not endpoint.startswith("tcp://"):
        return
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None)
    except OSError as exc:
        raise ServerUnavailable(f"cannot resolve the kvshm server's host {host!r}: "
                                f"{exc}") from None


def dealer_options(s: zmq.Socket) -> bytes:
    """Set a client DEALER's options (no linger, IPv6 allowed, CONNECT_TIMEOUT_MS) and a
    new random 16-byte routing id, which it returns: the server does not hand a connected
    id over to a new connection (ROUTER_HANDOVER off), and the client says HELLO on every
    new socket before anything else."""
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IPV6, 1)
    s.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
    rid = os.urandom(16)
    s.setsockopt(zmq.ROUTING_ID, rid)
    return rid


class Channel:
    """A request/reply channel to one server endpoint.

    Parameters
    ----------
    endpoint : str
        ZeroMQ endpoint (see :func:`endpoint_of`).
    timeout : float
        Seconds to wait for each reply.
    context : zmq.Context, optional
    socket_setup : callable, optional
        Applied to every new socket before connect (CURVE client keys, ...).
    """

    def __init__(self, endpoint: str, timeout: float, *, context: zmq.Context | None = None,
                 socket_setup: Callable[[zmq.Socket], None] | None = None,
                 label: str | None = None) -> None:
        self.endpoint = endpoint
        self.label = label
        self.timeout = timeout
        self.routing_id = os.urandom(16)
        self._ctx = context or zmq.Context.instance()
        self._setup = socket_setup
        # a zmq.Socket, or on the ZMTP transport a kvshm.zmq_ctrl._zmtp.Conn
        self._sock: Any = None
        self._monitor: zmq.Socket | None = None
        #: the most bytes one reply may hold (see :meth:`bound_replies`)
        self.reply_bound = HELLO_REPLY_BOUND
        self._bounded = False           # set by a HELLO's bound_replies
        self._next_id = 1
        self._slice_ms = max(1, int(min(WAIT_SLICE_S, POLL_S) * 1000))
        self._rcvtimeo = self._slice_ms     # the socket's RCVTIMEO now (ms)
        self._hs_failed = 0         # handshakes the peer closed (see _handshake_failed)
        self._watch_at = 0.0        # a wait checks the server watch from then on
        self._perm_at = 0.0 if endpoint.startswith("ipc://") else float("inf")
        self.lock = threading.Lock()
        self._pid = os.getpid()
        #: ``fn(req_id, status, body)`` for a reply no call waits for (a request sent
        #: with :meth:`send`); None: such replies are dropped.
        self.on_stray: Callable[[int, int, dict[str, Any]], None] | None = None
        #: (during :meth:`request_many`) the replies it still waits for, by request id:
        #: None until read, then ``(req_id, status, body, frames)``
        self._want: dict[int, Any] | None = None
        #: what the kernel proves about a same-host server (set by the client after a
        #: local HELLO; cleared by :meth:`reset`): see kvshm.zmq_ctrl.serverwatch
        self.watch: ServerWatch | None = None
        self._last = 0.0            # time.monotonic() of the last reply
        self.sent = 0               # requests sent
        self.fast = 0               # one-key replies read in C (call1)
        self.timeouts = 0           # waits that ran to their end (ServerUnavailable)
        #: replies found by the last look at a wait's deadline (see _expired)
        self.late = 0
        self._looked = 0.0          # (a wait) when its caller last looked for the reply
        self._kept = 0.0            # (a wait) its caller's longest spell without running
        self.gone = 0               # servers found gone by the watch (ServerGone)
        #: whether this endpoint is carried by the ZMTP transport (kvshm.zmq_ctrl._zmtp)
        self.zmtp = self._zmtp_for(endpoint)
        self._zlive = False         # (ZMTP) a routing id is chosen: a "socket" exists
        #: (ZMTP) messages of send() made while no connection could be made: sent first
        #: once one is (libzmq's queue of a connecting socket); dropped by reset
        self._zpending: list[tuple[bytes, list[bytes]]] = []
        self.reconnects = 0         # (ZMTP) connections made again under one routing id

    def _zmtp_for(self, endpoint: str) -> bool:
        return (ZMTP and _zmtp is not None and self._setup is None
                and endpoint.startswith(("tcp://", "ipc://")))

    def _socket(self) -> zmq.Socket:
        if self._pid != os.getpid():   # forked: never touch the parent's socket
            self._sock = None
            self._pid = os.getpid()
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            self.routing_id = dealer_options(s)
            s.setsockopt(zmq.RCVTIMEO, self._slice_ms)
            self._rcvtimeo = self._slice_ms
            if self._bounded:
                # (libzmq bounds each frame, from the next connection on: it drops one
                # that sends more; the wait then ends at the timeout)
                s.setsockopt(zmq.MAXMSGSIZE, self.reply_bound)
            if self._setup is not None:
                self._setup(s)
            if not self.endpoint.startswith("inproc://"):
                # Handshake failures (CURVE keys) end a wait with the reason (within
                # a slice of it), instead of a timeout.
                self._monitor = s.get_monitor_socket(
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def call1(self, kind: int, op: int, key: bytes, value: Any, checksum: int | None,
              out: Any, req_id: int, epoch: int, max_size: int = 65535) -> Any:
        """A single-key PUT / GET / EXISTS as :meth:`request` sends and waits for it, the
        header packed and the usual reply read in C (kvshm.zmq_ctrl._zmqc.call1/recv1).
        Call with :attr:`lock` held, only when ``CALL1`` is True.

        ``kind``: ``_zmqc.PUT1`` (``value``: a C-contiguous buffer, ``checksum`` its
        xxh64 or None; not sent when over ``max_size`` bytes), ``GET1``, ``GET1_INTO``
        (``out``: a writable C-contiguous buffer) or ``EXISTS1``.

        Returns
        -------
        NOT_SENT
            Nothing was sent (a key or value over _zmqc.MAX_KEY1 / MAX_VALUE1 bytes, a
            value without a C-contiguous buffer): the caller's general path sends it.
        tuple
            ``(status, body, frames)`` of a reply that is not the usual one (an error
            status, other fields): the caller reads it as it reads :meth:`request`'s.
        otherwise
            The usual reply: PUT1 0; GET1 the value (``bytes``) or -1 (a miss);
            GET1_INTO the size copied into ``out`` or -1; EXISTS1 a bool.

        Raises
        ------
        ServerUnavailable, ServerGone, ProtocolError
            As :meth:`request` (the same waits, slices and checks).
        """
        if _zmqc is None:           # (tests take it away: pyzmq then carries all)
            return NOT_SENT
        if self.zmtp:
            return self._zcall1(kind, op, key, value, checksum, out, req_id, epoch,
                                max_size)
        sock = self._sock
        if sock is None or self._pid != _pid[0]:
            sock = self._socket()
        watch = self.watch
        t0 = _monotonic()
        if watch is not None and t0 - self._last > IDLE_S:
            self._check(watch, sent=False)
        if self._rcvtimeo != self._slice_ms:
            sock.setsockopt(zmq.RCVTIMEO, self._slice_ms)
            self._rcvtimeo = self._slice_ms
        try:
            # send, then the first slice of the wait
            r = _call1(sock, kind, op, req_id, epoch, key, value if kind == _PUT1 else None,
                       checksum, max_size, out, ZERO_COPY_BYTES)
        except _SendFailed as exc:
            self.reset()
            raise ServerUnavailable(f"cannot send to kvshm server at {self._where()}: "
                                    f"{exc}") from None
        except zmq.ZMQError:
            raise                   # (of the receive, as request lets it through)
        except BaseException:
            self.reset()            # half a message may be queued (see request)
            raise
        if r is None:
            return NOT_SENT
        self.sent += 1
        if r is _AGAIN or type(r) is list:
            r = self._wait1(sock, watch, t0, r, kind, req_id, out)
            if type(r) is tuple:
                return r
        self.fast += 1
        if watch is not None:
            self._last = _monotonic()
        return r

    def _wait1(self, sock: zmq.Socket, watch: ServerWatch | None, t0: float, r: Any,
               kind: int, req_id: int, out: Any) -> Any:
        """The rest of call1's wait: slices after the first (as request's), and replies
        not read in C (another request's are handed to on_stray)."""
        deadline = t0 + self.timeout
        self._watch_at = t0 + POLL_S
        self._looked, self._kept = t0, 0.0
        self._hs_failed = 0
        while True:
            if r is _AGAIN:
                if not self._waited(sock, watch, deadline, self.timeout):
                    got = self._expired(sock, req_id, self.timeout)
                    return got[1], got[2], got[3]
            elif type(r) is not list:
                return r
            else:
                try:
                    status, rid, rbody = decode_reply(r[0])
                except DecodeError as exc:
                    self.reset()
                    raise ProtocolError(f"bad reply from {self._where()}: {exc}") from None
                if rid == req_id:
                    self._last = _monotonic()
                    return status, rbody, r[1:]
                if self.on_stray is not None:
                    self.on_stray(rid, status, rbody)
                if _monotonic() >= deadline:        # (a flood of them: not past it)
                    got = self._expired(sock, req_id, self.timeout)
                    return got[1], got[2], got[3]
            r = _recv1(sock, kind, req_id, out, ZERO_COPY_BYTES)

    def _where(self) -> str:
        if self.label and self.label != self.endpoint:
            return f"{self.label} ({self.endpoint})"
        return self.endpoint

    def reset(self, endpoint: str | None = None) -> None:
        """Drop the socket (and anything queued on it); optionally move to ``endpoint``."""
        if self.zmtp:
            if self._sock is not None:
                self._sock.close()  # (in a forked child: its copy only, no shutdown)
            self._zlive = False
            self._zpending = []
        elif self._sock is not None and self._pid == os.getpid():
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(0)
            self._sock.close(0)
        self._sock = None
        self._monitor = None
        self.watch = None
        if endpoint is not None:
            self.endpoint = endpoint
            self.zmtp = self._zmtp_for(endpoint)
            self._perm_at = 0.0 if endpoint.startswith("ipc://") else float("inf")

    def close(self) -> None:
        self.reset()

    def new_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def request(self, op: int, body: dict[str, Any], frames: Sequence[Any] = (), *,
                epoch: int = 0, req_id: int | None = None, timeout: float | None = None,
                into: Callable[[int, dict[str, Any]],
                               tuple[Sequence[Any], Sequence[int]] | None] | None = None
                ) -> tuple[int, int, dict[str, Any], list[Any]]:
        """Send one request and wait for its reply. Call with :attr:`lock` held.

        ``into`` (the ZMTP transport, with :data:`INTO`; ignored on libzmq): called with
        the status and body of this request's reply as soon as its header is here,
        before its payload frames; it returns None, or ``(buffers, sizes)``: the
        payload's bytes then go in order straight into ``buffers[i][:sizes[i]]``
        (:meth:`kvshm.zmq_ctrl._zmtp.Conn.recv`), and each frame so placed comes back as
        its length (an ``int``). A call that ends before the reply is whole (its
        deadline, an exception) closes the connection: no byte of it lands later.

        Returns
        -------
        (req_id, status, body, frames)
            ``frames``: the reply's payload frames, each ``bytes`` or (from
            ``ZERO_COPY_BYTES`` on) a zero-copy object with the buffer protocol; with
            ``into``, frames placed in its buffers are ints (their lengths).

        Raises
        ------
        ServerUnavailable
            No reply within the timeout (the socket is then reset).
        ServerGone
            With :attr:`watch` set: the server is proven gone or replaced, before the send
            (``sent`` False; idle over IDLE_S) or while waiting (checked once POLL_S
            passed without a reply, then every POLL_S: a DEALER reconnecting to a new
            server at the same address gets its reply in that time, and the client goes
            on with the new server instead of raising).
        ProtocolError
            An undecodable reply.
        """
        if req_id is None:
            req_id = self.new_id()
        if self.zmtp:
            return self._zrequest(op, body, frames, epoch, req_id, timeout,
                                  into if INTO else None)
        sock = self._sock
        if sock is None or self._pid != os.getpid():
            sock = self._socket()
        header = _encode(op, req_id, epoch, body)
        wait = self.timeout if timeout is None else timeout
        watch = self.watch
        if watch is not None and time.monotonic() - self._last > IDLE_S:
            self._check(watch, sent=False)
        self.sent += 1
        try:
            send_message(sock, header, frames)
        except zmq.ZMQError as exc:
            self.reset()
            raise ServerUnavailable(f"cannot send to kvshm server at {self._where()}: "
                                    f"{exc}") from None
        except BaseException:
            # A frame failed after earlier parts went out with SNDMORE: this socket holds
            # a half-sent message that the next send would complete. Drop the socket.
            self.reset()
            raise
        return self._await(sock, req_id, wait, watch)

    def _await(self, sock: zmq.Socket, req_id: int, wait: float,
               watch: ServerWatch | None) -> tuple[int, int, dict[str, Any], list[Any]]:
        """The wait of :meth:`request` (libzmq) for the reply to ``req_id``, sent now."""
        now = time.monotonic()
        deadline = now + wait
        self._watch_at = now + POLL_S
        self._looked, self._kept = now, 0.0
        self._hs_failed = 0
        if self._rcvtimeo != self._slice_ms:
            sock.setsockopt(zmq.RCVTIMEO, self._slice_ms)
            self._rcvtimeo = self._slice_ms
        while True:
            try:
                # blocks one slice at most (RCVTIMEO), with the GIL released
                msg = recv_message(sock)
            except zmq.Again:
                if not self._waited(sock, watch, deadline, wait):
                    return self._expired(sock, req_id, wait)
                continue
            try:
                status, rid, rbody = decode_reply(msg[0])
            except DecodeError as exc:
                self.reset()
                raise ProtocolError(f"bad reply from {self._where()}: {exc}") from None
            if rid != req_id:
                # a reply sent without a wait (send), or of an abandoned request
                self._stray(rid, status, rbody, msg)
                if time.monotonic() >= deadline:    # (a flood of them: not past it)
                    return self._expired(sock, req_id, wait)
                continue
            self._last = time.monotonic()
            return rid, status, rbody, msg[1:]

    def _waited(self, sock: zmq.Socket, watch: ServerWatch | None, deadline: float,
                wait: float) -> bool:
        """A slice of a wait passed without a reply: a failed handshake and a server the
        watch proves gone end the wait (raising); the deadline: False (the caller takes
        its last look, :meth:`_expired`); else True, the next slice set up (shorter when
        the deadline is nearer)."""
        mon = self._monitor
        while mon is not None and cast(int, mon.get(zmq.EVENTS)) & zmq.POLLIN:
            self._handshake_failed()        # raises, or the wait goes on
            mon = self._monitor
        now = time.monotonic()
        self._note_look(now)
        if now >= self._perm_at:
            # libzmq retries a refused connect(2) silently, EACCES too: looked at here
            self._perm_at = now + POLL_S
            why = ipc_denied(self.endpoint)
            if why is not None:
                self.reset()
                raise ServerUnavailable(f"cannot connect to kvshm server at "
                                        f"{self._where()}: {why}")
        if watch is not None and now >= self._watch_at:
            self._watch_at = now + POLL_S
            self._check(watch, sent=True)
        left = deadline - now
        if left <= 0:
            return False
        ms = max(1, min(self._slice_ms, int(left * 1000)))
        if ms != self._rcvtimeo:
            sock.setsockopt(zmq.RCVTIMEO, ms)
            self._rcvtimeo = ms
        return True

    def _expired(self, sock: zmq.Socket, req_id: int, wait: float
                 ) -> tuple[int, int, dict[str, Any], list[Any]]:
        """The deadline passed with no reply read: one last look, without waiting, at
        what is queued (at most LAST_LOOK replies), then the timeout. A caller kept off
        the CPU (or the GIL) from the end of a slice until past its deadline finds its
        reply there if it came meanwhile, rather than a ServerUnavailable with its reply
        unread (and lost with the socket). Returns ``(req_id, status, body, frames)``;
        raises ServerUnavailable (the socket is reset) or ProtocolError."""
        def one() -> Any:
            try:
                if _zmqc is not None:
                    return _zmqc.recv_multipart(sock, _zmqc.DONTWAIT, ZERO_COPY_BYTES)
                return sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:        # (Again, or the socket's end)
                return None
        return self._last_look(one, req_id, wait)

    def _last_look(self, recv: Callable[[], Any], req_id: int, wait: float
                   ) -> tuple[int, int, dict[str, Any], list[Any]]:
        """The loop of :meth:`_expired` and :meth:`_zexpired`: ``recv()`` gives a
        message already here or None; at most LAST_LOOK of them, then the timeout."""
        for _ in range(LAST_LOOK):
            msg = recv()
            if msg is None:
                break
            h = msg[0]
            r = self._reply_of(h if type(h) is bytes else h.buffer,  # type: ignore[union-attr]
                               req_id, msg)
            if r is not None:
                self.late += 1
                self._last = time.monotonic()
                return r[0], r[1], r[2], msg[1:]
        self._timed_out(wait)
        raise AssertionError("not reached")

    def _reply_of(self, header: Any, req_id: int, msg: Any = None
                  ) -> tuple[int, int, dict[str, Any]] | None:
        """``(rid, status, body)`` of a reply header when it answers ``req_id``; another
        request's goes to on_stray (None). ProtocolError (reset) when undecodable."""
        try:
            status, rid, rbody = decode_reply(header)
        except DecodeError as exc:
            self.reset()
            raise ProtocolError(f"bad reply from {self._where()}: {exc}") from None
        if rid == req_id:
            return rid, status, rbody
        self._stray(rid, status, rbody, msg)
        return None

    def _stray(self, rid: int, status: int, rbody: dict[str, Any], msg: Any) -> None:
        """A reply that is not the one awaited: one of :meth:`request_many`'s (kept, with
        its payload frames), else :attr:`on_stray`'s."""
        want = self._want
        if want is not None and rid in want and want[rid] is None:
            want[rid] = (rid, status, rbody, list(msg[1:]) if msg is not None else [])
            return
        if self.on_stray is not None:
            self.on_stray(rid, status, rbody)

    def _note_look(self, now: float) -> None:
        """A slice of a wait ended: the longest time this caller went without running
        beyond its slice (``_kept``, seconds) is kept for the timeout's message."""
        kept = now - self._looked - self._slice_ms / 1000
        if kept > self._kept:
            self._kept = kept
        self._looked = now

    def _timed_out(self, wait: float) -> None:
        self.timeouts += 1
        self.reset()
        why = ""
        if self._kept >= KEPT_NOTE_S:
            # (the process was starved: its CPU, or the GIL held by another thread)
            why = (f"; this caller did not run for {self._kept:.2f} s of it (the "
                   f"process was short of CPU, or another thread held the GIL)")
        raise ServerUnavailable(
            f"no reply from kvshm server at {self._where()} within {wait:g} s{why}")

    def send(self, op: int, body: dict[str, Any], frames: Sequence[Any] = (), *,
             epoch: int = 0, req_id: int) -> None:
        """Send one request whose reply nobody waits for: it goes to :attr:`on_stray`
        when a later :meth:`request` or :meth:`drain` reads it. Call with :attr:`lock`
        held. Raises ServerUnavailable when it cannot be sent (the socket is reset)."""
        if self.zmtp:
            self._zsend_nowait(_encode(op, req_id, epoch, body), frames)
            return
        sock = self._sock
        if sock is None or self._pid != os.getpid():
            sock = self._socket()
        try:
            send_message(sock, _encode(op, req_id, epoch, body), frames)
        except zmq.ZMQError as exc:
            self.reset()
            raise ServerUnavailable(f"cannot send to kvshm server at {self._where()}: "
                                    f"{exc}") from None
        except BaseException:
            self.reset()
            raise

    def request_many(self, reqs: Sequence[tuple[int, dict[str, Any], Sequence[Any], int]],
                     *, epoch: int = 0, timeout: float | None = None
                     ) -> list[tuple[int, int, dict[str, Any], list[Any]]]:
        """Send several requests back to back, then wait for every reply: a pipeline, so
        the server serves one while this caller packs the next and reads the replies of
        those done. Call with :attr:`lock` held.

        ``reqs``: ``(op, body, frames, req_id)`` each; ``body`` a dict, or the header
        frame already packed with that ``req_id`` and ``epoch`` (``bytes``). Returns ``(req_id, status, body,
        frames)`` per request, in the order of ``reqs`` whatever order the replies come
        in (a server serving a large one in slices answers a later small one first).

        Each reply is waited for as :meth:`request` waits (the timeout counted again
        from each reply that came, as a run of requests made one after the other would
        count it): a server that stops answering, or whose connection closes, ends the
        call in ServerUnavailable (ServerGone: the watch), and the replies still to come
        are then lost with the socket (reset), as a timed-out request's. Raises what
        :meth:`send` and :meth:`request` raise; a failure before the last request went
        out leaves those sent unanswered (the caller treats them as a timed-out one).
        """
        if not reqs:
            return []
        want: dict[int, Any] = {}
        for _, _, _, rid in reqs:
            want[rid] = None
        if len(want) != len(reqs):
            raise ValueError("request_many: request ids must differ")
        wait = self.timeout if timeout is None else timeout
        self._want = want
        try:
            watch = self.watch
            if watch is not None and time.monotonic() - self._last > IDLE_S:
                self._check(watch, sent=False)      # (as request: before any send)
                self._last = time.monotonic()       # (request looks again otherwise)
            for op, body, frames, rid in reqs[:-1]:
                self.send(op, body, frames, epoch=epoch, req_id=rid)
            op, body, frames, rid = reqs[-1]
            try:
                r = self.request(op, body, frames, epoch=epoch, req_id=rid, timeout=wait)
            except ServerGone as exc:
                exc.sent = exc.sent or len(reqs) > 1   # the earlier ones went out
                raise
            want[rid] = r
            for _, _, _, rid in reqs:
                if want[rid] is None:       # not come yet (answered after the last)
                    want[rid] = self._wait_for(rid, wait)
        finally:
            self._want = None
        return [want[rid] for _, _, _, rid in reqs]

    def _wait_for(self, req_id: int, wait: float
                  ) -> tuple[int, int, dict[str, Any], list[Any]]:
        """Wait for the reply to ``req_id``, sent earlier (:meth:`request_many`)."""
        watch = self.watch
        if self.zmtp:
            zt = self._sock
            if zt is None or self._pid != _pid[0]:
                # (the connection was closed or never made since the send: its
                # reply cannot come) a wait that ends as a lost reply's does
                zt = self._zconn(time.monotonic() + wait, watch, wait)
            return self._zawait(zt, req_id, wait, watch)
        sock = self._sock
        if sock is None or self._pid != os.getpid():
            sock = self._socket()
        return self._await(sock, req_id, wait, watch)

    def drain(self, limit: int = DRAIN_MAX) -> None:
        """Hand the replies already here to :attr:`on_stray`, without waiting, at most
        ``limit`` of them (the rest stay queued: see :data:`DRAIN_MAX`). Call with
        :attr:`lock` held.

        Raises
        ------
        ProtocolError
            An undecodable reply, as :meth:`request`: which request it answers is unknown
            (a RESERVE or PLACE sent without a wait: its caller's state would wait for
            that reply for good), so the socket is reset, and the replies still to come
            are lost with it; the caller says HELLO again.
        """
        if self.zmtp:
            self._zdrain(limit)
            return
        sock = self._sock
        if sock is None or self._pid != os.getpid():
            return
        for _ in range(limit):
            try:
                if _zmqc is not None:
                    msg = _zmqc.recv_multipart(sock, _zmqc.DONTWAIT, ZERO_COPY_BYTES)
                    if msg is None:
                        return      # nothing queued
                else:
                    if not sock.get(zmq.EVENTS) & zmq.POLLIN:
                        return      # (cheaper than a recv that raises Again)
                    msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            try:
                m0 = msg[0]
                status, rid, rbody = decode_reply(m0 if isinstance(m0, bytes) else m0.buffer)
            except DecodeError as exc:
                self.reset()
                raise ProtocolError(f"bad reply from {self._where()}: {exc}") from None
            self._stray(rid, status, rbody, msg)

    def _check(self, watch: ServerWatch, sent: bool) -> None:
        why = watch.gone()
        if why is not None:
            self.gone += 1
            self.reset()
            raise ServerGone(f"kvshm server at {self._where()} is gone: {why}", sent=sent)

    def _handshake_failed(self) -> None:
        """A security handshake failed. The server refusing this client's key (AUTH) or
        speaking another mechanism (PROTOCOL) is final: AuthenticationFailed. The peer
        closing the connection mid-handshake (NO_DETAIL) is what a dying server does, and
        also what a CURVE server does with a client that has the wrong server key: only
        when it happens again on the reconnect is it taken for a refusal; otherwise the
        wait goes on (and ends in ServerUnavailable if the server is gone)."""
        from zmq.utils.monitor import recv_monitor_message

        assert self._monitor is not None
        try:
            ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._hs_failed += 1
            if self._hs_failed < 2:
                return
        where = self._where()
        self.reset()
        if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = "the server does not accept this client's CURVE key"
        else:
            why = ("the security handshake failed: the server needs CURVE "
                   "(curve_server_key=...) or the key given is not the server's")
        raise AuthenticationFailed(f"kvshm server at {where} refused the connection: {why}")

    # ------------------------------------------------------------- the ZMTP transport

    def _zsend_nowait(self, header: bytes, frames: Sequence[Any]) -> None:
        """send() on the ZMTP transport: on the connection, made again (one try) when the
        server closed it; queued when none can be made now (as libzmq queues)."""
        now = time.monotonic()
        zt = self._zconn(now + self.timeout, None, self.timeout, once=True)
        self.sent += 1
        if zt is None:
            self._zpending.append((header, [bytes(memoryview(f)) for f in frames]))
            return
        self._zsend(zt, header, frames, now + self.timeout)

    def _zconn(self, deadline: float, watch: ServerWatch | None, wait: float,
               once: bool = False) -> Any:
        """The live ZMTP connection, made (again) when there is none or the server closed
        it: until ``deadline``, retried every slice (the watch and the deadline checked
        between, as a wait's slices; ``once``: one try, None when it failed). Messages
        queued by send() go first. Raises ServerUnavailable (deadline), ServerGone,
        AuthenticationFailed (a CURVE server, or the server's ZMTP ERROR),
        ProtocolError (not a ZMTP 3 ROUTER)."""
        zt = self._sock
        if self._pid != _pid[0]:        # forked: never touch the parent's connection
            if zt is not None:
                zt.close()              # (the child's copy of the descriptor only)
            zt = self._sock = None
            self._zlive = False
            self._zpending = []
            self._pid = _pid[0]
        if zt is not None:
            if zt.alive(ALIVE_IDLE_MS):
                return zt
            # replies whole before the close are not lost (all of them: a closed
            # connection's bytes are finite, no flood can go on)
            self._zdrain(1 << 62)
            self._sock = None           # (a bad one among them: ProtocolError, reset)
            self.reconnects += 1
            # a new routing id: the old connection's may still be held by the server
            # (libzmq's ROUTER lets it go only once its I/O thread saw the close;
            # ROUTER_HANDOVER off), and a connection claiming it meanwhile is not served
            self._zlive = False
        if not self._zlive:
            # a routing id of its own for each connection (as _socket: the server does
            # not hand a connected id over, and the client says HELLO on every new one)
            self.routing_id = os.urandom(16)
            self._zlive = True
        self._watch_at = time.monotonic() + POLL_S
        self._looked, self._kept = self._watch_at - POLL_S, 0.0
        hs_closed = 0
        while True:
            left = deadline - time.monotonic()
            try:
                zt = self._zopen(max(0.001, left))
            except _zmtp.MechanismMismatch as exc:
                where = self._where()
                self.reset()
                raise AuthenticationFailed(
                    f"kvshm server at {where} refused the connection: the security "
                    f"handshake failed: the server needs CURVE (curve_server_key=...) "
                    f"({exc})") from None
            except _zmtp.PeerError as exc:
                where = self._where()
                self.reset()
                raise AuthenticationFailed(f"kvshm server at {where} refused the "
                                           f"connection: {exc.reason}") from None
            except _zmtp.PeerClosed:
                # closed in the handshake: a dying server, or a CURVE server refusing
                # this NULL client; again, as libzmq's NO_DETAIL: twice is a refusal
                hs_closed += 1
                if hs_closed >= 2:
                    where = self._where()
                    self.reset()
                    raise AuthenticationFailed(
                        f"kvshm server at {where} refused the connection: the security "
                        "handshake failed: the server needs CURVE (curve_server_key=...) "
                        "or the key given is not the server's") from None
            except _zmtp.Timeout:
                pass                    # a starting server: again next slice
            except _zmtp.ZmtpError as exc:
                where = self._where()
                self.reset()
                raise ProtocolError(f"bad ZMTP handshake from {where}: {exc}") from None
            except PermissionError as exc:
                # (EACCES lasts: said at once, not as the timeout's "no reply")
                where = self._where()
                self.reset()
                raise ServerUnavailable(f"cannot connect to kvshm server at {where}: "
                                        f"permission denied ({exc.strerror})") from None
            except OSError:
                pass                    # refused, no such ipc path yet: as libzmq, retry
            else:
                self._sock = zt
                if self._zpending:
                    pending, self._zpending = self._zpending, []
                    for header, frames in pending:
                        self._zsend(zt, header, frames, deadline)
                return zt
            if once:
                return None
            self._zwaited(watch, deadline, wait, sent=False)
            time.sleep(max(0.0, min(self._slice_ms / 1000, deadline - time.monotonic())))

    def _zopen(self, left: float) -> Any:
        ep = self.endpoint
        if ep.startswith("ipc://"):
            path = ep[len("ipc://"):]
            if path.startswith("@"):
                path = "\0" + path[1:]     # (an abstract socket, as libzmq names it)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(left)
                s.connect(path)
            except BaseException:
                s.close()
                raise
        else:
            host, _, port = ep[len("tcp://"):].rpartition(":")
            # a connect not done in CONNECT_TIMEOUT_MS is made again (a lost SYN is
            # resent by the kernel only after 1 s), as libzmq's ZMQ_CONNECT_TIMEOUT
            s = socket.create_connection((host.strip("[]"), int(port)),
                                         timeout=min(left, CONNECT_TIMEOUT_MS / 1000))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        zt = _zmtp.Conn(s.detach())
        zt.max_message = self.reply_bound
        zt.handshake(self.routing_id, max(1, int(min(left, 1.0) * 1000)))
        return zt

    def bound_replies(self, nbytes: int) -> None:
        """Accept at most ``nbytes`` bytes in one reply from now on (a server's HELLO
        reply says how large its pool is: :meth:`kvshm.limits.Limits.reply_bound`).
        Before it the bound is :data:`kvshm.limits.HELLO_REPLY_BOUND` (1 MiB). On the
        ZMTP transport a larger reply (its frames together) is a ProtocolError at its
        first frame header past the bound, the connection closed and nothing allocated
        for the rest; on libzmq each frame is bounded (ZMQ_MAXMSGSIZE) on the
        connections made after this call, and a connection that passes it is dropped
        by libzmq (the wait ends as ServerUnavailable at the timeout)."""
        self.reply_bound = max(1, int(nbytes))
        self._bounded = True
        if self.zmtp and self._sock is not None:
            self._sock.max_message = self.reply_bound

    def _zwaited(self, watch: ServerWatch | None, deadline: float, wait: float,
                 sent: bool = True, look: bool = False) -> int:
        """A slice passed with no reply (or no connection): the watch (every POLL_S) and
        the deadline end the wait (raising, as _waited; with ``look``, the deadline
        returns 0: the caller takes its last look, :meth:`_zexpired`); else the next
        slice's ms."""
        now = time.monotonic()
        self._note_look(now)
        if watch is not None and now >= self._watch_at:
            self._watch_at = now + POLL_S
            self._check(watch, sent=sent)
        left = deadline - now
        if left <= 0:
            if look:
                return 0
            self._timed_out(wait)
        return max(1, min(self._slice_ms, int(left * 1000)))

    def _zexpired(self, zt: Any, req_id: int, wait: float
                  ) -> tuple[int, int, dict[str, Any], list[Any]]:
        """:meth:`_expired` on the ZMTP transport: the replies already here (at most
        LAST_LOOK), read without waiting, before the timeout."""
        def one() -> Any:
            try:
                return zt.recv(0)
            except OSError:
                return None             # (closed: the reply cannot come)
        return self._last_look(one, req_id, wait)

    def _zlost(self, watch: ServerWatch | None, exc: BaseException, deadline: float,
               wait: float) -> None:
        """The server closed the connection (or broke ZMTP) while a reply was awaited.
        A close (or reset: the server's end, or a relay between cutting the link): the
        reply cannot come, so the wait ends at once: the watch looked at (ServerGone,
        ``sent`` True), else ServerUnavailable. The request may have been applied (the
        server had it and its reply was lost): it is not sent again, as libzmq never
        sends a request twice; the caller's next call makes a new connection (and says
        HELLO). A protocol violation: ProtocolError at once; the server's ERROR command:
        ServerUnavailable at once."""
        where = self._where()
        if not isinstance(exc, _zmtp.PeerClosed) and isinstance(exc, _zmtp.ZmtpError):
            self.reset()
            if isinstance(exc, _zmtp.PeerError):
                raise ServerUnavailable(f"kvshm server at {where} ended the connection: "
                                        f"{exc.reason}") from None
            raise ProtocolError(f"bad reply from {where}: {exc}") from None
        self.reset()                    # (closed: the next call connects again)
        if watch is not None:
            # the close says "look": gone or replaced? A killed server's sockets close
            # a moment before its lock does: looked at each slice for CLOSE_WATCH_S
            end = min(deadline, time.monotonic() + CLOSE_WATCH_S)
            while True:
                self._check(watch, sent=True)
                left = end - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(self._slice_ms / 1000, left))
        raise ServerUnavailable(f"kvshm server at {where} closed the connection before "
                                f"the reply came ({exc}); the request may have been "
                                "applied and is not sent again") from None

    def _zsend(self, zt: Any, header: bytes, frames: Sequence[Any], deadline: float
               ) -> None:
        try:
            zt.send(header, frames, max(1, int((deadline - time.monotonic()) * 1000)))
        except _zmtp.Timeout:
            self.reset()
            raise ServerUnavailable(f"cannot send to kvshm server at {self._where()}: "
                                    f"it took nothing within {self.timeout:g} s") from None
        except OSError as exc:
            self.reset()
            raise ServerUnavailable(f"cannot send to kvshm server at {self._where()}: "
                                    f"{exc}") from None
        except BaseException:
            self.reset()
            raise

    def _zrequest(self, op: int, body: dict[str, Any], frames: Sequence[Any], epoch: int,
                  req_id: int, timeout: float | None, into: Any = None
                  ) -> tuple[int, int, dict[str, Any], list[Any]]:
        if into is None:
            return self._zrequest2(op, body, frames, epoch, req_id, timeout, None)

        def hook(header: bytes) -> Any:
            # the header of a message with payload frames: this request's reply?
            try:
                status, rid, rbody = decode_reply(header)
                if rid != req_id or type(rbody) is not dict:
                    return None
                return into(status, rbody)
            except Exception:
                return None             # (the usual path words what is wrong)

        try:
            return self._zrequest2(op, body, frames, epoch, req_id, timeout, hook)
        finally:
            zt: Any = self._sock        # (a _zmtp.Conn on this transport)
            if zt is not None and zt.end_into():
                self._sock = None       # (a reply given up mid-way: closed, see request)

    def _zrequest2(self, op: int, body: dict[str, Any], frames: Sequence[Any], epoch: int,
                   req_id: int, timeout: float | None, hook: Any
                   ) -> tuple[int, int, dict[str, Any], list[Any]]:
        header = _encode(op, req_id, epoch, body)
        wait = self.timeout if timeout is None else timeout
        watch = self.watch
        now = time.monotonic()
        if watch is not None and now - self._last > IDLE_S:
            self._check(watch, sent=False)
        zt = self._zconn(now + wait, watch, wait)
        self.sent += 1
        self._zsend(zt, header, frames, now + wait)
        return self._zawait(zt, req_id, wait, watch, hook)

    def _zawait(self, zt: Any, req_id: int, wait: float, watch: ServerWatch | None,
                hook: Any = None) -> tuple[int, int, dict[str, Any], list[Any]]:
        """The wait of :meth:`request` (ZMTP) for the reply to ``req_id``, sent now."""
        now = time.monotonic()
        deadline = now + wait
        self._watch_at = now + POLL_S
        self._looked, self._kept = now, 0.0
        ms = self._slice_ms
        while True:
            try:
                msg = zt.recv(ms, hook)
            except OSError as exc:
                self._zlost(watch, exc, deadline, wait)
                raise                   # (not reached)
            if msg is None:
                ms = self._zwaited(watch, deadline, wait, look=True)
                if not ms:
                    return self._zexpired(zt, req_id, wait)
                continue
            try:
                status, rid, rbody = decode_reply(msg[0])
            except DecodeError as exc:
                self.reset()
                raise ProtocolError(f"bad reply from {self._where()}: {exc}") from None
            if rid != req_id:
                self._stray(rid, status, rbody, msg)
                if time.monotonic() >= deadline:    # (a flood of them: not past it)
                    return self._zexpired(zt, req_id, wait)
                continue
            self._last = time.monotonic()
            return rid, status, rbody, msg[1:]

    def _zcall1(self, kind: int, op: int, key: bytes, value: Any, checksum: int | None,
                out: Any, req_id: int, epoch: int, max_size: int) -> Any:
        """call1 on the ZMTP transport (the same waits, slices and checks)."""
        watch = self.watch
        t0 = _monotonic()
        if watch is not None and t0 - self._last > IDLE_S:
            self._check(watch, sent=False)
        zt = self._sock
        if zt is None or self._pid != _pid[0] or not zt.alive(ALIVE_IDLE_MS):
            zt = self._zconn(t0 + self.timeout, watch, self.timeout)
        try:
            r = zt.call1(kind, op, req_id, epoch, key, value if kind == _PUT1 else None,
                         checksum, max_size, out, max(1, int(self.timeout * 1000)),
                         self._slice_ms)
        except _zmtp.Timeout:
            self.reset()
            raise ServerUnavailable(f"cannot send to kvshm server at {self._where()}: "
                                    f"it took nothing within {self.timeout:g} s") from None
        except OSError as exc:
            self._zlost(watch, exc, t0 + self.timeout, self.timeout)
            raise                       # (not reached)
        except BaseException:
            self.reset()
            raise
        if r is None:
            return NOT_SENT
        self.sent += 1
        if r is _zmtp.AGAIN or type(r) is list:
            deadline = t0 + self.timeout
            self._watch_at = t0 + POLL_S
            self._looked, self._kept = t0, 0.0
            while True:
                if r is _zmtp.AGAIN:
                    ms = self._zwaited(watch, deadline, self.timeout, look=True)
                    if not ms:
                        got = self._zexpired(zt, req_id, self.timeout)
                        return got[1], got[2], got[3]
                elif type(r) is not list:
                    break
                else:
                    try:
                        status, rid, rbody = decode_reply(r[0])
                    except DecodeError as exc:
                        self.reset()
                        raise ProtocolError(f"bad reply from {self._where()}: "
                                            f"{exc}") from None
                    if rid == req_id:
                        self._last = _monotonic()
                        return status, rbody, r[1:]
                    if self.on_stray is not None:
                        self.on_stray(rid, status, rbody)
                    ms = self._slice_ms
                    if _monotonic() >= deadline:    # (a flood of them: not past it)
                        got = self._zexpired(zt, req_id, self.timeout)
                        return got[1], got[2], got[3]
                try:
                    r = zt.recv1(kind, req_id, out, ms)
                except OSError as exc:
                    self._zlost(watch, exc, deadline, self.timeout)
                    raise               # (not reached)
        self.fast += 1
        self._last = _monotonic()
        return r

    def _zdrain(self, limit: int) -> None:
        zt = self._sock
        if zt is None or self._pid != _pid[0]:
            return
        for _ in range(limit):
            try:
                msg = zt.recv(0)
            except OSError:
                return                  # (closed: the next call makes a new connection)
            if msg is None:
                return
            try:
                status, rid, rbody = decode_reply(msg[0])
            except DecodeError as exc:   # (as drain on libzmq: see drain)
                self.reset()
                raise ProtocolError(f"bad reply from {self._where()}: {exc}") from None
            self._stray(rid, status, rbody, msg)
