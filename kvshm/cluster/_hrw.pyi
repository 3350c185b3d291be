"""Type stubs of the compiled placement core (kvshm/cluster/_hrw.pyx)."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

BUCKET_BITS: int
TABLE_COLUMNS: int
MAX_NODES: int
DIRECT_BELOW: int

def hash_key(key: bytes) -> int:
    """The 64-bit placement hash of ``key`` (as every client computes it)."""

def bucket_of(key: bytes) -> int:
    """The bucket of ``key``: the top BUCKET_BITS bits of its placement hash."""

def neg_ln1m(t: float) -> float:
    """``-ln(1 - t)`` as placement computes it (``t`` in (0, 1))."""

class Ring:
    """Owners over one member list; ``build()`` precomputes every bucket's owners."""

    nodes: int
    def __init__(self, seeds: Sequence[int] | npt.ArrayLike,
                 weights: Sequence[float] | npt.ArrayLike) -> None: ...
    @property
    def built(self) -> bool: ...
    def build(self) -> None: ...
    def bucket_owners(self, bucket: int, replicas: int = 1) -> npt.NDArray[np.int32]: ...
    def owners(self, keys: list[bytes], stripe: int = 1,
               replicas: int = 1) -> npt.NDArray[np.int32]:
        """Owners (node indices, best first) of each key: shape (len(keys), replicas)."""

def owners(keys: list[bytes], seeds: Sequence[int] | npt.ArrayLike,
           weights: Sequence[float] | npt.ArrayLike, stripe: int = 1,
           replicas: int = 1) -> npt.NDArray[np.int32]:
    """Owners (node indices, best first) of each key: shape (len(keys), replicas)."""
