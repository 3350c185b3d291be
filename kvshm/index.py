"""Entries and the key index: key -> entry, in LRU order.

The index is the only structure that knows which keys are visible. It sits behind this
narrow interface (get / insert / remove / iterate from the LRU end). With a shared table
attached (:meth:`Index.attach_shared`, a :class:`kvshm._shmindex.IndexWriter`), every
entry that becomes live is published there for same-host readers, and every entry that
leaves is unpublished before the call returns, so before its blocks can be freed or
reused (docs/DESIGN.md, "Same-host reads without a round trip"). The reads those readers
record are applied (:meth:`Index.sync`) before every LRU decision.

Both are C types (:mod:`kvshm._index`, with the store's per-key loops); this module is
their public name.
"""

from __future__ import annotations

from kvshm._index import DEAD, LIVE, MAX_EXTENTS, PENDING, Entry, Index

__all__ = ["Entry", "Index", "PENDING", "LIVE", "DEAD", "MAX_EXTENTS"]
