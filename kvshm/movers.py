"""Client-side movers: what copies the bytes once the control protocol placed them.

A *one-sided* mover writes and reads the server's pool at the offsets ALLOC and LOOKUP
return: :class:`ShmMover` by memcpy into the mapped segment (same host), the RDMA mover
(``kvshm.rdma``) by RDMA WRITE/READ against the pool's memory region. The TCP mover has
no class: its bytes travel in the PUT and GET messages themselves.

Every mover method takes lists of equal length and raises
:class:`~kvshm.errors.TransportError` (or IndexError/ValueError for a bad range) naming
what failed.

A value may lie in several runs of blocks: ALLOC and LOOKUP then answer its byte
extents ``[[offset, length], ...]`` instead of one offset. :func:`placed` gives each such
value a *virtual* offset (above any pool offset) and wraps the mover in an
:class:`ExtentMover`, which cuts every range it is given at the runs' edges and hands the
pieces to the real mover: sources and sinks (kvshm.paged, the integrations) address a
value as one range, whatever its layout; the shm mover copies the pieces in one call
with the GIL released, the RDMA mover plans its work requests over them.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from typing import Any, Iterator, Protocol, Sequence

from kvshm._buffers import byte_view
from kvshm._pool import PackedValues, Pool

__all__ = ["OneSidedMover", "ShmMover", "ExtentMover", "Layout", "placed", "VIRTUAL_BASE"]

#: Virtual offsets of values laid over several runs start here (far above any pool).
VIRTUAL_BASE = 1 << 56


class OneSidedMover(Protocol):
    """What the client needs from a mover that reaches the pool directly."""

    name: str

    def write(self, offsets: Sequence[int], values: Sequence[Any],
              keys: Sequence[bytes]) -> None:
        """Copy each ``values[i]`` (a byte view) to pool ``offsets[i]``."""

    def read_into(self, offsets: Sequence[int], sizes: Sequence[int], outs: Sequence[Any],
                  keys: Sequence[bytes]) -> None:
        """Copy ``sizes[i]`` bytes from pool ``offsets[i]`` into ``outs[i]``."""

    def read_bytes(self, offsets: Sequence[int], sizes: Sequence[int],
                   keys: Sequence[bytes]) -> list[bytes]:
        """New bytes objects of the given ranges."""

    def close(self) -> None:
        """Release the mover's resources; waits for copies in flight."""


class ShmMover:
    """Copies through the server's segment mapped in this process (same host).

    Copies of several threads run at once (the GIL is released); :meth:`close` waits for
    copies in flight before it unmaps, so a copy never touches unmapped memory.
    """

    name = "shm"

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._busy = 0
        self._cv = threading.Condition()
        self._closing = False

    def _enter(self) -> None:
        with self._cv:
            if self._closing:
                from kvshm.errors import ServerUnavailable

                raise ServerUnavailable("the server's segment was replaced; retry")
            self._busy += 1

    def _exit(self) -> None:
        with self._cv:
            self._busy -= 1
            if self._busy == 0 and self._closing:    # only close() ever waits
                self._cv.notify_all()

    def begin(self) -> Pool:
        """Count a copy of the caller's own as in flight (as :meth:`copying`, without
        a context manager: the write-behind put's hot path); :meth:`end` after it.
        Raises ServerUnavailable once the mover is closing."""
        self._enter()
        return self.pool

    def end(self) -> None:
        self._exit()

    @contextlib.contextmanager
    def copying(self) -> Iterator[Pool]:
        """The pool, for a copy of the caller's own (``Pool.scatter``/``gather`` of KV
        pages, a CUDA copy): counted as in flight, so :meth:`close` waits for it."""
        self._enter()
        try:
            yield self.pool
        finally:
            self._exit()

    def write(self, offsets: Sequence[int], values: Sequence[Any],
              keys: Sequence[bytes]) -> None:
        """Copy ``values[i]`` to pool ``offsets[i]``. ``values`` may also be a
        :class:`~kvshm._pool.PackedValues` (kvshm.client ``_Packed``), one offset per
        value, -1 for a value not written (``Pool.write_values``)."""
        self._enter()
        try:
            if type(values) is PackedValues:
                self.pool.write_values(offsets, values)
                return
            self.pool.write_many(offsets, values)
        finally:
            self._exit()

    def read_into(self, offsets: Sequence[int], sizes: Sequence[int], outs: Sequence[Any],
                  keys: Sequence[bytes]) -> None:
        self._enter()
        try:
            self.pool.read_many_into(offsets, outs, sizes)
        finally:
            self._exit()

    def read_bytes(self, offsets: Sequence[int], sizes: Sequence[int],
                   keys: Sequence[bytes]) -> list[bytes]:
        self._enter()
        try:
            return list(self.pool.read_bytes_many(offsets, sizes))
        finally:
            self._exit()

    def close(self) -> None:
        with self._cv:
            self._closing = True
            while self._busy:
                self._cv.wait()
        self.pool.close()


class Layout:
    """The values of one request that lie in several runs, behind virtual offsets.

    :meth:`add` takes a value's byte extents and returns the offset that stands for
    it; :meth:`pieces` turns a range at such an offset into pool ranges.
    """

    __slots__ = ("_bases", "_ends", "_runs")

    def __init__(self) -> None:
        self._bases: list[int] = []                 # virtual offset of each value
        self._ends: list[int] = []
        self._runs: list[list[tuple[int, int]]] = []

    def __bool__(self) -> bool:
        return bool(self._bases)

    def add(self, extents: Sequence[Sequence[int]]) -> int:
        """The virtual offset of a value in ``extents`` (``[[offset, length], ...]``)."""
        runs = [(int(o), int(n)) for o, n in extents]
        base = self._ends[-1] if self._ends else VIRTUAL_BASE
        total = sum(n for _, n in runs)
        self._bases.append(base)
        self._ends.append(base + max(total, 1))
        self._runs.append(runs)
        return base

    def pieces(self, offset: int, size: int) -> list[tuple[int, int]]:
        """Pool ``(offset, length)`` ranges of ``size`` bytes from ``offset`` (a pool
        offset passes unchanged). IndexError outside the value it names."""
        if offset < VIRTUAL_BASE:
            return [(offset, size)]
        j = bisect.bisect_right(self._bases, offset) - 1
        if j < 0 or offset + size > self._ends[j]:
            raise IndexError(f"range [{offset}, {offset + size}) is outside its value")
        rel = offset - self._bases[j]
        out: list[tuple[int, int]] = []
        for o, n in self._runs[j]:
            if size <= 0:
                break
            if rel >= n:
                rel -= n
                continue
            k = min(n - rel, size)
            out.append((o + rel, k))
            size -= k
            rel = 0
        if size > 0:
            raise IndexError(f"range at {offset} runs past the end of its value")
        return out or [(self._runs[j][0][0], 0)]


def placed(mover: Any, offsets: Sequence[Any], layout: Layout) -> tuple[Any, list[int]]:
    """``(mover, offsets)`` for a reply's per-key places (an int offset, or byte extents
    of a value of several runs): the mover unchanged and the offsets as they are when
    every value lies in one run, else an :class:`ExtentMover` and virtual offsets."""
    if all(type(o) is int for o in offsets):
        return mover, list(offsets)
    out = [o if type(o) is int else layout.add(o) for o in offsets]
    return ExtentMover(mover, layout), out


class ExtentMover:
    """A mover whose offsets may name values of several runs (:class:`Layout`)."""

    def __init__(self, mover: Any, layout: Layout) -> None:
        self.mover = mover
        self.layout = layout
        self.name = mover.name

    def _cut(self, offsets: Sequence[int], bufs: Sequence[Any], sizes: Sequence[int],
             keys: Sequence[bytes], writable: bool
             ) -> tuple[list[int], list[Any], list[int], list[bytes]]:
        offs: list[int] = []
        views: list[Any] = []
        lens: list[int] = []
        ks: list[bytes] = []
        pieces = self.layout.pieces
        for o, b, n, k in zip(offsets, bufs, sizes, keys):
            if o < VIRTUAL_BASE:
                offs.append(o)
                views.append(b)
                lens.append(n)
                ks.append(k)
                continue
            v = byte_view(b, writable=writable, what=f"buffer for key {k!r}")
            if v.nbytes < n:
                raise ValueError(f"buffer for key {k!r} holds {v.nbytes} bytes; the value "
                                 f"is {n} bytes")
            pos = 0
            for po, pn in pieces(o, n):
                offs.append(po)
                views.append(v[pos:pos + pn])
                lens.append(pn)
                ks.append(k)
                pos += pn
        return offs, views, lens, ks

    def write(self, offsets: Sequence[int], values: Sequence[Any],
              keys: Sequence[bytes]) -> None:
        sizes = [byte_view(v).nbytes for v in values]
        offs, views, _, ks = self._cut(offsets, values, sizes, keys, False)
        self.mover.write(offs, views, ks)

    def read_into(self, offsets: Sequence[int], sizes: Sequence[int], outs: Sequence[Any],
                  keys: Sequence[bytes]) -> None:
        offs, views, lens, ks = self._cut(offsets, outs, sizes, keys, True)
        self.mover.read_into(offs, lens, views, ks)

    def read_bytes(self, offsets: Sequence[int], sizes: Sequence[int],
                   keys: Sequence[bytes]) -> list[bytes]:
        bufs = [bytearray(n) for n in sizes]
        self.read_into(offsets, sizes, bufs, keys)
        return [bytes(b) for b in bufs]

    def close(self) -> None:
        """Nothing of its own to release: the wrapped mover is the session's, closed
        by the session."""
