"""Type stubs of the compiled placement core (kvshm/cluster/_hrw.pyx)."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

def hash_key(key: bytes) -> int:
    """The 64-bit placement hash of ``key`` (as every client computes it)."""

def owners(keys: list[bytes], seeds: Sequence[int] | npt.ArrayLike,
           weights: Sequence[float] | npt.ArrayLike, stripe: int = 1,
           replicas: int = 1) -> npt.NDArray[np.int32]:
    """Owners (node indices, best first) of each key: shape (len(keys), replicas)."""
