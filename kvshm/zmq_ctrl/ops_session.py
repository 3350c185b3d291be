"""Router handlers that end sessions: BYE, and the idle expiry of remote sessions.

BYE (op 52). A client that closes says BYE (best effort: :meth:`kvshm.Client.close` and
:meth:`kvshm.aio.AsyncClient.close` send it, wait at most :data:`BYE_WAIT_S` for the
answer, then close their socket). The server closes that session at once, through the
store's one path (:meth:`kvshm.store.Store.close_session`): every grant it holds is
settled (pending writes freed, pins dropped) and whatever else a session owns (RDMA QPs
through the reclaim hook, reservations) goes with it. Settle lists piggybacked on the
BYE (lazy COMMITs, RELEASE, ABORT) are applied first, as on any request. The reply says
how many grants were settled (``settled``); a BYE from a session that is gone is
answered STALE_EPOCH like any request.

Idle expiry. A same-host session ends when its liveness proof goes
(:mod:`kvshm.segments`), a remote one only when it says BYE; a remote client that
vanished without it (killed, unplugged) left a grant-less session that used to stay
until a cap of 65,536 sessions trimmed it. Now a remote session with no grants and no
replies in flight that sent nothing for ``idle_timeout`` seconds (``--session-idle-
timeout``, default :data:`IDLE_TIMEOUT_S`) is closed; its client, if it comes back,
is answered "no session" and says HELLO again by itself (transparent to the caller).
Sessions with grants are left to lease expiry, local ones to their proof.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvshm.zmq_ctrl.protocol import Op, Status

__all__ = ["SessionOps", "IDLE_TIMEOUT_S", "BYE_WAIT_S"]

log = logging.getLogger(__name__)

#: Default seconds a grant-less remote session may stay silent before it is closed.
IDLE_TIMEOUT_S = 600.0
#: Seconds a closing client waits for the answer to its BYE (then closes anyway).
BYE_WAIT_S = 0.25


class SessionOps:
    """BYE and idle expiry for one :class:`~kvshm.zmq_ctrl.router.ServiceLoop`.

    Parameters
    ----------
    loop : ServiceLoop
        Installed into it with :meth:`install` (``add_ops``: the BYE handler and a tick).
    idle_timeout : float
        Seconds (> 0) of silence after which a grant-less remote session is closed;
        ``float("inf")`` keeps them (until the loop's session cap).
    """

    def __init__(self, loop: Any, idle_timeout: float = IDLE_TIMEOUT_S) -> None:
        if not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be > 0 s, got {idle_timeout}")
        self.loop = loop
        self.idle_timeout = float(idle_timeout)
        self.counters = {"bye": 0, "idle_closed": 0}
        self._next_scan = time.perf_counter() + self._scan_every()

    def _scan_every(self) -> float:
        return min(max(self.idle_timeout / 4, 0.05), 30.0)

    def install(self) -> "SessionOps":
        self.loop.add_ops({Op.BYE: self._on_bye}, tick=self._tick)
        return self

    def _on_bye(self, session: Any, req_id: int, body: dict[str, Any], frames: list[Any],
                on_sent: list[Any]) -> tuple[int, dict[str, Any], list[Any]]:
        n = self.loop.end_session(session, "said BYE")
        self.counters["bye"] += 1
        return Status.OK, {"settled": n}, []

    def _tick(self, now: float) -> float | None:
        # ``now`` is the loop's time.monotonic(); a session's ``seen`` is perf_counter
        # (stamped by the loop on each request): both are measured here in perf_counter
        t = time.perf_counter()
        if t >= self._next_scan:
            self._next_scan = t + self._scan_every()
            self._expire_idle(t)
        return now + max(0.0, self._next_scan - time.perf_counter())

    def _expire_idle(self, t: float) -> None:
        if self.idle_timeout == float("inf"):
            return
        cutoff = t - self.idle_timeout
        idle = [s for s in self.loop.sessions()
                if s.proof is None and not s.grants and not s.sending and not s.closed
                and s.seen < cutoff]
        for s in idle:
            self.loop.end_session(s, f"idle for {self.idle_timeout:g} s")
        if idle:
            self.counters["idle_closed"] += len(idle)
            log.info("closed %d remote session(s) idle for %g s", len(idle),
                     self.idle_timeout)
