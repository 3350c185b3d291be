"""Client-side movers: what copies the bytes once the control protocol placed them.

A *one-sided* mover writes and reads the server's pool at the offsets ALLOC and LOOKUP
return: :class:`ShmMover` by memcpy into the mapped segment (same host), the RDMA mover
(``kvshm.rdma``) by RDMA WRITE/READ against the pool's memory region. The TCP mover has
no class: its bytes travel in the PUT and GET messages themselves.

Every mover method takes lists of equal length and raises
:class:`~kvshm.errors.TransportError` (or IndexError/ValueError for a bad range) naming
what failed.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Protocol, Sequence

from kvshm._pool import Pool

__all__ = ["OneSidedMover", "ShmMover"]


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
            if self._busy == 0:
                self._cv.notify_all()

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
        self._enter()
        try:
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
