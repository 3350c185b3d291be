"""What the SSD tier stores: its options (:class:`SsdConfig`), one value on disk
(:class:`SsdEntry`) and the states an entry goes through.

``SsdEntry.state``: ``WRITING`` (a spill write is in flight), ``STORED`` (on disk,
checksummed), ``DEAD`` (dropped; its blocks are freed once no job touches them).

``SsdEntry.where`` (see :mod:`kvshm.tiers.ssd.policy`): ``NOWHERE`` (not in a map),
``ONLY`` (the pool has no copy), ``MARGIN`` (a copy written ahead of the pool entry's
eviction), ``HOT`` (a copy of a pool entry read since).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvshm.tiers.api import SPILL_BUSY, SPILL_REFUSED, SPILL_STARTED, WRITING

__all__ = ["SsdConfig", "SsdEntry", "ALIGN", "GiB", "MiB", "WRITING", "STORED", "DEAD",
           "NOWHERE", "ONLY", "MARGIN", "HOT", "SPILL_STARTED", "SPILL_BUSY",
           "SPILL_REFUSED", "round_up"]

GiB = 1024 ** 3
MiB = 1024 ** 2
#: I/O alignment (offsets, lengths, buffer addresses) for O_DIRECT.
ALIGN = 4096

# SsdEntry.state (WRITING: kvshm.tiers.api, the store tests for it)
STORED = 1
DEAD = 2
# SsdEntry.where
NOWHERE = 0
ONLY = 1
MARGIN = 2
HOT = 3

# SsdTier.spill results: SPILL_STARTED, SPILL_BUSY, SPILL_REFUSED (kvshm.tiers.api)


def round_up(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-n // a) * a


@dataclass
class SsdConfig:
    """Options of an :class:`~kvshm.tiers.ssd.SsdTier` (the server fills them from ``--ssd-*``).

    Attributes
    ----------
    path : str
        Directory of the data files (created when missing).
    size : int
        Bytes of disk to use, all files together (rounded down to whole blocks).
    block_size : int
        Bytes per block: the pool's block size (a multiple of 4 KiB).
    files : int
        Number of data files; 0 picks one per GiB, 1 to 8.
    workers : int
        I/O threads.
    queue_bytes : int
        Most bytes of spill writes in flight; a spill beyond it is refused as busy.
    persist : bool
        Keep the files and write a manifest (on a clean stop and every
        ``manifest_interval`` seconds while entries change) so a restarted server serves
        the entries again. Without it the files are scratch and removed at exit.
    manifest_interval : float
        Seconds between manifest writes while entries change.
    direct : bool or None
        Use O_DIRECT: None (default) where the filesystem allows it; False never.
    """

    path: str
    size: int
    block_size: int
    files: int = 0
    workers: int = 4
    queue_bytes: int = 64 * MiB
    persist: bool = False
    manifest_interval: float = 5.0
    direct: bool | None = None


class SsdEntry:
    """One value on disk: ``nblocks`` blocks of file ``file`` from block ``start``."""

    __slots__ = ("key", "file", "start", "nblocks", "size", "checksum", "state", "where",
                 "io", "owner", "evict_after")

    def __init__(self, key: bytes, file: int, start: int, nblocks: int, size: int,
                 checksum: int = 0, state: int = WRITING) -> None:
        self.key = key
        self.file = file
        self.start = start
        self.nblocks = nblocks
        self.size = size
        self.checksum = checksum
        self.state = state
        self.where = NOWHERE
        self.io = 0                 # jobs in flight that touch these blocks
        self.owner: Any = None      # the pool Entry this is a copy of (MARGIN, HOT, writing)
        self.evict_after = False    # the store asked to evict the pool copy once written

    def __repr__(self) -> str:
        st = ("writing", "stored", "dead")[self.state]
        wh = ("-", "only", "margin", "hot")[self.where]
        return (f"<SsdEntry {self.key!r} file={self.file} blocks={self.start}+{self.nblocks} "
                f"size={self.size} {st} {wh} io={self.io}>")
