"""The SSD tier: entries evicted from the pool go to pre-allocated files, not away.

One concept a module:

- :mod:`~kvshm.tiers.ssd.entry`: options (:class:`SsdConfig`), one value on disk
  (:class:`SsdEntry`), its states, the spill results;
- :mod:`~kvshm.tiers.ssd.files`: the directory, its lock and the data files (layout);
- :mod:`~kvshm.tiers.ssd.workers`: I/O jobs, the worker threads, promotion reads
  started ahead (prefetch) and how requests are cut into jobs;
- :mod:`~kvshm.tiers.ssd.manifest`: what ``--ssd-persist`` keeps across restarts;
- :mod:`~kvshm.tiers.ssd.policy`: where each entry lives (ONLY / MARGIN / HOT), the LRU
  order and what is dropped when room is needed;
- :mod:`~kvshm.tiers.ssd.tier`: :class:`SsdTier`, the interface the store uses.

See docs/SSD.md.
"""

from __future__ import annotations

from kvshm.tiers.ssd.entry import (ALIGN, DEAD, HOT, MARGIN, NOWHERE, ONLY, SPILL_BUSY,
                                   SPILL_REFUSED, SPILL_STARTED, STORED, WRITING, SsdConfig,
                                   SsdEntry)
from kvshm.tiers.ssd.files import DATA_FMT, LOCK_NAME, MANIFEST_NAME
from kvshm.tiers.ssd.tier import SsdTier
from kvshm.tiers.ssd.workers import (MAX_JOB_BYTES, MAX_JOB_ITEMS, PLACE_TIMEOUT, READ_DEPTH,
                                     READ_PIECE_BYTES)

__all__ = ["SsdConfig", "SsdEntry", "SsdTier", "SPILL_STARTED", "SPILL_BUSY",
           "SPILL_REFUSED", "ALIGN", "WRITING", "STORED", "DEAD", "NOWHERE", "ONLY",
           "MARGIN", "HOT", "MAX_JOB_BYTES", "MAX_JOB_ITEMS", "READ_PIECE_BYTES",
           "READ_DEPTH", "PLACE_TIMEOUT", "LOCK_NAME", "MANIFEST_NAME", "DATA_FMT"]
