"""Type stubs of the compiled block allocator (kvshm/_bitmap.pyx)."""

from collections.abc import Iterable, Sequence

from typing_extensions import Buffer, final

#: Most runs one ``alloc_extents`` call may return.
MAX_RUNS: int

@final
class BitmapAllocator:
    """Allocate runs of contiguous blocks out of ``num_blocks`` (first fit).

    Raises ValueError when ``num_blocks`` < 1, MemoryError when the bitmap cannot be
    allocated. Not thread-safe.
    """

    def __init__(self, num_blocks: int) -> None: ...
    def alloc(self, n: int) -> int:
        """Start block of a new run of ``n`` blocks, or -1 if none fits.

        ValueError when ``n`` < 1."""
    def alloc_many(self, counts: Iterable[int] | Buffer) -> list[int]:
        """One run per count (a sequence of int, or an int64 buffer); -1 for a run that
        did not fit, the others stay allocated. ValueError for a count < 1 (checked before
        anything is allocated)."""
    def alloc_runs(self, counts: Buffer, out: Buffer) -> int:
        """alloc_many into an int64 buffer (-1 where a run did not fit); returns how many
        did not fit."""
    def free_runs(self, starts: Buffer, counts: Buffer) -> None:
        """Free runs given as int64 buffers; ValueError (nothing freed) as free_extents."""
    def alloc_extents(self, n: int, max_extents: int = 8) -> tuple[tuple[int, int], ...] | None:
        """``n`` blocks as ``(first block, count)`` runs in block order: one run by first
        fit if one holds them, else the fewest runs (the longest free runs whole, then
        the shortest run that holds the rest); None when more than ``max_extents`` runs
        would be needed (nothing allocated). ValueError when ``n`` < 1 or
        ``max_extents`` is outside 1..64."""
    def free_extents(self, extents: Sequence[tuple[int, int]]) -> None:
        """Free every run of ``extents``; ValueError (nothing freed) when a run is out of
        range, not all allocated, or overlaps another."""
    def free_map(self) -> bytearray:
        """``num_blocks`` flags, 1 where the block is free."""
    def alloc_at(self, start: int, n: int) -> None:
        """Allocate exactly blocks [start, start + n); ValueError when out of range or a
        block in it is allocated."""
    def free(self, start: int, n: int) -> None:
        """Free blocks [start, start + n); ValueError when out of range or a block in it is
        not allocated (double free); nothing is freed then."""
    def is_free(self, start: int, n: int = 1) -> bool:
        """True when every block of [start, start + n) is free; ValueError out of range."""
    def reset(self) -> None:
        """Free every block."""
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    @property
    def largest_free_run(self) -> int:
        """Length in blocks of the longest free run (a scan: O(num_blocks / 64))."""
    def __len__(self) -> int: ...
