"""The server loop's shared state, declared once for the type checker.

:class:`~kvshm.zmq_ctrl.router.ServiceLoop` is one class made of mixins, one module each
(see :mod:`kvshm.zmq_ctrl.router`); a mixin reads the loop's state and calls the other
mixins' methods through ``self``. :class:`LoopState`, the base of every mixin, names those
attributes and methods with their types. Annotations only: at run time it adds no
attribute (``ServiceLoop.__init__`` sets them, the mixins define the methods), so no
lookup changes.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable

import zmq

from kvshm.store import Session, Store

__all__ = ["LoopState"]

#: a handler's reply: (status, body, frames)
Reply = tuple[int, dict[str, Any], list[Any]]


class LoopState:
    """What the mixins of ServiceLoop share (set by ``ServiceLoop.__init__``)."""

    # the store served, this instance's epoch, the HELLO reply, the slice size
    store: Store
    epoch: int
    hello: dict[str, Any]
    hello_hook: Callable[[bytes, dict[str, Any]], dict[str, Any]] | None
    slice_keys: int
    send_cap_blocks: int
    door_token: bytes | None
    operator_token: bytes | None
    MAX_SESSIONS: int
    # sessions (kvshm.zmq_ctrl.sessions)
    _by_ident: dict[bytes, Session]
    _by_nonce: dict[bytes, Session]
    _order: collections.OrderedDict[int, Session]
    _monitor: zmq.Socket | None
    # admission (kvshm.zmq_ctrl.admission)
    _sock: zmq.Socket
    _unadmitted: collections.OrderedDict[int, tuple[int, int, float]]
    _admitted: dict[int, tuple[int, int]]
    _admitting: bool
    _mon_fd: int
    _native: Any = None   # the native listener (kvshm.zmq_ctrl.listener), or None
    hello_timeout: float
    max_unadmitted: int
    _admit: Callable[[Any], None]
    _admit_live: Callable[[bytes, Any], None]
    # parked and sliced requests, the sliced codec (parked, slices)
    _parked: list[Any]
    _parked_by: dict[tuple[int, int], Any]
    _runnable: collections.deque[Any]
    _decodes: collections.deque[Any]
    _encodes: collections.deque[Any]
    _held: dict[bytes, collections.deque[tuple[list[Any], Any]]]
    _seen_progress: int
    _pokes: int
    _seen_pokes: int
    slice_counters: dict[str, int]
    # dispatch, handlers, sends in flight, the C paths
    _handlers: dict[int, Callable[..., Reply]]
    _stateful: set[int]
    _sending: list[tuple[Any, list[Any], int, Session, bytes, float, Any]]
    _unsettled: dict[int, tuple[Session, Any]]
    latency: dict[int, list[int]]
    latency_sum: dict[int, float]
    errors: dict[str, int]
    _zmqc: Any
    _fast: Any
    _batchq: Any
    # methods one mixin calls on another (defined by ServiceLoop or a mixin)
    _count_error: Callable[[str], None]
    _send: Callable[..., zmq.MessageTracker | None]
    _handle: Callable[..., None]
    _dispatch: Callable[..., None]
    _reply: Callable[..., None]
    _record_latency: Callable[[int, float], None]
    _fast_internal: Callable[..., None]
    _unanswered: Callable[..., None]
    _sends: int
    _session_of: Callable[..., Session | None]
    _hello: Callable[..., tuple[int, dict[str, Any], list[Any], Session | None]]
    _attempt: Callable[..., Any]
    _abandon: Callable[[Any], None]
    _cancel_parked: Callable[[Session, list[int]], None]
    _settle_is_large: Callable[[Session, dict[str, Any]], bool]
    _settle_in_slices: Callable[..., None]
    _settle_own_sends: Callable[[Session], None]
    _on_put: Callable[..., Reply]
    _on_get: Callable[..., Reply]
    _on_exists: Callable[..., Reply]
    _on_match_prefix: Callable[..., Reply]
    fast_counts: Callable[[], dict[str, int]]

    if TYPE_CHECKING:
        @property
        def in_progress(self) -> int: ...
