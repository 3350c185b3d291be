"""The store: pool + allocator + index + leases + eviction. No I/O of its own.

One thread owns a :class:`Store` (the server's loop); movers and sockets never touch it.
Every public method takes already-decoded Python values and returns plain values, so the
ZeroMQ loop, the management port and the tests drive the same code.

Sessions and grants
-------------------
A client's HELLO opens a :class:`Session` (:meth:`Store.open_session`); an ALLOC or a
LOOKUP creates a *grant* of that session named by its request id: the pending entries of
the ALLOC, or the pins of the LOOKUP. COMMIT / ABORT / RELEASE name grants by request id
within the session. A grant not settled within ``lease_timeout`` seconds expires: pending
entries are freed, pins dropped, unless the session proves its process is alive and
attached to the pool (``Session.proof``, the kernel-held lock of
:class:`kvshm.segments.Liveness`): such a stalled client may still be copying, so its
grants stay *held* (never reused, still counted against it) until it settles them or its
proof goes. A session whose proof is gone, or that is closed, is settled whole at once
(:meth:`Store.close_session`).

Limits count blocks actually held (a zero-byte value holds one block), per *principal*
(the uid the kernel reports for a same-host client, the CURVE key or the door token of
another), never per connection: all sessions of one principal share one quota.

Tiers
-----
With a tier attached (:meth:`Store.attach_tier`, the SSD tier of :mod:`kvshm.tiers.ssd`),
an entry's ``meta`` is its copy below (None: dirty, no copy). Eviction moves a clean entry
down at no cost; a dirty one is spilled first (the write pins it, so its blocks cannot be
reused while a worker reads them) and evicted once clean. A cleaner spills the LRU end of
the pool ahead of need. A read of a key that lives only below is promoted into freshly
allocated blocks before it is answered: the caller (the server loop) parks the request
and tries it again when the store made progress (:meth:`prepare_read`, ``defer=``). The
store never sees a file; see docs/SSD.md.

Parts
-----
:mod:`kvshm.store.core` (the :class:`Store`, its data path), :mod:`kvshm.store.sessions`
(sessions, grants, leases), :mod:`kvshm.store.space` (allocation, eviction,
compaction), :mod:`kvshm.store.tiered` (a tier below, through :mod:`kvshm.tiers.api`),
:mod:`kvshm.store.accounting` (budgets, counters, stats), :mod:`kvshm.store.outcome`
(per-key outcomes, mapped to wire statuses by the router), :mod:`kvshm.store.config`.
The store imports no wire protocol and no concrete tier.
"""

from __future__ import annotations

from kvshm.store.config import StoreConfig
from kvshm.store.core import Store
from kvshm.store.outcome import QUOTA_REFUSED, Outcome
from kvshm.store.sessions import Session
from kvshm.store.tiered import ReadHold

__all__ = ["Store", "StoreConfig", "QUOTA_REFUSED", "ReadHold", "Session", "Outcome"]
