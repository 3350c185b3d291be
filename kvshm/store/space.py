"""Allocation, eviction and compaction of pool blocks (mixed into
:class:`kvshm.store.Store`): where a value's blocks come from, what is evicted to make
room, when live entries are moved to join free holes."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from kvshm import _index
from kvshm._pool import Pool
from kvshm.index import DEAD, LIVE, Entry
from kvshm.store.outcome import Outcome
from kvshm.store.parts import _StoreParts

log = logging.getLogger("kvshm.store")

# _evict_tiered results
_NOTHING = 0
_EVICTED = 1
_WAIT = 2          # nothing evictable now, but spill writes in flight will make some


def _copy_runs(pool: Pool, src: tuple[tuple[int, int], ...],
               dst: tuple[tuple[int, int], ...], size: int, bs: int) -> None:
    """Copy ``size`` bytes laid over the block runs ``src`` to the runs ``dst`` (disjoint
    blocks of the same pool)."""
    si = di = 0
    s_off, s_left = src[0][0] * bs, src[0][1] * bs
    d_off, d_left = dst[0][0] * bs, dst[0][1] * bs
    while size > 0:
        if s_left == 0:
            si += 1
            s_off, s_left = src[si][0] * bs, src[si][1] * bs
        if d_left == 0:
            di += 1
            d_off, d_left = dst[di][0] * bs, dst[di][1] * bs
        k = min(size, s_left, d_left)
        with pool.view(s_off, k, readonly=True) as v:
            pool.write(d_off, v)
        s_off += k
        d_off += k
        s_left -= k
        d_left -= k
        size -= k


class _Space(_StoreParts):
    """Blocks in and out: allocate (one run, extents, compaction), evict, free."""

    def _nblocks(self, size: int) -> int:
        return max(1, -(-size // self.block_size))

    def _free(self, e: Entry) -> None:
        _index.free_entry(self, e)

    def _free_runs(self, ext: tuple[tuple[int, int], ...]) -> None:
        # blocks allocated for an entry that was never made
        if len(ext) == 1:
            self.alloc.free(ext[0][0], ext[0][1])
        else:
            self.alloc.free_extents(ext)

    def _retire(self, e: Entry) -> None:
        """A live entry left the index: free it now, or when its last pin goes."""
        if self.tier is not None:
            self._tier_leave(e)
        if e.pins:
            e.state = DEAD
            self._dead.add(e)
        else:
            self._free(e)

    def _unpin(self, e: Entry) -> None:
        e.pins -= 1
        self._pins -= 1
        if e.pins == 0:
            self._pinned_entries -= 1
            if e.state == DEAD and e.start >= 0:
                self._dead.discard(e)
                self._free(e)

    def _pin(self, e: Entry) -> None:
        if e.pins == 0:
            self._pinned_entries += 1
        e.pins += 1
        self._pins += 1

    def _evict_one(self) -> bool:
        if self.tier is not None:
            return self._evict_tiered(False, after=True) == _EVICTED
        e = self.index.oldest_unpinned()
        if e is None:
            return False
        if self.evict_hook is not None:
            try:
                self.evict_hook(e)
            except Exception:   # a tier failure must not cost the pool its eviction
                log.exception("evict hook failed for %r", e.key)
        self.index.remove(e.key)
        self._free(e)
        self.counters["evictions"] += 1
        self.counters["evicted_bytes"] += e.size
        return True

    def _count_alloc_eviction(self, n: int, free: int) -> None:
        # an eviction for an ALLOC of n blocks: how much was free when it was needed
        c = self.counters
        c["alloc_evictions"] += 1
        c["free_blocks_at_evictions"] += free
        if free >= n:
            c["fragmented_evictions"] += 1

    def _allocate(self, nblocks_list: list[int], drop: bool = False,
                  replacing: Sequence[Any] = ()) -> list[tuple[tuple[int, int], ...] | None]:
        """Blocks for each count: ``(first block, count)`` runs, None where nothing more
        can go.

        One run where one fits, else up to ``max_extents`` runs (the fewest the free
        space allows); when the free blocks would do but lie in more runs than that,
        live entries are moved to join holes (:meth:`_compact`). Only when fewer blocks
        are free than a value needs (or nothing can move) does it evict, LRU first, one
        entry at a time until they are enough.

        ``replacing`` are the keys being written, one per count: when the pool lacks
        room, a key's own current (unpinned) entry makes room first, since the write
        replaces it anyway; but only if the new value then fits, so a write that fails
        leaves the old value readable. Without this an overwrite in a full pool would
        cost one unrelated entry each, and the store would keep less than an exact LRU
        of the same size. Until the new entry is committed such a key reads as a miss.
        Meanwhile the old entries of the request's keys are pinned, so that no eviction
        for another key of it takes one.

        With a tier, a dirty LRU entry is spilled rather than dropped, and ``self._wait``
        tells whether a None may succeed once spills in flight complete; ``drop`` evicts
        dirty entries without a copy instead (a request that waited long enough).
        """
        starts = self.alloc.alloc_many(nblocks_list) if nblocks_list else []
        self._wait = False
        return self._allocate_rest(starts, nblocks_list, drop, replacing)

    def _allocate_rest(self, starts: list[int], nblocks_list: list[int], drop: bool,
                       replacing: Sequence[Any]
                       ) -> list[tuple[tuple[int, int], ...] | None]:
        # _allocate once the allocator placed what fits (``starts``, -1 where not)
        out: list[tuple[tuple[int, int], ...] | None] = [
            ((s, n),) if s >= 0 else None for s, n in zip(starts, nblocks_list)]
        if -1 not in starts:
            return out
        tier = self.tier
        d = self.index.mapping
        # the keys' current values are pinned while the request is placed: no eviction
        # for another key takes one, and each is given up only for its own key's value
        held: dict[int, Entry] = {}
        if tier is None:
            for k in replacing:
                e = d.get(k) if type(k) is bytes else None
                if e is not None and e.pins == 0:
                    self._pin(e)
                    held[id(e)] = e
        try:
            for i, s in enumerate(starts):
                if s >= 0:
                    continue
                own = None
                if held and i < len(replacing):
                    k = replacing[i]
                    e = d.get(k) if type(k) is bytes else None
                    if e is not None and id(e) in held:
                        own = e
                out[i] = self._make_room(nblocks_list[i], own, drop)
        finally:
            for e in held.values():
                self._unpin(e)
        return out

    def _make_room(self, n: int, own: Entry | None, drop: bool
                   ) -> tuple[tuple[int, int], ...] | None:
        """Runs for ``n`` blocks, evicting as little as possible (see :meth:`_allocate`);
        ``own``: the pinned old entry of the key, given up if the new value fits then."""
        alloc = self.alloc
        tier = self.tier
        compact_at = n          # free blocks from which moving entries is worth a try
        while True:
            ext = alloc.alloc_extents(n, self.max_extents)
            if ext is None and alloc.num_free >= compact_at:
                ext = self._try_compact(n)
                # it failed (pinned or pending blocks everywhere): try again only once
                # evictions freed another value's worth, not after every eviction
                compact_at = alloc.num_free + n
            if ext is not None:
                return ext
            if own is not None and own.pins == 1 and alloc.num_free + own.nblocks >= n:
                # the key's old value makes room: in its blocks and the free ones
                self._free_runs(own.extents)
                ext = alloc.alloc_extents(n, self.max_extents)
                if ext is not None:
                    self.index.remove(own.key)
                    if tier is not None:
                        self._tier_leave(own)
                    own.state = DEAD
                    own.start = -1
                    own.extents = ()
                    self.progress += 1
                    self.counters["replaced_early"] += 1
                    return ext
                for r0, r1 in own.extents:   # does not fit: it stays where it was
                    alloc.alloc_at(r0, r1)
            free = alloc.num_free
            if tier is None:
                if not self._evict_one():
                    return None
                self._count_alloc_eviction(n, free)
                continue
            if self._wait:
                return None
            r = self._evict_tiered(drop)
            if r == _WAIT:
                self._wait = True
                return None
            if r == _NOTHING:
                return None
            self._count_alloc_eviction(n, free)

    def _try_compact(self, n: int) -> tuple[tuple[int, int], ...] | None:
        """:meth:`_compact`, with a back-off: after a failed attempt (every window holds
        pinned or pending blocks) the next 1, 2, 4 ... 64 chances are skipped (those
        values are placed by evicting), so that a pool that cannot be compacted costs
        little more than one without compaction."""
        if not self.config.compact:
            return None
        if self._compact_skip:
            self._compact_skip -= 1
            return None
        ext = self._compact(n)
        if ext is None:
            self.counters["compactions_failed"] += 1
            self._compact_backoff = min(64, self._compact_backoff * 2 or 1)
            self._compact_skip = self._compact_backoff
        else:
            self._compact_backoff = 0
        return ext

    def _compact(self, n: int) -> tuple[tuple[int, int], ...] | None:
        """Make one run of ``n`` blocks by moving live entries out of the way.

        Called when at least ``n`` blocks are free but in more than ``MAX_EXTENTS``
        runs. Picks the window of ``n`` blocks that holds the fewest allocated blocks, all
        of live entries without pins (pinned, pending and dead entries never move),
        copies those entries into free blocks outside it (each in up to
        ``MAX_EXTENTS`` runs), re-points them (:meth:`Index.relocate`, LRU order kept)
        and frees their old blocks. Costs one pass over the entries, a few vector
        operations over the blocks and a copy of at most the bytes of the value being
        placed; None (nothing moved) when no window qualifies or the entries to move do
        not fit elsewhere.
        """
        alloc = self.alloc
        nb = alloc.num_blocks
        movable: list[Entry] = []
        starts: list[int] = []
        counts: list[int] = []
        owner: list[int] = []
        for e in self.index.lru():
            if e.pins == 0:
                j = len(movable)
                movable.append(e)
                for s0, c0 in e.extents:
                    starts.append(s0)
                    counts.append(c0)
                    owner.append(j)
        st = np.array(starts, np.int64)
        ct = np.array(counts, np.int64)
        # blocks held by movable entries (a difference array, summed)
        edge = np.zeros(nb + 1, np.int32)
        np.add.at(edge, st, 1)
        np.add.at(edge, st + ct, -1)
        movable_blk = np.cumsum(edge[:nb]) > 0
        free_blk = np.frombuffer(alloc.free_map(), np.uint8).astype(bool)
        # per block: 0 free, 1 movable, n + 1 immovable (pinned, pending, dead)
        cost = np.where(free_blk, 0, np.where(movable_blk, 1, n + 1)).astype(np.int64)
        csum = np.concatenate(([0], np.cumsum(cost)))
        window = csum[n:] - csum[:nb - n + 1]
        a = int(np.argmin(window))
        used = int(window[a])
        if used > n or used == 0:
            return None
        b = a + n
        hit = np.flatnonzero((st < b) & (st + ct > a))
        moving = [movable[j] for j in dict.fromkeys(int(owner[i]) for i in hit)]
        free_inside = n - used
        if alloc.num_free - free_inside < sum(e.nblocks for e in moving):
            return None
        # hold the window's free blocks, so that nothing moves into them
        inside = np.flatnonzero(cost[a:b] == 0) + a
        holes: list[tuple[int, int]] = []
        if inside.size:
            cuts = np.flatnonzero(np.diff(inside) != 1) + 1
            for run in np.split(inside, cuts):
                holes.append((int(run[0]), int(run.size)))
                alloc.alloc_at(int(run[0]), int(run.size))
        places: list[tuple[tuple[int, int], ...]] = []
        for e in moving:
            ext = alloc.alloc_extents(e.nblocks, self.max_extents)
            if ext is None:
                for p in places:
                    self._free_runs(p)
                for h in holes:
                    alloc.free(*h)
                return None
            places.append(ext)
        bs = self.block_size
        pool = self.pool
        c = self.counters
        for e, ext in zip(moving, places):
            old = e.extents
            _copy_runs(pool, old, ext, e.size, bs)
            self.index.relocate(e, ext)
            self._free_runs(old)
            c["relocations"] += 1
            c["relocated_bytes"] += e.size
        for h in holes:
            alloc.free(*h)
        alloc.alloc_at(a, n)
        self.progress += 1
        return ((a, n),)

    def _new_entries(self, keys: Sequence[Any], sizes: Sequence[Any],
                     sums: Sequence[Any] | None, pending_budget: int | None,
                     defer: bool = False, drop: bool = False
                     ) -> tuple[list[Entry | None], list[int]] | None:
        """Validate and allocate one entry per key; statuses per key.

        None (nothing allocated, nothing counted) when ``defer`` and a key could not be
        placed now but may be once spills in flight complete.
        """
        n = len(keys)
        statuses, want, want_idx, bad_keys, too_large, quota = _index.check_new(
            self, keys, sizes, pending_budget, Outcome.OK, Outcome.INVALID_KEY,
            Outcome.INVALID_REQUEST, Outcome.TOO_LARGE, Outcome.QUOTA_EXCEEDED)
        starts = self.alloc.alloc_many(want) if want else []
        self._wait = False
        places: Any = starts            # one run per key: the start blocks do
        if -1 in starts:
            places = self._allocate_rest(starts, want, drop, [keys[i] for i in want_idx])
        if self.tier is not None:
            self.tier.submit()          # spills started to make room
        if defer and self._wait and places is not starts and None in places:
            for ext in places:
                if ext is not None:
                    self._free_runs(ext)
            return None
        c = self.counters
        c["invalid_keys"] += bad_keys
        c["too_large"] += too_large
        c["quota_refusals"] += quota
        entries, full, split = _index.make_entries(keys, sizes, sums, want, want_idx, places,
                                                   n, Outcome.POOL_FULL, statuses)
        if full:
            c["pool_full"] += full
        if split:
            c["split_values"] += split
        return entries, statuses

    def _install(self, e: Entry) -> None:
        old = self.index.insert(e)
        e.state = LIVE
        if old is not None:
            self._retire(old)
        tier = self.tier
        if tier is not None:
            if old is None:
                tier.discard_key(e.key)     # an older value below is stale now
            if e.meta is None:
                self._dirty[e.key] = e

    def evict(self, to_ratio: float) -> int:
        """Evict LRU entries until used blocks <= ``to_ratio`` of the pool. Returns count.

        With a tier, dirty entries are spilled first and evicted when their write
        completes (not counted here).
        """
        target = int(self.alloc.num_blocks * to_ratio)
        n = 0
        while self.alloc.num_used > target and self._evict_one():
            n += 1
        if self.tier is not None:
            self.tier.submit()
        return n

    def periodic_evict(self, min_ratio: float, max_ratio: float) -> int:
        """When usage passes ``max_ratio``, evict down to ``min_ratio``."""
        if self.alloc.num_used > self.alloc.num_blocks * max_ratio:
            return self.evict(min_ratio)
        return 0
