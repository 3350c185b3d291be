"""Large requests in slices, and the sliced codec (large headers, large replies).

Large requests in slices. A request of more than ``slice_keys`` keys (EXISTS, MATCH_PREFIX,
DELETE, ALLOC, PUT, LOOKUP, GET) is served ``slice_keys`` keys at a time: its handler
raises :class:`_Sliced`, the request joins the loop's runnable requests, and each turn of
the loop serves every queued message and then one slice of each runnable request (round
robin, so several large requests advance together). Its reply goes out when its last slice
is done. Per-key results are those of one request: the slices of an ALLOC or LOOKUP make
one grant (``extend=`` of the store), a quota spent by the first slices refuses the keys of
the later ones, and a slice that must wait for the tier parks the request
(:mod:`kvshm.zmq_ctrl.parked`) (once forced, its later slices are forced too, so the wait
stays bounded by ``tier_wait``). A RELEASE/ABORT naming it, or its session's end, abandons
it: the grant made so far is settled (by that RELEASE/ABORT or by the session's close) and
no later slice runs. Between two slices the store may change: a sliced EXISTS is not a
snapshot, as two requests are not. The codec is sliced too: a request header of at least
:data:`STREAM_HEADER_BYTES` is decoded ``2 * slice_keys`` msgpack items a turn
(:class:`~kvshm.zmq_ctrl.protocol.RequestDecoder`; that peer's later messages wait behind
it, so its requests still take effect in its order; at
:data:`~kvshm.zmq_ctrl.router.HELD_MAX` of them the rest is decoded at once), and a reply
with a list of more than :data:`STREAM_REPLY_ITEMS` items (and no payload) is encoded ``4 *
slice_keys`` items a turn (:class:`~kvshm.zmq_ctrl.protocol.ReplyEncoder`, the same bytes).
"""

from __future__ import annotations

import collections
import logging
import sys
import time
from typing import Any, Callable

from kvshm.store import Session
from kvshm.zmq_ctrl.handling import _MORE, _BatchTooLarge, _Defer, _list, _Malformed, _Sliced
from kvshm.zmq_ctrl.loopstate import LoopState
from kvshm.zmq_ctrl.parked import _Parked
from kvshm.zmq_ctrl.protocol import (
    DecodeError,
    ReplyEncoder,
    RequestDecoder,
    Status,
    encode_reply,
)
from kvshm.zmq_ctrl.sends import CONN_NOW, conn_of, conn_still

#: the loop's one logger: its records keep the name they had before the loop was
#: split into modules (as kvshm.store's modules share "kvshm.store")
log = logging.getLogger("kvshm.zmq_ctrl.router")


#: Keys a request may have before it is served in slices (``ServerConfig.slice_keys``,
#: ``kvshm serve --slice-keys``): ~1 ms of loop time per slice on this VM (an EXISTS key
#: costs ~0.4 us; an ALLOC key ~1 us, so ALLOC goes ``slice_keys // 2`` keys a slice).
SLICE_KEYS = 2048

#: Request header frames of at least this many bytes (~3.5 k keys) are decoded over
#: several turns (``RequestDecoder``, ``2 * slice_keys`` items a turn: ~1 ms), other
#: requests served between; one of 100 k keys takes ~15-25 ms in one go on this VM.
STREAM_HEADER_BYTES = 64 << 10
#: Replies with a list of more than this many items (and no payload) are encoded over
#: several turns (``ReplyEncoder``, ``4 * slice_keys`` items a turn: ~1 ms; ``8 *`` took
#: ~2 ms a turn for an ALLOC's offsets and statuses).
STREAM_REPLY_ITEMS = 16384


class _Decoding:
    """A large request whose header is being decoded (:meth:`ServiceLoop._run_decodes`)."""

    __slots__ = ("ident", "msg", "decoder", "t0", "conn")

    def __init__(self, ident: bytes, msg: list[Any], decoder: RequestDecoder,
                 t0: float, conn: Any = CONN_NOW) -> None:
        self.ident = ident
        self.msg = msg
        self.decoder = decoder
        self.t0 = t0
        # the connection it came on, taken now (sends.conn_of): by the time it is
        # dispatched the peer's fd number may name another client's connection
        self.conn = conn_of(msg[1]) if conn is CONN_NOW else conn


class _Encoding:
    """A large reply being encoded (:meth:`ServiceLoop._run_encodes`)."""

    __slots__ = ("ident", "op", "encoder", "t0", "req_id", "conn")

    def __init__(self, ident: bytes, op: int, encoder: ReplyEncoder, t0: float,
                 req_id: int = 0, conn: Any = None) -> None:
        self.ident = ident
        #: the connection its request came on (sends.conn_of): sent only while it lasts
        self.conn = conn
        self.op = op
        self.encoder = encoder
        self.t0 = t0
        self.req_id = req_id        # for an INTERNAL reply if encoding it fails


class SlicesMixin(LoopState):
    """Slices and the sliced codec of ServiceLoop (a mixin of it)."""

    @property
    def in_progress(self) -> int:
        """Large requests being served in slices (runnable or parked)."""
        return (len(self._runnable) + len(self._decodes) + len(self._encodes)
                + sum(1 for p in self._parked if p.sliced))

    def _sliced_c(self, ident: bytes, session: Session, req_id: int, op: int,
                  step: Callable[[bool], Any], cleanup: Callable[[], None], t0: float,
                  src: Any) -> None:
        """A large request the batch path serves in slices: ``step(force)`` does one
        and returns ``_MORE``, or the reply header (bytes) after the last one."""
        p = _Parked(ident, session, req_id, op, _Sliced(step, cleanup), {}, [], t0,
                    time.monotonic() + self.store.config.tier_wait, src)
        self.slice_counters["sliced_requests"] += 1
        self._runnable.append(p)
        self._parked_by[(session.id, req_id)] = p

    def _run_slices(self) -> None:
        """One slice of each large request in progress, in turn."""
        for _ in range(len(self._runnable)):
            p = self._runnable.popleft()
            if p.session.closed and not p.cancelled and p.follows is not None \
                    and p.follows():
                self._follow(p)
            if p.cancelled or p.session.closed:
                self._abandon(p)
                continue
            self.slice_counters["slices"] += 1
            r = self._attempt(p, p.forced, "slice of op")
            if r is _MORE:
                self._runnable.append(p)
                continue
            if r is None:                   # must wait for the tier: parked
                p.deadline = time.monotonic() + self.store.config.tier_wait
                self._parked.append(p)
                continue
            self._parked_by.pop((p.session.id, p.req_id), None)
            if type(r) is bytes:            # a reply made whole in C (_sliced_c)
                if not conn_still(self._native, p.src):
                    self._count_error("reply_conn_gone")    # (see _reply)
                    continue
                self._send(p.ident, r)
                self._record_latency(p.op, p.t0)
                continue
            status, rbody, frames = r
            self._reply(p.ident, p.session, p.req_id, p.op, status, rbody, frames, p.extra,
                        p.on_sent, p.t0, p.src)

    def _follow(self, p: _Parked) -> None:
        """``p`` (a sliced settle whose session a new HELLO of the same client replaced:
        the grants it settles moved over) goes on for the live session, its reply to the
        connection it came on; nothing when the session was closed for good."""
        live = p.session.live()
        if live is None:
            return
        self._parked_by.pop((p.session.id, p.req_id), None)
        p.session = live
        self._parked_by[(live.id, p.req_id)] = p

    def _settle_is_large(self, session: Session, body: dict[str, Any]) -> bool:
        """Whether the grants this request's commit/abort/release lists name hold more
        than ``slice_keys`` entries (settled in slices, :meth:`_settle_in_slices`)."""
        if not session.grants:
            return False
        n = 0
        for name in ("release", "abort", "commit"):
            rids = body.get(name)
            if rids and isinstance(rids, list):
                try:
                    n += self.store.grant_entries(session, rids)
                except TypeError:           # an unhashable id: _piggyback refuses it
                    return False
        return n > self.slice_keys

    def _settle_in_slices(self, session: Session, req_id: int, body: dict[str, Any],
                          frames: list[Any], on_sent: list[Any], extra: dict[str, Any],
                          handler: Callable[..., Any]) -> None:
        """Settle the grants a request names (release, abort, commit, in that order, as
        :meth:`_piggyback`) ``slice_keys`` entries per slice, then serve the request
        itself (which may be sliced or parked in turn). RELEASE/ABORT cancel parked
        requests at once; COMMITs that fail are reported as ``commit_failed``."""
        rel = _list(body, "release", ints=True, optional=True)
        ab = _list(body, "abort", ints=True, optional=True)
        com = _list(body, "commit", ints=True, optional=True)
        if rel:
            self._cancel_parked(session, rel)
        if ab:
            self._cancel_parked(session, ab)
        store = self.store
        # the grants it aborts, then those it commits, are this request's to settle: a
        # later request's ABORT of one being committed (or COMMIT of one being aborted)
        # does not take effect between its slices (Store.begin_settle)
        marked = store.begin_settle(session, "abort", ab) if ab else []
        if com:
            marked += store.begin_settle(session, "commit", com)
        todo = collections.deque([*(("release", r) for r in rel),
                                  *(("abort", r) for r in ab),
                                  *(("commit", r) for r in com)])
        failed: list[int] = []
        S = self.slice_keys
        inner: list[Any] = [None, None]     # the request's own attempt and cleanup

        def step(force: bool) -> Any:
            if inner[0] is not None:
                return inner[0](force)
            # the session whose grants these are now: a new HELLO of the same client
            # (same nonce) between two slices moved them over (follows, _follow)
            cur = session.live() or session
            left = S
            while todo and left > 0:
                how, rid = todo[0]
                k = store.settle_some(cur, rid, how, left)
                if k < 0:
                    if how == "commit":
                        failed.append(rid)
                    todo.popleft()
                    continue
                left -= k
                if cur.grants.get(rid) is None or k == 0:
                    todo.popleft()
            if todo:
                return _MORE
            if failed:
                extra["commit_failed"] = failed
            try:
                return handler(cur, req_id, body, frames, on_sent)
            except _Defer as d:
                inner[0], inner[1] = d.attempt, d.cleanup
                return None if not isinstance(d, _Sliced) else _MORE
            except _Malformed as exc:
                self._count_error("malformed")
                return Status.MALFORMED, {"error": str(exc)}, []
            except _BatchTooLarge as exc:
                return Status.INVALID_REQUEST, {"error": str(exc)}, []

        def cleanup() -> None:
            if todo and marked:     # abandoned before its grants were settled
                store.end_settle(marked)
            if inner[1] is not None:
                inner[1]()

        # while settling, the grants follow a new HELLO of the client; the request's own
        # attempt (inner) was made for one session and is abandoned with it. (Raised
        # unnamed: a local bound to it would close a cycle frame -> it -> its traceback
        # -> frame, which only a full collection frees: tests/test_gc_cycles.py)
        raise _Sliced(step, cleanup, follows=lambda: inner[0] is None)

    def _run_decodes(self) -> None:
        """One step of each large header being decoded; a request decoded is dispatched,
        then the messages its peer sent since (held until then)."""
        budget = 2 * self.slice_keys
        for _ in range(len(self._decodes)):
            job = self._decodes.popleft()
            try:
                r = job.decoder.step(budget)
            except DecodeError as exc:
                self._count_error("malformed")
                self._send(job.ident, encode_reply(Status.MALFORMED, 0, {"error": str(exc)}))
                r = None
                done = True
            else:
                done = r is not None
            if not done:
                self._decodes.append(job)
                continue
            self._decoded(job, r)

    def _finish_decode(self, ident: bytes) -> None:
        """The rest of ``ident``'s large header decoded now (its held messages reached
        :data:`HELD_MAX`), then served as :meth:`_run_decodes` would."""
        for job in self._decodes:
            if job.ident == ident:
                break
        else:                                   # pragma: no cover - held implies a job
            return
        self._decodes.remove(job)
        try:
            r = job.decoder.step(sys.maxsize)
        except DecodeError as exc:
            self._count_error("malformed")
            self._send(job.ident, encode_reply(Status.MALFORMED, 0, {"error": str(exc)}))
            r = None
        self._decoded(job, r)

    def _decoded(self, job: _Decoding, r: Any) -> None:
        """A large header decoded (``r``; None: it was refused): the request served,
        then the messages its peer sent since."""
        if r is not None:
            sends = self._sends
            try:
                self._dispatch(job.msg, r, job.t0, job.conn)
            except Exception as exc:
                log.exception("internal error dispatching a request")
                self._count_error("internal")
                if self._sends == sends:
                    self._unanswered(job.msg, r, exc)
        q = self._held.pop(job.ident, None)
        while q:
            self._handle(*q.popleft())
            if job.ident in self._held:     # that one is being decoded in turn
                self._held[job.ident].extend(q)
                break

    def _run_encodes(self) -> None:
        """One step of each large reply being encoded; sent once whole."""
        budget = 4 * self.slice_keys
        for _ in range(len(self._encodes)):
            job = self._encodes.popleft()
            try:
                header = job.encoder.step(budget)
            except Exception as exc:    # an item msgpack cannot encode (a bug)
                self._fast_internal(job.ident, job.req_id, job.op, exc, job.t0)
                continue
            if header is None:
                self._encodes.append(job)
                continue
            if not conn_still(self._native, job.conn):
                self._count_error("reply_conn_gone")        # (see _reply)
                continue
            self._send(job.ident, header)
            self._record_latency(job.op, job.t0)
