"""ClusterClient and AsyncClusterClient: the Client API over every member of a cluster.

A cluster client needs only its local server's address: it learns the members from
that server, which pushes each change of its view (:mod:`kvshm.cluster.follower`), so
an engine process needs neither grpc nor an etcd address.

Each batch is split by owner (:mod:`kvshm.cluster.placement`) and sent as one request
per owner, all owners at once (:mod:`kvshm.cluster.fanout` holds the plans; this module
runs them): :class:`ClusterClient` on one :class:`~kvshm.Client` per member in threads
(the copies release the GIL), :class:`AsyncClusterClient` on one
:class:`~kvshm.AsyncClient` per member with ``asyncio.gather``. The local member is
reached through shm, the others over TCP (or RDMA where both sides have a device).

Handoffs: :mod:`kvshm.cluster.handoffs`; counters: :mod:`kvshm.cluster.metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from kvshm.aio import AsyncClient
from kvshm.client import Client, Key
from kvshm.cluster.fanout import Call, Fanout, MemberLeft, Plan
from kvshm.cluster.follower import DEFAULT_WAIT, ThreadFollower, ViewState, fetch, follow
from kvshm.cluster.handoffs import read_handoff, renew_handoff
from kvshm.cluster.metrics import ClientCollector, ClusterMetrics, clients_collector
from kvshm.cluster.view import View
from kvshm.errors import ServerUnavailable
from kvshm.handoff import Handoff

__all__ = ["ClusterClient", "AsyncClusterClient"]

log = logging.getLogger(__name__)

_DOC_PARAMS = """
    Parameters
    ----------
    local_address : str
        ``host:port`` of this host's server (a member of the cluster).
    stripe : int
        Keys per stripe (see :mod:`kvshm.cluster.placement`). Default 1: each key placed
        by itself.
    replicas : int
        1 (default) or 2: writes go to the top ``replicas`` owners; reads try them in
        order.
    transport : str
        Mover for every member (``"auto"``: shm where the pool is on this host).
    timeout : float
        Seconds per reply from any member (a member that does not answer in time
        becomes suspect).
    refresh_interval : float
        Seconds between attempts to reach the local server while it does not answer
        (the last view stays), and between polls of a server that does not push.
    view_wait : float
        Seconds a CLUSTER_VIEW may stay parked at the local server (default 10): a
        change is pushed at once; an idle cluster costs one round trip per this long.
    fallback_window : float
        Seconds after a change of the member list during which misses are tried at the
        second choice and copied home.
    placement_key : callable, optional
        ``bytes -> bytes``: the placement key of a key (default the key itself); a call's
        ``placement_keys`` argument overrides it.
    workers : int
        Threads of the fan-out (sync client only).
    client_options : dict, optional
        More :class:`~kvshm.Client` arguments for every member (CURVE keys, ...).
"""


async def _fetch_now(client: AsyncClient, state: ViewState, timeout: float
                     ) -> tuple[View, View] | None:
    """The local server's view now, within ``timeout`` (the view client's own timeout
    is longer: it waits for pushes)."""
    try:
        return await asyncio.wait_for(fetch(client, state, None, None), timeout)
    except asyncio.TimeoutError:
        raise ServerUnavailable(f"no cluster view from the kvshm server at "
                                f"{client.address} within {timeout:g} s") from None


def _check(stripe: int, replicas: int) -> None:
    if stripe < 1:
        raise ValueError("stripe must be >= 1")
    if replicas not in (1, 2):
        raise ValueError("replicas must be 1 or 2")


class _Base:
    """What both drivers share: options, the view state, the plans, the counters."""

    def __init__(self, local_address: str, *, stripe: int = 1, replicas: int = 1,
                 transport: str = "auto", timeout: float = 2.0,
                 refresh_interval: float = 0.25, view_wait: float = DEFAULT_WAIT,
                 fallback_window: float = 60.0,
                 placement_key: Callable[[bytes], bytes] | None = None, workers: int = 16,
                 client_options: dict[str, Any] | None = None) -> None:
        _check(stripe, replicas)
        if not 0 < view_wait <= 60:
            raise ValueError("view_wait must be in (0, 60] seconds")
        self.local_address = local_address
        self.stripe = stripe
        self.replicas = replicas
        self.transport = transport
        self.timeout = timeout
        self.refresh_interval = refresh_interval
        self.view_wait = view_wait
        self.fallback_window = fallback_window
        self.placement_key = placement_key
        self.workers = workers
        self._opts = dict(client_options or {})
        self._state = ViewState()
        self._metrics = ClusterMetrics()
        self._fan = Fanout(self._state, self._metrics, stripe=stripe, replicas=replicas,
                           fallback_window=fallback_window, placement_key=placement_key)
        self._lock = threading.Lock()
        self._closed = False
        self._exports: list[Any] = []     # ClientsCollectors this client is in

    def _member_opts(self, node_id: str) -> tuple[str, dict[str, Any]] | None:
        """(address, client options) of a member, or None when not in the view."""
        m = self._state.view.get(node_id)
        if m is None:
            return None
        opts = dict(self._opts)
        if m.curve_public_key and "curve_server_key" not in self._opts:
            opts["curve_server_key"] = m.curve_public_key    # from its member record
        return m.service, opts

    def _view_client_opts(self) -> dict[str, Any]:
        # a parked CLUSTER_VIEW answers within view_wait: the reply timeout is longer
        return {"transport": "tcp", "timeout": self.timeout + self.view_wait, **self._opts}

    @property
    def view(self) -> View:
        """The last view learnt from the local server."""
        return self._state.view

    def owners(self, keys: Sequence[Key], placement_keys: Sequence[Key] | None = None
               ) -> list[str | None]:
        """The first owner's node id per key (None with no member up); the same on
        every client with the same view."""
        return self._fan.owners(keys, placement_keys)

    def suspects(self) -> list[str]:
        return self._fan.suspects()

    def metrics(self) -> dict[str, Any]:
        """Counters: misses by reason, fallback hits/copies, view revision, changes and
        pushes, suspect marks, and per peer requests, bytes in/out, mean latency (s),
        total seconds, errors (:mod:`kvshm.cluster.metrics`)."""
        return self._metrics.snapshot(self._state.view, self._fan.suspects())

    def collector(self, labels: dict[str, str] | None = None) -> ClientCollector:
        """A ``prometheus_client`` collector of :meth:`metrics` (needs
        ``prometheus_client`` when scraped): ``REGISTRY.register(cc.collector())``."""
        return ClientCollector(self.metrics, labels)

    def register_metrics(self, registry: Any = None,
                         labels: dict[str, str] | None = None) -> None:
        """Export :meth:`metrics` into ``registry`` (default
        ``prometheus_client.REGISTRY``) next to the other cluster clients there: one
        collector per registry holds them all (a second :meth:`collector` of the same
        names is refused by the registry). ``labels`` tell the clients apart (ValueError
        when another client of the registry has the same); :meth:`close` removes the
        client. A closed client is not added."""
        with self._lock:
            if self._closed:
                return
            col = clients_collector(registry)
            col.add(id(self), self.metrics, labels)
            self._exports.append(col)

    def _unexport(self) -> None:
        with self._lock:
            cols, self._exports = self._exports, []
        for col in cols:
            col.remove(id(self))

    def _count_push(self) -> None:
        self._metrics.count("view_pushes")


class ClusterClient(_Base):
    __doc__ = "Client of a kvshm cluster, through the local server (synchronous).\n" \
        + _DOC_PARAMS

    def __init__(self, local_address: str, **kw: Any) -> None:
        super().__init__(local_address, **kw)
        self._local = Client(local_address, transport=self.transport, timeout=self.timeout,
                             **self._opts)
        self._clients: dict[str, tuple[int, Client]] = {}
        self._pool = ThreadPoolExecutor(max_workers=self.workers,
                                        thread_name_prefix="kvshm-cluster")
        self._follower = ThreadFollower(
            lambda: AsyncClient(local_address, **self._view_client_opts()))
        try:
            self.refresh()
        except BaseException:
            self._follower.stop()
            self._pool.shutdown(wait=False)
            self._local.close()
            raise
        self._follower.start(lambda: follow(
            self._follower.client, self._state, self._on_change, wait=self.view_wait,
            retry=self.refresh_interval, on_push=self._count_push))

    # ------------------------------------------------------------------ view

    def _on_change(self, old: View, new: View) -> None:
        gone = self._fan.view_changed(old, new)
        with self._lock:
            drop = [self._clients.pop(n)[1] for n in gone if n in self._clients]
        for c in drop:
            c.close()

    def refresh(self) -> View:
        """Ask the local server for its view now (the follower gets changes anyway);
        returns it."""
        changed = self._follower.call(lambda: _fetch_now(self._follower.client,
                                                         self._state, self.timeout))
        if changed is not None:
            self._on_change(*changed)
        return self._state.view

    # ------------------------------------------------------------------ driver

    def _client(self, target: str) -> Client:
        if target.startswith("@"):
            return Client(target[1:], timeout=self.timeout, **self._opts)
        if target == self._state.local_id:
            return self._local
        found = self._member_opts(target)
        if found is None:      # left the view after the plan read its placement
            raise MemberLeft(f"member {target} left the cluster")
        epoch = self._state.view.get(target).epoch     # type: ignore[union-attr]
        with self._lock:
            cur = self._clients.get(target)
            if cur is not None and cur[0] == epoch:
                return cur[1]
        addr, opts = found
        c = Client(addr, transport=self.transport, timeout=self.timeout, connect=False,
                   **opts)
        with self._lock:
            old = self._clients.get(target)
            self._clients[target] = (epoch, c)
        if old is not None:
            old[1].close()
        return c

    @staticmethod
    def _invoke(c: Client, call: Call) -> Any:
        if call.method == "epoch":
            if not c.server_info:
                c.ping()
            return int(c.server_info.get("epoch", 0))
        return getattr(c, call.method)(*call.args, **call.kwargs)

    def _one(self, target: str, call: Call, adhoc: dict[str, Client]) -> Any:
        if target.startswith("@"):
            c = adhoc.get(target)
            if c is None:
                c = adhoc[target] = self._client(target)
        else:
            c = self._client(target)
        t0 = time.perf_counter()
        try:
            r = self._invoke(c, call)
        except Exception as exc:
            if self._dropped(target, c):
                exc = MemberLeft(f"member {target} left the cluster during the call: "
                                 f"{exc}")
            self._fan.finished(target, call, time.perf_counter() - t0, exc)
            raise exc
        self._fan.finished(target, call, time.perf_counter() - t0, r)
        return r

    def _dropped(self, target: str, c: Client) -> bool:
        """Whether ``c`` is a member client the view follower dropped (the member left
        or restarted) while a call used it: closed under the call."""
        if target.startswith("@") or c is self._local or self._closed:
            return False
        with self._lock:
            cur = self._clients.get(target)
        return cur is None or cur[1] is not c

    def _round(self, calls: dict[str, Call], adhoc: dict[str, Client]) -> dict[str, Any]:
        """Run one round, all targets at once; exceptions are returned."""
        out: dict[str, Any] = {}
        if len(calls) == 1:
            (target, call), = calls.items()
            try:
                out[target] = self._one(target, call, adhoc)
            except Exception as exc:
                out[target] = exc
            return out
        futs = {t: self._pool.submit(self._one, t, call, adhoc) for t, call in calls.items()}
        for t, f in futs.items():
            try:
                out[t] = f.result()
            except Exception as exc:
                out[t] = exc
        return out

    def _run(self, plan: Plan) -> Any:
        adhoc: dict[str, Client] = {}
        try:
            try:
                calls = next(plan)
            except StopIteration as stop:
                return stop.value
            while True:
                res = self._round(calls, adhoc)
                try:
                    calls = plan.send(res)
                except StopIteration as stop:
                    return stop.value
        finally:
            plan.close()
            for c in adhoc.values():
                c.close()

    # ------------------------------------------------------------------ the API

    def put(self, key: Key, value: Any, **kw: Any) -> None:
        self.put_batch([key], [value], **kw)

    def put_batch(self, keys: Sequence[Key], values: Sequence[Any], *,
                  checksum: bool = False, pin_ttl: float | None = None,
                  placement_keys: Sequence[Key] | None = None) -> Handoff | None:
        """Store each value at its owner(s), one request per owner, in parallel.

        ``pin_ttl``: prefill/decode handoff instead: write everything into the *local*
        store (shm) with a handoff pin and return the :class:`~kvshm.handoff.Handoff`.
        A write whose owner fails goes to the next HRW choice; the first error that
        could not be routed around is raised.
        """
        if pin_ttl is not None:
            return self._local.put_batch(keys, values, checksum=checksum,  # type: ignore[no-any-return]
                                         pin_ttl=pin_ttl)
        return self._run(self._fan.put(keys, values, checksum=checksum,  # type: ignore[no-any-return]
                                       placement_keys=placement_keys))

    def get(self, key: Key, **kw: Any) -> bytes | None:
        """The value of ``key``, or None on a miss (a cluster miss is never an error)."""
        return self.get_batch([key], **kw)[0]

    def get_batch(self, keys: Sequence[Key], *, verify: bool = False,
                  placement_keys: Sequence[Key] | None = None) -> list[bytes | None]:
        """Values of ``keys`` from their owners (None per miss), one request per owner."""
        return self._run(self._fan.get(keys, verify=verify,  # type: ignore[no-any-return]
                                       placement_keys=placement_keys))

    def exists_batch(self, keys: Sequence[Key], *,
                     placement_keys: Sequence[Key] | None = None) -> list[bool]:
        """Whether each key is stored at its first owner (suspect or gone: False)."""
        return self._run(self._fan.exists(keys, placement_keys=placement_keys))  # type: ignore[no-any-return]

    def exists(self, key: Key) -> bool:
        return self.exists_batch([key])[0]

    def match_prefix(self, keys: Sequence[Key], *,
                     placement_keys: Sequence[Key] | None = None) -> int:
        """How many leading keys the cluster holds (at their owners), one request per
        owner."""
        return self._run(self._fan.match_prefix(keys, placement_keys=placement_keys))  # type: ignore[no-any-return]

    def delete(self, keys: Key | Sequence[Key]) -> int:
        """Remove keys from every up member that may hold them (their owners and, in
        the fallback window, second choices). Returns entries removed."""
        return self._run(self._fan.delete(keys))  # type: ignore[no-any-return]

    def get_handoff(self, handoff: Handoff | dict[str, Any], *, unpin: bool = True,
                    verify: bool = False) -> list[bytes | None]:
        """Read a prefill's handoff (None per miss). A node that left the view or
        restarted (another epoch) gives all misses; ``unpin`` drops the pin after."""
        return self._run(read_handoff(self._fan, handoff, unpin=unpin, verify=verify))  # type: ignore[no-any-return]

    def renew(self, handoff: Handoff, ttl: float) -> float | None:
        """Extend a handoff's pin at its node; None when gone."""
        return self._run(renew_handoff(self._fan, handoff, ttl))  # type: ignore[no-any-return]

    @property
    def local(self) -> Client:
        """The client of the local server."""
        return self._local

    def close(self) -> None:
        """Stop the view follower and close every member connection. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._unexport()
        self._follower.stop()
        self._pool.shutdown(wait=True)
        with self._lock:
            clients = [c for _, c in self._clients.values()]
            self._clients.clear()
        for c in clients:
            c.close()
        self._local.close()

    def __enter__(self) -> "ClusterClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        v = self._state.view
        return (f"<kvshm.ClusterClient {self.local_address} members={len(v.members)} "
                f"revision={v.revision}>")


class AsyncClusterClient(_Base):
    __doc__ = ("The :class:`ClusterClient` API for asyncio, natively: one "
               ":class:`~kvshm.AsyncClient` per member, each batch's requests gathered, "
               "the view follower a task of the loop. Use it from one event loop; "
               "``async with`` or :meth:`connect` first, :meth:`close` last.\n"
               + _DOC_PARAMS)

    def __init__(self, local_address: str, **kw: Any) -> None:
        super().__init__(local_address, **kw)
        self._local: AsyncClient | None = None
        self._view_client: AsyncClient | None = None
        self._clients: dict[str, tuple[int, AsyncClient]] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    async def connect(self) -> "AsyncClusterClient":
        """Learn the view and start following it (every call does it first)."""
        if self._closed:
            raise ServerUnavailable("cluster client is closed")
        if self._task is not None:
            return self
        if self._local is None:
            self._local = AsyncClient(self.local_address, transport=self.transport,
                                      timeout=self.timeout, **self._opts)
            self._view_client = AsyncClient(self.local_address, **self._view_client_opts())
        await self.refresh()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(follow(
                self._view_client, self._state, self._on_change, wait=self.view_wait,
                retry=self.refresh_interval, on_push=self._count_push))
        return self

    async def refresh(self) -> View:
        """Ask the local server for its view now; returns it."""
        assert self._view_client is not None
        changed = await _fetch_now(self._view_client, self._state, self.timeout)
        if changed is not None:
            self._on_change(*changed)
        return self._state.view

    def _on_change(self, old: View, new: View) -> None:
        gone = self._fan.view_changed(old, new)
        for n in gone:
            cur = self._clients.pop(n, None)
            if cur is not None:
                self._close_later(cur[1])

    def _close_later(self, c: AsyncClient) -> None:
        t = asyncio.get_running_loop().create_task(c.close())
        self._closing.add(t)
        t.add_done_callback(self._closing.discard)

    # ------------------------------------------------------------------ driver

    def _client(self, target: str) -> AsyncClient:
        if target.startswith("@"):
            return AsyncClient(target[1:], timeout=self.timeout, **self._opts)
        if target == self._state.local_id:
            assert self._local is not None
            return self._local
        found = self._member_opts(target)
        if found is None:      # left the view after the plan read its placement
            raise MemberLeft(f"member {target} left the cluster")
        epoch = self._state.view.get(target).epoch     # type: ignore[union-attr]
        cur = self._clients.get(target)
        if cur is not None and cur[0] == epoch:
            return cur[1]
        addr, opts = found
        c = AsyncClient(addr, transport=self.transport, timeout=self.timeout, **opts)
        self._clients[target] = (epoch, c)
        if cur is not None:
            self._close_later(cur[1])
        return c

    @staticmethod
    async def _invoke(c: AsyncClient, call: Call) -> Any:
        if call.method == "epoch":
            if not c.server_info:
                await c.ping()
            return int(c.server_info.get("epoch", 0))
        return await getattr(c, call.method)(*call.args, **call.kwargs)

    async def _one(self, target: str, call: Call, adhoc: dict[str, AsyncClient]) -> Any:
        if target.startswith("@"):
            c = adhoc.get(target)
            if c is None:
                c = adhoc[target] = self._client(target)
        else:
            c = self._client(target)
        t0 = time.perf_counter()
        try:
            r = await self._invoke(c, call)
        except Exception as exc:
            if not (target.startswith("@") or c is self._local or self._closed) \
                    and (self._clients.get(target) or (0, None))[1] is not c:
                exc = MemberLeft(f"member {target} left the cluster during the call: "
                                 f"{exc}")    # its client was closed under the call
            self._fan.finished(target, call, time.perf_counter() - t0, exc)
            raise exc
        self._fan.finished(target, call, time.perf_counter() - t0, r)
        return r

    async def _run(self, plan: Plan) -> Any:
        await self.connect()
        adhoc: dict[str, AsyncClient] = {}
        try:
            try:
                calls = next(plan)
            except StopIteration as stop:
                return stop.value
            while True:
                targets = list(calls)
                got = await asyncio.gather(*(self._one(t, calls[t], adhoc) for t in targets),
                                           return_exceptions=True)
                res: dict[str, Any] = {}
                for t, r in zip(targets, got):
                    if isinstance(r, BaseException) and not isinstance(r, Exception):
                        raise r          # cancellation and the like end the call
                    res[t] = r
                try:
                    calls = plan.send(res)
                except StopIteration as stop:
                    return stop.value
        finally:
            plan.close()
            for c in adhoc.values():
                await c.close()

    # ------------------------------------------------------------------ the API

    async def put(self, key: Key, value: Any, **kw: Any) -> None:
        await self.put_batch([key], [value], **kw)

    async def put_batch(self, keys: Sequence[Key], values: Sequence[Any], *,
                        checksum: bool = False, pin_ttl: float | None = None,
                        placement_keys: Sequence[Key] | None = None) -> Handoff | None:
        """As :meth:`ClusterClient.put_batch`."""
        if pin_ttl is not None:
            await self.connect()
            assert self._local is not None
            return await self._local.put_batch(keys, values, checksum=checksum,  # type: ignore[no-any-return]
                                               pin_ttl=pin_ttl)
        return await self._run(self._fan.put(keys, values, checksum=checksum,  # type: ignore[no-any-return]
                                             placement_keys=placement_keys))

    async def get(self, key: Key, **kw: Any) -> bytes | None:
        return (await self.get_batch([key], **kw))[0]

    async def get_batch(self, keys: Sequence[Key], *, verify: bool = False,
                        placement_keys: Sequence[Key] | None = None
                        ) -> list[bytes | None]:
        """As :meth:`ClusterClient.get_batch`."""
        return await self._run(self._fan.get(keys, verify=verify,  # type: ignore[no-any-return]
                                             placement_keys=placement_keys))

    async def exists_batch(self, keys: Sequence[Key], *,
                           placement_keys: Sequence[Key] | None = None) -> list[bool]:
        return await self._run(self._fan.exists(keys, placement_keys=placement_keys))  # type: ignore[no-any-return]

    async def exists(self, key: Key) -> bool:
        return (await self.exists_batch([key]))[0]

    async def match_prefix(self, keys: Sequence[Key], *,
                           placement_keys: Sequence[Key] | None = None) -> int:
        return await self._run(self._fan.match_prefix(  # type: ignore[no-any-return]
            keys, placement_keys=placement_keys))

    async def delete(self, keys: Key | Sequence[Key]) -> int:
        return await self._run(self._fan.delete(keys))  # type: ignore[no-any-return]

    async def get_handoff(self, handoff: Handoff | dict[str, Any], *, unpin: bool = True,
                          verify: bool = False) -> list[bytes | None]:
        """As :meth:`ClusterClient.get_handoff`."""
        return await self._run(read_handoff(self._fan, handoff, unpin=unpin,  # type: ignore[no-any-return]
                                            verify=verify))

    async def renew(self, handoff: Handoff, ttl: float) -> float | None:
        return await self._run(renew_handoff(self._fan, handoff, ttl))  # type: ignore[no-any-return]

    async def owners(self, keys: Sequence[Key],  # type: ignore[override]
                     placement_keys: Sequence[Key] | None = None) -> list[str | None]:
        """As :meth:`ClusterClient.owners` (a coroutine: it connects first)."""
        await self.connect()
        return self._fan.owners(keys, placement_keys)

    @property
    def local(self) -> AsyncClient | None:
        """The client of the local server (None before :meth:`connect`)."""
        return self._local

    async def close(self) -> None:
        """Stop the view follower and close every member connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._unexport()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        clients = [c for _, c in self._clients.values()]
        self._clients.clear()
        for c in clients:
            await c.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        for own in (self._view_client, self._local):
            if own is not None:
                await own.close()

    async def __aenter__(self) -> "AsyncClusterClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        v = self._state.view
        return (f"<kvshm.AsyncClusterClient {self.local_address} members="
                f"{len(v.members)} revision={v.revision}>")
