"""ClusterClient: the Client API over every member of a cluster.

A :class:`ClusterClient` needs only its local server's address: it learns the members
from that server (CLUSTER_VIEW, polled every ``refresh_interval`` s on a connection of
its own; the member list travels only when the view's revision changed), so an engine
process needs neither grpc nor an etcd address.

Each batch is split by owner (:mod:`kvshm.cluster.placement`) and sent as one request
per owner, all owners at once (threads; each owner's :class:`~kvshm.Client` copies with
the GIL released). The local member is reached through shm, the others over TCP (or
RDMA where both sides have a device).

Failure and change, as the reader of a cache wants them (a miss recomputes, an error
stalls the engine):

* a member gone from the view (its lease expired): its keys are misses;
* one :class:`~kvshm.errors.ServerUnavailable` from a member marks it *suspect* for its
  lease's TTL: reads from it are immediate misses, writes go to the next HRW choice;
  so at most one batch waits for the timeout;
* for ``fallback_window`` s after the member list changed, a miss at a key's first
  choice is tried at its second (with HRW the previous owner, after a join) and a hit
  there is copied home to the first choice;
* a handoff whose node left or restarted (another epoch) reads as misses.

Counters (:meth:`metrics`): per-peer requests, bytes, latency and errors; misses by
reason (``absent``, ``peer_down``, ``suspect``, ``epoch``); view revision and changes;
fallback hits and copies.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from kvshm._buffers import byte_view
from kvshm.client import Client, Key
from kvshm.cluster.placement import Placement
from kvshm.cluster.view import View
from kvshm.errors import KvshmError, ServerUnavailable
from kvshm.handoff import Handoff

__all__ = ["ClusterClient", "AsyncClusterClient"]

log = logging.getLogger(__name__)


def _b(k: Key) -> bytes:
    return k.encode() if isinstance(k, str) else bytes(k)


class _Peer:
    __slots__ = ("requests", "bytes_in", "bytes_out", "seconds", "errors")

    def __init__(self) -> None:
        self.requests = self.bytes_in = self.bytes_out = self.errors = 0
        self.seconds = 0.0


class ClusterClient:
    """Client of a kvshm cluster, through the local server.

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
        Seconds between view polls of the local server.
    fallback_window : float
        Seconds after a change of the member list during which misses are tried at the
        second choice and copied home.
    placement_key : callable, optional
        ``bytes -> bytes``: the placement key of a key (default the key itself); a call's
        ``placement_keys`` argument overrides it.
    workers : int
        Threads of the fan-out.
    client_options : dict, optional
        More :class:`~kvshm.Client` arguments for every member (CURVE keys, ...).
    """

    def __init__(self, local_address: str, *, stripe: int = 1, replicas: int = 1,
                 transport: str = "auto", timeout: float = 2.0,
                 refresh_interval: float = 0.25, fallback_window: float = 60.0,
                 placement_key: Callable[[bytes], bytes] | None = None, workers: int = 16,
                 client_options: dict[str, Any] | None = None) -> None:
        if stripe < 1:
            raise ValueError("stripe must be >= 1")
        if replicas not in (1, 2):
            raise ValueError("replicas must be 1 or 2")
        self.local_address = local_address
        self.stripe = stripe
        self.replicas = replicas
        self.transport = transport
        self.timeout = timeout
        self.refresh_interval = refresh_interval
        self.fallback_window = fallback_window
        self.placement_key = placement_key
        self._opts = dict(client_options or {})
        self._lock = threading.Lock()
        self._closed = False
        self._local = Client(local_address, transport=transport, timeout=timeout,
                             **self._opts)
        self._ctl = Client(local_address, transport="tcp", timeout=timeout, **self._opts)
        self._clients: dict[str, tuple[int, Client]] = {}
        self._suspect: dict[str, float] = {}
        self._view = View()
        self._placement = Placement(self._view)
        self._changed_at = -1e18
        self._local_id = ""
        self.counters: dict[str, int] = defaultdict(int)
        self.peers: dict[str, _Peer] = defaultdict(_Peer)
        self._pool = ThreadPoolExecutor(max_workers=workers,
                                        thread_name_prefix="kvshm-cluster")
        self._refresh(wait=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="kvshm-cluster-view",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ view

    def _refresh(self, wait: bool = False) -> None:
        from kvshm.cluster.cli import op_view

        body = self._ctl.run_op(op_view(self._ctl.session, self._view.revision))
        self._local_id = body.get("node_id", "")
        if "view" not in body:
            fresh = bool(body.get("fresh", True))
            if fresh != self._view.fresh:
                v = self._view
                self._view = View(v.revision, v.members, v.cluster, fresh)
            return
        new = View.from_dict(body["view"])
        with self._lock:
            old = self._view
            self._view = new
            if not new.same_members(old):
                if old.revision:
                    self._changed_at = time.monotonic()
                self.counters["view_changes"] += 1
                self._placement = Placement(new)
                for nid in list(self._suspect):
                    m, was = new.get(nid), old.get(nid)
                    # gone, or back as another instance (new epoch, new lease): the
                    # mark was about the old one
                    if m is None or (was is not None and m.epoch != was.epoch):
                        del self._suspect[nid]
                gone = [self._clients.pop(nid) for nid in list(self._clients)
                        if new.get(nid) is None]
            else:
                gone = []
        for _, c in gone:
            c.close()

    def _poll(self) -> None:
        while not self._stop.wait(self.refresh_interval):
            try:
                self._refresh()
            except KvshmError as exc:
                log.debug("cluster view refresh from %s failed: %s", self.local_address, exc)
            except Exception:      # the poller must outlive a bad reply
                log.exception("cluster view refresh failed")

    def refresh(self) -> View:
        """Poll the local server's view now; returns it."""
        self._refresh()
        return self._view

    @property
    def view(self) -> View:
        """The last view learnt from the local server."""
        return self._view

    def owners(self, keys: Sequence[Key], placement_keys: Sequence[Key] | None = None
               ) -> list[str | None]:
        """The first owner's node id per key (None with no member up)."""
        return self._placement.owner_ids(self._pkeys(keys, placement_keys), self.stripe)

    def _pkeys(self, keys: Sequence[Key], placement_keys: Sequence[Key] | None
               ) -> list[bytes]:
        if placement_keys is not None:
            if len(placement_keys) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(placement_keys)} placement keys")
            return [_b(k) for k in placement_keys]
        bkeys = [_b(k) for k in keys]
        if self.placement_key is not None:
            return [self.placement_key(k) for k in bkeys]
        return bkeys

    # ------------------------------------------------------------------ members

    def _client(self, node_id: str) -> Client | None:
        m = self._view.get(node_id)
        if m is None:
            return None
        if node_id == self._local_id:
            return self._local
        with self._lock:
            cur = self._clients.get(node_id)
            if cur is not None and cur[0] == m.epoch:
                return cur[1]
        opts = dict(self._opts)
        if m.curve_public_key and "curve_server_key" not in self._opts:
            opts["curve_server_key"] = m.curve_public_key    # from its member record
        c = Client(m.service, transport=self.transport, timeout=self.timeout,
                   connect=False, **opts)
        with self._lock:
            old = self._clients.get(node_id)
            self._clients[node_id] = (m.epoch, c)
        if old is not None:
            old[1].close()
        return c

    def _is_suspect(self, node_id: str) -> bool:
        until = self._suspect.get(node_id)
        if until is None:
            return False
        if time.monotonic() >= until:
            self._suspect.pop(node_id, None)
            return False
        return True

    def _mark_suspect(self, node_id: str, exc: BaseException) -> None:
        m = self._view.get(node_id)
        ttl = m.ttl if m is not None else 5.0
        self._suspect[node_id] = time.monotonic() + ttl
        self.counters["suspect_marks"] += 1
        self.peers[node_id].errors += 1
        log.warning("cluster member %s suspect for %.1f s: %s", node_id, ttl, exc)

    def suspects(self) -> list[str]:
        return [n for n in list(self._suspect) if self._is_suspect(n)]

    def _call(self, node_id: str, fn: Callable[[Client], Any], nbytes_out: int = 0) -> Any:
        c = self._client(node_id)
        if c is None:
            raise ServerUnavailable(f"member {node_id} left the cluster")
        t0 = time.perf_counter()
        try:
            r = fn(c)
        except ServerUnavailable as exc:
            self._mark_suspect(node_id, exc)
            raise
        p = self.peers[node_id]
        p.requests += 1
        p.seconds += time.perf_counter() - t0
        p.bytes_out += nbytes_out
        return r

    def _choices(self, pkeys: list[bytes], extra: int = 0) -> tuple[Placement, Any]:
        pl = self._placement
        k = min(len(pl), self.replicas + extra + len(self._suspect))
        return pl, (pl.owners(pkeys, self.stripe, max(1, k)) if len(pl) else None)

    def _fan(self, groups: dict[str, list[int]], fn: Callable[[str, list[int]], Any]
             ) -> dict[str, Any]:
        """Run ``fn(node, indices)`` per owner in parallel; exceptions are returned."""
        if len(groups) == 1:
            (node, idx), = groups.items()
            try:
                return {node: fn(node, idx)}
            except Exception as exc:
                return {node: exc}
        futs = {n: self._pool.submit(fn, n, idx) for n, idx in groups.items()}
        out: dict[str, Any] = {}
        for n, f in futs.items():
            try:
                out[n] = f.result()
            except Exception as exc:
                out[n] = exc
        return out

    # ------------------------------------------------------------------ writes

    def put(self, key: Key, value: Any, **kw: Any) -> None:
        self.put_batch([key], [value], **kw)

    def put_batch(self, keys: Sequence[Key], values: Sequence[Any], *,
                  checksum: bool = False, pin_ttl: float | None = None,
                  placement_keys: Sequence[Key] | None = None, _depth: int = 0
                  ) -> Handoff | None:
        """Store each value at its owner(s), one request per owner, in parallel.

        ``pin_ttl``: prefill/decode handoff instead: write everything into the *local*
        store (shm) with a handoff pin and return the :class:`~kvshm.handoff.Handoff`.
        A write whose owner fails goes to the next HRW choice; the first error that
        could not be routed around is raised.
        """
        if pin_ttl is not None:
            return self._local.put_batch(keys, values, checksum=checksum,  # type: ignore[no-any-return]
                                         pin_ttl=pin_ttl)
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return None
        pkeys = self._pkeys(keys, placement_keys)
        pl, own = self._choices(pkeys, extra=1)
        if own is None:
            raise ServerUnavailable("no cluster member is up")
        groups: dict[str, list[int]] = defaultdict(list)
        for i, row in enumerate(own.tolist()):
            placed = 0
            for j in row:
                if j < 0:
                    break
                nid = pl.ids[j]
                if self._is_suspect(nid):
                    continue
                groups[nid].append(i)
                placed += 1
                if placed == self.replicas:
                    break
            if not placed:
                groups[pl.ids[row[0]]].append(i)    # every choice suspect: try the best
        errors: list[BaseException] = []
        redo: list[int] = []

        def write(node: str, idx: list[int]) -> None:
            vals = [values[i] for i in idx]
            nbytes = sum(byte_view(v).nbytes for v in vals)
            self._call(node, lambda c: c.put_batch([keys[i] for i in idx], vals,
                                                   checksum=checksum), nbytes)

        for node, r in self._fan(groups, write).items():
            if isinstance(r, ServerUnavailable):
                redo.extend(groups[node])
            elif isinstance(r, BaseException):
                errors.append(r)
        if redo and _depth >= len(pl):
            raise ServerUnavailable(f"no cluster member took the write of {len(redo)} keys")
        if redo:      # the owner just became suspect: its keys go to the next choice
            self.counters["rerouted_writes"] += len(redo)
            self.put_batch([keys[i] for i in redo], [values[i] for i in redo],
                           checksum=checksum, placement_keys=[pkeys[i] for i in redo],
                           _depth=_depth + 1)
        if errors:
            raise errors[0]
        return None

    # ------------------------------------------------------------------ reads

    def get(self, key: Key, **kw: Any) -> bytes | None:
        """The value of ``key``, or None on a miss (a cluster miss is never an error)."""
        return self.get_batch([key], **kw)[0]

    def get_batch(self, keys: Sequence[Key], *, verify: bool = False,
                  placement_keys: Sequence[Key] | None = None) -> list[bytes | None]:
        """Values of ``keys`` from their owners (None per miss), one request per owner."""
        n = len(keys)
        out: list[bytes | None] = [None] * n
        if not n:
            return out
        pkeys = self._pkeys(keys, placement_keys)
        fallback = time.monotonic() - self._changed_at < self.fallback_window
        pl, own = self._choices(pkeys, extra=1)
        if own is None:
            self.counters["miss_peer_down"] += n
            return out
        # per key: the choices to try, best first, suspects left out (a suspect first
        # choice is a miss there at once; a write made meanwhile went to the next one)
        depth = self.replicas if not fallback else max(2, self.replicas)
        suspect = {nid for nid in pl.ids if self._is_suspect(nid)}
        cands: list[list[str]] = []
        for row in own.tolist():
            c = []
            for rank, j in enumerate(row):
                if j < 0:
                    break
                nid = pl.ids[j]
                if nid in suspect:
                    if rank == 0:
                        self.counters["miss_suspect"] += 1
                    continue
                c.append(nid)
            cands.append(c[:depth + (1 if row and pl.ids[row[0]] in suspect else 0)])
        todo = list(range(n))
        for rank in range(max((len(c) for c in cands), default=0)):
            groups: dict[str, list[int]] = defaultdict(list)
            for i in todo:
                if rank < len(cands[i]):
                    groups[cands[i][rank]].append(i)
            if not groups:
                break

            def read(node: str, idx: list[int]) -> list[Any]:
                return self._call(node, lambda c: c.get_batch([keys[i] for i in idx],  # type: ignore[no-any-return]
                                                              verify=verify))

            hits: list[int] = []
            for node, r in self._fan(groups, read).items():
                idx = groups[node]
                if isinstance(r, BaseException):
                    if not isinstance(r, ServerUnavailable):
                        raise r
                    if rank == 0:
                        self.counters["miss_peer_down"] += len(idx)
                    continue
                nbytes = 0
                for i, v in zip(idx, r):
                    if v is not None:
                        out[i] = v
                        nbytes += len(v)
                        hits.append(i)
                    elif rank == 0:
                        self.counters["miss_absent"] += 1
                self.peers[node].bytes_in += nbytes
            if rank > 0 and hits:
                self.counters["fallback_hits"] += len(hits)
                if fallback:
                    self._copy_home(pl, [(i, pl.ids.index(cands[i][0])) for i in hits
                                         if own[i, 0] >= 0
                                         and pl.ids[own[i, 0]] == cands[i][0]],
                                    keys, out)
            todo = [i for i in todo if out[i] is None]
            if not todo:
                break
        return out

    def _copy_home(self, pl: Placement, items: list[tuple[int, int]], keys: Sequence[Key],
                   out: list[Any]) -> None:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, j in items:
            if j >= 0 and not self._is_suspect(pl.ids[j]):
                groups[pl.ids[j]].append(i)

        def copy(node: str, idx: list[int]) -> None:
            self._call(node, lambda c: c.put_batch([keys[i] for i in idx],
                                                   [out[i] for i in idx]))

        for node, r in self._fan(groups, copy).items():
            if isinstance(r, BaseException):
                log.debug("copy home to %s failed: %s", node, r)
            else:
                self.counters["fallback_copies"] += len(groups[node])

    def exists_batch(self, keys: Sequence[Key], *,
                     placement_keys: Sequence[Key] | None = None) -> list[bool]:
        """Whether each key is stored at its first owner (suspect or gone: False)."""
        n = len(keys)
        if not n:
            return []
        pkeys = self._pkeys(keys, placement_keys)
        pl, own = self._choices(pkeys)
        found = [False] * n
        if own is None:
            return found
        groups: dict[str, list[int]] = defaultdict(list)
        for i, j in enumerate(own[:, 0].tolist()):
            if not self._is_suspect(pl.ids[j]):
                groups[pl.ids[j]].append(i)

        def ex(node: str, idx: list[int]) -> list[bool]:
            return self._call(node, lambda c: c.exists_batch([keys[i] for i in idx]))  # type: ignore[no-any-return]

        for node, r in self._fan(groups, ex).items():
            if isinstance(r, BaseException):
                if not isinstance(r, ServerUnavailable):
                    raise r
                continue
            for i, f in zip(groups[node], r):
                found[i] = f
        return found

    def exists(self, key: Key) -> bool:
        return self.exists_batch([key])[0]

    def match_prefix(self, keys: Sequence[Key], *,
                     placement_keys: Sequence[Key] | None = None) -> int:
        """How many leading keys the cluster holds (at their owners), one request per
        owner."""
        found = self.exists_batch(keys, placement_keys=placement_keys)
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    def delete(self, keys: Key | Sequence[Key]) -> int:
        """Remove keys from every up member that may hold them (their owners and, in
        the fallback window, second choices). Returns entries removed."""
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        pkeys = self._pkeys(keys, None)
        pl, own = self._choices(pkeys, extra=1)
        if own is None:
            return 0
        groups: dict[str, set[int]] = defaultdict(set)
        for i, row in enumerate(own.tolist()):
            for j in row:
                if j >= 0 and not self._is_suspect(pl.ids[j]):
                    groups[pl.ids[j]].add(i)
        lg = {n: sorted(s) for n, s in groups.items()}
        res = self._fan(lg, lambda node, idx: self._call(
            node, lambda c: c.delete([keys[i] for i in idx])))
        return sum(r for r in res.values() if isinstance(r, int))

    # ------------------------------------------------------------------ handoff

    def get_handoff(self, handoff: Handoff | dict[str, Any], *, unpin: bool = True,
                    verify: bool = False) -> list[bytes | None]:
        """Read a prefill's handoff (None per miss). A node that left the view or
        restarted (another epoch) gives all misses; ``unpin`` drops the pin after."""
        h = handoff if isinstance(handoff, Handoff) else Handoff.from_dict(handoff)
        keys = list(h.keys)
        miss: list[bytes | None] = [None] * len(keys)
        m = self._view.get(h.node_id) if h.node_id else None
        if h.node_id and (m is None or m.epoch != h.epoch):
            self.counters["miss_epoch" if m is not None else "miss_peer_down"] += len(keys)
            return miss
        node = h.node_id or h.address
        c = self._client(h.node_id) if h.node_id else Client(h.address, timeout=self.timeout,
                                                                    **self._opts)
        assert c is not None
        try:
            try:
                if not c.server_info:
                    c.ping()
                if int(c.server_info.get("epoch", 0)) != h.epoch:
                    self.counters["miss_epoch"] += len(keys)
                    return miss
                t0 = time.perf_counter()
                vals = c.get_batch(keys, verify=verify)
            except ServerUnavailable as exc:
                if h.node_id:
                    self._mark_suspect(h.node_id, exc)
                self.counters["miss_peer_down"] += len(keys)
                return miss
            p = self.peers[node]
            p.requests += 1
            p.seconds += time.perf_counter() - t0
            p.bytes_in += sum(len(v) for v in vals if v is not None)
            self.counters["miss_absent"] += sum(v is None for v in vals)
            if unpin:
                try:
                    c.unpin(h)
                except ServerUnavailable as exc:
                    # the bytes are read: a lost UNPIN only lets the pin run to its end
                    if h.node_id:
                        self._mark_suspect(h.node_id, exc)
                    log.warning("unpin of handoff %d at %s failed: %s", h.pin, node, exc)
            return vals
        finally:
            if not h.node_id:
                c.close()

    def renew(self, handoff: Handoff, ttl: float) -> float | None:
        """Extend a handoff's pin at its node; None when gone."""
        c = self._client(handoff.node_id) if handoff.node_id else None
        if c is None:
            return None
        return c.renew(handoff, ttl)

    # ------------------------------------------------------------------ misc

    def metrics(self) -> dict[str, Any]:
        """Counters: misses by reason, fallback hits/copies, view revision and changes,
        suspect marks, and per peer requests, bytes in/out, mean latency (s), errors."""
        v = self._view
        out: dict[str, Any] = {
            "view_revision": v.revision, "view_changes": self.counters["view_changes"],
            "members": len(v.members), "up": len(v.up), "suspects": self.suspects(),
            "misses": {r: self.counters[f"miss_{r}"]
                       for r in ("absent", "peer_down", "suspect", "epoch")},
            "fallback_hits": self.counters["fallback_hits"],
            "fallback_copies": self.counters["fallback_copies"],
            "rerouted_writes": self.counters["rerouted_writes"],
            "suspect_marks": self.counters["suspect_marks"],
            "peers": {n: {"requests": p.requests, "bytes_in": p.bytes_in,
                          "bytes_out": p.bytes_out, "errors": p.errors,
                          "mean_latency_s": p.seconds / p.requests if p.requests else 0.0}
                      for n, p in list(self.peers.items())}}
        return out

    @property
    def local(self) -> Client:
        """The client of the local server."""
        return self._local

    def close(self) -> None:
        """Stop the view poller and close every member connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=True)
        with self._lock:
            clients = [c for _, c in self._clients.values()]
            self._clients.clear()
        for c in clients:
            c.close()
        self._ctl.close()
        self._local.close()

    def __enter__(self) -> "ClusterClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<kvshm.ClusterClient {self.local_address} members="
                f"{len(self._view.members)} revision={self._view.revision}>")


class AsyncClusterClient:
    """The :class:`ClusterClient` API for asyncio: each call runs the synchronous
    client's fan-out in a worker thread (its copies and waits release the GIL), so the
    event loop never blocks. Same parameters as :class:`ClusterClient`."""

    def __init__(self, local_address: str, **kw: Any) -> None:
        self._args = (local_address, kw)
        self._sync: ClusterClient | None = None

    async def connect(self) -> "AsyncClusterClient":
        if self._sync is None:
            a, kw = self._args
            self._sync = await asyncio.to_thread(ClusterClient, a, **kw)
        return self

    async def _do(self, name: str, *args: Any, **kw: Any) -> Any:
        await self.connect()
        return await asyncio.to_thread(getattr(self._sync, name), *args, **kw)

    async def put(self, key: Key, value: Any, **kw: Any) -> None:
        await self._do("put", key, value, **kw)

    async def put_batch(self, keys: Sequence[Key], values: Sequence[Any], **kw: Any
                        ) -> Handoff | None:
        return await self._do("put_batch", keys, values, **kw)  # type: ignore[no-any-return]

    async def get(self, key: Key, **kw: Any) -> bytes | None:
        return await self._do("get", key, **kw)  # type: ignore[no-any-return]

    async def get_batch(self, keys: Sequence[Key], **kw: Any) -> list[bytes | None]:
        return await self._do("get_batch", keys, **kw)  # type: ignore[no-any-return]

    async def exists_batch(self, keys: Sequence[Key], **kw: Any) -> list[bool]:
        return await self._do("exists_batch", keys, **kw)  # type: ignore[no-any-return]

    async def match_prefix(self, keys: Sequence[Key], **kw: Any) -> int:
        return await self._do("match_prefix", keys, **kw)  # type: ignore[no-any-return]

    async def delete(self, keys: Any) -> int:
        return await self._do("delete", keys)  # type: ignore[no-any-return]

    async def get_handoff(self, handoff: Any, **kw: Any) -> list[bytes | None]:
        return await self._do("get_handoff", handoff, **kw)  # type: ignore[no-any-return]

    async def owners(self, keys: Sequence[Key], **kw: Any) -> list[str | None]:
        return await self._do("owners", keys, **kw)  # type: ignore[no-any-return]

    @property
    def view(self) -> View:
        return self._sync.view if self._sync is not None else View()

    def metrics(self) -> dict[str, Any]:
        return self._sync.metrics() if self._sync is not None else {}

    async def close(self) -> None:
        if self._sync is not None:
            s, self._sync = self._sync, None
            await asyncio.to_thread(s.close)

    async def __aenter__(self) -> "AsyncClusterClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
