"""The store: pool + allocator + index + leases + eviction. No I/O of its own.

One thread owns a :class:`Store` (the server's loop); movers and sockets never touch it.
Every public method takes already-decoded Python values and returns plain values, so the
ZeroMQ loop, the management port and the tests drive the same code.

Sessions and grants
-------------------
A client's HELLO opens a :class:`Session` (:meth:`Store.open_session`); an ALLOC or a
LOOKUP creates a *grant* of that session named by its request id: the pending entries of
the ALLOC, or the pins of the LOOKUP. COMMIT / ABORT / RELEASE name grants by request id
within the session. A grant not settled within ``lease_timeout`` seconds expires: pending
entries are freed, pins dropped, unless the session proves its process is alive and
attached to the pool (``Session.proof``, the kernel-held lock of
:class:`kvshm.segments.Liveness`): such a stalled client may still be copying, so its
grants stay *held* (never reused, still counted against it) until it settles them or its
proof goes. A session whose proof is gone, or that is closed, is settled whole at once
(:meth:`Store.close_session`).

Limits count blocks actually held (a zero-byte value holds one block), per *principal*
(the uid the kernel reports for a same-host client, the CURVE key or the door token of
another), never per connection: all sessions of one principal share one quota.

Tiers
-----
With a tier attached (:meth:`Store.attach_tier`, the SSD tier of :mod:`kvshm.tiers.ssd`),
an entry's ``meta`` is its copy below (None: dirty, no copy). Eviction moves a clean entry
down at no cost; a dirty one is spilled first (the write pins it, so its blocks cannot be
reused while a worker reads them) and evicted once clean. A cleaner spills the LRU end of
the pool ahead of need. A read of a key that lives only below is promoted into freshly
allocated blocks before it is answered: the caller (the server loop) parks the request
and tries it again when the store made progress (:meth:`prepare_read`, ``defer=``). The
store never sees a file; see docs/SSD.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from kvshm._bitmap import BitmapAllocator
from kvshm._pool import Pool
from kvshm.index import DEAD, LIVE, MAX_EXTENTS, Entry, Index
from kvshm.tiers.ssd import MAX_JOB_BYTES, SPILL_BUSY, SPILL_REFUSED, SPILL_STARTED, WRITING
from kvshm.zmq_ctrl.protocol import Limits, Status

__all__ = ["Store", "StoreConfig", "QUOTA_REFUSED", "ReadHold", "Session"]

#: LOOKUP size of a key refused by the per-client pin limit.
QUOTA_REFUSED = -2

log = logging.getLogger(__name__)

_ALLOC = 0
_PIN = 1

# _evict_tiered results
_NOTHING = 0
_EVICTED = 1
_WAIT = 2          # nothing evictable now, but spill writes in flight will make some
#: Dirty entries an eviction may pass over (write queue full) looking for a clean one.
_SCAN_LIMIT = 64


@dataclass
class StoreConfig:
    """Policy knobs of a :class:`Store`.

    Attributes
    ----------
    lease_timeout : float
        Seconds a pending write or a pin may stay unsettled before it is reclaimed.
    limits : Limits
        Key, batch and value limits.
    max_client_pending_bytes : int
        Bytes of blocks one principal may hold in pending writes at once, all its
        sessions together (0: no limit). Counted in whole blocks actually held.
    max_client_pinned_bytes : int
        Bytes of blocks one principal may hold pinned at once, LOOKUP pins and GET
        replies not yet sent together (0: no limit). Counted in whole blocks.
    tier_wait : float
        With a tier: seconds a request may be parked waiting for spills (to make room) or
        a promotion before it is answered anyway (dirty entries dropped, or misses).
    max_extents : int
        Most block runs one value may be laid over, 1 to ``MAX_EXTENTS`` (1: every value
        in one contiguous run, as before values had extents).
    compact : bool
        Move live entries to join free holes when the free blocks would hold a value but
        lie in too many runs (else such a put evicts).
    """

    lease_timeout: float = 10.0
    limits: Limits = Limits()
    max_client_pending_bytes: int = 0
    max_client_pinned_bytes: int = 0
    tier_wait: float = 1.0
    max_extents: int = MAX_EXTENTS
    compact: bool = True


class _Grant:
    __slots__ = ("kind", "session", "rid", "entries", "deadline", "nbytes", "nblocks",
                 "held")

    def __init__(self, kind: int, session: "Session", rid: int, entries: list[Entry],
                 deadline: float, nbytes: int, nblocks: int) -> None:
        self.kind = kind
        self.session = session
        self.rid = rid
        self.entries = entries
        self.deadline = deadline
        self.nbytes = nbytes        # value bytes (counters)
        self.nblocks = nblocks      # blocks held (limits)
        self.held = False        # lease ran out, but its live client may still copy


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


class _Quota:
    """What one principal holds, all its sessions together (in blocks)."""

    __slots__ = ("pending", "pinned", "sending", "sessions")

    def __init__(self) -> None:
        self.pending = 0        # blocks of pending writes
        self.pinned = 0         # blocks pinned by LOOKUP grants
        self.sending = 0        # blocks pinned by GET replies not yet sent
        self.sessions = 0


class Session:
    """One HELLO's worth of state on the server: the grants it made, its principal.

    Made by :meth:`Store.open_session`. ``proof`` (None for a remote client) is its
    liveness proof: ``proof.alive()`` tells whether the process behind the session still
    holds it, ``proof.remove()`` clears it away once it is dead
    (:class:`kvshm.segments.Liveness`); ``id`` is issued by the server and ``nonce``
    chosen by the client (a new HELLO with the same nonce replaces the session:
    :meth:`Store.replace_session`).
    """

    __slots__ = ("id", "principal", "nonce", "proof", "grants", "quota", "closed",
                 "label", "local", "sending", "__weakref__")

    def __init__(self, sid: int, principal: Any, nonce: bytes, proof: Any,
                 quota: _Quota, label: str = "") -> None:
        self.id = sid
        self.principal = principal
        self.nonce = nonce
        self.proof = proof
        self.local = proof is not None
        self.sending = 0            # blocks of this session's GET replies not yet sent
        self.grants: dict[int, _Grant] = {}
        self.quota = quota
        self.closed = False
        self.label = label

    def __repr__(self) -> str:
        return f"<Session {self.id} {self.label or self.principal!r}>"


class ReadHold:
    """Pins a parked read holds on the entries of its request while others are promoted
    (so a long wait cannot evict what is already there). Made by :meth:`Store.read_hold`,
    dropped by :meth:`Store.release_hold`."""

    __slots__ = ("entries", "keys", "ssd_keys", "active", "waiting")

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.keys: set[bytes] = set()
        self.ssd_keys: set[bytes] = set()    # keys this read waited for a promotion of
        self.active = True
        self.waiting = 0                     # promotions it waits for, not yet done


class _Promotion:
    __slots__ = ("entry", "sentry", "holds")

    def __init__(self, entry: Entry, sentry: Any) -> None:
        self.entry = entry          # allocated, unpublished pool entry being filled
        self.sentry = sentry        # the tier's entry being read
        self.holds: list[ReadHold] = []


class Store:
    """Key -> value store over a :class:`~kvshm.Pool`.

    Parameters
    ----------
    pool : Pool
        The shared-memory pool (created by the server); the store never closes it.
    config : StoreConfig, optional
    clock : callable, optional
        Monotonic seconds (tests may pass a fake clock).
    """

    def __init__(self, pool: Pool, config: StoreConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.config = config or StoreConfig()
        self.block_size = pool.block_size
        self.alloc = BitmapAllocator(pool.num_blocks)
        self.index = Index()
        self._clock = clock
        self._ngrants = 0
        self._leases: deque[tuple[float, _Grant]] = deque()
        self._quotas: dict[Any, _Quota] = {}        # principal -> what it holds
        self._sessions: dict[int, Session] = {}
        self._named: dict[Any, Session] = {}         # implicit sessions (session_for)
        self._next_sid = int.from_bytes(os.urandom(4), "little") << 16
        self._pending = 0           # entries in state PENDING
        self._dead: set[Entry] = set()   # replaced/deleted while pinned
        self._pinned_entries = 0    # entries with pins > 0
        self._pins = 0              # total pins
        self.max_value = self.config.limits.max_value_bytes or pool.size
        if not 1 <= self.config.max_extents <= MAX_EXTENTS:
            raise ValueError(f"max_extents must be in 1..{MAX_EXTENTS}")
        #: Most runs a value is placed in (config.max_extents; at most what a tier
        #: below moves).
        self.max_extents = self.config.max_extents
        self._compact_skip = 0          # chances to compact left out (_try_compact)
        self._compact_backoff = 0
        # Called with each entry about to be evicted (without a tier); the entry's
        # blocks are freed after the hook returns.
        self.evict_hook: Callable[[Entry], None] | None = None
        # Called with a session before its grants are reclaimed (lease run out on a
        # client without a liveness proof, or the session closed): the RDMA endpoint
        # cuts every QP of that client so a late one-sided WRITE fails at the NIC.
        self.reclaim_hook: Callable[[Session], Any] | None = None
        self._held = 0
        # A tier below the pool (attach_tier); None: evicted entries are dropped.
        self.tier: Any = None
        self.clean_target = 0       # bytes the cleaner keeps free or clean
        self._dirty: OrderedDict[bytes, Entry] = OrderedDict()  # live, no copy, LRU order
        self._promoting: dict[bytes, _Promotion] = {}
        self._wait = False          # the last _allocate stopped for spills in flight
        #: Bumped whenever blocks are freed or a tier job completes (a parked request
        #: may then succeed).
        self.progress = 0
        self.tier_counters: dict[str, int] = dict.fromkeys(
            ("demotions", "dropped", "dropped_bytes", "promotions", "ssd_hits"), 0)
        self.counters: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "evictions", "evicted_bytes", "bytes_in", "bytes_out",
             "puts", "gets", "commits", "aborts", "lease_expired_writes",
             "lease_expired_pins", "deletes", "purged", "pool_full", "too_large",
             "invalid_keys", "quota_refusals", "replaced_early", "alloc_evictions",
             "free_blocks_at_evictions", "fragmented_evictions", "relocations",
             "relocated_bytes", "split_values", "compactions_failed"), 0)

    # ------------------------------------------------------------------ helpers

    def _as_session(self, session: "Session | bytes") -> Session:
        """``session``, or the implicit session named by a bytes id (tests, tools that
        drive a Store without a HELLO): principal = that id, no liveness proof."""
        if type(session) is Session:
            return session
        return self.session_for(session)  # type: ignore[arg-type]

    def session_for(self, name: Any) -> Session:
        """The implicit session named ``name`` (made on first use; principal ``name``)."""
        s = self._named.get(name)
        if s is None or s.closed:
            s = self._named[name] = self.open_session(name, label=repr(name))
        return s

    def _limit_blocks(self, nbytes: int) -> int:
        return max(1, nbytes // self.block_size) if nbytes else 0

    def _check_key(self, key: Any) -> int:
        if type(key) is not bytes:
            if isinstance(key, str):
                return Status.INVALID_KEY   # the codec delivers bin keys; str is a client bug
            return Status.INVALID_KEY
        n = len(key)
        if n == 0 or n > self.config.limits.max_key_bytes:
            return Status.INVALID_KEY
        return Status.OK

    def _nblocks(self, size: int) -> int:
        return max(1, -(-size // self.block_size))

    def _free(self, e: Entry) -> None:
        if len(e.extents) == 1:
            self.alloc.free(e.start, e.nblocks)
        else:
            self.alloc.free_extents(e.extents)
        e.state = DEAD
        e.start = -1
        e.extents = ()
        self.progress += 1

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
        out: list[tuple[tuple[int, int], ...] | None] = [
            ((s, n),) if s >= 0 else None for s, n in zip(starts, nblocks_list)]
        self._wait = False
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
        statuses: list[int] = [Status.OK] * n
        want: list[int] = []
        want_idx: list[int] = []
        budget = pending_budget
        bad_keys = too_large = quota = 0
        for i in range(n):
            if budget == 0:
                # the principal's quota is spent: every key left holds at least one
                # block, so it is refused (cheaply: a 1 M-key request costs its quota)
                statuses[i:] = [Status.QUOTA_EXCEEDED] * (n - i)
                quota += n - i
                break
            st: int = self._check_key(keys[i])
            size = sizes[i]
            if st != Status.OK:
                bad_keys += 1
            elif type(size) is not int or size < 0:
                st = Status.INVALID_REQUEST
            elif size > self.max_value:
                st = Status.TOO_LARGE
                too_large += 1
            elif budget is not None:
                nb = self._nblocks(size)         # blocks it holds (a 0-byte value: one)
                if nb > budget:
                    st = Status.QUOTA_EXCEEDED
                    quota += 1
                else:
                    budget -= nb
            statuses[i] = st
            if st == Status.OK:
                want.append(self._nblocks(size))
                want_idx.append(i)
        entries: list[Entry | None] = [None] * n
        places = self._allocate(want, drop, [keys[i] for i in want_idx])
        if self.tier is not None:
            self.tier.submit()          # spills started to make room
        if defer and self._wait and None in places:
            for ext in places:
                if ext is not None:
                    self._free_runs(ext)
            return None
        c = self.counters
        c["invalid_keys"] += bad_keys
        c["too_large"] += too_large
        c["quota_refusals"] += quota
        for j, i in enumerate(want_idx):
            ext = places[j]
            if ext is None:
                statuses[i] = Status.POOL_FULL
                self.counters["pool_full"] += 1
                continue
            csum = sums[i] if sums is not None else None
            entries[i] = Entry(keys[i], ext[0][0], want[j], sizes[i],
                               csum if type(csum) is int else None, ext)
            if len(ext) > 1:
                c["split_values"] += 1
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

    def _add_grant(self, kind: int, session: Session, req_id: int, entries: list[Entry],
                   nbytes: int) -> None:
        prev = session.grants.get(req_id)
        if prev is not None:          # a reused request id: settle the old grant first
            self._settle(prev, commit=False)
        deadline = self._clock() + self.config.lease_timeout
        nblocks = sum(e.nblocks for e in entries)
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
        if g.kind == _ALLOC:
            q.pending -= g.nblocks
            for e in g.entries:
                self._pending -= 1
                if commit:
                    self._install(e)
                else:
                    self._free(e)
        else:
            q.pinned -= g.nblocks
            for e in g.entries:
                self._unpin(e)

    # ------------------------------------------------------------------ write path

    def alloc_entries(self, session: Session | bytes, req_id: int, keys: Sequence[Any],
                      sizes: Sequence[Any], sums: Sequence[Any] | None = None, *,
                      defer: bool = False, drop: bool = False
                      ) -> tuple[list[int], list[int]] | None:
        """ALLOC: reserve blocks for each key as a pending entry.

        Returns
        -------
        offsets : list of int, or of list of [offset, length]
            Per key: the byte offset in the pool of a value in one run (the common case),
            the byte extents of a value laid over several runs (:meth:`place`), -1
            where refused.
        statuses : list of Status
            OK, INVALID_KEY, INVALID_REQUEST, TOO_LARGE, POOL_FULL or QUOTA_EXCEEDED.

        With a tier, ``defer`` returns None instead of POOL_FULL while spills in flight
        may make room (ask again after :meth:`service` made progress); ``drop`` makes
        room by dropping dirty entries instead of waiting for them to be spilled.
        """
        session = self._as_session(session)
        budget = None
        limit = self._limit_blocks(self.config.max_client_pending_bytes)
        if limit:
            budget = max(0, limit - session.quota.pending)
        r = self._new_entries(keys, sizes, sums, budget, defer, drop)
        if r is None:
            return None
        entries, statuses = r
        granted = [e for e in entries if e is not None]
        bs = self.block_size
        offsets = [-1 if e is None else e.start * bs if len(e.extents) == 1
                   else e.byte_extents(bs) for e in entries]
        if granted:
            self._pending += len(granted)
            self._add_grant(_ALLOC, session, req_id, granted, sum(e.size for e in granted))
        return offsets, statuses

    def place(self, e: Entry) -> int | list[list[int]]:
        """Where ``e``'s bytes lie, as ALLOC and LOOKUP answer it: the byte offset of a
        value in one run, else its byte extents ``[[offset, length], ...]``."""
        if len(e.extents) == 1:
            return e.start * self.block_size
        return e.byte_extents(self.block_size)

    def commit(self, session: Session | bytes, req_ids: Sequence[int]) -> list[int]:
        """COMMIT: make the pending entries of these ALLOC grants visible.

        Returns the request ids whose grant no longer exists (lease expired, or unknown).
        """
        grants = self._as_session(session).grants
        failed = []
        for rid in req_ids:
            g = grants.get(rid)
            if g is None or g.kind != _ALLOC:
                failed.append(rid)
                continue
            self._settle(g, commit=True)
            self.counters["commits"] += 1
            self.counters["puts"] += len(g.entries)
            self.counters["bytes_in"] += g.nbytes
        return failed

    def abort(self, session: Session | bytes, req_ids: Sequence[int]) -> None:
        """Free the pending entries of these ALLOC grants (a failed or cancelled write)."""
        grants = self._as_session(session).grants
        for rid in req_ids:
            g = grants.get(rid)
            if g is not None and g.kind == _ALLOC:
                self._settle(g, commit=False)
                self.counters["aborts"] += 1

    def put(self, keys: Sequence[Any], values: Sequence[Any],
            sums: Sequence[Any] | None = None, *, defer: bool = False,
            drop: bool = False) -> list[int] | None:
        """PUT (TCP mover): allocate, copy ``values`` (buffers) into the pool, commit.

        Returns a Status per key (None: deferred, as :meth:`alloc_entries`).
        """
        sizes = [memoryview(v).nbytes for v in values]
        r = self._new_entries(keys, sizes, sums, None, defer, drop)
        if r is None:
            return None
        entries, statuses = r
        ok = [e for e in entries if e is not None]
        if ok:
            bs = self.block_size
            offs: list[int] = []
            srcs: list[Any] = []
            for e, v in zip(entries, values):
                if e is None:
                    continue
                if len(e.extents) == 1:
                    offs.append(e.start * bs)
                    srcs.append(v)
                    continue
                m = memoryview(v)
                if m.format != "B" or m.ndim != 1:
                    m = m.cast("B")
                pos = 0
                for o, k in e.byte_extents(bs):     # the frame's bytes into each run
                    offs.append(o)
                    srcs.append(m[pos:pos + k])
                    pos += k
            self.pool.write_many(offs, srcs)
            for e in ok:
                self._install(e)
            self.counters["puts"] += len(ok)
            self.counters["bytes_in"] += sum(e.size for e in ok)
        return statuses

    # ------------------------------------------------------------------ read path

    def lookup(self, session: Session | bytes, req_id: int, keys: Sequence[Any],
               hold: ReadHold | None = None
               ) -> tuple[list[int], list[int], list[int | None]]:
        """LOOKUP: pin each hit and refresh its LRU position.

        With a tier, call :meth:`prepare_read` first (it promotes what lives below);
        ``hold`` is the one it filled (to count the hits that came from the tier).

        Returns
        -------
        offsets, sizes : list
            Per key as :meth:`alloc_entries` (an int offset, or byte extents of a value
            of several runs); -1 for a miss; a size of ``QUOTA_REFUSED`` (-2) for a key that is present but
            would take the principal over ``max_client_pinned_bytes`` (not pinned).
        checksums : list of int or None
        """
        n = len(keys)
        offsets: list[Any] = [-1] * n
        sizes = [-1] * n
        sums: list[int | None] = [None] * n
        pinned: list[Entry] = []
        self.index.sync()           # lock-free reads recorded before this one go first
        d = self.index.mapping
        bs = self.block_size
        nbytes = 0
        tier = self.tier
        session = self._as_session(session)
        limit = self._limit_blocks(self.config.max_client_pinned_bytes)
        budget = 0
        if limit:
            q = session.quota
            budget = limit - q.pinned - q.sending
        for i in range(n):
            k = keys[i]
            e = d.get(k) if type(k) is bytes else None
            if e is None:
                continue
            if limit:
                if e.nblocks > budget:
                    self.counters["quota_refusals"] += 1
                    sizes[i] = QUOTA_REFUSED     # present, but over this principal's limit
                    continue
                budget -= e.nblocks
            d.move_to_end(k)
            if tier is not None:
                self._touch(e, hold)
            self._pin(e)
            pinned.append(e)
            nbytes += e.size
            offsets[i] = e.start * bs if len(e.extents) == 1 else e.byte_extents(bs)
            sizes[i] = e.size
            sums[i] = e.checksum
        hits = len(pinned)
        self.counters["hits"] += hits
        self.counters["misses"] += n - hits
        if pinned:
            self._add_grant(_PIN, session, req_id, pinned, nbytes)
            self.counters["gets"] += hits
            self.counters["bytes_out"] += nbytes
        return offsets, sizes, sums

    def release(self, session: Session | bytes, req_ids: Sequence[int]) -> None:
        """RELEASE: drop the pins of these LOOKUP grants."""
        grants = self._as_session(session).grants
        for rid in req_ids:
            g = grants.get(rid)
            if g is not None and g.kind == _PIN:
                self._settle(g, commit=False)

    def pin_for_send(self, keys: Sequence[Any], hold: ReadHold | None = None
                     ) -> tuple[list[Entry | None], list[int | None]]:
        """GET (TCP mover): pin the hits so their bytes can be sent without a copy.

        The caller unpins each entry with :meth:`unpin` once its frame is sent.
        Returns the entry per key (None for a miss) and its checksum. With a tier, call
        :meth:`prepare_read` first, as for :meth:`lookup`.
        """
        self.index.sync()           # lock-free reads recorded before this one go first
        d = self.index.mapping
        out: list[Entry | None] = []
        sums: list[int | None] = []
        hits = nbytes = 0
        tier = self.tier
        for k in keys:
            e = d.get(k) if type(k) is bytes else None
            if e is not None:
                d.move_to_end(k)
                if tier is not None:
                    self._touch(e, hold)
                self._pin(e)
                hits += 1
                nbytes += e.size
            out.append(e)
            sums.append(e.checksum if e is not None else None)
        self.counters["hits"] += hits
        self.counters["misses"] += len(keys) - hits
        self.counters["gets"] += hits
        self.counters["bytes_out"] += nbytes
        return out, sums

    def pin_entries(self, entries: Sequence[Entry]) -> None:
        """Pin live entries (a handoff pin, kvshm.zmq_ctrl.ops_cluster); undo with
        :meth:`unpin`. Counts no read."""
        for e in entries:
            self._pin(e)

    def unpin(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            self._unpin(e)

    def send_budget(self, session: Session) -> int | None:
        """Blocks ``session``'s principal may still hold in GET replies not yet sent
        (None: no limit); LOOKUP pins count against the same limit."""
        limit = self._limit_blocks(self.config.max_client_pinned_bytes)
        if not limit:
            return None
        q = session.quota
        return max(0, limit - q.pinned - q.sending)

    def sending(self, session: Session, nblocks: int) -> None:
        """``nblocks`` of a GET reply to ``session`` are queued, not yet sent (zero-copy
        pins, or the server's copy): counted against its principal until :meth:`sent`."""
        session.quota.sending += nblocks
        session.sending += nblocks

    def sent(self, session: Session, nblocks: int, entries: Sequence[Entry] = ()) -> None:
        """A GET reply left (or was dropped): unpin its zero-copy ``entries`` and stop
        counting its ``nblocks``."""
        session.quota.sending -= nblocks
        session.sending -= nblocks
        for e in entries:
            self._unpin(e)

    def view(self, e: Entry) -> memoryview:
        """A read-only view of a pinned entry's bytes (one run; see :meth:`views`)."""
        if len(e.extents) != 1:
            raise ValueError(f"{e!r} lies in {len(e.extents)} runs: use views()")
        return self.pool.view(e.start * self.block_size, e.size, readonly=True)

    def views(self, e: Entry) -> list[memoryview]:
        """Read-only views of a pinned entry's bytes, one per run, in order."""
        pool = self.pool
        return [pool.view(o, k, readonly=True) for o, k in e.byte_extents(self.block_size)]

    # ------------------------------------------------------------------ queries

    def exists(self, keys: Sequence[Any]) -> list[bool]:
        """Whether each key is present (committed; in the pool or in a tier below)."""
        d = self.index.mapping
        tier = self.tier
        if tier is not None:
            return [type(k) is bytes and (k in d or tier.has(k)) for k in keys]
        try:
            return [k in d for k in keys]
        except TypeError:   # an unhashable key from a malformed request: a miss
            return [type(k) is bytes and k in d for k in keys]

    def list_keys(self, prefix: bytes = b"", start: int = 0, limit: int = 1000
                  ) -> tuple[list[bytes], bool]:
        """Committed keys starting with ``prefix`` (pool, then a tier below), from the
        ``start``-th match, at most ``limit``. Returns the keys and whether more follow.

        O(keys): an administrative scan, not a data path.
        """
        keys: Any = self.index.keys()
        if self.tier is not None and hasattr(self.tier, "keys"):
            import itertools

            keys = itertools.chain(keys, self.tier.keys())
        out: list[bytes] = []
        seen = 0
        for k in keys:
            if not k.startswith(prefix):
                continue
            if seen >= start:
                if len(out) == limit:
                    return out, True
                out.append(k)
            seen += 1
        return out, False

    def match_prefix(self, keys: Sequence[Any]) -> int:
        """How many leading keys are present (committed; pool or a tier below)."""
        d = self.index.mapping
        tier = self.tier
        n = 0
        for k in keys:
            if type(k) is not bytes or (k not in d and (tier is None or not tier.has(k))):
                break
            n += 1
        return n

    def delete(self, keys: Sequence[Any]) -> int:
        """Remove keys; pinned entries stay readable by their pin holders. Returns removed."""
        n = 0
        tier = self.tier
        for k in keys:
            e = self.index.remove(k) if type(k) is bytes else None
            if e is not None:
                self._retire(e)
                n += 1
            elif tier is not None and type(k) is bytes and tier.discard_key(k):
                n += 1
        self.counters["deletes"] += n
        return n

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

    def purge(self) -> int:
        """Remove every committed entry (pending writes are kept), in the pool and in a
        tier below. Returns count."""
        entries = self.index.clear()
        for e in entries:
            self._retire(e)
        n = len(entries)
        if self.tier is not None:
            n += self.tier.purge()
        self.counters["purged"] += n
        return n

    # ------------------------------------------------------------------ tiers

    def attach_tier(self, tier: Any, clean_target: int = 0) -> None:
        """Put ``tier`` (a :class:`kvshm.tiers.SsdTier`) below the pool.

        ``clean_target``: bytes of the pool the cleaner keeps free or clean (copied
        below), so that evictions rarely wait for a write.
        """
        self.tier = tier
        self.clean_target = clean_target
        self.max_extents = min(self.config.max_extents, getattr(tier, "max_extents", 1))
        tier.unshadow = self._unshadowed
        self.index.on_read = lambda e: self._touch(e, None)   # lock-free reads, as LOOKUP
        for e in self.index.lru():
            if e.meta is None:
                self._dirty[e.key] = e

    def close_tier(self) -> None:
        """Close the tier (waits for its I/O threads); the server's last step before the
        pool goes."""
        if self.tier is not None:
            self.tier.close()

    def flush_tier(self, timeout: float) -> int:
        """Write every dirty entry down and wait for the writes (a clean stop with a
        persistent tier, after the loop stopped). Returns the entries written; stops
        early after ``timeout`` seconds."""
        tier = self.tier
        if tier is None:
            return 0
        woke = threading.Event()
        notify, tier.notify = tier.notify, woke.set
        written = tier.counters["spills"]
        refused: set[bytes] = set()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                woke.clear()
                self.service()
                for e in list(self._dirty.values()):
                    if e.key in refused:
                        continue
                    r = tier.spill(e)
                    if r == SPILL_STARTED:
                        self._start_spill(e, False)
                    elif r == SPILL_BUSY:
                        break
                    else:
                        refused.add(e.key)
                tier.submit()
                if not tier.io_in_flight and all(k in refused for k in self._dirty):
                    break
                woke.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            self.service()
        finally:
            tier.notify = notify
        return tier.counters["spills"] - written

    def _unshadowed(self, e: Entry) -> None:
        # the tier dropped the copy of live entry e: it is dirty again
        if e.state == LIVE and self.index.get(e.key) is e:
            self._dirty[e.key] = e

    def _tier_leave(self, e: Entry) -> None:
        """Live entry ``e`` leaves the index (overwritten, deleted, purged, dropped)."""
        d = self._dirty
        if d.get(e.key) is e:
            del d[e.key]
        m = e.meta
        if m is not None:
            e.meta = None
            self.tier.discard(m)

    def _touch(self, e: Entry, hold: ReadHold | None) -> None:
        m = e.meta
        if m is None:
            if e.key in self._dirty:
                self._dirty.move_to_end(e.key)
        else:
            self.tier.touch(m)
        if hold is not None and e.key in hold.ssd_keys:
            self.tier_counters["ssd_hits"] += 1

    def _start_spill(self, e: Entry, after: bool) -> None:
        # tier.spill() returned SPILL_STARTED: the write pins e until it completes
        self._pin(e)
        d = self._dirty
        if d.get(e.key) is e:
            del d[e.key]
        if after:
            m: Any = e.meta
            m.evict_after = True

    def _evict_tiered(self, drop: bool, after: bool = False) -> int:
        """Evict one entry: the least recently used clean one; dirty ones met on the way
        are spilled (``after``: evicted once written). ``drop``: evict the LRU entry even
        if dirty (its bytes are lost). Returns _EVICTED, _WAIT or _NOTHING."""
        tier = self.tier
        victim = None
        busy = 0
        read_pinned: list[Entry] = []
        for e in self.index.lru():
            if e.pins:          # readers, or a spill write in flight
                m: Any = e.meta
                if e.pins == 1 and m is not None and m.state == WRITING and not drop:
                    # the LRU entry is being written: evict it when written, not a
                    # newer one now (so entries reach the SSD in LRU order)
                    self._touch_all(read_pinned)
                    return _WAIT
                if m is None or m.state != WRITING:
                    read_pinned.append(e)
                continue
            if e.meta is not None or drop:
                victim = e
                break
            r = tier.spill(e)
            if r == SPILL_STARTED:
                self._start_spill(e, after)
                continue
            if r == SPILL_REFUSED:      # cannot go below: drop it (it is the LRU entry)
                victim = e
                break
            busy += 1                   # the write queue is full: look for a clean one
            if busy >= _SCAN_LIMIT:
                break
        self._touch_all(read_pinned)
        if victim is None:
            return _WAIT if tier.io_in_flight else _NOTHING
        self._evict_entry(victim)
        return _EVICTED

    def _touch_all(self, entries: list[Entry]) -> None:
        # Entries pinned by readers met at the old end go to the young end, so the next
        # eviction does not scan past them again (see Index.oldest_unpinned).
        for e in entries:
            if self.index.get(e.key) is e:
                self.index.touch(e.key)

    def _evict_entry(self, e: Entry) -> None:
        self.index.remove(e.key)
        m = e.meta
        if m is not None:
            e.meta = None
            self.tier.demote(m)
            self.tier_counters["demotions"] += 1
        else:
            d = self._dirty
            if d.get(e.key) is e:
                del d[e.key]
            self.tier_counters["dropped"] += 1
            self.tier_counters["dropped_bytes"] += e.size
        self._free(e)
        self.counters["evictions"] += 1
        self.counters["evicted_bytes"] += e.size

    def _clean(self) -> None:
        """Spill the oldest dirty entries while free + clean bytes are under target."""
        dirty = self._dirty
        if not dirty:
            return
        tier = self.tier
        need = (self.clean_target - self.alloc.num_free * self.block_size
                - tier.margin_bytes - tier.write_bytes)
        while need > 0 and dirty:
            e = next(iter(dirty.values()))
            r = tier.spill(e)
            if r == SPILL_STARTED:
                self._start_spill(e, False)
                need -= e.nblocks * self.block_size
            elif r == SPILL_BUSY:
                break
            else:                       # refused (too large, disk failing): later
                dirty.move_to_end(e.key)
                break

    def read_hold(self) -> ReadHold:
        return ReadHold()

    def release_hold(self, hold: ReadHold) -> None:
        """Drop the pins of a parked read (after its lookup, or when it is abandoned)."""
        hold.active = False
        for e in hold.entries:
            self._unpin(e)
        hold.entries.clear()
        hold.keys.clear()

    def prepare_read(self, keys: Sequence[Any], hold: ReadHold, force: bool = False
                     ) -> bool:
        """Before a LOOKUP/GET: start promoting the keys that live only below.

        Returns True when the read can be answered now (every key is in the pool or
        nowhere), False when it must wait for promotions (or for room to promote into);
        call again after :meth:`service` made progress. While it waits, the keys already
        in the pool are pinned through ``hold``. ``force``: answer now, what is not in
        the pool is a miss.
        """
        tier = self.tier
        if tier is None:
            return True
        if hold.waiting and not force:
            return False            # its promotions are not all done yet: nothing to do
        d = self.index.mapping
        promoting = self._promoting
        need = [k for k in keys
                if type(k) is bytes and k not in d and (k in promoting or tier.has(k))]
        if not need or force:
            return True
        for k in keys:          # hold what is here, so a long wait cannot evict it
            if type(k) is bytes and k not in hold.keys:
                e = d.get(k)
                if e is not None:
                    self._pin(e)
                    hold.entries.append(e)
                    hold.keys.add(k)
        ready = True
        new: list[tuple[bytes, Any]] = []
        for k in need:
            p = promoting.get(k)
            if p is None:
                se = tier.lookup(k)
                if se is not None:
                    tier.reserve(se)        # not dropped below while we make room
                    new.append((k, se))
                continue
            hold.ssd_keys.add(k)
            if hold not in p.holds:
                p.holds.append(hold)
                hold.waiting += 1
            ready = False
        # The disk reads start now, into the tier's private buffers (checksums checked
        # there); each entry below is then placed in new pool blocks (tier.read) or
        # given up (tier.unreserve), and only then copied into the pool. Room is made a
        # job's worth at a time (values larger than a job are read once placed).
        if new:
            tier.prefetch([se for _, se in new])
        step = max(1, MAX_JOB_BYTES // self.block_size)
        for c in range(0, len(new), step):
            chunk = new[c:c + step]
            places = self._allocate([se.nblocks for _, se in chunk])
            for (k, se), ext in zip(chunk, places):
                if k in promoting:          # the same key twice in one request
                    if ext is not None:
                        self._free_runs(ext)
                    tier.unreserve(se)
                    continue
                if ext is None or tier.lookup(k) is not se:
                    if ext is not None:
                        self._free_runs(ext)
                    tier.unreserve(se)
                    if ext is None and self._wait:
                        ready = False       # room comes when spills complete
                    continue                # else: the pool is pinned full; a miss
                # xxh64, as the client's
                e = Entry(k, ext[0][0], se.nblocks, se.size, se.checksum, ext)
                p = promoting[k] = _Promotion(e, se)
                tier.read(se, e)
                hold.ssd_keys.add(k)
                p.holds.append(hold)
                hold.waiting += 1
                ready = False
            tier.submit()
        tier.submit()
        return ready

    def _read_done(self, se: Any, e: Entry, ok: bool) -> None:
        p = self._promoting.pop(e.key, None)
        if ok and e.key not in self.index:
            self.tier.installed(se, e)
            e.meta = se
            self._install(e)
            self.tier_counters["promotions"] += 1
            if p is not None:
                for h in p.holds:
                    h.waiting -= 1
                    if h.active and e.key not in h.keys:
                        self._pin(e)
                        h.entries.append(e)
                        h.keys.add(e.key)
        else:
            if p is not None:
                for h in p.holds:
                    h.waiting -= 1
            self._free(e)

    def _write_done(self, se: Any, e: Entry, ok: bool) -> None:
        self._unpin(e)              # the write's pin
        if e.meta is not se:        # overwritten/deleted meanwhile: the copy was dropped
            return
        if not ok:
            e.meta = None
            if e.state == LIVE and self.index.get(e.key) is e:
                self._dirty[e.key] = e
            return
        if getattr(se, "evict_after", False) and e.pins == 0 and self.index.get(e.key) is e:
            self._evict_entry(e)

    def service(self, now: float | None = None) -> float | None:
        """Apply the tier's finished I/O, run the cleaner, queue new I/O. The loop calls
        it every turn. Returns when the tier next needs a call (None: on its own wake)."""
        tier = self.tier
        if tier is None:
            return None
        events = tier.poll()
        if events:
            self.progress += 1
            for kind, se, e, ok in events:
                if kind == "w":
                    self._write_done(se, e, ok)
                else:
                    self._read_done(se, e, ok)
        self._clean()
        tier.submit()
        return tier.service(self._clock() if now is None else now)

    # ------------------------------------------------------------------ leases

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
        session.closed = True
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
                                    len(g.entries), sess.label or sess.id)
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
                            len(g.entries), sess.label or sess.id)
            else:
                log.info("lease expired: %d pins of %s dropped", len(g.entries),
                         sess.label or sess.id)
            self._settle(g, commit=False)
        return None

    # ------------------------------------------------------------------ stats

    @property
    def used_bytes(self) -> int:
        return self.alloc.num_used * self.block_size

    def stats(self, verify: bool = False) -> dict[str, Any]:
        """Counters and gauges. ``verify`` adds an accounting check (O(entries)).

        Keys (all ints unless noted): used_bytes, capacity_bytes, num_keys, pending,
        pinned (entries with a pin), pins (total pins), dead (replaced but still
        pinned), block_size, num_blocks, free_blocks, largest_free_run (blocks),
        usage (float 0..1), clients (principals holding blocks), sessions (open),
        grants, held_grants (lease run out, client alive) and the counters: hits, misses,
        evictions, evicted_bytes, bytes_in, bytes_out, puts, gets, commits, aborts,
        lease_expired_writes, lease_expired_pins, deletes, purged, pool_full, too_large,
        invalid_keys, quota_refusals, replaced_early, alloc_evictions (evictions made to
        place an ALLOC or PUT), free_blocks_at_evictions (free blocks summed over those
        evictions: space that fragmentation kept from use), fragmented_evictions (those
        made while the free blocks were as many as the value needed), split_values
        (values placed in several runs), relocations and relocated_bytes (live entries
        moved to join free space for a value, :meth:`_compact`), compactions_failed
        (attempts that found no window to clear). With ``verify``: entry_blocks (blocks held by live,
        pending, dead and promoting entries, counted one by one) and accounting_ok
        (entry_blocks == used blocks). ``pins`` includes the pins of spill writes in
        flight and of parked reads.

        With a shared index (same-host lock-free reads, kvshm.localread): ``shared_index``
        = {live, tombstones, slots, unpublished, rebuilds, skipped_records, reads_applied};
        lock-free reads are not in hits/gets (reads_applied counts those that reached the
        LRU), and with ``verify`` accounting_ok also needs every live key in the table or
        counted as unpublished.

        With a tier: ``tiers`` = {"pool": {...}, "ssd": {...}}, per tier entries, bytes,
        hits, spills, promotions, drops, checksum_failures and more (docs/SSD.md); with
        ``verify`` the SSD tier adds its own accounting_ok.
        """
        a = self.alloc
        s: dict[str, Any] = {
            "used_bytes": a.num_used * self.block_size,
            "capacity_bytes": self.pool.size,
            "num_keys": len(self.index),
            "pending": self._pending,
            "pinned": self._pinned_entries,
            "pins": self._pins,
            "dead": len(self._dead),
            "block_size": self.block_size,
            "num_blocks": a.num_blocks,
            "free_blocks": a.num_free,
            "largest_free_run": a.largest_free_run,
            "usage": a.num_used / a.num_blocks,
            "clients": sum(1 for q in self._quotas.values()
                           if q.pending or q.pinned or q.sending),
            "sessions": len(self._sessions),
            "grants": self._ngrants,
            "held_grants": self._held,
        }
        s.update(self.counters)
        if self.index.shared is not None:     # same-host lock-free reads (kvshm.localread)
            s["shared_index"] = self.index.shared.stats()
        if verify:
            blocks = sum(e.nblocks for e in self.index.lru())
            blocks += sum(e.nblocks for sess in self._sessions.values()
                          for g in sess.grants.values() if g.kind == _ALLOC
                          for e in g.entries)
            blocks += sum(e.nblocks for e in self._dead)
            blocks += sum(p.entry.nblocks for p in self._promoting.values())
            s["entry_blocks"] = blocks
            s["accounting_ok"] = blocks == a.num_used
            t = self.index.shared
            if t is not None and t.live + t.unpublished != len(self.index):
                s["accounting_ok"] = False
        if self.tier is not None:
            tc = self.tier_counters
            ssd = self.tier.stats(verify)
            ssd["hits"] = tc["ssd_hits"]
            s["tiers"] = {
                "pool": {"entries": len(self.index), "bytes": s["used_bytes"],
                         "hits": s["hits"] - tc["ssd_hits"], "spills": tc["demotions"],
                         "promotions": tc["promotions"], "drops": tc["dropped"],
                         "dropped_bytes": tc["dropped_bytes"], "checksum_failures": 0,
                         "dirty": len(self._dirty), "promoting": len(self._promoting)},
                "ssd": ssd,
            }
        return s
