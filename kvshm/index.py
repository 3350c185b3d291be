"""Entries and the key index: key -> entry, in LRU order.

The index is the only structure that knows which keys are visible. It sits behind this
narrow interface (get / insert / remove / iterate from the LRU end) so that it can later
move into the shared segment for same-host reads without a round trip (docs/DESIGN.md,
"Where speed comes from").
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

__all__ = ["Entry", "Index", "PENDING", "LIVE", "DEAD"]

#: Allocated, bytes being written, invisible to readers.
PENDING = 0
#: Committed and visible.
LIVE = 1
#: Replaced or deleted while pinned: invisible, blocks freed when the last pin goes.
DEAD = 2


class Entry:
    """One value: ``nblocks`` contiguous blocks from block ``start``.

    Attributes
    ----------
    key : bytes
    start : int
        First block index; the byte offset in the pool is ``start * block_size``.
    nblocks : int
        Blocks held, ``max(1, ceil(size / block_size))``.
    size : int
        Value length in bytes.
    pins : int
        Readers holding the entry; a pinned entry is never evicted or reused.
    state : int
        PENDING, LIVE or DEAD.
    checksum : int or None
        xxh64 of the value when the writer asked for end-to-end checksums.
    """

    __slots__ = ("key", "start", "nblocks", "size", "pins", "state", "checksum", "meta")

    def __init__(self, key: bytes, start: int, nblocks: int, size: int,
                 checksum: int | None = None) -> None:
        self.key = key
        self.start = start
        self.nblocks = nblocks
        self.size = size
        self.pins = 0
        self.state = PENDING
        self.checksum = checksum
        self.meta: object = None   # opaque per-entry data of a tier (e.g. SSD location)

    def __repr__(self) -> str:
        state = ("pending", "live", "dead")[self.state]
        return (f"<Entry {self.key!r} blocks={self.start}+{self.nblocks} size={self.size} "
                f"pins={self.pins} {state}>")


class Index:
    """Committed entries by key, least recently used first."""

    __slots__ = ("_d",)

    def __init__(self) -> None:
        self._d: OrderedDict[bytes, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def get(self, key: bytes) -> Entry | None:
        """The live entry of ``key`` or None; does not touch the LRU order."""
        return self._d.get(key)

    def touch(self, key: bytes) -> None:
        """Mark ``key`` most recently used."""
        self._d.move_to_end(key)

    def insert(self, entry: Entry) -> Entry | None:
        """Make ``entry`` the live, most recently used entry of its key.

        Returns the entry it replaced, if any (the caller retires it).
        """
        old = self._d.pop(entry.key, None)
        self._d[entry.key] = entry
        return old

    def remove(self, key: bytes) -> Entry | None:
        return self._d.pop(key, None)

    def lru(self) -> Iterator[Entry]:
        """Entries from least to most recently used (do not mutate while iterating)."""
        return iter(self._d.values())

    def oldest_unpinned(self) -> Entry | None:
        """The least recently used entry without pins, or None.

        Pinned entries met at the old end are moved to the young end on the way (they
        are being read, and a reader that holds pins long must not make every eviction
        scan past them again): amortized O(1) per call, however many pins there are.
        """
        d = self._d
        for _ in range(len(d)):
            e = next(iter(d.values()))
            if e.pins == 0:
                return e
            d.move_to_end(e.key)
        return None

    def keys(self) -> Iterator[bytes]:
        return iter(self._d.keys())

    def clear(self) -> list[Entry]:
        entries = list(self._d.values())
        self._d.clear()
        return entries

    @property
    def mapping(self) -> "OrderedDict[bytes, Entry]":
        """The underlying ordered dict, for read-only bulk membership tests."""
        return self._d
