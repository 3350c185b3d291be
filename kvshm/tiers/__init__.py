"""Storage tiers below the shared-memory pool.

The :class:`~kvshm.store.Store` talks to a tier through a narrow interface and never sees
a file: it hands over an entry to write (``spill``), asks whether a key lives below
(``has``), asks for a key to be read back into pool blocks it allocated (``read``), and
applies the completions the tier delivers on the loop thread (``poll``). See docs/SSD.md.

The interface is :mod:`kvshm.tiers.api`; :mod:`kvshm.tiers.ssd` is the one tier so far: pre-allocated files on a local disk.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SsdConfig", "SsdEntry", "SsdTier"]


def __getattr__(name: str) -> Any:
    # loaded on first use, so that importing kvshm.tiers.api (the store does) does not
    # load a concrete tier
    if name in __all__:
        from kvshm.tiers import ssd

        return getattr(ssd, name)
    raise AttributeError(f"module 'kvshm.tiers' has no attribute {name!r}")
