"""What a read parked for a tier holds, and a promotion from a tier into the pool, as data
(the logic is :mod:`kvshm.store.tiered`'s); apart so that :mod:`kvshm.store.parts` can
name them without an import cycle."""

from __future__ import annotations

from typing import Any

from kvshm.index import Entry

__all__ = ["ReadHold"]


class ReadHold:
    """Pins a parked read holds on the entries of its request while others are promoted
    (so a long wait cannot evict what is already there). Made by :meth:`Store.read_hold`,
    dropped by :meth:`Store.release_hold`."""

    __slots__ = ("entries", "keys", "ssd_keys", "active", "waiting")

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.keys: set[bytes] = set()
        self.ssd_keys: set[bytes] = set()    # keys this read waited for a promotion of
        self.active = True
        self.waiting = 0                     # promotions it waits for, not yet done


class _Promotion:
    __slots__ = ("entry", "sentry", "holds")

    def __init__(self, entry: Entry, sentry: Any) -> None:
        self.entry = entry          # allocated, unpublished pool entry being filled
        self.sentry = sentry        # the tier's entry being read
        self.holds: list[ReadHold] = []
