"""Storage tiers below the shared-memory pool.

The :class:`~kvshm.store.Store` talks to a tier through a narrow interface and never sees
a file: it hands over an entry to write (``spill``), asks whether a key lives below
(``has``), asks for a key to be read back into pool blocks it allocated (``read``), and
applies the completions the tier delivers on the loop thread (``poll``). See docs/SSD.md.

:mod:`kvshm.tiers.ssd` is the one tier so far: pre-allocated files on a local disk.
"""

from __future__ import annotations

from kvshm.tiers.ssd import SsdConfig, SsdEntry, SsdTier

__all__ = ["SsdConfig", "SsdEntry", "SsdTier"]
