"""The server's ZeroMQ loop: one ROUTER socket, decode, dispatch to the Store, reply.

The loop thread owns the :class:`~kvshm.store.Store`. It wakes only for a message, a
lease deadline, a periodic eviction, a zero-copy send in flight, a tier's I/O completion
(through :meth:`ServiceLoop.wake`), or :meth:`stop`, so an idle server sleeps in
``zmq_poll`` and uses no CPU.

Deferred replies. With a tier below the pool a request may have to wait for disk I/O: a
LOOKUP/GET of a key that lives only on SSD (promoted first), an ALLOC/PUT that needs
room while spills are in flight. Its handler then raises :class:`_Defer` with an
``attempt(force)`` function; the request is parked (its piggybacked COMMIT/RELEASE/ABORT
are applied already, as for any request) and attempted again each time the store makes
progress. Its reply goes out when an attempt succeeds, or unconditionally (``force``)
once it waited ``StoreConfig.tier_wait`` seconds. Replies to one client may thus leave in
another order than its requests came; clients match them by request id, and grants are
named by request id, so COMMIT/RELEASE stay exact. A RELEASE or ABORT that names a
parked request (its client gave up on it) cancels it: the grant it would make is never
made.

Sessions. HELLO opens a :class:`~kvshm.store.Session` of the store (its ``session`` id is
in the reply); every later request of that connection (ZeroMQ routing id) belongs to it,
and every handler gets ``(session, req_id, body, frames, on_sent)``; ``session.principal``
is who it is, proven, not claimed: the uid owning the client's liveness file (a
same-host client that attached the pool, :class:`kvshm.segments.Liveness`), the CURVE
key of an authenticated peer, or the holder of the server's door token. Without the
door token or a CURVE key a HELLO is refused and no other request is served. A new
HELLO with the same client ``nonce`` replaces the old session (its grants move over);
a session whose liveness proof is gone is closed and its grants reclaimed at once.

Large requests in slices. A request of more than ``slice_keys`` keys (EXISTS,
MATCH_PREFIX, DELETE, ALLOC, PUT, LOOKUP, GET) is served ``slice_keys`` keys at a time:
its handler raises :class:`_Sliced`, the request joins the loop's runnable requests, and
each turn of the loop serves every queued message and then one slice of each runnable
request (round robin, so several large requests advance together). Its reply goes out
when its last slice is done. Per-key results are those of one request: the slices of an
ALLOC or LOOKUP make one grant (``extend=`` of the store), a quota spent by the first
slices refuses the keys of the later ones, and a slice that must wait for the tier parks
the request as above (once forced, its later slices are forced too, so the wait stays
bounded by ``tier_wait``). A RELEASE/ABORT naming it, or its session's end, abandons it:
the grant made so far is settled (by that RELEASE/ABORT or by the session's close) and no
later slice runs. Between two slices the store may change: a sliced EXISTS is not a
snapshot, as two requests are not. The codec is sliced too: a request header of at least
:data:`STREAM_HEADER_BYTES` is decoded ``2 * slice_keys`` msgpack items a turn
(:class:`~kvshm.zmq_ctrl.protocol.RequestDecoder`; that peer's later messages wait behind
it, so its requests still take effect in its order), and a reply with a list of more
than :data:`STREAM_REPLY_ITEMS` items (and no payload) is encoded ``4 * slice_keys``
items a turn (:class:`~kvshm.zmq_ctrl.protocol.ReplyEncoder`, the same bytes).

Sockets. When :mod:`kvshm.zmq_ctrl._zmqc` is built, the loop polls, receives and sends
through it (direct libzmq calls; the header frame is kept as a libzmq message for its
metadata, zero-copy replies are tracked in C); otherwise through pyzmq, alike.

One-key fast path. With ``_zmqc``, each drained message is first offered to
:class:`kvshm.zmq_ctrl._fastpath.FastPath`: a plain one-key PUT, GET or EXISTS of an open
session is decoded, served and answered there in C (the same store calls, the same reply
bytes, latency recorded); anything else (another op, piggybacked settles, a tier, an odd
or hostile header, a value it does not copy) it declines before changing anything, and
the Python path below serves it. ``ServiceLoop.fast_counts()`` (STATS: ``fast_path``)
says how many it took.

Batch EXISTS / MATCH_PREFIX path. A plain batch EXISTS or MATCH_PREFIX (``{"keys":
[bin, ...]}`` and nothing else, an open session, no tier) is parsed, looked up and
answered in C from its request frame (:class:`kvshm.zmq_ctrl._batchq.BatchQuery`; the
same reply bytes), a large one in slices of ``SLICE_MULT * slice_keys`` keys (the reply
made in C after the last, :meth:`ServiceLoop._sliced_c`); anything else it declines
before changing anything. ``KVSHM_BATCHPATH=0`` turns it off (``fast_path``'s
``EXISTS_batch``, ``MATCH_PREFIX_batch``, ``batch_declined`` count it).

Lean turns. While nothing is parked, sliced, decoded, encoded or in flight and no tier is
attached, :meth:`ServiceLoop.run` hands its turns to ``FastPath.serve``: it waits
(``_zmqc.wait_in``: ``ZMQ_EVENTS``, then one ``poll(2)``), drains, serves and flushes in
C, turn after turn, until a message takes the Python path, the earliest timer (leases,
the liveness check, ticks' deadlines, periodic eviction, the latest full collection) is
due, or the wake pipe (stop, poke, a signal's wake-up fd) or the monitor fires; the
Python turn then goes on from there. Ticks and housekeeping thus run at their deadlines,
not on every request (``fast_path``'s ``lean_turns``: turns done in C; ``lean_returns``:
hand-backs). :meth:`ServiceLoop.turn` (tests) is always one Python turn.

Nothing a client sends may raise out of the loop: every handler runs under a catch-all
that answers INTERNAL, and the store's lease and liveness checks never raise.
"""

from __future__ import annotations

import collections
import errno
import gc
import hmac
import logging
import os
import sys
import threading
import time
from bisect import bisect_left
from typing import Any, Callable, Sequence

import zmq

from kvshm import _index
from kvshm._pool import PackedValues
from kvshm.segments import Liveness
from kvshm.store import QUOTA_REFUSED, Outcome, Session, Store
from kvshm.zmq_ctrl.frames import PACK_BELOW, PACK_FRAME_BYTES, FrameLayoutError
from kvshm.zmq_ctrl.frames import plan as plan_frames
from kvshm.zmq_ctrl.frames import unpack as unpack_frames
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

try:    # direct libzmq calls for the hot loop; without them pyzmq does the same
    from kvshm.zmq_ctrl import _zmqc
except ImportError:     # pragma: no cover - the extension is not built, or no libzmq found
    _zmqc = None  # type: ignore[assignment]

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
#: Request headers shorter than this are not offered to the batch path (a few keys:
#: the Python path's cost is the call's, not the keys')
_BATCHQ_MIN_BYTES = 256
#: KVSHM_LEAN_TURNS=0 turns run()'s lean turns off (A/B figures; every turn is a Python
#: one then, the fast path still serving one-key requests)
_LEAN_ON = os.environ.get("KVSHM_LEAN_TURNS", "1") != "0"

__all__ = ["ServiceLoop", "LATENCY_BUCKETS"]

log = logging.getLogger(__name__)

#: Upper bounds (seconds) of the request latency histogram buckets.
LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
                   50e-3, 100e-3, 250e-3, 1.0, float("inf"))


_STALE_CHECK_S = 0.002   # poll interval while zero-copy sends are in flight

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
#: A peer's messages held behind its large header being decoded (read off the socket,
#: past libzmq's receive HWM, before any session check): at this many, the rest of that
#: decode runs at once, as before the sliced codec, so what a peer makes the server hold
#: stays bounded however long its header takes.
HELD_MAX = 1024

#: ServiceLoop.run's own full garbage collections: once no request came for this long
#: (s), ...
_FULL_GC_QUIET_S = 1.0
#: ... at most this often (s), ...
_FULL_GC_IDLE_S = 5.0
#: ... and at the latest this long after the last one, busy or not (s).
_FULL_GC_MAX_S = 120.0


class _FullGcHold:
    """The process-wide collector setting shared by every ServiceLoop of a process.

    Thresholds are per process: the first loop to run keeps the automatic collector to its
    two young generations, the last one to stop puts the caller's thresholds back. (Each
    loop saving and restoring them itself left full collections off for good when two
    loops of one process, e.g. servers embedded in one program or in a test run, stopped
    in another order than they started.)"""

    _lock = threading.Lock()
    _holders = 0
    _saved: tuple[int, ...] = ()

    @classmethod
    def take(cls) -> None:
        with cls._lock:
            if cls._holders == 0:
                cls._saved = gc.get_threshold()
                t = cls._saved
                gc.set_threshold(t[0], t[1] if len(t) > 1 else 10, 1 << 30)
            cls._holders += 1

    @classmethod
    def give(cls) -> None:
        with cls._lock:
            cls._holders -= 1
            if cls._holders == 0:
                gc.set_threshold(*cls._saved)

#: Op.HELLO as a plain int (no enum attribute lookup per request)
_HELLO = int(Op.HELLO)

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
    request is abandoned (cancelled, its session gone, the server stops)."""


class _Parked:
    __slots__ = ("ident", "session", "req_id", "op", "attempt", "cleanup", "extra",
                 "on_sent", "t0", "deadline", "cancelled", "src", "on_poke", "sliced",
                 "forced")

    def __init__(self, ident: bytes, session: Session, req_id: int, op: int, d: _Defer,
                 extra: dict[str, Any], on_sent: list[Any], t0: float,
                 deadline: float, src: Any = None) -> None:
        self.ident = ident
        self.src = src
        self.session = session
        self.cancelled = False
        self.req_id = req_id
        self.op = op
        self.attempt = d.attempt
        self.cleanup = d.cleanup
        self.on_poke = d.on_poke
        self.extra = extra
        self.on_sent = on_sent
        self.t0 = t0
        self.deadline = deadline
        self.sliced = isinstance(d, _Sliced)
        self.forced = False         # a slice was forced: the later ones are too


class _Decoding:
    """A large request whose header is being decoded (:meth:`ServiceLoop._run_decodes`)."""

    __slots__ = ("ident", "msg", "decoder", "t0")

    def __init__(self, ident: bytes, msg: list[Any], decoder: RequestDecoder,
                 t0: float) -> None:
        self.ident = ident
        self.msg = msg
        self.decoder = decoder
        self.t0 = t0


class _Encoding:
    """A large reply being encoded (:meth:`ServiceLoop._run_encodes`)."""

    __slots__ = ("ident", "op", "encoder", "t0")

    def __init__(self, ident: bytes, op: int, encoder: ReplyEncoder, t0: float) -> None:
        self.ident = ident
        self.op = op
        self.encoder = encoder
        self.t0 = t0


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


def make_router(ctx: zmq.Context, socket_setup: Callable[[zmq.Socket], None] | None = None,
                max_frame_bytes: int = -1, ipv6: bool = False) -> zmq.Socket:
    """The server's ROUTER socket with its options set, not bound yet (``ipv6``: to bind
    an IPv6 address)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # No handover: a second connection claiming a connected peer's routing id is not
    # served (libzmq leaves it unidentified), so it can neither act on that peer's
    # session nor get its replies (docs/RELIABILITY.md, "Sessions and routing ids");
    # clients take a new routing id for each connection.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    if ipv6:
        sock.setsockopt(zmq.IPV6, 1)
    if max_frame_bytes > 0:
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    if socket_setup is not None:
        socket_setup(sock)
    return sock


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint``; returns the bound address (the port chosen for port 0).

    Raises
    ------
    OSError
        The address is taken or cannot be bound, with the endpoint in the message.
    """
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(exc.errno, f"cannot bind {endpoint}: {exc.strerror}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class ServiceLoop:
    """Serve the control protocol for one :class:`Store`.

    Parameters
    ----------
    store : Store
    endpoints : list of str
        ZeroMQ endpoints to bind (``tcp://127.0.0.1:12345``, ``ipc:///run/kvshm.sock``).
        A tcp port of 0 binds a free port; :attr:`endpoints` holds the bound addresses.
    hello : dict
        Static part of the HELLO reply (pool name, size, token, limits, ...).
    epoch : int
        This server instance's number, echoed by clients on stateful requests.
    periodic_evict : tuple (interval_s, min_ratio, max_ratio) or None
    socket_setup : callable, optional
        Called with the ROUTER socket before bind (CURVE options, ...).
    hello_hook : callable, optional
        ``hook(session, body) -> dict`` merged into the HELLO reply (the RDMA mover's
        connection set-up).
    door_token : bytes, optional
        The secret a HELLO must carry (``body["token"]``) unless its connection is
        CURVE-authenticated; None: no door (in-process tests), every peer gets an
        implicit session (an operator one).
    operator_token : bytes, optional
        A HELLO carrying it (``body["operator_token"]``) opens an operator session
        (:attr:`Session.operator`: DRAIN, PURGE, EVICT); a proof-holding local session
        of this server's uid or root is one without it.
    slice_keys : int
        Requests of more keys are served in slices of this many, other requests served
        between two slices (default :data:`SLICE_KEYS`; see the module docstring).
    """

    #: Sessions kept at most; beyond, the oldest without grants are closed.
    MAX_SESSIONS = 65536

    def __init__(self, store: Store, endpoints: list[str], hello: dict[str, Any],
                 epoch: int, *, periodic_evict: tuple[float, float, float] | None = None,
                 socket_setup: Callable[[zmq.Socket], None] | None = None,
                 hello_hook: Callable[[bytes, dict[str, Any]], dict[str, Any]] | None = None,
                 context: zmq.Context | None = None, max_frame_bytes: int = -1,
                 log_handshakes: bool = False, sock: zmq.Socket | None = None,
                 bound: Sequence[str] = (), door_token: bytes | None = None,
                 operator_token: bytes | None = None,
                 slice_keys: int = SLICE_KEYS) -> None:
        if slice_keys < 1:
            raise ValueError("slice_keys must be >= 1")
        self.slice_keys = slice_keys
        self._runnable: collections.deque[_Parked] = collections.deque()
        # large headers being decoded (one RequestDecoder step a turn each), and the
        # later messages of their peers, held until that request is dispatched (a
        # request's effects, its piggybacked COMMITs among them, stay in its peer's order)
        self._decodes: collections.deque[_Decoding] = collections.deque()
        self._held: dict[bytes, collections.deque[list[Any]]] = {}
        self._encodes: collections.deque[_Encoding] = collections.deque()
        #: sliced_requests (served in slices), slices (run), abandoned (cancelled or
        #: their session gone before the last slice)
        self.slice_counters = {"sliced_requests": 0, "slices": 0, "abandoned": 0}
        self._poller: zmq.Poller | None = None
        #: The longest a turn kept the loop from polling: wall seconds, and CPU seconds
        #: of the loop's thread (what other clients wait for, whatever the scheduler did).
        self.max_turn = {"wall_s": 0.0, "cpu_s": 0.0, "gc_s": 0.0, "gc_generation": -1}
        self._gc_t0 = 0.0
        self._next_full_gc = 0.0
        self._last_full_gc = 0.0
        self._next_evict: float | None = None
        self.store = store
        self.epoch = epoch
        self.hello = dict(hello)
        # Blocks one principal may hold in GET replies not yet sent (a peer that stops
        # reading must not pin the pool nor grow this process): beyond it, hits are
        # refused (QUOTA_REFUSED), and a peer whose replies stay unsent past the lease
        # loses them and its connection.
        self.send_cap_blocks = max(1, store.alloc.num_blocks // 4)
        self.door_token = door_token
        self.operator_token = operator_token
        self._by_ident: dict[bytes, Session] = {}
        self._by_nonce: dict[bytes, Session] = {}
        self._order: "collections.OrderedDict[int, Session]" = collections.OrderedDict()
        self._next_check = 0.0
        self.hello_hook = hello_hook
        self._periodic = periodic_evict
        self._ctx = context or zmq.Context.instance()
        if sock is None:
            sock = make_router(self._ctx, socket_setup, max_frame_bytes)
        self._sock = sock
        #: kvshm.zmq_ctrl._zmqc (module-level ``_zmqc`` when the loop is made), or None:
        #: pyzmq receives and sends
        self._zmqc = _zmqc
        #: replies queued by :meth:`_send` while a turn drains the socket (a list), else None
        self._outq: list[tuple[bytes, bytes]] | None = None
        self.endpoints: list[str] = list(bound)
        try:
            for ep in endpoints:
                self.endpoints.append(bind(self._sock, ep))
        except OSError:
            self._sock.close(0)
            raise
        self._monitor: zmq.Socket | None = None
        if log_handshakes:
            self._monitor = self._sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._running = True    # stop() before run() must still stop it
        self._parked: list[_Parked] = []
        self._seen_progress = -1
        self._pokes = 0             # poke() count (other threads); the loop's last seen:
        self._seen_pokes = 0
        self._tier_deadline: float | None = None
        # (tracker, zero-copy entries, blocks counted, session, ident, since, the
        # request's frame: it names the peer's socket)
        self._sending: list[tuple[zmq.MessageTracker, list[Any], int, Session, bytes,
                                  float, Any]] = []
        self._parked_by: dict[tuple[int, int], _Parked] = {}
        self.latency: dict[int, list[int]] = {op: [0] * len(LATENCY_BUCKETS) for op in Op}
        self.latency_sum: dict[int, float] = {op: 0.0 for op in Op}
        self.errors: dict[str, int] = {}
        self._handlers: dict[int, Callable[..., tuple[int, dict[str, Any], list[Any]]]] = {
            Op.ALLOC: self._on_alloc,
            Op.COMMIT: self._on_commit,
            Op.LOOKUP: self._on_lookup,
            Op.RELEASE: self._on_release,
            Op.PUT: self._on_put,
            Op.GET: self._on_get,
            Op.EXISTS: self._on_exists,
            Op.MATCH_PREFIX: self._on_match_prefix,
            Op.DELETE: self._on_delete,
            Op.EVICT: self._on_evict,
            Op.STATS: self._on_stats,
            Op.PURGE: self._on_purge,
            Op.LIST: self._on_list,
        }
        self._stateful = {Op.ALLOC, Op.LOOKUP, Op.COMMIT}
        self._ticks: list[Callable[[float], float | None]] = []
        self._tick_deadline: float | None = None
        #: the earliest timer (time.monotonic() s; inf: none) of the last
        #: :meth:`_next_timeout`, and whether the loop's next turns may be lean ones
        #: (FastPath.serve: nothing parked, sliced, in flight; no tier)
        self._due = float("inf")
        self._lean = False
        self._fast: Any = None
        self._make_fast()
        self._batchq: Any = None
        self._make_batchq()

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

    def _gc_timer(self, phase: str, info: dict[str, Any]) -> None:
        # the longest garbage collection (a pause of the loop, as a long turn)
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            dt = time.perf_counter() - self._gc_t0
            if dt > self.max_turn["gc_s"]:
                self.max_turn["gc_s"] = dt
                self.max_turn["gc_generation"] = info.get("generation", -1)

    def add_ops(self, handlers: dict[int, Callable[..., Any]],
                tick: Callable[[float], float | None] | None = None) -> None:
        """Serve more ops (``op -> handler``, as the built-in ones) and call ``tick(now)``
        each Python turn of the loop (it returns its next deadline, or None: none until a
        request of the Python path or a wake-up); the lean turns of :meth:`run` (see the
        module) call it no later than that deadline, not on every one-key request."""
        self._handlers.update(handlers)
        if tick is not None:
            self._ticks.append(tick)
        self._make_fast()
        self._make_batchq()

    # ------------------------------------------------------------------ lifecycle

    @property
    def wake_fd(self) -> int:
        """Write end of the loop's wake-up pipe (for ``signal.set_wakeup_fd``)."""
        return self._wake_w

    def stop(self) -> None:
        """Ask the loop to return. Safe from any thread and from a signal handler."""
        self._running = False
        self.wake()

    def poke(self) -> None:
        """Attempt the parked requests again at the next turn: an event outside the
        store (a new cluster view) may let one answer. Safe from any thread."""
        self._pokes += 1
        self.wake()

    def wake(self) -> None:
        """Wake the loop (a tier's I/O completed). Safe from any thread."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Close the socket (after :meth:`run` returned). Unpins entries still in flight."""
        for _, entries, nblocks, sess, *_ in self._sending:
            self.store.sent(sess, nblocks, entries)
        self._sending.clear()
        for p in [*self._parked, *self._runnable]:
            if p.cleanup is not None:
                p.cleanup()
        self._parked.clear()
        self._runnable.clear()
        self._decodes.clear()
        self._held.clear()
        self._encodes.clear()
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
        self._sock.close(0)
        if self._zmqc is not None:
            # zero-copy replies dropped by the close: their buffers (pool views) go
            # once libzmq says so (its reaper, at once with LINGER 0)
            self._zmqc.sweep(1.0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def run(self) -> None:
        """Serve until :meth:`stop`.

        Garbage collection: a full (oldest-generation) collection walks every entry of
        the store, ~0.1 s at 50 k entries on this VM, a pause of the whole loop that
        large requests (many short-lived objects) would trigger every few slices. While
        it runs the loop keeps the automatic collector to its two young generations and
        makes the full collections itself, once no request came for
        :data:`_FULL_GC_QUIET_S`, at most every :data:`_FULL_GC_IDLE_S` (and at the latest
        every :data:`_FULL_GC_MAX_S`, busy or not), so cyclic garbage is still collected. The thresholds are restored at the
        end. ``stats()["loop_max_turn"]["gc_s"]`` is the longest collection seen."""
        _FullGcHold.take()      # no automatic full collection while a loop runs
        gc.callbacks.append(self._gc_timer)
        now = time.monotonic()
        self._last_full_gc = now
        self._next_full_gc = now + _FULL_GC_IDLE_S
        busy = now
        try:
            while self._running:
                idle = self._turn(None, True)
                t = time.monotonic()
                if not idle:
                    busy = t
                elif t - busy >= _FULL_GC_QUIET_S and t >= self._next_full_gc:
                    self._full_gc()
                if t - self._last_full_gc > _FULL_GC_MAX_S:
                    self._full_gc()
        finally:
            _FullGcHold.give()
            if self._gc_timer in gc.callbacks:
                gc.callbacks.remove(self._gc_timer)

    def _full_gc(self) -> None:
        gc.collect()
        now = time.monotonic()
        self._last_full_gc = now
        self._next_full_gc = now + _FULL_GC_IDLE_S

    @property
    def in_progress(self) -> int:
        """Large requests being served in slices (runnable or parked)."""
        return (len(self._runnable) + len(self._decodes) + len(self._encodes)
                + sum(1 for p in self._parked if p.sliced))

    def turn(self, timeout_ms: int | None = None) -> bool:
        """One turn of the loop: wait for a message or a timer (at most ``timeout_ms``;
        None: until the next timer; no wait while large requests are in progress),
        serve what is queued, then leases, the tier, ticks, parked requests, one slice of
        each large request in progress, sends in flight, periodic eviction. :meth:`run`
        calls it until :meth:`stop`; tests drive it directly. Returns True when the
        wait ended with nothing to serve and no large request is in progress (idle)."""
        return self._turn(timeout_ms, False)

    def _turn(self, timeout_ms: int | None, many: bool) -> bool:
        """One turn of the loop: wait for a message or a timer (at most ``timeout_ms``;
        None: until the next timer; no wait while large requests are in progress),
        serve what is queued, then leases, the tier, ticks, parked requests, one slice of
        each large request in progress, sends in flight, periodic eviction. :meth:`run`
        calls it until :meth:`stop`; tests drive it directly. Returns True when the
        wait ended with nothing to serve and no large request is in progress (idle)."""
        poller = self._poller
        if poller is None:
            poller = self._poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            if self._monitor is not None:
                poller.register(self._monitor, zmq.POLLIN)
            if self._periodic:
                self._next_evict = time.monotonic() + self._periodic[0]
        sock = self._sock
        if self._runnable or self._decodes or self._encodes:
            timeout: int | None = 0
            self._lean = False
        else:
            timeout = self._next_timeout(self._next_evict)
            if timeout_ms is not None:
                timeout = timeout_ms if timeout is None else min(timeout, timeout_ms)
        zc = self._zmqc
        ev = -2
        served = False          # a lean turn of serve() ran (requests served in C)
        if many and self._lean and timeout_ms is None:
            lean0 = self._fast.lean_turns
            # :meth:`run`'s common turns (a message at a time, each served by the fast
            # path, no timer due) run in C until one needs this turn: it goes on with
            # what the wait saw, or after the drain (8), or polls again (16: a timer due)
            ev = self._fast.serve(sock, self._wake_r, self._monitor, self._due,
                                  zc.wait_in, zc.recv_multipart, zc.send_parts,
                                  self._handle, 256)
            # requests served in its C turns make this turn a busy one (run()'s full
            # collection waits for a quiet loop)
            served = self._fast.lean_turns != lean0
            if ev == -1:
                return False            # EINTR
            if ev == 16:
                timeout = self._next_timeout(self._next_evict)
                ev = -2
        drained = ev == 8
        if drained:
            ev = 1
        elif ev != -2:
            pass
        elif zc is not None:
            # one zmq_poll, GIL released, no pyzmq Poller (a Python layer per call)
            ev = zc.poll_in(sock, self._wake_r, self._monitor,
                            -1 if timeout is None else int(timeout))
            if ev < 0:
                return False            # EINTR
        else:
            try:
                events = dict(poller.poll(timeout))
            except zmq.ZMQError as exc:
                if exc.errno == errno.EINTR:
                    return False
                raise
            ev = ((1 if sock in events else 0) | (2 if self._wake_r in events else 0)
                  | (4 if self._monitor is not None and self._monitor in events else 0))
        w0 = time.perf_counter()
        # CPU time of the turn only while large requests are in progress (thread_time is
        # a system call, ~1-10 us: not on every small request's turn)
        c0 = (time.thread_time() if self._runnable or self._decodes or self._encodes
              else -1.0)
        if ev & 2:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        if ev & 4:
            self._log_handshakes()
        if ev & 1 and not drained:
            # Drain what is queued, bounded so timers still run under load.
            if zc is not None:
                recv = zc.recv_multipart
                handle = self._handle
                fast = self._fast
                # the plain replies of the drained requests go out together at the end
                # (:meth:`_send`): libzmq wakes its I/O thread once for the lot rather
                # than once a reply
                self._outq = outq = []
                try:
                    if fast is not None:
                        # the same loop in C, one-key requests served there
                        fast.drain(recv, sock, outq, handle, 256)
                    else:
                        for _ in range(256):
                            # header frame kept as a libzmq message: its metadata (peer,
                            # fd, User-Id) for HELLO and _cut; parts >= 64 KiB zero-copy
                            m = recv(sock, 1, 65536, 1)
                            if m is None:
                                break
                            handle(m)
                finally:
                    self._outq = None
                    if outq:
                        self._flush_out(outq)
            else:
                for _ in range(256):
                    try:
                        msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(msg)
        now = time.monotonic()
        self._housekeep(now)
        self._tier_deadline = self.store.service(now)
        if self._ticks:
            td = None
            for tick in self._ticks:
                d = tick(now)
                if d is not None and (td is None or d < td):
                    td = d
            self._tick_deadline = td
        if self._parked:
            self._retry_parked(now)
        if self._decodes:
            self._run_decodes()
        if self._runnable:
            self._run_slices()
        if self._encodes:
            self._run_encodes()
        if self._sending:
            self._reap_sends(now)
        next_evict = self._next_evict
        if next_evict is not None and now >= next_evict:
            assert self._periodic is not None
            n = self.store.periodic_evict(self._periodic[1], self._periodic[2])
            if n:
                log.info("periodic eviction freed %d entries", n)
            self._next_evict = now + self._periodic[0]
        mt = self.max_turn
        if c0 >= 0:
            dt = time.thread_time() - c0
            if dt > mt["cpu_s"]:
                mt["cpu_s"] = dt
        dt = time.perf_counter() - w0
        if dt > mt["wall_s"]:
            mt["wall_s"] = dt
        return (not ev and not served and not self._runnable and not self._decodes
                and not self._encodes)

    def _housekeep(self, now: float) -> None:
        """Leases and liveness proofs. Never raises: a bug here must not end the loop
        (and with it the cache)."""
        try:
            self.store.expire(now)
            if now >= self._next_check:
                # same-host sessions whose proof is gone: reclaim at once, not at lease
                self._next_check = now + min(1.0, self.store.config.lease_timeout / 4)
                if self.store.check_sessions():
                    self._forget_closed()
        except Exception:
            log.exception("internal error in lease/liveness housekeeping")
            self._count_error("internal")

    def sessions(self) -> list[Session]:
        """The open sessions (a snapshot)."""
        return [s for s in self._order.values() if not s.closed]

    def end_session(self, sess: Session, why: str) -> int:
        """Close ``sess`` now (every grant settled: :meth:`Store.close_session`) and
        forget it: its routing id names no session any more. Returns the grants
        settled."""
        n = self.store.close_session(sess, why)
        self._order.pop(sess.id, None)
        if self._by_ident.get(sess.conn) is sess:
            del self._by_ident[sess.conn]
        if self._by_nonce.get(sess.nonce) is sess:
            del self._by_nonce[sess.nonce]
        return n

    def _forget_closed(self) -> None:
        for d in (self._by_ident, self._by_nonce):
            for k in [k for k, v in d.items() if v.closed]:
                del d[k]
        for sid in [sid for sid, v in self._order.items() if v.closed]:
            del self._order[sid]

    def _next_timeout(self, next_evict: float | None) -> int | None:
        try:
            first = self.store.expire()
        except Exception:
            log.exception("internal error in lease expiry")
            first = None
        # the earliest of the deadlines (no list per turn)
        if self._by_nonce and (first is None or self._next_check < first):
            first = self._next_check
        if next_evict is not None and (first is None or next_evict < first):
            first = next_evict
        d = self._tier_deadline
        if d is not None and (first is None or d < first):
            first = d
        d = self._tick_deadline
        if d is not None and (first is None or d < first):
            first = d
        if self._parked:
            d = min(p.deadline for p in self._parked)
            if first is None or d < first:
                first = d
        # the turns FastPath.serve may run alone: until the earliest timer (the liveness
        # check and run()'s latest full collection among them), while nothing is parked,
        # sliced, decoded, encoded or in flight and no tier is attached
        lean = (_LEAN_ON and self._fast is not None and not self._parked and not self._sending
                and not self._runnable and not self._decodes and not self._encodes
                and self.store.tier is None)
        self._lean = lean
        if lean:
            due = self._last_full_gc + _FULL_GC_MAX_S
            if first is not None and first < due:
                due = first
            if self._next_check < due:
                due = self._next_check
            self._due = due
        now = time.monotonic()
        t = None
        if first is not None:
            t = max(0.0, first - now)
        if self._sending:
            t = _STALE_CHECK_S if t is None else min(t, _STALE_CHECK_S)
        if self._runnable:
            t = 0.0
        # at most an hour: a timer far away (or infinite) is looked at again then
        return None if t is None else int(min(t, 3600.0) * 1000) + 1

    def _log_handshakes(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        assert self._monitor is not None
        while True:
            try:
                ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._count_error("auth_refused")
            reasons: dict[int, str] = {
                zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its key is not allowed",
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CURVE handshake failed (no key, "
                                                     "or not this server's public key)"}
            why = reasons.get(int(ev["event"]), "handshake failed")
            log.warning("refused a client connection on %s: %s",
                        ev.get("endpoint", b"?").decode(errors="replace")
                        if isinstance(ev.get("endpoint"), bytes) else ev.get("endpoint"), why)

    def _retry_parked(self, now: float) -> None:
        """Attempt the parked requests again (in arrival order) after the store made
        progress, or once one waited long enough."""
        progress = self.store.progress
        pokes = self._pokes           # read once: a poke after this is seen next turn
        poked = pokes != self._seen_pokes
        if progress == self._seen_progress and not poked \
                and all(now < p.deadline for p in self._parked):
            return
        self._seen_pokes = pokes
        parked, self._parked = self._parked, []
        for p in parked:
            force = now >= p.deadline or p.forced
            if p.on_poke and not (poked or force or p.cancelled or p.session.closed):
                self._parked.append(p)
                continue
            if p.cancelled or p.session.closed:
                # its client gave up on it (RELEASE/ABORT of its id) or is gone: make no
                # grant it would never settle
                self._abandon(p)
                continue
            if force and p.sliced:
                p.forced = True
            r = self._attempt(p, force, "parked op")
            if r is None:
                self._parked.append(p)
                continue
            if r is _MORE:                  # a sliced request: its next slice runs now
                self._runnable.append(p)
                continue
            self._parked_by.pop((p.session.id, p.req_id), None)
            status, rbody, frames = r
            self._reply(p.ident, p.session, p.req_id, p.op, status, rbody, frames, p.extra,
                        p.on_sent, p.t0, p.src)
        # Progress the attempts made themselves (their own evictions) is no reason to
        # attempt again; the next completion or free is.
        self._seen_progress = self.store.progress

    def _attempt(self, p: _Parked, force: bool, what: str) -> Any:
        """Run a parked request's attempt (or a large request's next slice): its reply
        triple, None (wait for the tier) or _MORE (more slices). A bug in it is logged and
        answered INTERNAL, its cleanup run; a forced attempt must answer."""
        try:
            r = p.attempt(force)
            if r is None and force:
                raise RuntimeError(f"a forced attempt ({what}) did not answer")
            return r
        except Exception as exc:
            log.exception("internal error in a %s %s", what, p.op)
            self._count_error("internal")
            if p.cleanup is not None:
                p.cleanup()
            return Status.INTERNAL, {"error": f"internal error: {exc!r}"}, []

    def _abandon(self, p: _Parked) -> None:
        # cancelled (RELEASE/ABORT of its id) or its session is gone: no reply, no grant
        self._parked_by.pop((p.session.id, p.req_id), None)
        if p.sliced:
            self.slice_counters["abandoned"] += 1
        if p.cleanup is not None:
            p.cleanup()

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
            try:
                self._dispatch(job.msg, r, job.t0)
            except Exception:
                log.exception("internal error dispatching a request")
                self._count_error("internal")
        q = self._held.pop(job.ident, None)
        while q:
            self._handle(q.popleft())
            if job.ident in self._held:     # that one is being decoded in turn
                self._held[job.ident].extend(q)
                break

    def _run_encodes(self) -> None:
        """One step of each large reply being encoded; sent once whole."""
        budget = 4 * self.slice_keys
        for _ in range(len(self._encodes)):
            job = self._encodes.popleft()
            header = job.encoder.step(budget)
            if header is None:
                self._encodes.append(job)
                continue
            self._send(job.ident, header)
            self._record_latency(job.op, job.t0)

    def _run_slices(self) -> None:
        """One slice of each large request in progress, in turn."""
        for _ in range(len(self._runnable)):
            p = self._runnable.popleft()
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
                self._send(p.ident, r)
                self._record_latency(p.op, p.t0)
                continue
            status, rbody, frames = r
            self._reply(p.ident, p.session, p.req_id, p.op, status, rbody, frames, p.extra,
                        p.on_sent, p.t0, p.src)

    def _reap_sends(self, now: float) -> None:
        keep = []
        stuck: dict[bytes, Any] = {}
        lease = self.store.config.lease_timeout
        for item in self._sending:
            tracker, entries, nblocks, sess, ident, since, frame = item
            if tracker.done:
                self.store.sent(sess, nblocks, entries)
            else:
                keep.append(item)
                if now - since > lease and ident not in stuck:
                    stuck[ident] = frame
                    # once: its connection goes now; a new one starts a new count
                    keep[-1] = (*item[:5], now, frame)
        self._sending = keep
        for ident, frame in stuck.items():
            self._cut(ident, frame)

    def _cut(self, ident: bytes, frame: Any) -> None:
        """A peer has not read its replies within the lease: shut its connection down
        (libzmq then drops the unsent replies, and their pins go when their trackers
        say so). ``frame``: a request frame of that peer, naming its socket."""
        log.warning("peer %s has not read its replies within the lease (%g s): its "
                    "connection is dropped", ident.hex(), self.store.config.lease_timeout)
        self._count_error("unread_replies")
        try:
            fd = frame.get(zmq.SRCFD)
            peer = frame.get("Peer-Address")
        except (zmq.ZMQError, AttributeError, TypeError):
            return
        if type(fd) is not int or fd < 0:
            return
        import socket as _socket

        try:
            s = _socket.socket(fileno=os.dup(fd))
        except OSError:
            return
        try:
            if s.family in (_socket.AF_INET, _socket.AF_INET6):
                if s.getpeername()[0] != peer:
                    return                  # that fd is someone else's by now
            elif s.family != _socket.AF_UNIX:
                return
            s.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()

    # ------------------------------------------------------------------ dispatch

    def _count_error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def _handle(self, msg: list[zmq.Frame]) -> None:
        held = self._held
        if held:
            ident = msg[0] if type(msg[0]) is bytes else msg[0].bytes
            q = held.get(ident)
            if q is not None:       # behind its peer's request still being decoded
                q.append(msg)
                if len(q) >= HELD_MAX:
                    self._finish_decode(ident)
                return
        try:
            self._dispatch(msg)
        except Exception:      # a bug outside the handlers: log it, keep serving
            log.exception("internal error dispatching a request")
            self._count_error("internal")

    def _dispatch(self, msg: list[zmq.Frame], decoded: Any = None, t0: float = 0.0) -> None:
        """Serve one request; ``decoded``: its header, decoded over earlier turns
        (:meth:`_run_decodes`), ``t0`` when it came."""
        if decoded is None:
            t0 = time.perf_counter()
        ident = msg[0]
        if type(ident) is not bytes:            # a pyzmq Frame
            ident = ident.bytes
        req_id = 0
        op = -1
        if len(msg) < 2:
            self._count_error("malformed")
            self._send(ident, encode_reply(Status.MALFORMED, 0, {"error": "no header frame"}))
            return
        try:
            if decoded is not None:
                version, op, req_id, epoch, body = decoded
            elif (self._batchq is not None and len(msg[1]) >= _BATCHQ_MIN_BYTES
                  and self._batchq.handle(msg, t0)):
                return                  # a plain batch EXISTS / MATCH_PREFIX, served in C
            elif len(msg[1]) >= STREAM_HEADER_BYTES:
                # a large request: its header is decoded a slice a turn; this peer's
                # later messages wait behind it
                self._decodes.append(_Decoding(ident, msg, RequestDecoder(msg[1]), t0))
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
        session = self._session_of(ident)
        if op == _HELLO:
            try:
                carried = fresh and session is not None
                if carried:
                    self._piggyback(session, body, reply_extra)
                status, rbody, frames, session = self._hello(ident, msg[1], body, session)
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
                                            else d.wait), msg[1])
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
                    t0, msg[1])

    def _session_of(self, ident: bytes) -> Session | None:
        sess = self._by_ident.get(ident)
        if sess is not None and sess.closed:
            del self._by_ident[ident]
            sess = None
        if sess is None and self.door_token is None:
            # no door (a Store served in-process, tests): an implicit session per peer
            sess = self._open(ident, ("peer", ident), os.urandom(16), None, ident.hex())
            sess.operator = True
        return sess

    def _open(self, ident: bytes, principal: Any, nonce: bytes, proof: Any,
              label: str) -> Session:
        sess = self.store.open_session(principal, nonce=nonce, proof=proof, label=label)
        sess.conn = ident
        old = self._by_nonce.get(nonce)
        if old is not None:
            # the same client again (a new HELLO: reconnect, ping, a new mover): the old
            # session ends, its grants move over (that process may still be copying)
            self.store.replace_session(old, sess)
            self._order.pop(old.id, None)
            if self._by_ident.get(old.conn) is old:     # its old connection's name
                del self._by_ident[old.conn]
        prev = self._by_ident.get(ident)
        if prev is not None and prev is not old and not prev.grants:
            self.store.close_session(prev)         # another client on this routing id
            self._order.pop(prev.id, None)
            if self._by_nonce.get(prev.nonce) is prev:
                del self._by_nonce[prev.nonce]
        self._by_ident[ident] = sess
        self._by_nonce[nonce] = sess
        self._order[sess.id] = sess
        if len(self._order) > self.MAX_SESSIONS:
            self._trim_sessions()
        return sess

    def _trim_sessions(self) -> None:
        for sid, sess in list(self._order.items()):
            if len(self._order) <= self.MAX_SESSIONS * 3 // 4:
                break
            if not sess.grants:
                self.store.close_session(sess, "forgotten (too many sessions)")
                del self._order[sid]
        self._forget_closed()

    def _hello(self, ident: bytes, frame: zmq.Frame, body: dict[str, Any],
               current: Session | None
               ) -> tuple[int, dict[str, Any], list[Any], Session | None]:
        """HELLO: who is this (proven), is it on this host (proven), open its session."""
        nonce = body.get("nonce")
        if type(nonce) is not bytes or not 8 <= len(nonce) <= 64:
            if self.door_token is not None or nonce is not None:
                raise _Malformed("HELLO needs a nonce of 8-64 bytes")
            nonce = os.urandom(16)      # no door: an old-style HELLO in tests
        principal: Any = None
        try:
            user = frame.get("User-Id")
        except (zmq.ZMQError, AttributeError):
            user = ""
        if user and user != "anonymous":
            principal = ("curve", user)            # the CURVE key ZAP authenticated
        elif self.door_token is None:
            principal = ("peer", ident)
        else:
            tok = body.get("token")
            if type(tok) is bytes and hmac.compare_digest(tok, self.door_token):
                principal = ("door",)
        if principal is None:
            self._count_error("auth_refused")
            log.warning("HELLO from %s refused: no valid token", ident.hex())
            return Status.UNAUTHORIZED, {
                "error": "this server needs its token in HELLO (same-host clients read it "
                         "from the server's token file; see docs/RELIABILITY.md, 'Doors')"
            }, [], current
        proof = None
        if body.get("proof") is True:
            proof = Liveness.verify(self.store.pool.name, self.store.pool.token, nonce)
            if proof is not None and principal[0] != "curve":
                principal = ("uid", proof.uid)    # as the kernel recorded it
        local = proof is not None
        label = f"{principal[0]}:{principal[1] if len(principal) > 1 else ''}"
        if isinstance(principal[-1], bytes):
            label = f"{principal[0]}:{principal[-1].hex()[:12]}"
        sess = self._open(ident, principal, nonce, proof, label)
        sess.operator = self._is_operator(principal, proof, body)
        reply = dict(self.hello)
        reply["epoch"] = self.epoch
        reply["session"] = sess.id
        reply["local"] = local
        if self.hello_hook is not None:
            reply.update(self.hello_hook(sess, body))
        return Status.OK, reply, [], sess

    def _is_operator(self, principal: Any, proof: Any, body: dict[str, Any]) -> bool:
        """Operator ops (DRAIN, PURGE, EVICT): a proof-holding local session of this
        server's uid or root, a holder of the operator token, or anyone when there is
        no door (in-process)."""
        if self.door_token is None:
            return True
        if proof is not None and proof.uid in (os.geteuid(), 0):
            return True
        tok = body.get("operator_token")
        return (self.operator_token is not None and type(tok) is bytes
                and hmac.compare_digest(tok, self.operator_token))

    def _reply(self, ident: bytes, session: Session | None, req_id: int, op: int,
               status: int, rbody: dict[str, Any], frames: list[Any],
               reply_extra: dict[str, Any], on_sent: list[Any], t0: float,
               src: Any = None) -> None:
        if reply_extra:
            rbody.update(reply_extra)
        if not on_sent and not frames and len(rbody) < 8:
            for v in rbody.values():
                if type(v) is list and len(v) > STREAM_REPLY_ITEMS:
                    # a large reply: encoded a chunk a turn, then sent (nothing pinned)
                    self._encodes.append(_Encoding(ident, op, ReplyEncoder(status, req_id,
                                                                           rbody), t0))
                    return
        track = bool(on_sent) and session is not None
        tracker = self._send(ident, encode_reply(status, req_id, rbody), frames,
                             track=track)
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
                                      time.monotonic(), src))
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

    def _send(self, ident: bytes, header: bytes, frames: list[Any] = (),  # type: ignore[assignment]
              track: bool = False) -> zmq.MessageTracker | None:
        outq = self._outq
        if outq is not None:
            if not track and not frames:
                outq.append((ident, header))        # sent at the end of the drain
                return None
            if outq:
                self._flush_out(outq)               # a peer's replies keep their order
        try:
            zc = self._zmqc
            if zc is not None:
                if track:       # zero-copy from index 2 on; the tracker says when done
                    return zc.send_parts(self._sock, [ident, header, *frames], 0, 2)
                if not frames:
                    zc.send_parts(self._sock, (ident, header))
                    return None
            if track:
                parts = [zmq.Frame(f, track=True) for f in frames]
                trackers = [p.tracker for p in parts if isinstance(p, zmq.Frame)]
                self._sock.send_multipart([ident, header, *parts], copy=False)
                return zmq.MessageTracker(*trackers)
            self._sock.send_multipart([ident, header, *frames], copy=False)
        except zmq.ZMQError as exc:  # peer gone, or HWM: drop the reply, keep serving
            log.debug("reply to %s dropped: %s", ident.hex(), exc)
            self._count_error("send_failed")
        return None

    def _send_failed(self, m: tuple[bytes, bytes], exc: zmq.ZMQError) -> None:
        """A queued reply could not be sent (FastPath.serve's flush): dropped as
        :meth:`_flush_out` drops it."""
        log.debug("reply to %s dropped: %s", m[0].hex(), exc)
        self._count_error("send_failed")

    def _flush_out(self, outq: list[tuple[bytes, bytes]]) -> None:
        """Send the replies :meth:`_send` queued during a drain (``_zmqc`` only), in
        order, and empty ``outq``; a failed one is dropped as :meth:`_send` drops it."""
        send = self._zmqc.send_parts
        sock = self._sock
        for m in outq:
            try:
                send(sock, m)
            except zmq.ZMQError as exc:
                log.debug("reply to %s dropped: %s", m[0].hex(), exc)
                self._count_error("send_failed")
        outq.clear()

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
        todo = collections.deque([*(("release", r) for r in rel),
                                  *(("abort", r) for r in ab),
                                  *(("commit", r) for r in com)])
        failed: list[int] = []
        store = self.store
        S = self.slice_keys
        inner: list[Any] = [None, None]     # the request's own attempt and cleanup

        def step(force: bool) -> Any:
            if inner[0] is not None:
                return inner[0](force)
            left = S
            while todo and left > 0:
                how, rid = todo[0]
                k = store.settle_some(session, rid, how, left)
                if k < 0:
                    if how == "commit":
                        failed.append(rid)
                    todo.popleft()
                    continue
                left -= k
                if session.grants.get(rid) is None or k == 0:
                    todo.popleft()
            if todo:
                return _MORE
            if failed:
                extra["commit_failed"] = failed
            try:
                return handler(session, req_id, body, frames, on_sent)
            except _Defer as d:
                inner[0], inner[1] = d.attempt, d.cleanup
                return None if not isinstance(d, _Sliced) else _MORE
            except _Malformed as exc:
                self._count_error("malformed")
                return Status.MALFORMED, {"error": str(exc)}, []
            except _BatchTooLarge as exc:
                return Status.INVALID_REQUEST, {"error": str(exc)}, []

        def cleanup() -> None:
            if inner[1] is not None:
                inner[1]()

        raise _Sliced(step, cleanup)

    def _cancel_parked(self, session: Session, rids: list[int]) -> None:
        # RELEASE/ABORT of a request still parked: its client gave up (cancelled, timed
        # out); the grant it would make must never be made
        if self._parked_by:
            for rid in rids:
                p = self._parked_by.pop((session.id, rid), None)
                if p is not None:
                    p.cancelled = True
                    self._seen_progress = -1      # look at it on the next turn

    def _keys(self, body: dict[str, Any]) -> list[Any]:
        keys = _list(body, "keys")
        self._check_batch(keys)
        return keys

    def _check_batch(self, keys: list[Any]) -> None:
        if len(keys) > self.store.config.limits.max_batch:
            raise _BatchTooLarge(len(keys), self.store.config.limits.max_batch)

    # ------------------------------------------------------------------ handlers

    def _on_alloc(self, session, req_id, body, frames, on_sent):
        keys = _list(body, "keys")
        sizes = _list(body, "sizes")
        if len(keys) != len(sizes):
            raise _Malformed("keys and sizes differ in length")
        sums = body.get("sums")
        if sums is not None and (not isinstance(sums, list) or len(sums) != len(keys)):
            raise _Malformed("sums must be a list as long as keys")
        self._check_batch(keys)
        store = self.store
        if len(keys) > self.slice_keys:
            self._alloc_in_slices(session, req_id, keys, sizes, sums)
        if store.tier is None:
            offsets, statuses = store.alloc_entries(session, req_id, keys, sizes,  # type: ignore[misc]
                                                    sums)
            return Status.OK, {"offsets": offsets, "st": _wire_statuses(statuses)}, []

        def attempt(force: bool) -> tuple[int, dict[str, Any], list[Any]] | None:
            r = store.alloc_entries(session, req_id, keys, sizes, sums, defer=not force,
                                    drop=force)
            if r is None:
                return None
            return Status.OK, {"offsets": r[0], "st": _wire_statuses(r[1])}, []

        return _attempt_now(attempt)

    def _alloc_in_slices(self, session: Session, req_id: int, keys: list[Any],
                         sizes: list[Any], sums: list[Any] | None) -> None:
        store = self.store
        S = max(1, self.slice_keys // 2)    # ~1 us a key: ~1 ms a slice, as the others
        n = len(keys)
        offsets: list[Any] = []
        statuses: list[int] = []

        def step(force: bool) -> Any:
            a = len(offsets)
            b = a + S
            tier = store.tier is not None
            r = store.alloc_entries(session, req_id, keys[a:b], sizes[a:b],
                                    None if sums is None else sums[a:b],
                                    defer=tier and not force, drop=tier and force,
                                    extend=a > 0)
            if r is None:
                return None
            offsets.extend(r[0])
            statuses.extend(r[1])
            if len(offsets) < n:
                return _MORE
            return Status.OK, {"offsets": offsets, "st": _wire_statuses(statuses)}, []

        raise _Sliced(step)

    def _on_commit(self, session, req_id, body, frames, on_sent):
        # the commit/abort lists were applied by _piggyback; report what failed
        return Status.OK, {}, []

    def _on_lookup(self, session, req_id, body, frames, on_sent):
        keys = self._keys(body)
        if len(keys) > self.slice_keys:
            offsets: list[Any] = []
            sizes: list[int] = []
            sums: list[Any] = []

            def part(a: int, b: int, hold: Any) -> Any:
                o, sz, sm = self.store.lookup(session, req_id, keys[a:b], hold,
                                              extend=a > 0)
                offsets.extend(o)
                sizes.extend(sz)
                sums.extend(sm)

            def reply() -> tuple[int, dict[str, Any], list[Any]]:
                rbody: dict[str, Any] = {"offsets": offsets, "sizes": sizes}
                if any(x is not None for x in sums):
                    rbody["sums"] = sums
                return Status.OK, rbody, []

            self._read_in_slices(keys, part, reply)
        return self._read(keys, lambda hold: self._lookup_reply(session, req_id, keys, hold))

    def _read_in_slices(self, keys: list[Any], part: Callable[[int, int, Any], Any],
                        reply: Callable[[], tuple[int, dict[str, Any], list[Any]]],
                        cleanup: Callable[[], None] | None = None) -> None:
        """Serve a read of many keys in slices: ``part(a, b, hold)`` answers keys
        ``a:b`` (after the tier promoted what lives only below), ``reply()`` the whole."""
        store = self.store
        S = self.slice_keys
        n = len(keys)
        state: list[Any] = [0, None]            # next key, the slice's ReadHold

        def step(force: bool) -> Any:
            a = state[0]
            b = min(n, a + S)
            hold = None
            if store.tier is not None:
                hold = state[1]
                if hold is None:
                    hold = state[1] = store.read_hold()
                if not store.prepare_read(keys[a:b], hold, force):
                    return None
            try:
                part(a, b, hold)
            finally:
                if hold is not None:
                    store.release_hold(hold)
                    state[1] = None
            state[0] = b
            return _MORE if b < n else reply()

        def abandon() -> None:
            if state[1] is not None:
                store.release_hold(state[1])
                state[1] = None
            if cleanup is not None:
                cleanup()

        raise _Sliced(step, abandon)

    def _lookup_reply(self, session: Session, req_id: int, keys: list[Any], hold: Any
                      ) -> tuple[int, dict[str, Any], list[Any]]:
        offsets, sizes, sums = self.store.lookup(session, req_id, keys, hold)
        rbody: dict[str, Any] = {"offsets": offsets, "sizes": sizes}
        if any(s is not None for s in sums):
            rbody["sums"] = sums
        return Status.OK, rbody, []

    def _on_release(self, session, req_id, body, frames, on_sent):
        return Status.OK, {}, []

    def _on_put(self, session, req_id, body, frames, on_sent):
        keys = _list(body, "keys")
        counts = body.get("counts")
        if counts is not None:            # packed small values (kvshm.zmq_ctrl.frames)
            sizes = _list(body, "sizes")
            if not isinstance(counts, list) or len(sizes) != len(keys):
                raise _Malformed("counts must be a list, and sizes as long as keys")
            if (len(frames) == 1 and len(counts) == 1 and len(sizes) == 1
                    and type(frames[0]) is bytes and type(counts[0]) is int
                    and counts[0] == 1 and type(sizes[0]) is int
                    and sizes[0] == len(frames[0])):
                pass        # one value in one frame: what unpack_frames would give
            else:
                # a plain layout is read in place (no view per value); anything else
                # (and every error) goes the general way
                packed = PackedValues.of(frames, counts, sizes) if len(sizes) > 1 else None
                try:
                    frames = packed if packed is not None else unpack_frames(
                        frames, counts, sizes)
                except FrameLayoutError as exc:
                    return Status.INVALID_REQUEST, {"error": str(exc)}, []
        elif len(keys) != len(frames):
            return Status.INVALID_REQUEST, {
                "error": f"{len(keys)} keys but {len(frames)} value frames"}, []
        sums = body.get("sums")
        if sums is not None and (not isinstance(sums, list) or len(sums) != len(keys)):
            raise _Malformed("sums must be a list as long as keys")
        self._check_batch(keys)
        store = self.store
        if len(keys) > self.slice_keys:
            S = self.slice_keys
            st: list[int] = []

            def step(force: bool) -> Any:
                a = len(st)
                b = a + S
                tier = store.tier is not None
                r = store.put(keys[a:b], frames[a:b], None if sums is None else sums[a:b],
                              defer=tier and not force, drop=tier and force)
                if r is None:
                    return None
                st.extend(r)
                return _MORE if len(st) < len(keys) else (
                    Status.OK, {"st": _wire_statuses(st)}, [])

            raise _Sliced(step)
        if store.tier is None:
            return Status.OK, {"st": _wire_statuses(store.put(keys, frames, sums))}, []

        def attempt(force: bool) -> tuple[int, dict[str, Any], list[Any]] | None:
            st = store.put(keys, frames, sums, defer=not force, drop=force)
            return None if st is None else (Status.OK, {"st": _wire_statuses(st)}, [])

        return _attempt_now(attempt)

    def _on_get(self, session, req_id, body, frames, on_sent):
        keys = self._keys(body)
        if len(keys) > self.slice_keys:
            if self._sending:
                self._settle_own_sends(session)
            copy_over = not session.sending     # decided once, as for one request
            sizes: list[int] = []
            counts: list[int] = []
            sums: list[Any] = []
            out: list[Any] = []

            def part(a: int, b: int, hold: Any) -> None:
                sz, cn, sm, fr = self._get_part(keys[a:b], on_sent, hold, session,
                                                copy_over)
                sizes.extend(sz)
                counts.extend(cn)
                sums.extend(sm)
                out.extend(fr)

            def reply() -> tuple[int, dict[str, Any], list[Any]]:
                rbody: dict[str, Any] = {"sizes": sizes, "counts": counts}
                if sums.count(None) != len(sums):       # some key has a checksum
                    rbody["sums"] = sums
                return Status.OK, rbody, out

            def cleanup() -> None:
                # abandoned before its reply: what its slices pinned or counted goes
                self.store.sent(session, sum(x for x in on_sent if isinstance(x, int)),
                                [e for e in on_sent if not isinstance(e, int)])
                on_sent.clear()
                out.clear()

            self._read_in_slices(keys, part, reply, cleanup)
        return self._read(keys, lambda hold: self._get_reply(keys, on_sent, hold, session))

    def _read(self, keys: list[Any], reply: Callable[[Any], tuple[int, dict[str, Any],
                                                                  list[Any]]]
              ) -> tuple[int, dict[str, Any], list[Any]]:
        """Answer a read with ``reply(hold)``; with a tier, first promote what lives only
        below (the request is parked until it is in the pool)."""
        store = self.store
        if store.tier is None:
            return reply(None)
        hold = store.read_hold()

        def attempt(force: bool) -> tuple[int, dict[str, Any], list[Any]] | None:
            if not store.prepare_read(keys, hold, force):
                return None
            try:
                return reply(hold)
            finally:
                store.release_hold(hold)

        return _attempt_now(attempt, lambda: store.release_hold(hold))

    def _get_reply(self, keys: list[Any], on_sent: list[Any], hold: Any, session: Session
                   ) -> tuple[int, dict[str, Any], list[Any]]:
        """GET: the hits' bytes as frames, large ones zero-copy (pinned until sent),
        small ones packed into one copy. Every block queued (pinned or copied) counts
        against the principal until the frame is sent; hits beyond its budget are
        refused (size QUOTA_REFUSED), so a peer that does not read cannot pin the pool
        nor grow this process."""
        if self._sending:
            self._settle_own_sends(session)
        sizes, counts, sums, out = self._get_part(keys, on_sent, hold, session,
                                                  not session.sending)
        rbody: dict[str, Any] = {"sizes": sizes, "counts": counts}
        if sums.count(None) != len(sums):       # some key has a checksum
            rbody["sums"] = sums
        return Status.OK, rbody, out

    def _get_part(self, keys: list[Any], on_sent: list[Any], hold: Any, session: Session,
                  copy_over: bool) -> tuple[list[int], list[int], list[Any], list[Any]]:
        """The hits of ``keys`` as GET frames (see :meth:`_get_reply`): sizes, counts,
        checksums and frames; what it pinned or queued is added to ``on_sent``."""
        store = self.store
        entries, sums = store.pin_for_send(keys, hold)
        if len(entries) == 1 and copy_over:
            # one key (the common request): what the general path below gives, shorter
            e = entries[0]
            if e is None:
                return [-1], [], sums, []
            if e.size < PACK_BELOW and e.nruns == 1:
                bs = store.block_size
                data = store.pool.read_bytes(e.start * bs, e.size)
                store.unpin(entries)
                queued = -(-e.size // bs)
                if queued:
                    store.sending(session, queued)
                    on_sent.append(queued)
                return [e.size], [1], sums, [data]
        if copy_over:
            # every hit small and in one run (a batch of small values): the general
            # path's frames and counts, planned and copied in C
            fast = _index.small_frames(entries, store.block_size, PACK_BELOW,
                                       PACK_FRAME_BYTES)
            if fast is not None:
                sizes, hits, offs, lens, counts, queued = fast
                out = store.pool.read_groups(offs, lens, counts) if hits else []
                store.unpin(hits)
                if queued:
                    store.sending(session, queued)
                    on_sent.append(queued)
                return sizes, counts, sums, out
        sizes = [e.size if e is not None else -1 for e in entries]
        budget = store.send_budget(session)
        cap = self.send_cap_blocks - session.quota.sending
        budget = cap if budget is None else min(budget, cap)
        # A session with nothing unsent always gets its whole reply (``copy_over``): hits
        # beyond the zero-copy budget are copied (server memory bounded by one reply per
        # reading session), so every reader makes progress whatever its principal's other
        # connections hold. One with replies queued and unread gets only the budget.
        refused = []
        if not copy_over and any(e is not None for e in entries):
            for i, e in enumerate(entries):
                if e is None:
                    continue
                if e.nblocks > budget:
                    refused.append(e)
                    entries[i] = None
                    sizes[i] = QUOTA_REFUSED
                    sums[i] = None
                else:
                    budget -= e.nblocks
        if refused:
            store.counters["quota_refusals"] += len(refused)
            store.unpin(refused)
        hits = [e for e in entries if e is not None]
        out: list[Any] = []
        counts: list[int] = []
        small: list[Any] = []
        bs = store.block_size
        queued = 0
        for first, count in plan_frames([e.size for e in hits]):
            group = hits[first:first + count]
            e = group[0]
            if count == 1 and e.size >= PACK_BELOW and (not copy_over or e.nblocks <= budget):
                # zero-copy, pinned until sent; a value of several runs in one frame per
                # run, the runs after the first with a count of 0 (frames.unpack)
                if e.nruns == 1:
                    out.append(store.view(e))
                    counts.append(1)
                else:
                    views = store.views(e)
                    out.extend(views)
                    counts.extend([1] + [0] * (len(views) - 1))
                on_sent.append(e)
                queued += e.nblocks
                budget -= e.nblocks
                continue
            if count == 1 and e.size >= PACK_BELOW:
                # over the budget: a copy (one frame), counted until sent as the others
                n = e.size
                queued += e.nblocks
            else:                                           # small values: one packed copy
                n = sum(g.size for g in group)
                queued += -(-n // bs)
            if count == 1 and e.nruns == 1:      # one value, one run: one copy
                out.append(store.pool.read_bytes(e.start * bs, e.size))
                small.append(e)
                counts.append(1)
                continue
            buf = bytearray(n)
            offs: list[int] = []
            lens: list[int] = []
            for g in group:
                if g.nruns == 1:
                    offs.append(g.start * bs)
                    lens.append(g.size)
                else:
                    for o, k in g.byte_extents(bs):
                        offs.append(o)
                        lens.append(k)
            store.pool.gather(offs, lens, buf)
            out.append(buf)
            small.extend(group)
            counts.append(count)
        store.unpin(small)
        if queued:
            store.sending(session, queued)
            on_sent.append(queued)
        return sizes, counts, sums, out

    def _on_exists(self, session, req_id, body, frames, on_sent):
        keys = self._keys(body)
        S = self.slice_keys
        if len(keys) > S:
            found: list[bool] = []

            def step(force: bool) -> Any:
                a = len(found)
                found.extend(self.store.exists(keys[a:a + S]))
                return _MORE if len(found) < len(keys) else (Status.OK, {"found": found}, [])

            raise _Sliced(step)
        return Status.OK, {"found": self.store.exists(keys)}, []

    def _on_match_prefix(self, session, req_id, body, frames, on_sent):
        keys = self._keys(body)
        S = self.slice_keys
        if len(keys) > S:
            at = [0]

            def step(force: bool) -> Any:
                a = at[0]
                part = keys[a:a + S]
                m = self.store.match_prefix(part)
                at[0] = a + m
                if m < len(part) or at[0] == len(keys):
                    return Status.OK, {"n": at[0]}, []
                return _MORE

            raise _Sliced(step)
        return Status.OK, {"n": self.store.match_prefix(keys)}, []

    def _on_delete(self, session, req_id, body, frames, on_sent):
        keys = self._keys(body)
        S = self.slice_keys
        if len(keys) > S:
            state = [0, 0]                      # next key, removed so far

            def step(force: bool) -> Any:
                a = state[0]
                state[1] += self.store.delete(keys[a:a + S])
                state[0] = a + S
                return _MORE if state[0] < len(keys) else (Status.OK, {"n": state[1]}, [])

            raise _Sliced(step)
        return Status.OK, {"n": self.store.delete(keys)}, []

    def _on_evict(self, session, req_id, body, frames, on_sent):
        if not session.operator:
            return not_operator("EVICT")
        ratio = body.get("ratio")
        if type(ratio) not in (int, float) or not 0.0 <= ratio <= 1.0:
            return Status.INVALID_REQUEST, {"error": "ratio must be a number in [0, 1]"}, []
        return Status.OK, {"n": self.store.evict(float(ratio))}, []

    def _settle_own_sends(self, session: Session) -> None:
        """This peer's earlier GET replies leave before the reply to its new request
        (one pipe, in order) and it is reading: let their zero-copy pins go first, so
        that what it has already received is not counted against it. Bounded: only
        replies queued within the last second, 0.1 s in all; a peer that does not read
        gains no more than that."""
        if not session.sending:
            return
        now = time.monotonic()
        deadline = now + 0.1
        for tracker, _, _, sess, _, since, _ in self._sending:
            if sess is session and not tracker.done and now - since < 1.0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    tracker.wait(left)
                except zmq.NotDone:
                    break
        self._reap_sends(time.monotonic())

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
