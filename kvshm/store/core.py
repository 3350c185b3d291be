"""The :class:`Store`: its state and its data path (ALLOC, COMMIT, PUT, LOOKUP, GET,
EXISTS, MATCH_PREFIX, DELETE, PURGE). The rest of its methods come from the parts it is
made of: :mod:`~kvshm.store.sessions` (sessions, grants, leases),
:mod:`~kvshm.store.space` (allocation, eviction, compaction), :mod:`~kvshm.store.tiered`
(a tier below), :mod:`~kvshm.store.accounting` (budgets, stats).

A PUT of packed values (TCP) with no tier and no checksums, whose values all fit in free
runs without evicting, is done in one C pass (:func:`kvshm._index.put_packed`: no list,
tuple or int object per key); anything else, and every such PUT with the environment
variable ``KVSHM_FAST_PUT=0`` (read at import, for A/B figures), goes the general way,
with the same results.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Sequence

from kvshm import _index
from kvshm._bitmap import BitmapAllocator
from kvshm._pool import PackedValues, Pool
from kvshm.index import MAX_EXTENTS, Entry, Index
from kvshm.store.accounting import _Accounting
from kvshm.store.config import StoreConfig
from kvshm.store.outcome import QUOTA_REFUSED, Outcome
from kvshm.store.reserve import _Reserving
from kvshm.store.sessions import _ALLOC, _PIN, Session, _Grant, _Quota, _Sessions
from kvshm.store.space import _Space
from kvshm.store.tiered import ReadHold, _Promotion, _Tiered

__all__ = ["Store"]

#: Batch PUTs of packed values in one C pass (module docstring); ``KVSHM_FAST_PUT=0``: off.
FAST_PUT = os.environ.get("KVSHM_FAST_PUT", "1") != "0"


class Store(_Sessions, _Space, _Tiered, _Accounting, _Reserving):
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
        #: (session id, request id) of each commit id a session remembers, oldest
        #: first (sessions.RECENT_COMMITS_TOTAL bounds them all together)
        self._commit_order: deque[tuple[int, int]] = deque()
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
        #: Same-host clients' reservations (a kvshm.store.reserve.Reservations attaches
        #: itself); None: RESERVE/PLACE not served.
        self.reservations: Any = None
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
             "puts", "gets", "commits", "commits_again", "aborts", "lease_expired_writes",
             "lease_expired_pins", "deletes", "purged", "pool_full", "too_large",
             "invalid_keys", "quota_refusals", "replaced_early", "alloc_evictions",
             "free_blocks_at_evictions", "fragmented_evictions", "relocations",
             "relocated_bytes", "split_values", "compactions_failed"), 0)

    def _check_key(self, key: Any) -> int:
        if type(key) is not bytes:
            if isinstance(key, str):
                return Outcome.INVALID_KEY   # the codec delivers bin keys; str is a client bug
            return Outcome.INVALID_KEY
        n = len(key)
        if n == 0 or n > self.config.limits.max_key_bytes:
            return Outcome.INVALID_KEY
        return Outcome.OK

    def alloc_entries(self, session: Session | bytes, req_id: int, keys: Sequence[Any],
                      sizes: Sequence[Any], sums: Sequence[Any] | None = None, *,
                      defer: bool = False, drop: bool = False, extend: bool = False
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
        ``extend``: these keys are a later slice of request ``req_id``: their entries join
        its grant (one COMMIT or ABORT settles all slices).
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
        # per key: -1, or its place (:meth:`place`); the entries made, their bytes
        offsets, granted, nbytes = _index.places(entries, self.block_size)
        if granted:
            self._pending += len(granted)
            self._add_grant(_ALLOC, session, req_id, granted, nbytes, extend)
        return offsets, statuses

    def place(self, e: Entry) -> int | list[list[int]]:
        """Where ``e``'s bytes lie, as ALLOC and LOOKUP answer it: the byte offset of a
        value in one run, else its byte extents ``[[offset, length], ...]``."""
        if e.nruns == 1:
            return e.start * self.block_size
        return e.byte_extents(self.block_size)

    def commit(self, session: Session | bytes, req_ids: Sequence[int]) -> list[int]:
        """COMMIT: make the pending entries of these ALLOC grants visible.

        Returns the request ids whose grant no longer exists (lease expired, or unknown).
        A request id of a grant this session committed already (one of its last
        :data:`~kvshm.store.sessions.RECENT_COMMITS`: a COMMIT re-sent after a lost
        reply) is not among them: it is committed, as the first COMMIT said (counted in
        ``commits_again``). A grant an ABORT received earlier is settling in slices
        (:meth:`begin_settle`) is among them: it is being aborted.
        """
        session = self._as_session(session)
        grants = session.grants
        failed = []
        for rid in req_ids:
            g = grants.get(rid)
            if g is None or g.kind != _ALLOC:
                if g is None and rid in session.committed:
                    self.counters["commits_again"] += 1     # re-sent: committed already
                    continue
                failed.append(rid)
                continue
            if g.closing == "abort":            # an earlier ABORT is settling it
                failed.append(rid)
                continue
            self._settle(g, commit=True)
            self.counters["commits"] += 1
            self.counters["puts"] += g.count()
            self.counters["bytes_in"] += g.nbytes
        return failed

    def abort(self, session: Session | bytes, req_ids: Sequence[int]) -> None:
        """Free the pending entries of these ALLOC grants (a failed or cancelled write).
        A grant a COMMIT received earlier is settling in slices (:meth:`begin_settle`)
        is left to it: an ABORT after a COMMIT is a no-op, whether or not that COMMIT is
        done."""
        grants = self._as_session(session).grants
        for rid in req_ids:
            g = grants.get(rid)
            if g is not None and g.kind == _ALLOC and g.closing != "commit":
                self._settle(g, commit=False)
                self.counters["aborts"] += 1

    def put(self, keys: Sequence[Any], values: Sequence[Any],
            sums: Sequence[Any] | None = None, *, defer: bool = False,
            drop: bool = False) -> list[int] | None:
        """PUT (TCP mover): allocate, copy ``values`` (buffers, or a
        :class:`~kvshm._pool.PackedValues` of a request's payload) into the pool, commit.

        Returns a Status per key (None: deferred, as :meth:`alloc_entries`).
        """
        pv = values if type(values) is PackedValues else None
        packed = pv is not None
        sizes = pv.sizes() if pv is not None else _index.value_sizes(values)
        if packed and sums is None and FAST_PUT and self.tier is None:
            st = _index.put_packed(self, keys, values, sizes, Outcome.OK)
            if st is not None:
                return st
        r = self._new_entries(keys, sizes, sums, None, defer, drop)
        if r is None:
            return None
        entries, statuses = r
        ok, nbytes = _index.placed(entries)
        if ok:
            # the bytes of each value into its run(s): packed values in one C loop
            # (values of several runs go the general way)
            offs = _index.value_offsets(entries, self.block_size) if pv is not None else None
            if offs is not None and pv is not None:
                self.pool.write_values(offs, pv)
            else:
                offs, srcs = _index.write_layout(entries, values, self.block_size)
                self.pool.write_many(offs, srcs)
            self.index.sync()       # lock-free reads recorded before this write go first
            _index.install_entries(self, ok)
            self.counters["puts"] += len(ok)
            self.counters["bytes_in"] += nbytes
        return statuses

    def lookup(self, session: Session | bytes, req_id: int, keys: Sequence[Any],
               hold: ReadHold | None = None, *, extend: bool = False
               ) -> tuple[list[int], list[int], list[int | None]]:
        """LOOKUP: pin each hit and refresh its LRU position.

        With a tier, call :meth:`prepare_read` first (it promotes what lives below);
        ``hold`` is the one it filled (to count the hits that came from the tier).
        ``extend``: a later slice of request ``req_id`` (its pins join the same grant).

        Returns
        -------
        offsets, sizes : list
            Per key as :meth:`alloc_entries` (an int offset, or byte extents of a value
            of several runs); -1 for a miss; a size of ``QUOTA_REFUSED`` (-2) for a key that is present but
            would take the principal over ``max_client_pinned_bytes`` (not pinned).
        checksums : list of int or None
        """
        n = len(keys)
        self.index.sync()           # lock-free reads recorded before this one go first
        session = self._as_session(session)
        limit = self._limit_blocks(self.config.max_client_pinned_bytes)
        budget = 0
        if limit:
            q = session.quota
            budget = limit - q.pinned - q.sending
        # per key: a miss; a hit over this principal's limit (QUOTA_REFUSED: present, not
        # pinned); or a hit pinned, made most recently used, its place
        offsets, sizes, sums, pinned, nbytes, refused = _index.lookup_pins(
            self, keys, hold, bool(limit), budget, QUOTA_REFUSED)
        if refused:
            self.counters["quota_refusals"] += refused
        hits = len(pinned)
        self.counters["hits"] += hits
        self.counters["misses"] += n - hits
        if pinned:
            self._add_grant(_PIN, session, req_id, pinned, nbytes, extend)
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
        out, sums, hits, nbytes = _index.pin_for_send(self, keys, hold)
        self.counters["hits"] += hits
        self.counters["misses"] += len(keys) - hits
        self.counters["gets"] += hits
        self.counters["bytes_out"] += nbytes
        return out, sums

    def pin_entries(self, entries: Sequence[Entry]) -> None:
        """Pin live entries (a handoff pin, kvshm.zmq_ctrl.ops_cluster); undo with
        :meth:`unpin`. Counts no read."""
        _index.pin_entries(self, entries)

    def unpin(self, entries: Sequence[Entry]) -> None:
        _index.unpin_entries(self, entries)

    def view(self, e: Entry) -> memoryview:
        """A read-only view of a pinned entry's bytes (one run; see :meth:`views`)."""
        if e.nruns != 1:
            raise ValueError(f"{e!r} lies in {len(e.extents)} runs: use views()")
        return self.pool.view(e.start * self.block_size, e.size, readonly=True)

    def views(self, e: Entry) -> list[memoryview]:
        """Read-only views of a pinned entry's bytes, one per run, in order."""
        pool = self.pool
        return [pool.view(o, k, readonly=True) for o, k in e.byte_extents(self.block_size)]

    def exists(self, keys: Sequence[Any]) -> list[bool]:
        """Whether each key is present (committed; in the pool or in a tier below)."""
        d = self.index.mapping
        tier = self.tier
        if tier is not None:
            return [type(k) is bytes and (k in d or tier.has(k)) for k in keys]
        # (an unhashable key from a malformed request: a miss, as any key not bytes)
        shared = self.index.shared
        if shared is not None and len(keys) > 1 and shared.unpublished == 0:
            # the shared table holds every live key: its probes are prefetched ahead
            return shared.contains_many(keys)
        return _index.contains_keys(self.index, keys)

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
