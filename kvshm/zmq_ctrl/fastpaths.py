"""The server loop's C paths: the one-key fast path and the batch EXISTS / MATCH_PREFIX path.

One-key fast path. With ``_zmqc``, each drained message is first offered to
:class:`kvshm.zmq_ctrl._fastpath.FastPath`: a plain one-key PUT, GET or EXISTS of an open
session is decoded, served and answered there in C (the same store calls, the same reply
bytes, latency recorded); anything else (another op, piggybacked settles, a tier, an odd or
hostile header, a value it does not copy) it declines before changing anything, and the
Python path (:mod:`kvshm.zmq_ctrl.dispatch`) serves it. ``ServiceLoop.fast_counts()``
(STATS: ``fast_path``) says how many it took. ``KVSHM_FASTPATH=0`` turns it off.

Batch EXISTS / MATCH_PREFIX path. A plain batch EXISTS or MATCH_PREFIX (``{"keys": [bin,
...]}`` and nothing else, an open session, no tier) is parsed, looked up and answered in C
from its request frame (:class:`kvshm.zmq_ctrl._batchq.BatchQuery`; the same reply bytes),
a large one in slices of ``SLICE_MULT * slice_keys`` keys (the reply made in C after the
last, :meth:`~kvshm.zmq_ctrl.slices.SlicesMixin._sliced_c`); anything else it declines
before changing anything. ``KVSHM_BATCHPATH=0`` turns it off (``fast_path``'s
``EXISTS_batch``, ``MATCH_PREFIX_batch``, ``batch_declined`` count it).

Both are (re)built for the ops whose handler is still the loop's own
(:meth:`FastPathsMixin._make_fast`, :meth:`FastPathsMixin._make_batchq`, again after
``add_ops``); the lean turns that hand whole turns to ``FastPath.serve`` are the loop's
(:mod:`kvshm.zmq_ctrl.router`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvshm.zmq_ctrl.dispatch import LATENCY_BUCKETS
from kvshm.zmq_ctrl.frames import PACK_BELOW
from kvshm.zmq_ctrl.handling import _MORE, _SAME_NUMBERS
from kvshm.zmq_ctrl.loopstate import LoopState
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, Status, encode_reply

try:    # one-key PUT/GET/EXISTS decoded, served and answered in C (with _zmqc only)
    from kvshm.zmq_ctrl import _fastpath
except ImportError:     # pragma: no cover - the extension is not built
    _fastpath = None  # type: ignore[assignment]

#: KVSHM_FASTPATH=0 in the environment turns the one-key fast path off (A/B figures;
#: the Python path serves every request then)
_FAST_ON = os.environ.get("KVSHM_FASTPATH", "1") != "0"
try:    # batch EXISTS / MATCH_PREFIX decoded, served and answered in C
    from kvshm.zmq_ctrl import _batchq
except ImportError:     # pragma: no cover - the extension is not built
    _batchq = None  # type: ignore[assignment]
#: KVSHM_BATCHPATH=0 turns the batch EXISTS / MATCH_PREFIX path off (A/B figures; the
#: Python path serves every batch then)
_BATCH_ON = os.environ.get("KVSHM_BATCHPATH", "1") != "0"

#: the loop's one logger: its records keep the name they had before the loop was
#: split into modules (as kvshm.store's modules share "kvshm.store")
log = logging.getLogger("kvshm.zmq_ctrl.router")


class FastPathsMixin(LoopState):
    """The C paths of ServiceLoop (a mixin of it)."""

    def _make_fast(self) -> None:
        """(Re)build the one-key fast path for the ops whose handler is still the
        loop's own (an op that add_ops replaced goes through its handler)."""
        self._fast = None
        if _fastpath is None or not _FAST_ON or self._zmqc is None or not _SAME_NUMBERS:
            return
        own = {Op.PUT: self._on_put, Op.GET: self._on_get, Op.EXISTS: self._on_exists}
        ops = [int(op) for op, h in own.items() if self._handlers.get(op) == h]
        if ops:
            self._fast = _fastpath.FastPath(self, PROTOCOL_VERSION, LATENCY_BUCKETS,
                                            PACK_BELOW, 65536, ops)

    def _make_batchq(self) -> None:
        """(Re)build the batch EXISTS / MATCH_PREFIX path for the ops whose handler is
        still the loop's own."""
        self._batchq = None
        if _batchq is None or not _BATCH_ON:
            return
        own = {Op.EXISTS: self._on_exists, Op.MATCH_PREFIX: self._on_match_prefix}
        ops = [int(op) for op, h in own.items() if self._handlers.get(op) == h]
        if ops:
            self._batchq = _batchq.BatchQuery(self, PROTOCOL_VERSION, ops,
                                              _batchq.SLICE_MULT * self.slice_keys, _MORE)

    def fast_counts(self) -> dict[str, int]:
        """Requests the one-key fast path served, per op name, and ``declined`` (handed
        to the Python path); all 0 without it."""
        f = self._fast
        out = {op.name: (f.counts.get(int(op), 0) if f is not None else 0)
               for op in (Op.PUT, Op.GET, Op.EXISTS)}
        out["declined"] = f.declined if f is not None else 0
        # turns of :meth:`run` done wholly in C (FastPath.serve), and its hand-backs
        out["lean_turns"] = f.lean_turns if f is not None else 0
        out["lean_returns"] = f.serve_returns if f is not None else 0
        # batch EXISTS / MATCH_PREFIX served by kvshm.zmq_ctrl._batchq, and declined
        b = self._batchq
        for op in (Op.EXISTS, Op.MATCH_PREFIX):
            out[f"{op.name}_batch"] = b.counts.get(int(op), 0) if b is not None else 0
        out["batch_declined"] = b.declined if b is not None else 0
        return out

    def _fast_bug(self) -> None:
        """The fast path raised outside its store calls (a bug; it changed nothing
        before them): logged and counted; the Python path then serves the message."""
        log.exception("internal error in the one-key fast path")
        self._count_error("internal")

    def _fast_internal(self, ident: bytes, req_id: int, op: int, exc: BaseException,
                       t0: float) -> None:
        """The fast path's store call raised (a bug): logged, counted and answered
        INTERNAL, as a handler's exception in :meth:`_dispatch`."""
        log.exception("internal error handling op %s", op)
        self._count_error("internal")
        self._send(ident, encode_reply(Status.INTERNAL, req_id,
                                       {"error": f"internal error: {exc!r}"}))
        self._record_latency(op, t0)
