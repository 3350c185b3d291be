"""Router handlers of the same-host write-behind ops: RESERVE and PLACE.

Registered with :meth:`ServiceLoop.add_ops` by :func:`attach`; they run on the server's
loop thread like every handler. The store side (what a reservation is, what PLACE
checks) is :mod:`kvshm.store.reserve`; here the bodies are decoded and outcomes mapped to
wire statuses.

RESERVE ``{blocks: int, reset: bool}`` (a local session only): add up to ``blocks``
blocks to this session's reservation; ``reset`` first gives the old one back and starts
a new generation. Answers ``{gen, runs: [[first block, count], ...], held}``, the runs
added (possibly none: quota or pool full) and the blocks now held. A session without a
liveness proof is answered ``UNSUPPORTED``.

PLACE ``{gen, keys, sizes, runs, sums?}``: ``runs[i]`` is ``[[first block, count], ...]``,
the blocks of the reservation value ``i`` was copied into. Answers ``{st: [Status, ...]}``
per key: OK (installed, and pinned under this request id until RELEASE), INVALID_KEY,
TOO_LARGE, INVALID_REQUEST (runs not wholly held, reused, malformed or not the blocks
the size needs), STALE_EPOCH (not the reservation's current generation) or
QUOTA_EXCEEDED (the pins would pass ``max_client_pinned_bytes``). The client does not
wait for this reply (kvshm.client, ``write_behind``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvshm.store.reserve import PlaceOutcome, Reservations
from kvshm.zmq_ctrl.protocol import Op, Status

__all__ = ["LocalOps", "attach", "PLACE_STATUS"]

log = logging.getLogger(__name__)

Reply = tuple[int, dict[str, Any], list[Any]]

#: Wire status of each :class:`kvshm.store.reserve.PlaceOutcome`.
PLACE_STATUS = {
    PlaceOutcome.OK: Status.OK,
    PlaceOutcome.INVALID_KEY: Status.INVALID_KEY,
    PlaceOutcome.TOO_LARGE: Status.TOO_LARGE,
    PlaceOutcome.BAD_RUNS: Status.INVALID_REQUEST,
    PlaceOutcome.STALE: Status.STALE_EPOCH,
    PlaceOutcome.QUOTA: Status.QUOTA_EXCEEDED,
}


class LocalOps:
    """RESERVE / PLACE handlers over one store's :class:`~kvshm.store.reserve.Reservations`."""

    def __init__(self, store: Any, max_session_blocks: int | None = None) -> None:
        self.store = store
        self.reservations = Reservations(store, max_session_blocks)

    def handlers(self) -> dict[int, Callable[..., Reply]]:
        return {Op.RESERVE: self._on_reserve, Op.PLACE: self._on_place}

    def tick(self, now: float) -> float | None:
        return self.reservations.tick(now)

    def _on_reserve(self, session: Any, req_id: int, body: dict[str, Any], frames: Any,
                    on_sent: Any) -> Reply:
        want = body.get("blocks")
        if type(want) is not int or want < 0:
            return Status.MALFORMED, {"error": "RESERVE takes blocks: int >= 0"}, []
        if not session.local:
            return Status.UNSUPPORTED, {
                "error": "RESERVE is for same-host clients that proved their liveness"}, []
        gen, runs, held = self.reservations.reserve(session, want,
                                                    reset=body.get("reset") is True)
        return Status.OK, {"gen": gen, "runs": [list(r) for r in runs], "held": held}, []

    def _on_place(self, session: Any, req_id: int, body: dict[str, Any], frames: Any,
                  on_sent: Any) -> Reply:
        keys, sizes, runs = body.get("keys"), body.get("sizes"), body.get("runs")
        sums = body.get("sums")
        if not (type(keys) is list and type(sizes) is list and type(runs) is list
                and len(keys) == len(sizes) == len(runs)):
            return Status.MALFORMED, {"error": "PLACE takes lists keys, sizes and runs "
                                               "of one length"}, []
        if sums is not None and (type(sums) is not list or len(sums) != len(keys)):
            return Status.MALFORMED, {"error": "sums must be a list as long as keys"}, []
        if len(keys) > self.store.config.limits.max_batch:
            return Status.INVALID_REQUEST, {"error": "batch too large"}, []
        out = self.reservations.place(session, req_id, body.get("gen"), keys, sizes,
                                      runs, sums)
        return Status.OK, {"st": [int(PLACE_STATUS[o]) for o in out]}, []

    def stats(self) -> dict[str, Any]:
        return self.reservations.stats()


def attach(loop: Any, store: Any, max_session_blocks: int | None = None) -> LocalOps:
    """Serve RESERVE and PLACE on ``loop`` (a :class:`ServiceLoop`) for ``store``."""
    ops = LocalOps(store, max_session_blocks)
    loop.add_ops(ops.handlers(), ops.tick)
    return ops
