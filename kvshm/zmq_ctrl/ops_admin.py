"""The server loop's operator and inspection handlers: EVICT, STATS, LIST, PURGE.

EVICT and PURGE are operator ops (:func:`~kvshm.zmq_ctrl.handling.not_operator` answers
others); STATS reports the store's figures and the loop's own (errors, sends in flight,
slices, the longest turn, the C paths' counts, latency histograms); LIST pages through
keys by prefix.
"""

from __future__ import annotations

from kvshm.zmq_ctrl.dispatch import LATENCY_BUCKETS
from kvshm.zmq_ctrl.handling import not_operator
from kvshm.zmq_ctrl.loopstate import LoopState
from kvshm.zmq_ctrl.protocol import Op, Status

class AdminOpsMixin(LoopState):
    """Operator and inspection handlers of ServiceLoop (a mixin of it)."""

    def _on_evict(self, session, req_id, body, frames, on_sent):
        if not session.operator:
            return not_operator("EVICT")
        ratio = body.get("ratio")
        if type(ratio) not in (int, float) or not 0.0 <= ratio <= 1.0:
            return Status.INVALID_REQUEST, {"error": "ratio must be a number in [0, 1]"}, []
        return Status.OK, {"n": self.store.evict(float(ratio))}, []

    def _on_stats(self, session, req_id, body, frames, on_sent):
        if self._sending:
            self._settle_own_sends(session)
        s = self.store.stats(verify=bool(body.get("verify")))
        s["errors"] = sum(self.errors.values())
        s["error_kinds"] = dict(self.errors)
        s["sending"] = len(self._sending)
        s["slices"] = dict(self.slice_counters, in_progress=self.in_progress,
                           slice_keys=self.slice_keys)
        s["loop_max_turn"] = dict(self.max_turn)
        s["fast_path"] = self.fast_counts()
        # what serves tcp:// and ipc://, and the native listener's connections closed
        # by reason (kvshm.zmq_ctrl.listener)
        nat = self._native
        s["listener"] = ({"kind": "native", "connections": nat.connections,
                          "closed": dict(nat.counts)} if nat is not None
                         else {"kind": "libzmq"})
        if body.get("latency"):
            s["latency"] = {(Op(op).name if op in Op._value2member_map_ else str(op)): {
                                "buckets": list(LATENCY_BUCKETS[:-1]),
                                "counts": self.latency[op], "sum": self.latency_sum[op]}
                            for op in self.latency if sum(self.latency[op])}
        return Status.OK, {"stats": s}, []

    def _on_list(self, session, req_id, body, frames, on_sent):
        prefix = body.get("prefix", b"")
        start = body.get("start", 0)
        limit = body.get("limit", 1000)
        if (type(prefix) is not bytes or type(start) is not int or type(limit) is not int
                or start < 0 or not 0 < limit <= self.store.config.limits.max_batch):
            return Status.INVALID_REQUEST, {
                "error": "LIST takes prefix (bytes), start >= 0 and 0 < limit <= the "
                         "batch limit"}, []
        keys, more = self.store.list_keys(prefix, start, limit)
        return Status.OK, {"keys": keys, "more": more}, []

    def _on_purge(self, session, req_id, body, frames, on_sent):
        if not session.operator:
            return not_operator("PURGE")
        return Status.OK, {"n": self.store.purge()}, []
