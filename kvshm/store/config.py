"""The store's policy knobs (:class:`StoreConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvshm.index import MAX_EXTENTS
from kvshm.limits import Limits

__all__ = ["StoreConfig"]


@dataclass
class StoreConfig:
    """Policy knobs of a :class:`Store`.

    Attributes
    ----------
    lease_timeout : float
        Seconds a pending write or a pin may stay unsettled before it is reclaimed.
    limits : Limits
        Key, batch and value limits.
    max_client_pending_bytes : int
        Bytes of blocks one principal may hold in pending writes at once, all its
        sessions together (0: no limit). Counted in whole blocks actually held.
    max_client_pinned_bytes : int
        Bytes of blocks one principal may hold pinned at once, LOOKUP pins and GET
        replies not yet sent together (0: no limit). Counted in whole blocks.
    tier_wait : float
        With a tier: seconds a request may be parked waiting for spills (to make room) or
        a promotion before it is answered anyway (dirty entries dropped, or misses).
    max_extents : int
        Most block runs one value may be laid over, 1 to ``MAX_EXTENTS`` (1: every value
        in one contiguous run, as before values had extents).
    compact : bool
        Move live entries to join free holes when the free blocks would hold a value but
        lie in too many runs (else such a put evicts).
    """

    lease_timeout: float = 10.0
    limits: Limits = Limits()
    max_client_pending_bytes: int = 0
    max_client_pinned_bytes: int = 0
    tier_wait: float = 1.0
    max_extents: int = MAX_EXTENTS
    compact: bool = True
