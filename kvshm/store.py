"""The store: pool + allocator + index + leases + eviction. No I/O of its own.

One thread owns a :class:`Store` (the server's loop); movers and sockets never touch it.
Every public method takes already-decoded Python values and returns plain values, so the
ZeroMQ loop, the management port and the tests drive the same code.

Grants
------
An ALLOC or a LOOKUP creates a *grant* named ``(client, req_id)``: the pending entries of
the ALLOC, or the pins of the LOOKUP. COMMIT / ABORT / RELEASE name grants by request id.
A grant not settled within ``lease_timeout`` seconds expires: pending entries are freed,
pins dropped. So a client that dies mid-write or mid-read loses only its own work.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvshm._bitmap import BitmapAllocator
from kvshm._pool import Pool
from kvshm.index import DEAD, LIVE, PENDING, Entry, Index
from kvshm.zmq_ctrl.protocol import Limits, Status

__all__ = ["Store", "StoreConfig", "QUOTA_REFUSED"]

#: LOOKUP size of a key refused by the per-client pin limit.
QUOTA_REFUSED = -2

log = logging.getLogger(__name__)

_ALLOC = 0
_PIN = 1


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
        Bytes one client may hold in pending writes at once (0: no limit).
    max_client_pinned_bytes : int
        Bytes one client may hold pinned at once (0: no limit).
    """

    lease_timeout: float = 10.0
    limits: Limits = Limits()
    max_client_pending_bytes: int = 0
    max_client_pinned_bytes: int = 0


class _Grant:
    __slots__ = ("kind", "client", "entries", "deadline", "nbytes")

    def __init__(self, kind: int, client: bytes, entries: list[Entry], deadline: float,
                 nbytes: int) -> None:
        self.kind = kind
        self.client = client
        self.entries = entries
        self.deadline = deadline
        self.nbytes = nbytes


class _ClientState:
    __slots__ = ("pending_bytes", "pinned_bytes", "grants")

    def __init__(self) -> None:
        self.pending_bytes = 0
        self.pinned_bytes = 0
        self.grants = 0


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
        self._grants: dict[tuple[bytes, int], _Grant] = {}
        self._leases: deque[tuple[float, tuple[bytes, int]]] = deque()
        self._clients: dict[bytes, _ClientState] = {}
        self._pending = 0           # entries in state PENDING
        self._dead: set[Entry] = set()   # replaced/deleted while pinned
        self._pinned_entries = 0    # entries with pins > 0
        self._pins = 0              # total pins
        self.max_value = self.config.limits.max_value_bytes or pool.size
        # Called with each entry about to be evicted (an SSD tier spills it); the entry's
        # blocks are freed after the hook returns.
        self.evict_hook: Callable[[Entry], None] | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "evictions", "evicted_bytes", "bytes_in", "bytes_out",
             "puts", "gets", "commits", "aborts", "lease_expired_writes",
             "lease_expired_pins", "deletes", "purged", "pool_full", "too_large",
             "invalid_keys", "quota_refusals"), 0)

    # ------------------------------------------------------------------ helpers

    def _client(self, client: bytes) -> _ClientState:
        st = self._clients.get(client)
        if st is None:
            st = self._clients[client] = _ClientState()
        return st

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
        self.alloc.free(e.start, e.nblocks)
        e.state = DEAD
        e.start = -1

    def _retire(self, e: Entry) -> None:
        """A live entry left the index: free it now, or when its last pin goes."""
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

    def _allocate(self, nblocks_list: list[int]) -> list[int]:
        """Allocate runs, evicting LRU entries as needed; -1 where nothing more can go."""
        starts = self.alloc.alloc_many(nblocks_list) if nblocks_list else []
        for i, s in enumerate(starts):
            if s >= 0:
                continue
            n = nblocks_list[i]
            while True:
                s = self.alloc.alloc(n)
                if s >= 0 or not self._evict_one():
                    break
            starts[i] = s
        return starts

    def _new_entries(self, keys: Sequence[Any], sizes: Sequence[Any],
                     sums: Sequence[Any] | None, pending_budget: int | None
                     ) -> tuple[list[Entry | None], list[int]]:
        """Validate and allocate one entry per key; statuses per key."""
        n = len(keys)
        statuses: list[int] = [Status.OK] * n
        want: list[int] = []
        want_idx: list[int] = []
        budget = pending_budget
        for i in range(n):
            st: int = self._check_key(keys[i])
            size = sizes[i]
            if st != Status.OK:
                self.counters["invalid_keys"] += 1
            elif type(size) is not int or size < 0:
                st = Status.INVALID_REQUEST
            elif size > self.max_value:
                st = Status.TOO_LARGE
                self.counters["too_large"] += 1
            elif budget is not None:
                if size > budget:
                    st = Status.QUOTA_EXCEEDED
                    self.counters["quota_refusals"] += 1
                else:
                    budget -= size
            statuses[i] = st
            if st == Status.OK:
                want.append(self._nblocks(size))
                want_idx.append(i)
        entries: list[Entry | None] = [None] * n
        starts = self._allocate(want)
        for j, i in enumerate(want_idx):
            s = starts[j]
            if s < 0:
                statuses[i] = Status.POOL_FULL
                self.counters["pool_full"] += 1
                continue
            csum = sums[i] if sums is not None else None
            entries[i] = Entry(keys[i], s, want[j], sizes[i],
                               csum if type(csum) is int else None)
        return entries, statuses

    def _install(self, e: Entry) -> None:
        old = self.index.insert(e)
        e.state = LIVE
        if old is not None:
            self._retire(old)

    def _add_grant(self, kind: int, client: bytes, req_id: int, entries: list[Entry],
                   nbytes: int) -> None:
        gkey = (client, req_id)
        prev = self._grants.get(gkey)
        if prev is not None:          # a reused request id: settle the old grant first
            self._settle(gkey, prev, commit=False)
        deadline = self._clock() + self.config.lease_timeout
        self._grants[gkey] = _Grant(kind, client, entries, deadline, nbytes)
        self._leases.append((deadline, gkey))
        st = self._client(client)
        st.grants += 1
        if kind == _ALLOC:
            st.pending_bytes += nbytes
        else:
            st.pinned_bytes += nbytes

    def _settle(self, gkey: tuple[bytes, int], g: _Grant, commit: bool) -> None:
        del self._grants[gkey]
        st = self._clients.get(g.client)
        if st is not None:
            st.grants -= 1
            if g.kind == _ALLOC:
                st.pending_bytes -= g.nbytes
            else:
                st.pinned_bytes -= g.nbytes
            if st.grants == 0:
                del self._clients[g.client]
        if g.kind == _ALLOC:
            for e in g.entries:
                self._pending -= 1
                if commit:
                    self._install(e)
                else:
                    self._free(e)
        else:
            for e in g.entries:
                self._unpin(e)

    # ------------------------------------------------------------------ write path

    def alloc_entries(self, client: bytes, req_id: int, keys: Sequence[Any],
                      sizes: Sequence[Any], sums: Sequence[Any] | None = None
                      ) -> tuple[list[int], list[int]]:
        """ALLOC: reserve blocks for each key as a pending entry.

        Returns
        -------
        offsets : list of int
            Byte offset in the pool per key, -1 where refused.
        statuses : list of Status
            OK, INVALID_KEY, INVALID_REQUEST, TOO_LARGE, POOL_FULL or QUOTA_EXCEEDED.
        """
        budget = None
        if self.config.max_client_pending_bytes:
            st = self._clients.get(client)
            used = st.pending_bytes if st else 0
            budget = max(0, self.config.max_client_pending_bytes - used)
        entries, statuses = self._new_entries(keys, sizes, sums, budget)
        granted = [e for e in entries if e is not None]
        bs = self.block_size
        offsets = [e.start * bs if e is not None else -1 for e in entries]
        if granted:
            self._pending += len(granted)
            self._add_grant(_ALLOC, client, req_id, granted, sum(e.size for e in granted))
        return offsets, statuses

    def commit(self, client: bytes, req_ids: Sequence[int]) -> list[int]:
        """COMMIT: make the pending entries of these ALLOC grants visible.

        Returns the request ids whose grant no longer exists (lease expired, or unknown).
        """
        failed = []
        for rid in req_ids:
            gkey = (client, rid)
            g = self._grants.get(gkey)
            if g is None or g.kind != _ALLOC:
                failed.append(rid)
                continue
            self._settle(gkey, g, commit=True)
            self.counters["commits"] += 1
            self.counters["puts"] += len(g.entries)
            self.counters["bytes_in"] += g.nbytes
        return failed

    def abort(self, client: bytes, req_ids: Sequence[int]) -> None:
        """Free the pending entries of these ALLOC grants (a failed or cancelled write)."""
        for rid in req_ids:
            gkey = (client, rid)
            g = self._grants.get(gkey)
            if g is not None and g.kind == _ALLOC:
                self._settle(gkey, g, commit=False)
                self.counters["aborts"] += 1

    def put(self, keys: Sequence[Any], values: Sequence[Any],
            sums: Sequence[Any] | None = None) -> list[int]:
        """PUT (TCP mover): allocate, copy ``values`` (buffers) into the pool, commit.

        Returns a Status per key.
        """
        sizes = [memoryview(v).nbytes for v in values]
        entries, statuses = self._new_entries(keys, sizes, sums, None)
        ok = [e for e in entries if e is not None]
        if ok:
            bs = self.block_size
            self.pool.write_many([e.start * bs for e in ok],
                                 [values[i] for i, e in enumerate(entries) if e is not None])
            for e in ok:
                self._install(e)
            self.counters["puts"] += len(ok)
            self.counters["bytes_in"] += sum(e.size for e in ok)
        return statuses

    # ------------------------------------------------------------------ read path

    def lookup(self, client: bytes, req_id: int, keys: Sequence[Any]
               ) -> tuple[list[int], list[int], list[int | None]]:
        """LOOKUP: pin each hit and refresh its LRU position.

        Returns
        -------
        offsets, sizes : list of int
            -1 for a miss; a size of ``QUOTA_REFUSED`` (-2) for a key that is present but
            would take the client over ``max_client_pinned_bytes`` (not pinned).
        checksums : list of int or None
        """
        n = len(keys)
        offsets = [-1] * n
        sizes = [-1] * n
        sums: list[int | None] = [None] * n
        pinned: list[Entry] = []
        d = self.index.mapping
        bs = self.block_size
        nbytes = 0
        limit = self.config.max_client_pinned_bytes
        if limit:
            st = self._clients.get(client)
            budget = limit - (st.pinned_bytes if st else 0)
        for i in range(n):
            k = keys[i]
            e = d.get(k) if type(k) is bytes else None
            if e is None:
                continue
            if limit and e.size > budget - nbytes:
                self.counters["quota_refusals"] += 1
                sizes[i] = QUOTA_REFUSED     # present, but over this client's pin limit
                continue
            d.move_to_end(k)
            self._pin(e)
            pinned.append(e)
            nbytes += e.size
            offsets[i] = e.start * bs
            sizes[i] = e.size
            sums[i] = e.checksum
        hits = len(pinned)
        self.counters["hits"] += hits
        self.counters["misses"] += n - hits
        if pinned:
            self._add_grant(_PIN, client, req_id, pinned, nbytes)
            self.counters["gets"] += hits
            self.counters["bytes_out"] += nbytes
        return offsets, sizes, sums

    def release(self, client: bytes, req_ids: Sequence[int]) -> None:
        """RELEASE: drop the pins of these LOOKUP grants."""
        for rid in req_ids:
            gkey = (client, rid)
            g = self._grants.get(gkey)
            if g is not None and g.kind == _PIN:
                self._settle(gkey, g, commit=False)

    def pin_for_send(self, keys: Sequence[Any]) -> tuple[list[Entry | None], list[int | None]]:
        """GET (TCP mover): pin the hits so their bytes can be sent without a copy.

        The caller unpins each entry with :meth:`unpin` once its frame is sent.
        Returns the entry per key (None for a miss) and its checksum.
        """
        d = self.index.mapping
        out: list[Entry | None] = []
        sums: list[int | None] = []
        hits = nbytes = 0
        for k in keys:
            e = d.get(k) if type(k) is bytes else None
            if e is not None:
                d.move_to_end(k)
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

    def unpin(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            self._unpin(e)

    def view(self, e: Entry) -> memoryview:
        """A read-only view of a pinned entry's bytes."""
        return self.pool.view(e.start * self.block_size, e.size, readonly=True)

    # ------------------------------------------------------------------ queries

    def exists(self, keys: Sequence[Any]) -> list[bool]:
        d = self.index.mapping
        try:
            return [k in d for k in keys]
        except TypeError:   # an unhashable key from a malformed request: a miss
            return [type(k) is bytes and k in d for k in keys]

    def match_prefix(self, keys: Sequence[Any]) -> int:
        """How many leading keys are present (committed)."""
        d = self.index.mapping
        n = 0
        for k in keys:
            if type(k) is not bytes or k not in d:
                break
            n += 1
        return n

    def delete(self, keys: Sequence[Any]) -> int:
        """Remove keys; pinned entries stay readable by their pin holders. Returns removed."""
        n = 0
        for k in keys:
            e = self.index.remove(k) if type(k) is bytes else None
            if e is not None:
                self._retire(e)
                n += 1
        self.counters["deletes"] += n
        return n

    def evict(self, to_ratio: float) -> int:
        """Evict LRU entries until used blocks <= ``to_ratio`` of the pool. Returns count."""
        target = int(self.alloc.num_blocks * to_ratio)
        n = 0
        while self.alloc.num_used > target and self._evict_one():
            n += 1
        return n

    def periodic_evict(self, min_ratio: float, max_ratio: float) -> int:
        """When usage passes ``max_ratio``, evict down to ``min_ratio``."""
        if self.alloc.num_used > self.alloc.num_blocks * max_ratio:
            return self.evict(min_ratio)
        return 0

    def purge(self) -> int:
        """Remove every committed entry (pending writes are kept). Returns count."""
        entries = self.index.clear()
        for e in entries:
            self._retire(e)
        self.counters["purged"] += len(entries)
        return len(entries)

    # ------------------------------------------------------------------ leases

    def expire(self, now: float | None = None) -> float | None:
        """Reclaim grants whose lease ran out. Returns the next deadline, or None."""
        if now is None:
            now = self._clock()
        leases = self._leases
        while leases:
            deadline, gkey = leases[0]
            g = self._grants.get(gkey)
            if g is None or g.deadline != deadline:
                leases.popleft()          # settled already (or re-granted later)
                continue
            if deadline > now:
                return deadline
            leases.popleft()
            if g.kind == _ALLOC:
                self.counters["lease_expired_writes"] += 1
                log.warning("lease expired: pending write of %d entries from client %s "
                            "reclaimed", len(g.entries), g.client.hex())
            else:
                self.counters["lease_expired_pins"] += 1
                log.info("lease expired: %d pins of client %s dropped",
                         len(g.entries), g.client.hex())
            self._settle(gkey, g, commit=False)
        return None

    def drop_client(self, client: bytes) -> None:
        """Settle every grant of a client now (it is known to be gone)."""
        for gkey in [k for k, g in self._grants.items() if g.client == client]:
            self._settle(gkey, self._grants[gkey], commit=False)

    # ------------------------------------------------------------------ stats

    @property
    def used_bytes(self) -> int:
        return self.alloc.num_used * self.block_size

    def stats(self, verify: bool = False) -> dict[str, Any]:
        """Counters and gauges. ``verify`` adds an accounting check (O(entries)).

        Keys (all ints unless noted): used_bytes, capacity_bytes, num_keys, pending,
        pinned (entries with a pin), pins (total pins), dead (replaced but still
        pinned), block_size, num_blocks, free_blocks, largest_free_run (blocks),
        usage (float 0..1), clients (with open grants) and the counters: hits, misses,
        evictions, evicted_bytes, bytes_in, bytes_out, puts, gets, commits, aborts,
        lease_expired_writes, lease_expired_pins, deletes, purged, pool_full, too_large,
        invalid_keys, quota_refusals. With ``verify``: entry_blocks (blocks held by live,
        pending and dead entries, counted one by one) and accounting_ok
        (entry_blocks == used blocks).
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
            "clients": len(self._clients),
            "grants": len(self._grants),
        }
        s.update(self.counters)
        if verify:
            blocks = sum(e.nblocks for e in self.index.lru())
            blocks += sum(e.nblocks for g in self._grants.values() if g.kind == _ALLOC
                          for e in g.entries)
            blocks += sum(e.nblocks for e in self._dead)
            s["entry_blocks"] = blocks
            s["accounting_ok"] = blocks == a.num_used
        return s
