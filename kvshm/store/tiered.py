"""Coordination with a tier below the pool (mixed into :class:`kvshm.store.Store`):
spills of dirty entries, demotion on eviction, promotion of a read key back into the pool,
the cleaner. The tier is reached only through the interface of :mod:`kvshm.tiers.api`;
the store never sees a file or a concrete tier."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

from kvshm.index import LIVE, Entry
from kvshm.store.holds import ReadHold, _Promotion
from kvshm.store.parts import _StoreParts
from kvshm.store.space import _EVICTED, _NOTHING, _WAIT
from kvshm.tiers.api import MAX_JOB_BYTES, SPILL_BUSY, SPILL_REFUSED, SPILL_STARTED, WRITING

__all__ = ["ReadHold"]

log = logging.getLogger("kvshm.store")

#: Dirty entries an eviction may pass over (write queue full) looking for a clean one.
_SCAN_LIMIT = 64


class _Tiered(_StoreParts):
    """The pool's side of a tier below it."""

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
            self.index.sync()       # lock-free reads recorded before it go first
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
