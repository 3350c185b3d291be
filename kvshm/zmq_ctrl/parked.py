"""Deferred replies: the requests the server loop parked, retried and cancelled.

Deferred replies. With a tier below the pool a request may have to wait for disk I/O: a
LOOKUP/GET of a key that lives only on SSD (promoted first), an ALLOC/PUT that needs room
while spills are in flight. Its handler then raises
:class:`~kvshm.zmq_ctrl.handling._Defer` with an ``attempt(force)`` function; the request
is parked (its piggybacked COMMIT/RELEASE/ABORT are applied already, as for any request)
and attempted again each time the store makes progress. Its reply goes out when an attempt
succeeds, or unconditionally (``force``) once it waited ``StoreConfig.tier_wait`` seconds.
Replies to one client may thus leave in another order than its requests came; clients match
them by request id, and grants are named by request id, so COMMIT/RELEASE stay exact. A
RELEASE or ABORT that names a parked request (its client gave up on it) cancels it: the
grant it would make is never made.
"""

from __future__ import annotations

import logging
from typing import Any

from kvshm.store import Session
from kvshm.zmq_ctrl.handling import _MORE, _Defer, _Sliced
from kvshm.zmq_ctrl.loopstate import LoopState
from kvshm.zmq_ctrl.protocol import Status
from kvshm.zmq_ctrl.sends import conn_of

#: the loop's one logger: its records keep the name they had before the loop was
#: split into modules (as kvshm.store's modules share "kvshm.store")
log = logging.getLogger("kvshm.zmq_ctrl.router")


class _Parked:
    __slots__ = ("ident", "session", "req_id", "op", "attempt", "cleanup", "extra",
                 "on_sent", "t0", "deadline", "cancelled", "src", "on_poke", "sliced",
                 "forced", "follows")

    def __init__(self, ident: bytes, session: Session, req_id: int, op: int, d: _Defer,
                 extra: dict[str, Any], on_sent: list[Any], t0: float,
                 deadline: float, src: Any = None) -> None:
        self.ident = ident
        # the connection the request came on, taken now (sends.conn_of): by the time
        # its reply is queued the peer's fd number may name another client's connection
        self.src = conn_of(src)
        self.session = session
        self.cancelled = False
        self.req_id = req_id
        self.op = op
        self.attempt = d.attempt
        self.cleanup = d.cleanup
        self.on_poke = d.on_poke
        self.extra = extra
        self.on_sent = on_sent
        self.t0 = t0
        self.deadline = deadline
        self.sliced = isinstance(d, _Sliced)
        self.forced = False         # a slice was forced: the later ones are too
        self.follows = d.follows if isinstance(d, _Sliced) else None   # (_Sliced's)


class ParkedMixin(LoopState):
    """Parked requests of ServiceLoop (a mixin of it)."""

    def _retry_parked(self, now: float) -> None:
        """Attempt the parked requests again (in arrival order) after the store made
        progress, or once one waited long enough."""
        progress = self.store.progress
        pokes = self._pokes           # read once: a poke after this is seen next turn
        poked = pokes != self._seen_pokes
        if progress == self._seen_progress and not poked \
                and all(now < p.deadline for p in self._parked):
            return
        self._seen_pokes = pokes
        parked, self._parked = self._parked, []
        for p in parked:
            force = now >= p.deadline or p.forced
            if p.on_poke and not (poked or force or p.cancelled or p.session.closed):
                self._parked.append(p)
                continue
            if p.cancelled or p.session.closed:
                # its client gave up on it (RELEASE/ABORT of its id) or is gone: make no
                # grant it would never settle
                self._abandon(p)
                continue
            if force and p.sliced:
                p.forced = True
            r = self._attempt(p, force, "parked op")
            if r is None:
                self._parked.append(p)
                continue
            if r is _MORE:                  # a sliced request: its next slice runs now
                self._runnable.append(p)
                continue
            self._parked_by.pop((p.session.id, p.req_id), None)
            status, rbody, frames = r
            self._reply(p.ident, p.session, p.req_id, p.op, status, rbody, frames, p.extra,
                        p.on_sent, p.t0, p.src)
        # Progress the attempts made themselves (their own evictions) is no reason to
        # attempt again; the next completion or free is.
        self._seen_progress = self.store.progress

    def _attempt(self, p: _Parked, force: bool, what: str) -> Any:
        """Run a parked request's attempt (or a large request's next slice): its reply
        triple, None (wait for the tier) or _MORE (more slices). A bug in it is logged and
        answered INTERNAL, its cleanup run; a forced attempt must answer."""
        try:
            r = p.attempt(force)
            if r is None and force:
                raise RuntimeError(f"a forced attempt ({what}) did not answer")
            return r
        except Exception as exc:
            log.exception("internal error in a %s %s", what, p.op)
            self._count_error("internal")
            if p.cleanup is not None:
                p.cleanup()
            return Status.INTERNAL, {"error": f"internal error: {exc!r}"}, []

    def _abandon(self, p: _Parked) -> None:
        # cancelled (RELEASE/ABORT of its id) or its session is gone: no reply, no grant
        self._parked_by.pop((p.session.id, p.req_id), None)
        if p.sliced:
            self.slice_counters["abandoned"] += 1
        if p.cleanup is not None:
            p.cleanup()

    def _cancel_parked(self, session: Session, rids: list[int]) -> None:
        # RELEASE/ABORT of a request still parked: its client gave up (cancelled, timed
        # out); the grant it would make must never be made
        if self._parked_by:
            for rid in rids:
                p = self._parked_by.pop((session.id, rid), None)
                if p is not None:
                    p.cancelled = True
                    self._seen_progress = -1      # look at it on the next turn
