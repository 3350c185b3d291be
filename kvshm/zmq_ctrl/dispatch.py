"""One request through the server loop: decode, check, settle, hand to its handler, reply.

:meth:`DispatchMixin._dispatch` decodes a request (or offers it to the batch path, or
starts its sliced decode), checks its id, version, op and session, applies the settle
lists it carries (:meth:`DispatchMixin._piggyback`; a large one in slices), runs its
handler under a catch-all (a bug is answered INTERNAL) and answers through
:meth:`DispatchMixin._reply` (a large reply is encoded in slices, a zero-copy one
tracked until sent), recording its latency (:data:`LATENCY_BUCKETS`).
"""

from __future__ import annotations

import collections
import logging
import time
from bisect import bisect_left
from typing import Any

import zmq

from kvshm.store import Session
from kvshm.zmq_ctrl.handling import _BatchTooLarge, _Defer, _list, _Malformed
from kvshm.zmq_ctrl.loopstate import LoopState
from kvshm.zmq_ctrl.parked import _Parked
from kvshm.zmq_ctrl.protocol import (
    PROTOCOL_VERSION,
    DecodeError,
    Op,
    ReplyEncoder,
    RequestDecoder,
    Status,
    decode_request,
    encode_reply,
)
from kvshm.zmq_ctrl.slices import STREAM_HEADER_BYTES, STREAM_REPLY_ITEMS, _Decoding, _Encoding
from kvshm.zmq_ctrl.sends import CONN_NOW, conn_of, conn_still

#: the loop's one logger: its records keep the name they had before the loop was
#: split into modules (as kvshm.store's modules share "kvshm.store")
log = logging.getLogger("kvshm.zmq_ctrl.router")


#: Upper bounds (seconds) of the request latency histogram buckets.
LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
                   50e-3, 100e-3, 250e-3, 1.0, float("inf"))

#: Request headers shorter than this are not offered to the batch path (a few keys:
#: the Python path's cost is the call's, not the keys')
_BATCHQ_MIN_BYTES = 256

#: Op.HELLO as a plain int (no enum attribute lookup per request)
_HELLO = int(Op.HELLO)


class DispatchMixin(LoopState):
    """Request dispatch of ServiceLoop (a mixin of it)."""

    def _dispatch(self, msg: list[zmq.Frame], decoded: Any = None, t0: float = 0.0,
                  conn: Any = CONN_NOW) -> None:
        """Serve one request; ``decoded``: its header, decoded over earlier turns
        (:meth:`_run_decodes`), ``t0`` when it came; ``conn``: the connection it came on
        (:func:`~kvshm.zmq_ctrl.sends.conn_of` taken then) when it is served turns
        later (decoded over turns, held behind its peer's), CONN_NOW otherwise."""
        if decoded is None:
            t0 = time.perf_counter()
        ident = msg[0]
        if type(ident) is not bytes:            # a pyzmq Frame
            ident = ident.bytes
        req_id = 0
        op = -1
        # the connection its tracked reply goes on (decoded over turns: taken when it came)
        src = conn if conn is not CONN_NOW else (msg[1] if len(msg) >= 2 else None)
        if len(msg) < 2:
            self._count_error("malformed")
            self._send(ident, encode_reply(Status.MALFORMED, 0, {"error": "no header frame"}))
            return
        if self._unadmitted:
            # connections without HELLO are held: this one is admitted if its routing id
            # has an open session (kvshm.zmq_ctrl.admission)
            self._admit_live(ident, src)
        try:
            if decoded is not None:
                version, op, req_id, epoch, body = decoded
            elif (self._batchq is not None and len(msg[1]) >= _BATCHQ_MIN_BYTES
                  and self._batchq.handle(msg, t0)):
                return                  # a plain batch EXISTS / MATCH_PREFIX, served in C
            elif len(msg[1]) >= STREAM_HEADER_BYTES:
                # a large request: its header is decoded a slice a turn; this peer's
                # later messages wait behind it
                self._decodes.append(_Decoding(ident, msg, RequestDecoder(msg[1]), t0,
                                               conn))
                self._held[ident] = collections.deque()
                return
            else:
                version, op, req_id, epoch, body = decode_request(msg[1].buffer)
        except DecodeError as exc:
            self._count_error("malformed")
            self._send(ident, encode_reply(Status.MALFORMED, 0, {"error": str(exc)}))
            return
        if not -(2**63) <= req_id < 2**64:
            self._count_error("malformed")
            self._send(ident, encode_reply(Status.MALFORMED, 0,
                                           {"error": "req_id out of range"}))
            return
        if version != PROTOCOL_VERSION:
            self._count_error("bad_version")
            self._send(ident, encode_reply(Status.BAD_VERSION, req_id, {
                "error": f"server speaks protocol {PROTOCOL_VERSION}, request used {version}",
                "version": PROTOCOL_VERSION}))
            return
        handler = self._handlers.get(op)
        if handler is None and op != _HELLO:      # HELLO: self._hello, below
            self._count_error("unknown_op")
            self._send(ident, encode_reply(Status.UNKNOWN_OP, req_id,
                                           {"error": f"unknown op {op}"}))
            return
        fresh = epoch == self.epoch
        reply_extra: dict[str, Any] = {}
        on_sent: list[Any] = []
        status: int
        rbody: dict[str, Any]
        frames: list[Any]
        session = self._session_of(ident, src)
        if op == _HELLO:
            try:
                carried = fresh and session is not None
                if carried:
                    self._piggyback(session, body, reply_extra)
                status, rbody, frames, session = self._hello(ident, msg[1], body, session,
                                                              src)
                if status == Status.OK and self._admitting:
                    self._admit(src)        # its connection is not shut down
                if fresh and not carried and status == Status.OK and session is not None:
                    # a new connection of the same client (a new routing id: reconnect,
                    # the ipc endpoint): the grants its settle lists name moved over
                    # with the nonce
                    self._piggyback(session, body, reply_extra)
            except _Malformed as exc:
                self._count_error("malformed")
                status, rbody, frames = Status.MALFORMED, {"error": str(exc)}, []
            except Exception as exc:
                log.exception("internal error handling HELLO")
                self._count_error("internal")
                status, rbody, frames = Status.INTERNAL, {"error": f"internal error: {exc!r}"}, []
            self._reply(ident, session, req_id, op, status, rbody, frames, reply_extra, [], t0)
            return
        if session is None:
            self._count_error("no_session")
            self._send(ident, encode_reply(Status.STALE_EPOCH, req_id, {
                "error": "no session: say HELLO (with the server's token) first",
                "epoch": self.epoch}))
            return
        session.seen = t0
        try:
            if fresh:
                if self._settle_is_large(session, body):
                    assert handler is not None
                    self._settle_in_slices(session, req_id, body, msg[2:], on_sent,
                                           reply_extra, handler)
                self._piggyback(session, body, reply_extra)
            if op in self._stateful and not fresh:
                status, rbody, frames = Status.STALE_EPOCH, {
                    "error": "server restarted; say HELLO again", "epoch": self.epoch}, []
            else:
                assert handler is not None
                status, rbody, frames = handler(session, req_id, body, msg[2:], on_sent)
        except _Defer as d:
            p = _Parked(ident, session, req_id, op, d, reply_extra, on_sent, t0,
                        time.monotonic() + (self.store.config.tier_wait if d.wait is None
                                            else d.wait), src)
            if p.sliced:
                self.slice_counters["sliced_requests"] += 1
                self._runnable.append(p)
            else:
                self._parked.append(p)
            self._parked_by[(session.id, req_id)] = p
            return
        except _Malformed as exc:
            self._count_error("malformed")
            status, rbody, frames = Status.MALFORMED, {"error": str(exc)}, []
        except _BatchTooLarge as exc:
            status, rbody, frames = Status.INVALID_REQUEST, {"error": str(exc)}, []
        except Exception as exc:  # a bug: log it, answer, keep serving
            log.exception("internal error handling op %s", op)
            self._count_error("internal")
            status, rbody, frames = Status.INTERNAL, {"error": f"internal error: {exc!r}"}, []
        self._reply(ident, session, req_id, op, status, rbody, frames, reply_extra, on_sent,
                    t0, src)

    def _piggyback(self, session: Session, body: dict[str, Any],
                   extra: dict[str, Any]) -> None:
        rel = body.get("release")
        if rel:
            rel = _list(body, "release", ints=True)
            self.store.release(session, rel)
            self._cancel_parked(session, rel)
        ab = body.get("abort")
        if ab:
            ab = _list(body, "abort", ints=True)
            self.store.abort(session, ab)
            self._cancel_parked(session, ab)
        com = body.get("commit")
        if com:
            failed = self.store.commit(session, _list(body, "commit", ints=True))
            if failed:
                extra["commit_failed"] = failed

    def _reply(self, ident: bytes, session: Session | None, req_id: int, op: int,
               status: int, rbody: dict[str, Any], frames: list[Any],
               reply_extra: dict[str, Any], on_sent: list[Any], t0: float,
               src: Any = None) -> None:
        if type(src) is tuple and not conn_still(self._native, src):
            # served turns after it came, and its connection ended since: the routing id
            # may be another connection's now (a thief's); the reply is dropped and
            # what it pinned settled (as a reply its peer never read)
            self._count_error("reply_conn_gone")
            if type(frames) is list:
                frames.clear()
            if on_sent and session is not None:
                self.store.sent(session, sum(e for e in on_sent if isinstance(e, int)),
                                [e for e in on_sent if not isinstance(e, int)])
                on_sent.clear()
            return
        if reply_extra:
            rbody.update(reply_extra)
        if not on_sent and not frames and len(rbody) < 8:
            for v in rbody.values():
                if type(v) is list and len(v) > STREAM_REPLY_ITEMS:
                    # a large reply: encoded a chunk a turn, then sent (nothing pinned)
                    self._encodes.append(_Encoding(ident, op, ReplyEncoder(status, req_id,
                                                                           rbody), t0,
                                                  req_id, conn_of(src)))
                    return
        track = bool(on_sent) and session is not None
        try:
            header = encode_reply(status, req_id, rbody)
        except Exception as exc:    # a handler's reply msgpack cannot encode (a bug)
            # (its frames, views of the pool, dropped as below: the logged traceback
            # holds this frame, and a handler that keeps records would keep them)
            if type(frames) is list:
                frames.clear()
            self._reply_bug(ident, session, req_id, op, exc, on_sent, t0)
            return
        try:
            tracker = self._send(ident, header, frames, track=track)
        except Exception as exc:    # not sent (a frame it cannot send: a bug; _send drops
            # a ZMQError itself): what the reply pinned is settled, INTERNAL answers it;
            # its frames (views of the pool) dropped now, not kept by the logged traceback
            if type(frames) is list:
                frames.clear()
            self._reply_bug(ident, session, req_id, op, exc, on_sent, t0)
            return
        if track:
            assert session is not None
            entries = [e for e in on_sent if not isinstance(e, int)]
            nblocks = sum(e for e in on_sent if isinstance(e, int))
            if tracker is None or tracker.done:
                # done at once (nothing zero-copy: a copied small value): settled now,
                # not through _sending and a later turn's _reap_sends
                self.store.sent(session, nblocks, entries)
            else:
                self._sending.append((tracker, entries, nblocks, session, ident,
                                      time.monotonic(), conn_of(src)))
        self._record_latency(op, t0)

    def _unanswered(self, msg: list[Any], decoded: Any, exc: BaseException) -> None:
        """Answer INTERNAL a request whose dispatch raised before any reply went (a bug
        outside the handlers; logged and counted by the caller): its id from ``decoded``
        or its header; a header that does not decode has no id to answer."""
        try:
            ident = msg[0] if type(msg[0]) is bytes else msg[0].bytes
            if decoded is None:
                decoded = decode_request(msg[1].buffer)
            req_id = decoded[2]
            self._send(ident, encode_reply(Status.INTERNAL, req_id,
                                           {"error": f"internal error: {exc!r}"}))
        except Exception:
            log.exception("internal error answering a request whose dispatch failed")

    def _reply_bug(self, ident: bytes, session: Session | None, req_id: int, op: int,
                   exc: BaseException, on_sent: list[Any], t0: float) -> None:
        """A reply that could not be encoded (a bug): logged, counted, answered INTERNAL
        (the handler's exceptions' status); what it pinned for its frames is settled."""
        log.error("internal error encoding the reply to op %s", op, exc_info=exc)
        self._count_error("internal")
        if on_sent and session is not None:
            self.store.sent(session, sum(e for e in on_sent if isinstance(e, int)),
                            [e for e in on_sent if not isinstance(e, int)])
            on_sent.clear()
        self._send(ident, encode_reply(Status.INTERNAL, req_id,
                                       {"error": f"internal error: {exc!r}"}))
        self._record_latency(op, t0)

    def _record_latency(self, op: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        # keyed by the op's int (an Op member hashes as its int): no enum call per reply;
        # an op added through add_ops gets its histogram on first use
        hist = self.latency.get(op)
        if hist is None:
            if op not in self._handlers and op != Op.HELLO:
                return
            hist = self.latency[op] = [0] * len(LATENCY_BUCKETS)
            self.latency_sum[op] = 0.0
        hist[bisect_left(LATENCY_BUCKETS, dt)] += 1
        self.latency_sum[op] += dt
