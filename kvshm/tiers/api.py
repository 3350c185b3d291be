"""What the store expects of a tier below the pool: the :class:`Tier` protocol and the
constants both sides use. :class:`kvshm.store.Store` imports this module, never a
concrete tier; :mod:`kvshm.tiers.ssd` implements it (docs/SSD.md)."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

__all__ = ["Tier", "TierEntry", "SPILL_STARTED", "SPILL_BUSY", "SPILL_REFUSED", "WRITING",
           "MAX_JOB_BYTES"]

#: ``Tier.spill`` results: the write started (it pins the entry until it completes) ...
SPILL_STARTED = 0
#: ... the write queue is full: try again when a write completes ...
SPILL_BUSY = 1
#: ... or the entry cannot be stored (larger than a file, no room, tier failing).
SPILL_REFUSED = 2

#: ``TierEntry.state`` while a spill write of it is in flight.
WRITING = 0

#: A tier job moves at most this many bytes (8 MiB): the store allocates promotions in
#: groups of at most this much, so one group is one job.
MAX_JOB_BYTES = 8 * 1024 ** 2


class TierEntry(Protocol):
    """A value below the pool, as the store sees it (``Entry.meta`` of a pool entry that
    has a copy below)."""

    state: int            # WRITING while its spill is in flight
    nblocks: int          # pool blocks a promotion of it needs
    size: int             # value bytes
    checksum: int | None  # xxh64 of the value, as the client's
    evict_after: bool     # evict the pool entry once this copy is written


class Tier(Protocol):
    """The calls :class:`kvshm.store.Store` makes on a tier; all on the loop thread.

    Completions are delivered by :meth:`poll` as ``(kind, tier entry, pool entry, ok)``
    tuples, ``kind`` "w" (a spill write) or "r" (a promotion read).
    """

    max_extents: int                 # most pool runs of one entry it moves
    margin_bytes: int                # bytes of pool entries with a copy below (clean)
    write_bytes: int                 # bytes of spill writes queued or in flight
    counters: dict[str, int]
    notify: Callable[[], None] | None       # called (any thread) when poll() has something
    unshadow: Callable[[Any], None] | None  # set by the store: a live entry's copy was dropped

    @property
    def io_in_flight(self) -> bool: ...
    def has(self, key: Any) -> bool: ...
    def lookup(self, key: bytes) -> TierEntry | None: ...
    def spill(self, e: Any) -> int: ...
    def prefetch(self, ses: list[Any]) -> None: ...
    def read(self, se: Any, e: Any) -> None: ...
    def unreserve(self, se: Any) -> None: ...
    def installed(self, se: Any, e: Any) -> None: ...
    def demote(self, se: Any) -> None: ...
    def touch(self, se: Any) -> None: ...
    def discard(self, se: Any) -> None: ...
    def discard_key(self, key: bytes) -> bool: ...
    def purge(self) -> int: ...
    def submit(self) -> None: ...
    def poll(self) -> Sequence[tuple[str, Any, Any, bool]]: ...
    def service(self, now: float) -> float | None: ...
    def stats(self, verify: bool = False) -> dict[str, Any]: ...
    def close(self) -> None: ...
