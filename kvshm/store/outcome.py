"""What the store answers per key: its own outcome codes, not the wire's.

The store knows no protocol. The server's router maps each :class:`Outcome` to the wire's
``kvshm.zmq_ctrl.protocol.Status`` through its own table (``_OUTCOME_STATUS`` in
:mod:`kvshm.zmq_ctrl.router`); the numbers are chosen equal to those wire statuses so that
the table is an identity on the numbers and a list of outcomes goes on the wire as it is
(the router checks that at import).
"""

from __future__ import annotations

import enum

__all__ = ["Outcome", "QUOTA_REFUSED"]


class Outcome(enum.IntEnum):
    """Per-key result of a write (:meth:`kvshm.store.Store.alloc_entries`,
    :meth:`~kvshm.store.Store.put`)."""

    OK = 0
    INVALID_KEY = 5        # empty, too long, or not bytes
    TOO_LARGE = 6          # larger than the pool or the per-value limit
    POOL_FULL = 7          # nothing evictable left to make room
    INVALID_REQUEST = 9    # a size that is not an int >= 0
    QUOTA_EXCEEDED = 10    # over the principal's pending-blocks limit


#: LOOKUP size of a key refused by the per-client pin limit.
QUOTA_REFUSED = -2
