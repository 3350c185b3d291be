"""What a handler of the server loop is, and what it may raise and return.

Every handler (the built-in ones of :mod:`kvshm.zmq_ctrl.ops_write`,
:mod:`~kvshm.zmq_ctrl.ops_read` and :mod:`~kvshm.zmq_ctrl.ops_admin`, and those installed
with :meth:`~kvshm.zmq_ctrl.router.ServiceLoop.add_ops`) is called as ``handler(session,
req_id, body, frames, on_sent)`` and returns ``(status, body, frames)``. It may raise
:class:`_Malformed` (answered MALFORMED), :class:`_BatchTooLarge` (INVALID_REQUEST),
:class:`_Defer` (the request is parked: :mod:`kvshm.zmq_ctrl.parked`) or :class:`_Sliced`
(served in slices: :mod:`kvshm.zmq_ctrl.slices`). The store's per-key outcomes go out as
wire statuses through :func:`_wire_statuses`.
"""

from __future__ import annotations

from typing import Any, Callable

from kvshm.store import Outcome
from kvshm.zmq_ctrl.loopstate import LoopState
from kvshm.zmq_ctrl.protocol import Status

#: A slice step's answer: one slice done, more to come.
_MORE = object()

#: The store's per-key outcomes (kvshm.store.Outcome) as wire statuses.
_OUTCOME_STATUS: dict[int, Status] = {
    Outcome.OK: Status.OK,
    Outcome.INVALID_KEY: Status.INVALID_KEY,
    Outcome.TOO_LARGE: Status.TOO_LARGE,
    Outcome.POOL_FULL: Status.POOL_FULL,
    Outcome.INVALID_REQUEST: Status.INVALID_REQUEST,
    Outcome.QUOTA_EXCEEDED: Status.QUOTA_EXCEEDED,
}
if set(_OUTCOME_STATUS) != set(Outcome):
    raise ImportError("router: a store outcome has no wire status")
#: Equal numbers (as chosen in kvshm.store.outcome): a list of outcomes goes out as it is.
_SAME_NUMBERS = all(int(o) == int(s) for o, s in _OUTCOME_STATUS.items())


def _wire_statuses(outcomes: list[int]) -> list[int]:
    """Per-key store outcomes -> wire statuses (``_OUTCOME_STATUS``)."""
    if _SAME_NUMBERS:
        return outcomes
    table = _OUTCOME_STATUS
    return [table[o] for o in outcomes]


class _Malformed(Exception):
    pass


class _Defer(Exception):
    """Raised by a handler: park the request; ``attempt(force)`` returns the reply
    (status, body, frames), or None to keep waiting (never None with ``force``);
    ``cleanup()`` runs if the request is abandoned (the server stops). ``wait``: seconds
    until the forced attempt (default ``StoreConfig.tier_wait``). ``on_poke``: attempted
    only after :meth:`ServiceLoop.poke` (and when forced), not at each store progress."""

    def __init__(self, attempt: Callable[[bool], Any],
                 cleanup: Callable[[], None] | None = None,
                 wait: float | None = None, on_poke: bool = False) -> None:
        super().__init__()
        self.attempt = attempt
        self.cleanup = cleanup
        self.wait = wait
        self.on_poke = on_poke


class _Sliced(_Defer):
    """Raised by a handler: serve the request in slices. ``attempt(force)`` does one
    slice and returns ``_MORE``, the reply (status, body, frames) after the last one, or
    None to wait for the store's progress (as :class:`_Defer`); ``cleanup()`` runs if the
    request is abandoned (cancelled, its session gone, the server stops).

    ``follows()``, when set, says whether the request goes on for the session that took
    its session's grants over (a new HELLO of the same client, ``Session.live``) instead
    of being abandoned with it: its attempt then acts on the live session."""

    def __init__(self, attempt: Callable[[bool], Any],
                 cleanup: Callable[[], None] | None = None,
                 follows: Callable[[], bool] | None = None) -> None:
        super().__init__(attempt, cleanup)
        self.follows = follows


def _list(body: dict[str, Any], name: str, *, ints: bool = False, optional: bool = False
          ) -> list[Any]:
    v = body.get(name)
    if v is None and optional:
        return []
    if not isinstance(v, list):
        raise _Malformed(f"field {name!r} must be a list")
    if ints and not all(type(x) is int for x in v):
        raise _Malformed(f"field {name!r} must be a list of ints")
    return v


def not_operator(what: str) -> tuple[int, dict[str, Any], list[Any]]:
    """The answer to an operator op (DRAIN, PURGE, EVICT) from a session that is not
    :attr:`Session.operator`."""
    return Status.UNAUTHORIZED, {
        "error": f"{what} is an operator op: it needs a local client of the server's own "
                 "user (or root) or the server's operator token (<port>.operator beside "
                 "its token file; see docs/RELIABILITY.md, 'Who can do what')"}, []


def _attempt_now(attempt: Callable[[bool], Any],
                 cleanup: Callable[[], None] | None = None) -> Any:
    """Run a deferrable handler's first attempt; park the request if it must wait."""
    r = attempt(False)
    if r is None:
        raise _Defer(attempt, cleanup)
    return r


class _BatchTooLarge(Exception):
    def __init__(self, n: int, limit: int) -> None:
        super().__init__(f"batch of {n} keys exceeds the server's limit of {limit}")


class RequestChecksMixin(LoopState):
    """The body checks every handler family uses (a mixin of ServiceLoop)."""

    def _keys(self, body: dict[str, Any]) -> list[Any]:
        keys = _list(body, "keys")
        self._check_batch(keys)
        return keys

    def _check_batch(self, keys: list[Any]) -> None:
        if len(keys) > self.store.config.limits.max_batch:
            raise _BatchTooLarge(len(keys), self.store.config.limits.max_batch)
