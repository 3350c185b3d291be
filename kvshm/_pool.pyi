"""Type stubs of the compiled shared-memory pool (kvshm/_pool.pyx).

Every offset is in bytes from the start of the pool's data area; sizes are in bytes.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, overload

import numpy as np
from typing_extensions import Buffer, Self, TypeAlias, final

#: Bytes of the header in front of the data area of every segment.
HEADER_SIZE: int
#: Bytes reserved and pre-faulted per step of :meth:`Pool.create` (a stop request is
#: looked at between steps).
CREATE_STEP: int

class CreateStopped(Exception):
    """:meth:`Pool.create` gave up because its ``stop()`` said so (nothing is left)."""

class _CpuTensor(Protocol):
    """What Pool copies use of a torch CPU tensor (torch tensors export no buffer)."""

    def data_ptr(self) -> int: ...
    def is_contiguous(self) -> bool: ...
    def numel(self) -> int: ...
    def element_size(self) -> int: ...

#: Bytes to copy from: any C- or F-contiguous buffer (bytes, bytearray, memoryview,
#: numpy array, array.array) or a contiguous torch CPU tensor. (numpy declares its buffer
#: support to type checkers only for Python >= 3.12, hence the explicit ndarray.)
_Source: TypeAlias = Buffer | np.ndarray[Any, Any] | _CpuTensor
#: Bytes to copy into: as ``_Source``, and writable (a read-only buffer is a TypeError).
_Dest: TypeAlias = Buffer | np.ndarray[Any, Any] | _CpuTensor
#: Offsets or sizes: a sequence of int, or a 1-d int64 buffer (used without a copy).
_Ints: TypeAlias = Iterable[int] | Buffer

@final
class Pool:
    """A POSIX shared-memory segment holding the store's blocks.

    Made with :meth:`create` (the server) or :meth:`attach` (clients); ``Pool()`` raises
    TypeError.
    """

    @property
    def name(self) -> str:
        """POSIX shm name, with a leading ``/``."""
    @property
    def token(self) -> bytes:
        """The 16 bytes chosen by the creator."""
    @property
    def creator_pid(self) -> int: ...
    @staticmethod
    def create(
        name: str,
        size: int,
        block_size: int = 65536,
        *,
        token: bytes | None = None,
        populate: bool = True,
        stop: Callable[[], bool] | None = None,
    ) -> Pool:
        """Create, size and map a new segment (mode 0600), in steps of CREATE_STEP bytes;
        ``stop()`` is called between steps and True gives up (segment unlinked).

        Raises CreateStopped, ValueError (bad name, size, block size or token),
        FileExistsError, and OSError (ENOSPC when /dev/shm has not room for it; other
        errno values)."""
    @staticmethod
    def attach(name: str, *, populate: bool = True) -> Pool:
        """Map a segment made by :meth:`create`.

        Raises FileNotFoundError, PermissionError, and ValueError (not a kvshm pool)."""
    def close(self) -> None:
        """Unmap (idempotent). BufferError while a view lives or a copy runs."""
    def unlink(self) -> None:
        """Remove the segment name; PermissionError outside the creating process."""
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def owner(self) -> bool:
        """True in the creating process only (not in a forked child, not in clients)."""
    @property
    def size(self) -> int:
        """Bytes of the data area."""
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def address(self) -> int:
        """Virtual address of the data area in this process; ValueError when closed."""
    @property
    def num_views(self) -> int: ...
    def write(self, offset: int, src: _Source) -> int:
        """Copy all of ``src`` to ``offset``; returns the bytes copied."""
    def stream_write(self, offset: int, src: _Source) -> int:
        """:meth:`write` with non-temporal stores (bypassing this CPU's caches)."""
    def read_into(self, offset: int, dst: _Dest, size: int = -1) -> int:
        """Copy ``size`` bytes (-1: all of ``dst``) from ``offset`` into ``dst``."""
    def view(self, offset: int, size: int, *, readonly: bool = False) -> memoryview:
        """A zero-copy view of [offset, offset + size); counted until released."""
    def scatter(
        self, src: _Source, offsets: _Ints, sizes: _Ints, src_offsets: _Ints | None = None
    ) -> int:
        """Copy pieces of ``src`` to many pool ranges; returns the total bytes copied."""
    def gather(
        self, offsets: _Ints, sizes: _Ints, dst: _Dest, dst_offsets: _Ints | None = None
    ) -> int:
        """Copy many pool ranges into pieces of ``dst``; returns the total bytes copied."""
    def read_bytes(self, offset: int, size: int) -> bytes:
        """A new bytes object holding [offset, offset + size)."""
    def read_bytes_many(self, offsets: _Ints, sizes: _Ints) -> list[bytes]:
        """``[read_bytes(o, s) for o, s in zip(offsets, sizes)]`` in one call."""
    def write_many(self, offsets: _Ints, srcs: Iterable[_Source]) -> int:
        """Copy each ``srcs[i]`` whole to ``offsets[i]``; returns the total bytes copied."""
    def write_values(self, offsets: _Ints, values: PackedValues) -> int:
        """Copy value ``i`` of ``values`` to ``offsets[i]`` (int64; -1: not written) in one
        C loop; returns the bytes copied. IndexError (checked before any byte moves),
        ValueError (lengths differ, pool closed)."""
    def read_groups(self, offsets: _Ints, sizes: _Ints, counts: Sequence[int]) -> list[bytes]:
        """Pool ranges gathered into new bytes objects, ``counts[j]`` consecutive ranges
        into the j-th. IndexError (a range outside the pool), ValueError (counts that do
        not add up to the ranges)."""
    def read_many_into(
        self, offsets: _Ints, dsts: Iterable[_Dest], sizes: _Ints | None = None
    ) -> int:
        """Copy pool ``offsets[i]`` into each ``dsts[i]`` (``sizes[i]`` bytes, default all
        of it); returns the total bytes copied."""

@final
class PackedValues:
    """A PUT's values packed back to back in its payload frames, read in place: a
    sequence whose items are 1-d ``B`` memoryviews (zero-copy) and whose slices (step 1)
    are PackedValues sharing the frames. ``PackedValues()`` raises TypeError."""

    @staticmethod
    def of(frames: list[Any], counts: list[Any], sizes: list[Any]) -> PackedValues | None:
        """The values of ``frames`` (``counts`` values per frame, ``sizes`` bytes per
        value), or None unless the layout is plain (see kvshm/_pool.pyx)."""
    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, item: int) -> memoryview: ...
    @overload
    def __getitem__(self, item: slice) -> PackedValues: ...
    def sizes(self) -> list[int]:
        """Bytes of each value."""
