"""Router handlers of the cluster ops: CLUSTER_VIEW, PIN, RENEW, UNPIN, DRAIN.

They run on the server's loop thread like every handler (they own no other thread);
:class:`ClusterOps` is registered with :meth:`ServiceLoop.add_ops`, which also calls its
:meth:`tick` so that handoff pins expire on time even on an idle server.

CLUSTER_VIEW ``{since: revision, wait: seconds}`` answers ``{revision, node_id,
epoch, fresh}`` and, when the server's view is at another revision than ``since``,
``view`` (:meth:`View.to_dict`). With ``wait`` (0-60 s) and ``since`` equal to the
current revision the request is *parked* (the loop's deferred replies) and answered as
soon as the revision changes (the membership agent pokes the loop) or when ``wait`` is
over: a client's view follower keeps one such request outstanding, so a change is
pushed to it at once and an idle cluster costs one round trip per ``wait``. Engine
processes learn the cluster this way and need no etcd client. A session parks at most
:data:`MAX_VIEW_WAITS_PER_SESSION` requests and the server :data:`MAX_VIEW_WAITERS`;
beyond, a request is answered at once. A session that ends (BYE, its process gone)
takes its parked requests with it on the loop's next turn.

Handoff pins (:mod:`kvshm.handoff`) are pins the server itself holds for a TTL: they do
not belong to the writer's session, survive its disconnect, keep their entries from
eviction and end at UNPIN or at their deadline (counted as ``expired``). Their blocks are
capped (``max_pinned_bytes``, default half the pool, counted in whole blocks) and so is
their number (``max_pins``), so that unread handoffs cannot take the whole pool hostage;
and one principal (the writer's proven identity, ``Session.principal``) may hold at
most ``pin_share`` of each cap (default 1/2), so one client cannot take every handoff
pin from the others. A PIN over a cap is refused with QUOTA_EXCEEDED.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import threading
import time
from typing import Any, Callable

from kvshm.handoff import check_ttl
from kvshm.zmq_ctrl.protocol import Op, Status
from kvshm.zmq_ctrl.router import _Defer as Defer

__all__ = ["ClusterOps"]

log = logging.getLogger(__name__)

Reply = tuple[int, dict[str, Any], list[Any]]

#: Longest CLUSTER_VIEW wait a client may ask for (seconds).
MAX_VIEW_WAIT = 60.0
#: CLUSTER_VIEW requests parked at once at most; beyond, they are answered at once
#: (each parked request is looked at on every turn of the loop that retries them).
MAX_VIEW_WAITERS = 4096
#: CLUSTER_VIEW requests one session may have parked at once (a view follower keeps one
#: outstanding); beyond, they are answered at once, so that one client cannot spend
#: :data:`MAX_VIEW_WAITERS` and turn every other client's push into polling.
MAX_VIEW_WAITS_PER_SESSION = 4


class _Pin:
    __slots__ = ("entries", "deadline", "nbytes", "principal", "quota", "nblocks")

    def __init__(self, entries: list[Any], deadline: float, nbytes: int,
                 principal: Any, quota: Any = None, nblocks: int = 0) -> None:
        self.entries = entries
        self.deadline = deadline
        self.nbytes = nbytes
        self.principal = principal
        self.quota = quota          # its principal's (kvshm.store.sessions._Quota)
        self.nblocks = nblocks      # counted there as pinned while the pin lives


class _Waiter:
    __slots__ = ("live",)

    def __init__(self) -> None:
        self.live = True


class ClusterOps:
    """Cluster and handoff handlers for one server.

    Parameters
    ----------
    store : kvshm.store.Store
    epoch : int
        The server instance's epoch (handoffs name it).
    node_id : str
        Cluster node id ("" outside a cluster).
    view : callable, optional
        Returns the current :class:`kvshm.cluster.view.View` (thread-safe: the
        membership agent replaces it whole). None: a server outside a cluster, whose
        CLUSTER_VIEW answers an empty view.
    drain : callable, optional
        Called by DRAIN with ``leave_after`` (seconds or None): mark this member
        draining in etcd, and leave after that long.
    max_pinned_bytes : int, optional
        Cap on the bytes held by handoff pins (default half the pool).
    membership_stats : callable, optional
        The membership agent's counters, added to :meth:`stats`.
    max_pins : int
        Cap on the number of handoff pins held at once (the byte cap alone does not
        bound pins of empty values).
    pin_share : float
        Fraction (0, 1] of each cap (bytes and count) one principal may hold.
    clock : callable
        Monotonic seconds.
    """

    def __init__(self, store: Any, epoch: int, node_id: str = "",
                 view: Callable[[], Any] | None = None,
                 drain: Callable[[float | None], None] | None = None,
                 max_pinned_bytes: int | None = None,
                 membership_stats: Callable[[], dict[str, Any]] | None = None,
                 max_pins: int = 65536, pin_share: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < pin_share <= 1:
            raise ValueError(f"pin_share must be in (0, 1], got {pin_share}")
        self.store = store
        self.epoch = epoch
        self.node_id = node_id
        self._view = view
        self._drain = drain
        self._membership_stats = membership_stats
        self.max_pinned_bytes = (store.pool.size // 2 if max_pinned_bytes is None
                                 else max_pinned_bytes)
        self._clock = clock
        self._pins: dict[int, _Pin] = {}
        self._heap: list[tuple[float, int]] = []
        self.max_pins = max_pins
        self.pin_share = pin_share
        self.pinned_bytes = 0
        # principal -> [pins held, bytes held]
        self._by_principal: dict[Any, list[int]] = {}
        self._waiters = 0
        self._waits_of: dict[int, int] = {}     # session id -> its parked views
        self.counters = dict.fromkeys(("pins", "renewed", "unpinned", "expired",
                                       "refused", "refused_share", "view_requests",
                                       "view_waits", "view_pushed"), 0)
        self.lock = threading.Lock()   # stats() may be read from another thread

    # ------------------------------------------------------------------ wiring

    def handlers(self) -> dict[int, Callable[..., Reply]]:
        return {Op.CLUSTER_VIEW: self._on_view, Op.PIN: self._on_pin,
                Op.RENEW: self._on_renew, Op.UNPIN: self._on_unpin,
                Op.DRAIN: self._on_drain}

    def _new_id(self) -> int:
        # unguessable (a pin id is the capability to renew or drop the pin), never 0,
        # exact as a double (a handoff record may travel through JSON in other languages)
        while True:
            pid = secrets.randbits(52) | 1
            if pid not in self._pins:
                return pid

    def tick(self, now: float) -> float | None:
        """Expire handoff pins past their deadline; returns the next deadline."""
        heap = self._heap
        while heap:
            deadline, pid = heap[0]
            p = self._pins.get(pid)
            if p is None or p.deadline != deadline:
                heapq.heappop(heap)        # unpinned, or renewed (a later entry exists)
                continue
            if deadline > now:
                return deadline
            heapq.heappop(heap)
            self._drop(pid)
            self.counters["expired"] += 1
            log.info("handoff pin %d of %d entries expired unread", pid, len(p.entries))
        return None

    def close(self) -> None:
        """Drop every handoff pin (the server stops)."""
        for pid in list(self._pins):
            self._drop(pid)

    def _drop(self, pid: int) -> None:
        p = self._pins.pop(pid, None)
        if p is not None:
            self.store.unpin(p.entries)
            self.pinned_bytes -= p.nbytes
            held = self._by_principal.get(p.principal)
            if held is not None:
                held[0] -= 1
                held[1] -= p.nbytes
                if held[0] <= 0:
                    del self._by_principal[p.principal]
            q = p.quota
            if q is not None:
                q.pinned -= p.nblocks
                if q.sessions <= 0 and not (q.pending or q.pinned or q.sending):
                    # its principal has nothing left here: forget it (as Store does
                    # when its last session ends)
                    quotas = getattr(self.store, "_quotas", {})
                    for principal in [k for k, v in quotas.items() if v is q]:
                        del quotas[principal]

    def stats(self) -> dict[str, Any]:
        """Handoff pins held (count, bytes) and the counters; with a cluster, the
        membership agent's (view revision, changes, registrations, lease_lost, ...)."""
        out: dict[str, Any] = {
            "handoff_pins_held": len(self._pins), "handoff_pinned_bytes": self.pinned_bytes,
            "handoff_pin_principals": len(self._by_principal),
            **{f"handoff_{k}": v for k, v in self.counters.items()
               if not k.startswith("view_")},
            "view_requests": self.counters["view_requests"],
            "view_waits": self.counters["view_waits"],
            "view_pushed": self.counters["view_pushed"],
            "view_waiting": self._waiters}
        if self._membership_stats is not None:
            out["membership"] = self._membership_stats()
        return out

    # ------------------------------------------------------------------ handlers

    def _view_reply(self, v: Any, since: int, stats: bool) -> Reply:
        rev = v.revision if v is not None else 0
        out: dict[str, Any] = {"revision": rev, "node_id": self.node_id,
                               "epoch": self.epoch, "clustered": v is not None,
                               "fresh": v.fresh if v is not None else True}
        if v is not None and rev != since:
            out["view"] = v.to_dict()
        if stats:
            out["stats"] = self.stats()
        return Status.OK, out, []

    def _on_view(self, session: Any, req_id: int, body: dict[str, Any], frames: list[Any],
                 on_sent: list[Any]) -> Reply:
        self.counters["view_requests"] += 1
        since = body.get("since", -1)
        if type(since) is not int:
            return Status.INVALID_REQUEST, {"error": "since must be an int revision"}, []
        wait = body.get("wait")
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float))
                                 or not 0 <= wait <= MAX_VIEW_WAIT):
            return Status.INVALID_REQUEST, {
                "error": f"wait must be 0-{MAX_VIEW_WAIT:g} seconds"}, []
        stats = bool(body.get("stats"))
        v = self._view() if self._view is not None else None
        sid = getattr(session, "id", 0)
        mine = self._waits_of.get(sid, 0)
        if not wait or v is None or v.revision != since \
                or self._waiters >= MAX_VIEW_WAITERS or mine >= MAX_VIEW_WAITS_PER_SESSION:
            return self._view_reply(v, since, stats)
        # park until the revision changes (the membership agent pokes the loop) or the
        # wait is over
        self.counters["view_waits"] += 1
        self._waiters += 1
        self._waits_of[sid] = mine + 1
        w = _Waiter()
        view = self._view
        assert view is not None

        def done() -> None:
            if w.live:
                w.live = False
                self._waiters -= 1
                left = self._waits_of.get(sid, 1) - 1
                if left > 0:
                    self._waits_of[sid] = left
                else:
                    self._waits_of.pop(sid, None)

        def attempt(force: bool) -> Reply | None:
            cur = view()
            if cur.revision == since and not force:
                return None
            done()
            if cur.revision != since:
                self.counters["view_pushed"] += 1
            return self._view_reply(cur, since, stats)

        # attempted on the membership agent's poke (or at the end of the wait), not at
        # every store progress: a busy server frees blocks on most turns
        raise Defer(attempt, done, wait=float(wait), on_poke=True)

    def _ttl(self, body: dict[str, Any]) -> float:
        return check_ttl(body.get("ttl"))

    def _on_pin(self, session, req_id, body, frames, on_sent) -> Reply:
        keys = body.get("keys")
        if not isinstance(keys, list) or not keys:
            return Status.INVALID_REQUEST, {"error": "PIN takes a non-empty list keys"}, []
        if len(keys) > self.store.config.limits.max_batch:
            return Status.INVALID_REQUEST, {"error": "batch too large"}, []
        try:
            ttl = self._ttl(body)
        except ValueError as exc:
            return Status.INVALID_REQUEST, {"error": str(exc)}, []
        d = self.store.index.mapping
        found = [d.get(k) if type(k) is bytes else None for k in keys]
        entries = [e for e in found if e is not None]
        # the pool bytes the pin holds (whole blocks), not the values' lengths: pins of
        # 1-byte values would otherwise hold a block each against one byte of the cap
        nblocks = sum(e.nblocks for e in entries)
        nbytes = nblocks * self.store.block_size
        # a handoff pin is a pin of its principal: counted in blocks against the same
        # quota as its LOOKUP pins and GET replies (--max-client-pinned), all its
        # sessions together, until the pin goes (UNPIN, expiry)
        quota = getattr(session, "quota", None)
        budget = self.store.send_budget(session) if quota is not None else None
        if budget is not None and nblocks > budget:
            self.store.counters["quota_refusals"] += 1
            self.counters["refused"] += 1
            return Status.QUOTA_EXCEEDED, {
                "error": f"a handoff pin of {nblocks} blocks would take this principal over "
                         f"its pinned limit ({budget} blocks left)"}, []
        if self.pinned_bytes + nbytes > self.max_pinned_bytes:
            self.counters["refused"] += 1
            return Status.QUOTA_EXCEEDED, {
                "error": f"handoff pins would hold {self.pinned_bytes + nbytes} bytes, over "
                         f"this server's cap of {self.max_pinned_bytes}"}, []
        if not entries:            # nothing to hold: no pin to leak (UNPIN 0 is a no-op)
            return Status.OK, {"pin": 0, "ttl": ttl, "found": [False] * len(found),
                               "epoch": self.epoch}, []
        if len(self._pins) >= self.max_pins:
            self.counters["refused"] += 1
            return Status.QUOTA_EXCEEDED, {
                "error": f"this server holds {len(self._pins)} handoff pins, its cap"}, []
        principal = getattr(session, "principal", None)
        held = self._by_principal.get(principal, (0, 0))
        share_pins = max(1, int(self.max_pins * self.pin_share))
        share_bytes = int(self.max_pinned_bytes * self.pin_share)
        if held[0] + 1 > share_pins or held[1] + nbytes > share_bytes:
            self.counters["refused"] += 1
            self.counters["refused_share"] += 1
            return Status.QUOTA_EXCEEDED, {
                "error": f"this client's handoff pins would hold {held[0] + 1} pins / "
                         f"{held[1] + nbytes} bytes, over its share ({self.pin_share:g}) of "
                         f"this server's caps: {share_pins} pins / {share_bytes} bytes"}, []
        self.store.pin_entries(entries)
        pid = self._new_id()
        p = _Pin(entries, self._clock() + ttl, nbytes, principal, quota, nblocks)
        if quota is not None:
            quota.pinned += nblocks
        self._pins[pid] = p
        self.pinned_bytes += p.nbytes
        acc = self._by_principal.setdefault(principal, [0, 0])
        acc[0] += 1
        acc[1] += nbytes
        heapq.heappush(self._heap, (p.deadline, pid))
        self.counters["pins"] += 1
        return Status.OK, {"pin": pid, "ttl": ttl, "found": [e is not None for e in found],
                           "epoch": self.epoch}, []

    def _pin_of(self, body: dict[str, Any]) -> tuple[int, _Pin | None, str | None]:
        pid = body.get("pin")
        epoch = body.get("epoch", self.epoch)
        if type(pid) is not int:
            return 0, None, "pin must be an int"
        if epoch != self.epoch:
            return pid, None, None       # another server instance: a clean miss
        return pid, self._pins.get(pid), None

    def _on_renew(self, session, req_id, body, frames, on_sent) -> Reply:
        pid, p, err = self._pin_of(body)
        if err:
            return Status.INVALID_REQUEST, {"error": err}, []
        try:
            ttl = self._ttl(body)
        except ValueError as exc:
            return Status.INVALID_REQUEST, {"error": str(exc)}, []
        if p is None:
            return Status.OK, {"ok": False, "epoch": self.epoch}, []
        p.deadline = self._clock() + ttl
        heapq.heappush(self._heap, (p.deadline, pid))
        self.counters["renewed"] += 1
        return Status.OK, {"ok": True, "ttl": ttl, "epoch": self.epoch}, []

    def _on_unpin(self, session, req_id, body, frames, on_sent) -> Reply:
        pid, p, err = self._pin_of(body)
        if err:
            return Status.INVALID_REQUEST, {"error": err}, []
        if p is None:
            return Status.OK, {"ok": False, "epoch": self.epoch}, []
        self._drop(pid)
        self.counters["unpinned"] += 1
        return Status.OK, {"ok": True, "epoch": self.epoch}, []

    def _on_drain(self, session, req_id, body, frames, on_sent) -> Reply:
        if not getattr(session, "operator", False):
            from kvshm.zmq_ctrl.router import not_operator

            return not_operator("DRAIN")
        if self._drain is None:
            return Status.UNSUPPORTED, {"error": "this server is not in a cluster"}, []
        after = body.get("leave_after")
        if after is not None and (isinstance(after, bool) or not isinstance(after, (int, float))
                                  or not 0 <= after <= 86400):
            return Status.INVALID_REQUEST, {"error": "leave_after must be 0-86400 s"}, []
        self._drain(after)
        return Status.OK, {"draining": True, "leave_after": after}, []
