"""Which members own a key: weighted rendezvous hashing over the ``up`` members.

Every client computes the same owners from the same view (no metadata round trip):
nodes are ordered by id, seeded by the hash of their id, weighted by pool size; a key
is placed by its bucket (the top bits of its hash), and the owners of every bucket are
precomputed once per view (:class:`kvshm.cluster._hrw.Ring`, C), so placing a batch is
a hash and a table read per key.

Stripes: with ``stripe=G`` the keys ``i`` of one call with the same ``i // G`` go where
the first of them goes, so a lost host costs whole runs of G keys of a prefix instead of
scattering holes through every prefix. Placement is a function of the *placement key*
list of a call: pass whole sequences from their first key, or pass ``placement_keys``
(an integration's own, e.g. the hash of the stripe's first chunk) so that a call that
starts mid-sequence places its keys where the full sequence did.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvshm.cluster import _hrw
from kvshm.cluster.view import Member, View

__all__ = ["Placement", "hash_key"]

hash_key = _hrw.hash_key


class Placement:
    """Owners over one view's ``up`` members (immutable; build one per view)."""

    def __init__(self, view: View, exclude: Sequence[str] = ()) -> None:
        ex = set(exclude)
        self.members: tuple[Member, ...] = tuple(m for m in view.up if m.id not in ex)
        self.ids = [m.id for m in self.members]
        self._seeds = np.array([hash_key(m.id.encode()) for m in self.members],
                               dtype=np.uint64)
        self._weights = np.array([float(m.pool_size) for m in self.members],
                                 dtype=np.float64)
        self._ring = _hrw.Ring(self._seeds, self._weights)

    def prepare(self) -> "Placement":
        """Build the bucket table now (tens of ms for 64 nodes; the GIL is released),
        so that no request pays for it; the view follower calls this before it
        switches to a new view. Returns self."""
        self._ring.build()
        return self

    def __len__(self) -> int:
        return len(self.members)

    def owners(self, placement_keys: list[bytes], stripe: int = 1, replicas: int = 1
               ) -> np.ndarray:
        """Member indices, shape (len(keys), replicas), best first; -1 beyond the number
        of members."""
        return self._ring.owners(placement_keys, stripe, replicas)

    def owner_ids(self, placement_keys: list[bytes], stripe: int = 1) -> list[str | None]:
        """The first owner's id per key (None with no member up)."""
        if not self.members:
            return [None] * len(placement_keys)
        o = self.owners(placement_keys, stripe, 1)[:, 0]
        return [self.ids[j] for j in o.tolist()]
