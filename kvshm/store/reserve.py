"""Reservations: free pool blocks a same-host client holds to write without waiting.

A local session (one whose liveness proof the server saw, ``Session.local``) may hold a
*reservation*: runs of free pool blocks handed out by RESERVE, refilled ahead of need.
The client copies a value into blocks of its reservation (one memcpy) and sends PLACE,
naming the key, its size and the runs it used, without waiting for the reply. The
server checks everything against the reservation before it installs anything:

* the PLACE names the reservation's current generation (a reservation voided by
  ``reset`` or by a server restart is never written through);
* every run lies inside what the session still holds, no block is named twice (within
  one PLACE or across PLACEs: a placed block leaves the reservation), at most
  ``max_extents`` runs a value, and the runs hold exactly the blocks the size needs;
* the key is valid, the size within the server's per-value limit, and the pins the
  PLACE takes fit the principal's pin limit (``max_client_pinned_bytes``).

A value that passes is installed as COMMIT installs (index, shared index, LRU; an
overwrite replaces the old value only now, so a refused PLACE keeps it) and pinned
under the PLACE's request id until the client RELEASEs it: the client reads its own
placed-but-unacknowledged values straight from those blocks, which therefore cannot be
reused meanwhile. A refused value's blocks go back to the pool (the client no longer
counts them as its own either).

Reserved blocks count, in blocks, against the principal's pending-write quota
(``max_client_pending_bytes``). They go back to the pool when the session's process is
gone (its liveness proof): a session that ends while its process is still alive (a
reconnect's new session takes them over; an explicit close) leaves them held until the
proof goes, because that process may still be copying into them. A stalled but live
client (SIGSTOP, GC pause) therefore keeps its reservation, never reused.

The store calls :meth:`Reservations.moved`, :meth:`Reservations.ended` and
:meth:`Reservations.stats` (its only hooks, in :mod:`~kvshm.store.sessions` and
:mod:`~kvshm.store.accounting`); :class:`Reservations` uses the store's public methods,
those of :class:`_Reserving` (mixed into :class:`kvshm.store.Store`) among them. The
wire side is :mod:`kvshm.zmq_ctrl.ops_local`.
"""

from __future__ import annotations

import bisect
import logging
import os
from typing import Any, Sequence

from kvshm.index import Entry
from kvshm.store.outcome import Outcome
from kvshm.store.parts import _StoreParts
from kvshm.store.sessions import _PIN

__all__ = ["Reservations", "Reservation", "PlaceOutcome", "DEFAULT_MAX_SESSION_SHARE"]

log = logging.getLogger(__name__)

#: Most of the pool one session may hold reserved: 1/16 of its blocks (a few values'
#: worth for a cache of a few GiB; the client asks for less, see kvshm.client).
DEFAULT_MAX_SESSION_SHARE = 16


class _Reserving(_StoreParts):
    """The store's side of reservations (mixed into :class:`kvshm.store.Store`): blocks
    taken from free space and given back, budgets, and installing values whose blocks
    are already theirs."""

    def take_runs(self, nblocks: int) -> tuple[tuple[int, int], ...] | None:
        """Runs of ``nblocks`` blocks taken from free space, evicting as an ALLOC would;
        None when there is no room. The caller owns them (:meth:`give_back_runs`)."""
        ext = self._allocate([nblocks])[0]
        if self.tier is not None:
            self.tier.submit()
        return ext

    def give_back_runs(self, runs: Sequence[tuple[int, int]]) -> None:
        """Free runs taken with :meth:`take_runs` that hold no entry."""
        if runs:
            self._free_runs(tuple(runs))
            self.progress += 1

    def valid_key(self, key: Any) -> bool:
        return self._check_key(key) == Outcome.OK

    def pending_budget(self, session: Any) -> int | None:
        """Blocks ``session``'s principal may still hold pending (None: no limit)."""
        limit = self._limit_blocks(self.config.max_client_pending_bytes)
        return max(0, limit - session.quota.pending) if limit else None

    def pin_budget(self, session: Any) -> int | None:
        """Blocks ``session``'s principal may still pin (None: no limit)."""
        limit = self._limit_blocks(self.config.max_client_pinned_bytes)
        if not limit:
            return None
        q = session.quota
        return max(0, limit - q.pinned - q.sending)

    def install_entries(self, session: Any, req_id: int, entries: list[Entry],
                        pin: bool = False) -> None:
        """Make new entries visible as COMMIT does (their blocks are theirs and
        written); with ``pin`` also hold them under a pin grant ``req_id`` of
        ``session`` (RELEASE drops it)."""
        nbytes = 0
        c = self.counters
        self.index.sync()  # reads recorded before go first
        for e in entries:
            self._install(e)
            nbytes += e.size
            if len(e.extents) > 1:
                c["split_values"] += 1
        c["commits"] += 1
        c["puts"] += len(entries)
        c["bytes_in"] += nbytes
        if pin and entries:
            for e in entries:
                self._pin(e)
            self._add_grant(_PIN, session, req_id, entries, nbytes)


class PlaceOutcome:
    """Per-key outcome codes of :meth:`Reservations.place` (the router maps them to
    :class:`kvshm.zmq_ctrl.protocol.Status`)."""

    OK = "ok"
    INVALID_KEY = "invalid_key"
    TOO_LARGE = "too_large"
    BAD_RUNS = "bad_runs"           # outside the reservation, reused, or not the size's
    STALE = "stale"                 # another generation (voided reservation)
    QUOTA = "quota"                 # pins over the principal's limit


class Reservation:
    """The free blocks one session holds: disjoint runs ``(first block, count)``, kept
    sorted by first block and merged where they touch."""

    __slots__ = ("gen", "starts", "counts", "blocks", "proof")

    def __init__(self, gen: int, proof: Any) -> None:
        self.gen = gen
        self.starts: list[int] = []
        self.counts: list[int] = []
        self.blocks = 0
        self.proof = proof

    def add(self, start: int, count: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.counts.insert(i, count)
        self.blocks += count
        # merge with the neighbours where they touch
        if i + 1 < len(self.starts) and start + count == self.starts[i + 1]:
            self.counts[i] += self.counts.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.counts[i - 1] == start:
            self.counts[i - 1] += self.counts.pop(i)
            self.starts.pop(i)

    def holds(self, start: int, count: int) -> int:
        """Index of the run that holds blocks ``[start, start + count)``, or -1."""
        i = bisect.bisect_right(self.starts, start) - 1
        if i < 0 or start + count > self.starts[i] + self.counts[i]:
            return -1
        return i

    def take(self, i: int, start: int, count: int) -> None:
        """Remove ``[start, start + count)`` from run ``i`` (which holds it)."""
        s0, c0 = self.starts[i], self.counts[i]
        before = start - s0
        after = s0 + c0 - (start + count)
        self.blocks -= count
        if before and after:
            self.counts[i] = before
            self.starts.insert(i + 1, start + count)
            self.counts.insert(i + 1, after)
        elif before:
            self.counts[i] = before
        elif after:
            self.starts[i] = start + count
            self.counts[i] = after
        else:
            del self.starts[i]
            del self.counts[i]

    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self.starts, self.counts))

    def clear(self) -> list[tuple[int, int]]:
        r = self.runs()
        self.starts, self.counts, self.blocks = [], [], 0
        return r


def _new_gen() -> int:
    # unguessable, never 0, exact as a double
    return int.from_bytes(os.urandom(7), "little") >> 4 | 1


class Reservations:
    """Every session's reservation, for one :class:`kvshm.store.Store`.

    Parameters
    ----------
    store : kvshm.store.Store
        Attaches itself as ``store.reservations``.
    max_session_blocks : int, optional
        Most blocks one session may hold reserved (default: the pool's blocks divided by
        ``DEFAULT_MAX_SESSION_SHARE``, at least one).
    """

    def __init__(self, store: Any, max_session_blocks: int | None = None) -> None:
        self.store = store
        nb = store.alloc.num_blocks
        self.max_session_blocks = (max(1, nb // DEFAULT_MAX_SESSION_SHARE)
                                   if max_session_blocks is None else max_session_blocks)
        self._by_session: dict[int, Reservation] = {}
        # reservations of ended sessions whose process may still copy into them
        self._orphans: list[Reservation] = []
        self.blocks = 0             # reserved blocks, all reservations together
        self.counters = dict.fromkeys(
            ("reserves", "reserved_blocks_granted", "places", "placed_keys",
             "place_refused_keys", "reclaimed_blocks"), 0)
        store.reservations = self

    # ------------------------------------------------------------------ RESERVE

    def reserve(self, session: Any, want: int, reset: bool = False
                ) -> tuple[int, list[tuple[int, int]], int]:
        """Add up to ``want`` blocks to ``session``'s reservation.

        Returns ``(generation, runs added, blocks held now)``. ``reset`` first gives the
        current reservation back and starts a new generation (the client no longer
        knows what it holds: a reconnect). Grants are bounded by ``max_session_blocks``
        and by the principal's pending quota; blocks come from free space, evicting LRU
        entries as an ALLOC would. Raises ValueError for a session that is not local.
        """
        if not session.local or session.proof is None:
            raise ValueError("only a same-host client that proved its liveness may "
                             "reserve blocks")
        r = self._by_session.get(session.id)
        if r is None:
            r = self._by_session[session.id] = Reservation(_new_gen(), session.proof)
        elif reset:
            self._give_back(session, r)
            r.gen = _new_gen()
        want = max(0, min(int(want), self.max_session_blocks - r.blocks))
        budget = self.store.pending_budget(session)
        if budget is not None:
            want = min(want, budget)
        added: list[tuple[int, int]] = []
        if want > 0:
            runs = self.store.take_runs(want)
            if runs is not None:
                for s, c in runs:
                    r.add(s, c)
                    added.append((s, c))
                n = sum(c for _, c in runs)
                self.blocks += n
                session.quota.pending += n
                self.counters["reserved_blocks_granted"] += n
        self.counters["reserves"] += 1
        return r.gen, added, r.blocks

    def _give_back(self, session: Any, r: Reservation) -> None:
        runs = r.clear()
        n = sum(c for _, c in runs)
        if n:
            self.store.give_back_runs(runs)
            self.blocks -= n
            if session is not None:
                session.quota.pending -= n

    # ------------------------------------------------------------------ PLACE

    def place(self, session: Any, req_id: int, gen: Any, keys: Sequence[Any],
              sizes: Sequence[Any], runs: Sequence[Any],
              sums: Sequence[Any] | None) -> list[str]:
        """Install values the client copied into its reservation; outcomes per key
        (:class:`PlaceOutcome`). The inputs are as decoded from the wire and are checked
        here, one by one; nothing of a refused key is installed, and its blocks (those
        that were the session's) go back to the pool. The installed entries are pinned
        under ``req_id`` (RELEASE drops the pins).
        """
        store = self.store
        n = len(keys)
        r = self._by_session.get(session.id)
        if r is None or type(gen) is not int or gen != r.gen:
            self.counters["place_refused_keys"] += n
            return [PlaceOutcome.STALE] * n
        out = [PlaceOutcome.OK] * n
        bs = store.block_size
        max_ext = store.max_extents
        pin_budget = store.pin_budget(session)
        made: list[Entry] = []
        consumed = 0
        freed: list[tuple[int, int]] = []
        for i in range(n):
            k, size, rr = keys[i], sizes[i], runs[i]
            taken = self._take(r, rr, max_ext)
            if taken is None:
                out[i] = PlaceOutcome.BAD_RUNS
                continue
            nblocks = sum(c for _, c in taken)
            consumed += nblocks
            st = PlaceOutcome.OK
            if not store.valid_key(k):
                st = PlaceOutcome.INVALID_KEY
            elif type(size) is not int or size < 0:
                st = PlaceOutcome.BAD_RUNS
            elif size > store.max_value:
                st = PlaceOutcome.TOO_LARGE
            elif max(1, -(-size // bs)) != nblocks:
                st = PlaceOutcome.BAD_RUNS
            elif pin_budget is not None and nblocks > pin_budget:
                st = PlaceOutcome.QUOTA
            if st != PlaceOutcome.OK:
                out[i] = st
                freed.extend(taken)
                continue
            if pin_budget is not None:
                pin_budget -= nblocks
            csum = sums[i] if sums is not None and i < len(sums) else None
            ext = tuple(taken)
            made.append(Entry(k, ext[0][0], nblocks, size,
                              csum if type(csum) is int and 0 <= csum < 2**64 else None,
                              ext))
        self.blocks -= consumed
        session.quota.pending -= consumed
        if freed:
            store.give_back_runs(freed)
        if made:
            store.install_entries(session, req_id, made, pin=True)
        c = self.counters
        c["places"] += 1
        c["placed_keys"] += len(made)
        c["place_refused_keys"] += n - len(made)
        return out

    @staticmethod
    def _take(r: Reservation, rr: Any, max_ext: int) -> list[tuple[int, int]] | None:
        """Take the runs ``rr`` (``[[first block, count], ...]``) out of ``r``, all or
        nothing; None when one is malformed or not wholly held."""
        if type(rr) is not list or not 1 <= len(rr) <= max_ext:
            return None
        taken: list[tuple[int, int]] = []
        for run in rr:
            ok = (type(run) is list and len(run) == 2 and type(run[0]) is int
                  and type(run[1]) is int and run[1] > 0 and run[0] >= 0)
            j = r.holds(run[0], run[1]) if ok else -1
            if j < 0:
                for s, c in taken:          # put back what this key took already
                    r.add(s, c)
                return None
            r.take(j, run[0], run[1])
            taken.append((run[0], run[1]))
        return taken

    # ------------------------------------------------------------------ lifecycle

    def held_by(self, session: Any) -> int:
        """Blocks ``session`` holds reserved."""
        r = self._by_session.get(session.id)
        return 0 if r is None else r.blocks

    def moved(self, old: Any, new: Any) -> None:
        """Store hook: a new HELLO of the same client (same nonce) replaced ``old`` by
        ``new``; the reservation goes with it (the client may still copy into it)."""
        r = self._by_session.pop(old.id, None)
        if r is None:
            return
        if old.quota is not new.quota:
            old.quota.pending -= r.blocks
            new.quota.pending += r.blocks
        if new.proof is not None:
            r.proof = new.proof
        prev = self._by_session.pop(new.id, None)
        if prev is not None:
            self._give_back(new, prev)
        self._by_session[new.id] = r

    def ended(self, session: Any) -> None:
        """Store hook: ``session`` is closing (before its quota is dropped). Its
        reservation goes back to the pool now when its process is gone, else once it
        is (:meth:`tick`)."""
        r = self._by_session.pop(session.id, None)
        if r is None:
            return
        if r.blocks and r.proof is not None and _alive(r.proof):
            # that process may still be copying into these blocks: hold them
            session.quota.pending -= r.blocks
            self._orphans.append(r)
            return
        self.counters["reclaimed_blocks"] += r.blocks
        self._give_back(session, r)

    def tick(self, now: float) -> float | None:
        """Give back the reservations of ended sessions whose process is gone."""
        if not self._orphans:
            return None
        keep = []
        for r in self._orphans:
            if _alive(r.proof):
                keep.append(r)
            else:
                self.counters["reclaimed_blocks"] += r.blocks
                self._give_back(None, r)
        self._orphans = keep
        return now + 0.25 if keep else None

    def stats(self, verify: bool = False) -> dict[str, Any]:
        """``reservations`` = {sessions, blocks, orphaned_blocks, max_session_blocks,
        reserves, reserved_blocks_granted, places, placed_keys, place_refused_keys,
        reclaimed_blocks}; ``blocks`` counts orphaned ones too."""
        s: dict[str, Any] = {"sessions": len(self._by_session), "blocks": self.blocks,
                             "orphaned_blocks": sum(r.blocks for r in self._orphans),
                             "max_session_blocks": self.max_session_blocks}
        s.update(self.counters)
        if verify:
            held = sum(r.blocks for r in self._by_session.values())
            held += s["orphaned_blocks"]
            s["accounting_ok"] = held == self.blocks
        return s


def _alive(proof: Any) -> bool:
    try:
        return bool(proof.alive())
    except Exception:
        log.exception("liveness check of a reservation failed; treating it as alive")
        return True
