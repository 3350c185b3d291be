"""Sessions, grants and leases of the store (mixed into :class:`kvshm.store.Store`).

A session is one HELLO's worth of state; a grant (the pending entries of an ALLOC, or the
pins of a LOOKUP) belongs to a session and is named by its request id; a lease bounds how
long a grant may stay unsettled; a quota (in blocks) is shared by every session of one
principal. See the package docstring for the rules.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from kvshm import _index
from kvshm.index import Entry
# _ALLOC, _PIN, Session, _Grant, _Quota: also taken from here by the other parts
from kvshm.store.grants import _ALLOC, _PIN, Session, _Grant, _Quota, _untrack_entries
from kvshm.store.parts import _StoreParts

__all__ = ["Session"]

log = logging.getLogger("kvshm.store")

#: Request ids of its committed ALLOC grants a session remembers (the most recent): a
#: COMMIT of one of them sent again (its reply was lost, the client retries) is answered
#: as the first was, committed, not as a grant gone (LeaseExpired). Bounded per session
#: (a dict of ints, ~100 bytes an id); a re-sent COMMIT older than that many commits of
#: its session is reported failed, as before.
RECENT_COMMITS = 1024
#: ... and all sessions together remember at most this many (the oldest forgotten first,
#: whichever session's): ~130 bytes an id with its order entry, so ~70 MB at most. Without it one token holder
#: opening the router's 65,536 sessions, each committing 1024 grants, made the server
#: hold ~4.5 GB of ids. A client re-sends a COMMIT within its timeout (seconds): at
#: 100 k commits/s server-wide an id is still remembered ~5 s after it was committed.
RECENT_COMMITS_TOTAL = 1 << 19


class _Sessions(_StoreParts):
    """Open, replace and close sessions; make, settle and expire grants."""

    def _as_session(self, session: "Session | bytes") -> Session:
        """``session``, or the implicit session named by a bytes id (tests, tools that
        drive a Store without a HELLO): principal = that id, no liveness proof."""
        if type(session) is Session:
            return session
        return self.session_for(session)

    def session_for(self, name: Any) -> Session:
        """The implicit session named ``name`` (made on first use; principal ``name``)."""
        s = self._named.get(name)
        if s is None or s.closed:
            s = self._named[name] = self.open_session(name, label=repr(name))
        return s

    def _add_grant(self, kind: int, session: Session, req_id: int, entries: list[Entry],
                   nbytes: int, extend: bool = False) -> None:
        """Make the grant ``req_id`` of ``session`` over ``entries`` (counted against its
        principal). ``extend``: a later slice of the same request (the router serves a
        large request in slices): the entries join the grant the earlier slices made, and
        its lease starts again, so a long request cannot lose its first slices' blocks."""
        prev = session.grants.get(req_id)
        if session.committed:
            session.committed.pop(req_id, None)     # a new grant of a reused id
        deadline = self._clock() + self.config.lease_timeout
        nblocks = _index.sum_blocks(entries)
        if prev is not None:
            if extend and prev.kind == kind:
                n0 = len(prev.entries)
                prev.entries.extend(entries)
                _untrack_entries(prev.entries, n0)
                prev.nbytes += nbytes
                prev.nblocks += nblocks
                prev.deadline = deadline
                self._leases.append((deadline, prev))
                if kind == _ALLOC:
                    session.quota.pending += nblocks
                else:
                    session.quota.pinned += nblocks
                return
            self._settle(prev, commit=False)   # a reused request id: settle the old first
        g = _Grant(kind, session, req_id, entries, deadline, nbytes, nblocks)
        session.grants[req_id] = g
        self._ngrants += 1
        self._leases.append((deadline, g))
        q = session.quota
        if kind == _ALLOC:
            q.pending += nblocks
        else:
            q.pinned += nblocks

    def _settle(self, g: _Grant, commit: bool) -> None:
        session = g.session
        if session.grants.get(g.rid) is not g:
            return                      # settled already
        del session.grants[g.rid]
        self._ngrants -= 1
        if g.held:
            self._held -= 1
        q = session.quota
        entries = g.rest()
        if g.kind == _ALLOC:
            q.pending -= g.nblocks
            self._pending -= len(entries)
            if commit:
                self.index.sync()   # lock-free reads recorded before this write go first
                _index.install_entries(self, entries)
                done = session.committed
                done[g.rid] = None
                if len(done) > RECENT_COMMITS:
                    del done[next(iter(done))]
                order = self._commit_order
                order.append((session.id, g.rid))
                if len(order) > RECENT_COMMITS_TOTAL:
                    self._forget_commits()
            else:
                _index.free_entries(self, entries)
        else:
            q.pinned -= g.nblocks
            _index.unpin_entries(self, entries)

    def _forget_commits(self) -> None:
        """The oldest remembered commit ids forgotten until at most
        :data:`RECENT_COMMITS_TOTAL` are (every id a session remembers has its entry in
        ``_commit_order``, so the sessions' together are no more)."""
        order = self._commit_order
        sessions = self._sessions
        while len(order) > RECENT_COMMITS_TOTAL:
            sid, rid = order.popleft()
            sess = sessions.get(sid)        # (by id: a closed session is not kept)
            if sess is not None:
                sess.committed.pop(rid, None)

    @staticmethod
    def committed_before(session: Session, req_id: int) -> bool:
        """Whether ``req_id`` names an ALLOC grant of ``session`` committed already (one
        of its last :data:`RECENT_COMMITS` commits, none of its grants since): a COMMIT
        of it sent again is answered as committed."""
        return req_id in session.committed

    def begin_settle(self, session: Session, how: str, req_ids: Sequence[int]
                     ) -> list[_Grant]:
        """A request that ``how`` ("commit" or "abort") these ALLOC grants of ``session``
        is being settled in slices (the router, :meth:`settle_some`): until it is done,
        a later request of the other kind does not take effect between its slices. An
        ABORT of a grant being committed is a no-op (:meth:`abort`, as it is once the
        COMMIT is done), a COMMIT of a grant being aborted fails (:meth:`commit`, as it
        does once the ABORT is done): the first one the server received settles it
        whole, never half one way and half the other. A grant marked already keeps its
        mark (the earlier request's). Returns the grants it marked, for
        :meth:`end_settle`."""
        grants = session.grants
        marked = []
        for rid in req_ids:
            g = grants.get(rid)
            if g is not None and g.kind == _ALLOC and g.closing is None:
                g.closing = how
                marked.append(g)
        return marked

    @staticmethod
    def end_settle(marked: Sequence[_Grant]) -> None:
        """The request that marked these grants (:meth:`begin_settle`) was abandoned
        before it was done (its session replaced or closed, it was cancelled): their
        marks go, and a grant it left (moved to a new session by a same-nonce HELLO,
        say) is again its client's to settle either way."""
        for g in marked:
            g.closing = None

    def grant_entries(self, session: Session, req_ids: Sequence[int]) -> int:
        """Entries held by the grants ``req_ids`` of ``session`` (what settling them
        costs; the router settles large grants in slices)."""
        grants = session.grants
        n = 0
        for rid in req_ids:
            g = grants.get(rid)
            if g is not None:
                n += g.count()
        return n

    def settle_some(self, session: Session, req_id: int, how: str, n: int) -> int:
        """Settle at most ``n`` entries of grant ``req_id``, in its order: ``how`` is
        "commit" or "abort" (an ALLOC grant) or "release" (a LOOKUP grant). The grant's
        last entries settle it as :meth:`commit` / :meth:`abort` / :meth:`release` would
        (same counters); until then it stays, smaller, with its lease started again.
        Returns the entries settled, -1 when there is no such grant (a COMMIT of it
        failed), 0 for a "commit" of a grant committed already
        (:meth:`committed_before`: a COMMIT sent again). A grant another request is
        settling the other way (:meth:`begin_settle`): an "abort" of one being committed
        settles nothing (0), a "commit" of one being aborted fails (-1). Linear in ``n``
        (amortized), however many parts a grant is settled in. Raises ValueError for
        ``n`` < 0."""
        if n < 0:
            raise ValueError(f"settle_some: n must be >= 0, got {n!r}")
        g = session.grants.get(req_id)
        kind = _PIN if how == "release" else _ALLOC
        if g is None or g.kind != kind:
            if g is None and how == "commit" and req_id in session.committed:
                self.counters["commits_again"] += 1
                return 0
            return -1
        if g.closing is not None and g.closing != how:
            return 0 if how == "abort" else -1      # the other request came first
        k = g.count()
        if k <= n:
            if how == "commit":
                self.commit(session, [req_id])
            elif how == "abort":
                self.abort(session, [req_id])
            else:
                self.release(session, [req_id])
            return k
        d = g.done
        part = g.entries[d:d + n]
        d += n
        if 2 * d >= len(g.entries):
            # compact once the settled front is half the list: the entries moved are
            # fewer than those settled since the last compaction (amortized O(1) each)
            del g.entries[:d]
            d = 0
        g.done = d
        nblocks, nbytes = _index.sum_blocks_bytes(part)     # (one C loop, not n steps)
        g.nblocks -= nblocks
        g.nbytes -= nbytes
        q = session.quota
        if kind == _ALLOC:
            q.pending -= nblocks
            self._pending -= n
            if how == "commit":
                self.index.sync()   # lock-free reads recorded before this write go first
                _index.install_entries(self, part)
                self.counters["puts"] += n
                self.counters["bytes_in"] += nbytes
            else:
                _index.free_entries(self, part)
        else:
            q.pinned -= nblocks
            _index.unpin_entries(self, part)
        g.deadline = self._clock() + self.config.lease_timeout
        self._leases.append((g.deadline, g))
        return n

    def open_session(self, principal: Any, *, nonce: bytes = b"", proof: Any = None,
                     label: str = "") -> Session:
        """A new session of ``principal`` (any hashable: ``("uid", 1000)``, a CURVE key).

        ``proof``: the session's liveness proof (a same-host client that attached the
        pool; ``alive()``, ``remove()``); None for a remote client, whose grants are
        reclaimed at lease expiry.
        """
        self._next_sid += 1
        q = self._quotas.get(principal)
        if q is None:
            q = self._quotas[principal] = _Quota()
        q.sessions += 1
        sess = Session(self._next_sid, principal, nonce, proof, q, label)
        self._sessions[sess.id] = sess
        return sess

    def replace_session(self, old: Session, new: Session) -> None:
        """A new HELLO of the same process (same nonce): ``old`` ends, and its grants
        (still being copied by that live process, or lazily committed) move to ``new``.
        Request ids are never reused by one client, so they stay unique in ``new``."""
        if old.closed or old is new:
            return
        if old.committed:       # a COMMIT re-sent on the new session: answered as done
            done = new.committed
            order = self._commit_order
            for rid in old.committed:
                if rid not in new.grants:
                    done[rid] = None
                    order.append((new.id, rid))     # (old's entries: popped as no-ops)
            while len(done) > RECENT_COMMITS:
                del done[next(iter(done))]
            old.committed = {}
            if len(order) > RECENT_COMMITS_TOTAL:
                self._forget_commits()
        for rid, g in old.grants.items():
            g.session = new
            prev = new.grants.get(rid)
            if prev is not None:
                self._settle(prev, commit=False)
            new.grants[rid] = g
            n = g.nblocks
            if old.quota is not new.quota:
                if g.kind == _ALLOC:
                    old.quota.pending -= n
                    new.quota.pending += n
                else:
                    old.quota.pinned -= n
                    new.quota.pinned += n
        old.grants = {}
        old.successor = new     # (work the router does for old goes on for new: live())
        if self.reservations is not None:      # kvshm.store.reserve
            self.reservations.moved(old, new)
        self._end(old)

    def close_session(self, session: Session, why: str = "closed") -> int:
        """Settle every grant of ``session`` now (its process is gone, or it said so):
        pending writes freed, pins dropped. Idempotent. Returns the grants settled."""
        if session.closed:
            return 0
        n = len(session.grants)
        if n:
            if self.reclaim_hook is not None:
                try:
                    self.reclaim_hook(session)
                except Exception:
                    log.exception("reclaim hook failed for %r", session)
            log.info("session %s %s: %d grants reclaimed", session.label or session.id, why,
                     n)
            for g in list(session.grants.values()):
                self._count_reclaim(g)
                self._settle(g, commit=False)
        self._end(session)
        return n

    def _end(self, session: Session) -> None:
        if self.reservations is not None:      # before its quota may be dropped
            self.reservations.ended(session)
        session.closed = True
        session.committed = {}      # (its ids' entries in _commit_order: no-ops now)
        # progress: the loop looks at the parked requests again and drops this
        # session's (a parked CLUSTER_VIEW would otherwise stay until its wait ended)
        self.progress += 1
        self._sessions.pop(session.id, None)
        q = session.quota
        q.sessions -= 1
        if q.sessions <= 0 and not (q.pending or q.pinned or q.sending):
            self._quotas.pop(session.principal, None)

    def drop_client(self, session: Session | bytes) -> None:
        """Settle every grant of a session now (it is known to be gone)."""
        self.close_session(self._as_session(session), "dropped")

    def check_sessions(self) -> int:
        """Close every same-host session whose liveness proof is gone (the process
        died, whatever its namespace): its grants are reclaimed at once, not at lease
        expiry. Returns how many were closed."""
        dead = []
        for sess in self._sessions.values():
            if sess.proof is not None and not self._alive(sess):
                dead.append(sess)
        for sess in dead:
            self._dead_session(sess)
        return len(dead)

    def _dead_session(self, sess: Session) -> None:
        self.close_session(sess, "ended (its liveness lock is gone)")
        try:
            sess.proof.remove()
        except Exception:
            log.exception("removing the liveness file of %r failed", sess)

    @staticmethod
    def _alive(sess: Session) -> bool:
        try:
            return bool(sess.proof.alive())
        except Exception:
            log.exception("liveness check of %r failed; treating it as alive", sess)
            return True

    def _count_reclaim(self, g: _Grant) -> None:
        if g.kind == _ALLOC:
            self.counters["lease_expired_writes"] += 1
        else:
            self.counters["lease_expired_pins"] += 1

    def expire(self, now: float | None = None) -> float | None:
        """Reclaim grants whose lease ran out. Returns the next deadline, or None.

        A grant of a session with a liveness proof is reclaimed only once the proof is
        gone (then the whole session is): a live client merely stalled (a GC pause,
        SIGSTOP, a starved CPU) may still be copying into or out of those blocks
        through its mapping of the pool, and reusing them would hand its late bytes to
        another key. Its grants stay held (not visible, not reused, counted against its
        principal and in ``held_grants``) until it settles them or exits.
        """
        if now is None:
            now = self._clock()
        leases = self._leases
        while leases:
            deadline, g = leases[0]
            if g.deadline != deadline or g.session.grants.get(g.rid) is not g:
                leases.popleft()          # settled already (or re-granted later)
                continue
            if deadline > now:
                return deadline
            leases.popleft()
            sess = g.session
            if sess.proof is not None:
                if self._alive(sess):
                    if not g.held:
                        g.held = True
                        self._held += 1
                        log.warning("lease expired for %d entries of live client %s: held, "
                                    "not reused, until it settles them or exits",
                                    g.count(), sess.label or sess.id)
                    g.deadline = now + self.config.lease_timeout    # look again later
                    leases.append((g.deadline, g))
                else:
                    self._dead_session(sess)
                continue
            if self.reclaim_hook is not None:
                # a remote one-sided client (RDMA): cut its QPs before its blocks are
                # reused, so a late WRITE or READ fails at the NIC instead of landing
                try:
                    self.reclaim_hook(sess)
                except Exception:
                    log.exception("reclaim hook failed for %r", sess)
            self._count_reclaim(g)
            if g.kind == _ALLOC:
                log.warning("lease expired: pending write of %d entries from %s reclaimed",
                            g.count(), sess.label or sess.id)
            else:
                log.info("lease expired: %d pins of %s dropped", g.count(),
                         sess.label or sess.id)
            self._settle(g, commit=False)
        return None
