"""Entries and the key index: key -> entry, in LRU order.

The index is the only structure that knows which keys are visible. It sits behind this
narrow interface (get / insert / remove / iterate from the LRU end). With a shared table
attached (:meth:`Index.attach_shared`, a :class:`kvshm._shmindex.IndexWriter`), every
entry that becomes live is published there for same-host readers, and every entry that
leaves is unpublished before the call returns, so before its blocks can be freed or
reused (docs/DESIGN.md, "Same-host reads without a round trip"). The reads those readers
record are applied (:meth:`Index.sync`) before every LRU decision.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterator

__all__ = ["Entry", "Index", "PENDING", "LIVE", "DEAD", "MAX_EXTENTS"]

#: Allocated, bytes being written, invisible to readers.
PENDING = 0
#: Committed and visible.
LIVE = 1
#: Replaced or deleted while pinned: invisible, blocks freed when the last pin goes.
DEAD = 2

#: Most block runs one value may be laid over (``Entry.extents``).
MAX_EXTENTS = 8


class Entry:
    """One value: ``nblocks`` blocks in one or more runs (``extents``).

    Attributes
    ----------
    key : bytes
    extents : tuple of (int, int)
        ``(first block, block count)`` of each run, in the order the value's bytes are
        laid (a run's byte offset in the pool is ``first * block_size``); one run in
        the common case, at most :data:`MAX_EXTENTS`; ``()`` once freed.
    start : int
        First block of the first run (-1 once freed).
    nblocks : int
        Blocks held in all, ``max(1, ceil(size / block_size))``.
    size : int
        Value length in bytes.
    pins : int
        Readers holding the entry; a pinned entry is never evicted or reused.
    state : int
        PENDING, LIVE or DEAD.
    checksum : int or None
        xxh64 of the value when the writer asked for end-to-end checksums.
    """

    __slots__ = ("key", "start", "nblocks", "size", "pins", "state", "checksum", "meta",
                 "extents")

    def __init__(self, key: bytes, start: int, nblocks: int, size: int,
                 checksum: int | None = None,
                 extents: tuple[tuple[int, int], ...] | None = None) -> None:
        self.key = key
        self.start = start
        self.nblocks = nblocks
        self.extents = ((start, nblocks),) if extents is None else extents
        self.size = size
        self.pins = 0
        self.state = PENDING
        self.checksum = checksum
        self.meta: object = None   # opaque per-entry data of a tier (e.g. SSD location)

    def __repr__(self) -> str:
        state = ("pending", "live", "dead")[self.state]
        runs = ",".join(f"{s}+{n}" for s, n in self.extents) or "-"
        return (f"<Entry {self.key!r} blocks={runs} size={self.size} "
                f"pins={self.pins} {state}>")

    def byte_extents(self, block_size: int) -> list[list[int]]:
        """``[[offset, length], ...]`` in the pool, covering exactly ``size`` bytes (the
        last run's tail past the value is left out; a value of 0 bytes: one [offset, 0])."""
        out = []
        left = self.size
        for s, n in self.extents:
            k = min(left, n * block_size)
            out.append([s * block_size, k])
            left -= k
        return out


def _runs(e: Entry) -> tuple[tuple[int, int], ...]:
    runs = getattr(e, "extents", None)
    return runs if runs else ((e.start, e.nblocks),)


class Index:
    """Committed entries by key, least recently used first."""

    __slots__ = ("_d", "_shared", "on_read")

    def __init__(self) -> None:
        self._d: OrderedDict[bytes, Entry] = OrderedDict()
        self._shared: Any = None
        #: Called with each entry a lock-free read touched (the store's tier order).
        self.on_read: Callable[[Entry], Any] | None = None

    # ------------------------------------------------------------ shared table

    def attach_shared(self, table: Any) -> None:
        """Publish into ``table`` (a :class:`kvshm._shmindex.IndexWriter`) from now on;
        the entries live now are published at once."""
        self._shared = table
        for e in self._d.values():
            table.publish(e.key, e.size, _runs(e), e.checksum)

    def detach_shared(self) -> None:
        """Stop publishing (the server is closing the table)."""
        self._shared = None

    @property
    def shared(self) -> Any:
        """The attached shared table, or None."""
        return self._shared

    def sync(self) -> None:
        """Apply the lock-free reads recorded since the last call, in their global order
        (each makes its key most recently used, if its entry is still the one read).
        Called before every LRU decision and before the store's own LRU touches."""
        t = self._shared
        if t is not None:
            d = self._d
            on_read = self.on_read
            for k in t.drain():
                e = d.get(k)
                if e is not None:
                    d.move_to_end(k)
                    if on_read is not None:
                        on_read(e)

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

        Returns the entry it replaced, if any (the caller retires it). The caller
        applies the lock-free reads recorded before the write first (:meth:`sync`, once
        per request, not per key): they happened before it, so they must not end up more
        recent than its keys (without that, a put into free blocks, which evicts
        nothing, left them to the next eviction: the store departed from exact LRU).
        """
        old = self._d.pop(entry.key, None)
        self._d[entry.key] = entry
        if self._shared is not None:
            # in place of the old entry's slot: its readers notice before it is freed
            self._shared.publish(entry.key, entry.size, _runs(entry), entry.checksum)
        return old

    def remove(self, key: bytes) -> Entry | None:
        e = self._d.pop(key, None)
        if e is not None and self._shared is not None:
            self._shared.unpublish(key)
        return e

    def relocate(self, entry: Entry, extents: tuple[tuple[int, int], ...]) -> None:
        """Live ``entry`` now lies in ``extents`` (its bytes were copied there; the old
        blocks are freed after this returns). Keeps its LRU position. The one place a
        visible entry's location changes."""
        entry.extents = extents
        entry.start = extents[0][0]
        if self._shared is not None and self._d.get(entry.key) is entry:
            # reads of it recorded so far were of the old slot version: apply them now,
            # the ring would drop them once the version changes
            self.sync()
            # Re-published in place: the slot's version changes, so a lock-free reader
            # that copied from the old runs retries; the old blocks are freed only after.
            self._shared.publish(entry.key, entry.size, _runs(entry), entry.checksum)

    def lru(self) -> Iterator[Entry]:
        """Entries from least to most recently used (do not mutate while iterating)."""
        self.sync()
        return iter(self._d.values())

    def oldest_unpinned(self) -> Entry | None:
        """The least recently used entry without pins, or None.

        Pinned entries met at the old end are moved to the young end on the way (they
        are being read, and a reader that holds pins long must not make every eviction
        scan past them again): amortized O(1) per call, however many pins there are.
        """
        self.sync()
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
        if self._shared is not None:
            self._shared.clear()
        return entries

    @property
    def mapping(self) -> "OrderedDict[bytes, Entry]":
        """The underlying ordered dict, for read-only bulk membership tests."""
        return self._d
