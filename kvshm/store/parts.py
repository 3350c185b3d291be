"""The state the parts of :class:`kvshm.store.Store` share, declared once.

``Store`` is made of mixins (sessions and grants, space, the tier, accounting,
reservations), each in its own file, that read and write one set of attributes and call
each other's methods. Each mixin derives from :class:`_StoreParts`, which declares those
attributes and methods (annotations only: nothing is set or defined here at run time,
``Store.__init__`` sets the attributes and the mixins define the methods), so that a
type checker sees what every part may use, and a name one part uses that no part has is
an error.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kvshm._bitmap import BitmapAllocator
    from kvshm._pool import Pool
    from kvshm.index import Entry, Index
    from kvshm.store.config import StoreConfig
    from kvshm.store.grants import Session, _Grant, _Quota
    from kvshm.store.holds import _Promotion

class _StoreParts:
    """Attributes (set by ``Store.__init__``) and methods (defined by the mixins) that
    the parts of the store share."""

    # ------------------------------------------------------------ the pool and its index
    pool: Pool
    config: StoreConfig
    block_size: int                 # bytes in one block of the pool
    alloc: BitmapAllocator
    index: Index
    max_value: int                  # bytes: the largest value taken
    max_extents: int                # runs of blocks one value may take
    _clock: Callable[[], float]     # monotonic seconds
    progress: int                   # bumped when blocks are freed or a request may go on
    counters: dict[str, int]
    tier_counters: dict[str, int]
    evict_hook: Callable[[Entry], None] | None
    reclaim_hook: Callable[[Session], Any] | None

    # ------------------------------------------------------------ entries and pins
    _pending: int                   # entries in state PENDING
    _dead: set[Entry]               # replaced / deleted while pinned
    _pinned_entries: int            # entries with pins > 0
    _pins: int                      # pins in all
    _held: int
    _compact_skip: int              # chances to compact left out (_try_compact)
    _compact_backoff: int

    # ------------------------------------------------------------ sessions and grants
    _ngrants: int
    _leases: deque[tuple[float, _Grant]]
    _commit_order: deque[tuple[int, int]]
    _quotas: dict[Any, _Quota]      # principal -> what it holds
    _sessions: dict[int, Session]
    _named: dict[Any, Session]      # implicit sessions (session_for)
    _next_sid: int
    reservations: Any               # kvshm.store.reserve.Reservations, or None

    # ------------------------------------------------------------ the tier
    tier: Any                       # a kvshm.tiers tier, or None
    _dirty: OrderedDict[bytes, Entry]   # live, no copy in the tier, LRU order
    _promoting: dict[bytes, _Promotion]
    _wait: bool                     # the last _allocate stopped for spills in flight

    # ------------------------------------------------------------ methods of the parts
    _free: Callable[[Entry], None]                                      # space
    _free_runs: Callable[[tuple[tuple[int, int], ...]], None]           # space
    _pin: Callable[[Entry], None]                                       # space
    _unpin: Callable[[Entry], None]                                     # space
    _install: Callable[[Entry], None]                                   # space
    _allocate: Callable[..., "list[tuple[tuple[int, int], ...] | None]"]  # space
    _tier_leave: Callable[[Entry], None]                                # tiered
    _evict_tiered: Callable[..., int]                                   # tiered
    _limit_blocks: Callable[[int], int]                                 # accounting
    _add_grant: Callable[..., None]                                     # sessions
    _check_key: Callable[[Any], int]                                    # Store
    commit: Callable[..., "list[int]"]                                  # Store
    abort: Callable[..., None]                                          # Store
    release: Callable[..., None]                                        # Store
