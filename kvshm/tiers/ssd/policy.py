"""Where each SSD entry lives, in which order, and what is dropped when room is needed.

Where an SSD entry lives (``SsdEntry.where``):

- ``ONLY``: the pool has no copy; a LOOKUP promotes it. Kept in LRU order (the order in
  which entries left the pool); the oldest is dropped when room is needed.
- ``MARGIN``: a copy of a pool entry written ahead of its eviction (the store's cleaner
  keeps the LRU end of the pool clean, so an eviction costs no I/O).
- ``HOT``: a copy of a pool entry that was read since (promoted from SSD, or touched).
  Dropped first, most recently used first, when room is needed: its pool entry will be
  the last to be evicted, and only becomes dirty again.

The SSD blocks of an entry are freed only when no job touches them (``SsdEntry.io``).
:class:`SsdPolicy` is the state and the rules; :class:`~kvshm.tiers.ssd.SsdTier` adds
the I/O and the store's interface. Everything here runs on the loop thread.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from kvshm.tiers.ssd.entry import DEAD, HOT, MARGIN, NOWHERE, ONLY, STORED, SsdEntry
from kvshm.tiers.ssd.files import SsdFile

__all__ = ["SsdPolicy", "COUNTERS"]

#: The tier's counters (``SsdTier.counters``, reported by ``stats()``).
COUNTERS = ("spills", "spill_bytes", "promotions", "promoted_bytes", "drops",
            "dropped_bytes", "shadow_drops", "checksum_failures", "io_errors", "stale",
            "refused", "manifest_writes", "manifest_errors", "loaded", "load_skipped")


class SsdPolicy:
    """The tier's maps (ONLY / MARGIN / HOT, each in LRU order), its accounting of blocks
    and bytes, and the rules that place and drop entries in the files ``files``."""

    def __init__(self, files: list[SsdFile]) -> None:
        self.files = files
        #: Called with a pool Entry whose SSD copy was dropped (it is dirty again).
        self.unshadow: Callable[[Any], None] | None = None
        self._only: OrderedDict[bytes, SsdEntry] = OrderedDict()
        self._margin: OrderedDict[bytes, SsdEntry] = OrderedDict()
        self._hot: OrderedDict[bytes, SsdEntry] = OrderedDict()
        self._held: set[SsdEntry] = set()      # every entry whose blocks are allocated
        self.stored_bytes = 0                  # value bytes of STORED entries
        self.margin_bytes = 0                  # value bytes in MARGIN
        self.reads_in_flight = 0
        self._next_file = 0
        self._manifest_dirty = False
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # ------------------------------------------------------------------ maps

    def _put(self, se: SsdEntry, where: int) -> None:
        se.where = where
        if where == ONLY:
            self._only[se.key] = se
        elif where == MARGIN:
            self._margin[se.key] = se
            self.margin_bytes += se.size
        else:
            self._hot[se.key] = se
        if se.state == STORED:
            self.stored_bytes += se.size
        self._manifest_dirty = True

    def _take(self, se: SsdEntry) -> None:
        """Remove a STORED entry from its map (the caller re-files or kills it)."""
        w = se.where
        if w == ONLY:
            del self._only[se.key]
        elif w == MARGIN:
            del self._margin[se.key]
            self.margin_bytes -= se.size
        elif w == HOT:
            del self._hot[se.key]
        else:
            return
        se.where = NOWHERE
        self.stored_bytes -= se.size
        self._manifest_dirty = True

    def _kill(self, se: SsdEntry) -> None:
        """Mark dead; free the blocks now, or when the last job on them finishes."""
        self._take(se)
        se.state = DEAD
        se.owner = None
        if se.io == 0:
            self._free(se)

    def _free(self, se: SsdEntry) -> None:
        if se in self._held:
            self._held.discard(se)
            f = self.files[se.file]
            f.alloc.free(se.start, se.nblocks)
            f.entries -= se.nblocks

    def _unshadow(self, se: SsdEntry) -> None:
        owner = se.owner
        self._kill(se)
        if owner is not None and owner.meta is se:
            owner.meta = None
            if self.unshadow is not None:
                self.unshadow(owner)

    def _drop_only(self, se: SsdEntry, count: bool = True) -> None:
        if count:
            self.counters["drops"] += 1
            self.counters["dropped_bytes"] += se.size
        self._kill(se)

    def _make_room(self) -> bool | None:
        """Drop one entry to free blocks: a HOT copy (most recently used first), else the
        least recently used SSD-only entry not being read. None: not now (entries being
        promoted become HOT copies, droppable, when their reads complete: dropping an
        SSD-only entry instead would lose data an exact LRU keeps). False: nothing."""
        if self._hot:
            se = next(reversed(self._hot.values()))
            self.counters["shadow_drops"] += 1
            self._unshadow(se)
            return True
        if self.reads_in_flight:
            return None
        for se in self._only.values():
            if se.io == 0:
                self._drop_only(se)
                return True
        return False

    def _alloc(self, nblocks: int) -> tuple[int, int] | None | bool:
        """(file, start) of a new run; None: not now (see _make_room); False: never."""
        files = [f for f in self.files if not f.disabled]
        if not files or nblocks > max(f.nblocks for f in files):
            return False
        k = len(files)
        while True:
            for j in range(k):
                f = files[(self._next_file + j) % k]
                s = f.alloc.alloc(nblocks)
                if s >= 0:
                    self._next_file = (self._next_file + j) % k
                    f.entries += nblocks
                    return f.index, s
            r = self._make_room()
            if not r:
                return r


    def _restore(self, records: list[Any], block_size: int) -> None:
        """Put the manifest's ``records`` back as SSD-only entries (a record out of range
        or of a bad type is skipped and counted)."""
        bs = block_size
        for rec in records:
            try:
                key, fi, start, size, csum = rec
                f = self.files[fi]
                nblocks = max(1, -(-size // bs))
                if type(key) is not bytes or start < 0 or start + nblocks > f.nblocks:
                    raise ValueError("out of range")
                f.alloc.alloc_at(start, nblocks)
            except (ValueError, TypeError, IndexError):
                self.counters["load_skipped"] += 1
                continue
            if key in self._only:     # a duplicate key: keep the later (newer) record
                self._drop_only(self._only[key], count=False)
            se = SsdEntry(key, fi, start, nblocks, size, csum, STORED)
            f.entries += nblocks
            self._held.add(se)
            self._put(se, ONLY)
            self.counters["loaded"] += 1
        self._manifest_dirty = False

    def _snapshot(self) -> list[tuple[bytes, int, int, int, int]]:
        """The STORED entries, least recently used first (the manifest's records)."""
        return [(se.key, se.file, se.start, se.size, se.checksum)
                for d in (self._only, self._margin, self._hot) for se in d.values()]

    def _drop_file(self, f: SsdFile) -> int:
        """Drop every stored entry of file ``f`` (it is no longer usable); entries being
        written to it die when their write completes. Returns how many were dropped."""
        lost = 0
        for d in (self._only, self._margin, self._hot):
            for se in [s for s in d.values() if s.file == f.index]:
                lost += 1
                if se.where == ONLY:
                    self._drop_only(se)
                else:
                    self._unshadow(se)
        return lost
