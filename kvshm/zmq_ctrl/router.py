"""The server's ZeroMQ loop: one ROUTER socket, decode, dispatch to the Store, reply.

The loop thread owns the :class:`~kvshm.store.Store`. It wakes only for a message, a
lease deadline, a periodic eviction, a zero-copy send in flight, a tier's I/O completion
(through :meth:`ServiceLoop.wake`), or :meth:`stop`, so an idle server sleeps in
``zmq_poll`` and uses no CPU.

The loop, one class (:class:`ServiceLoop`) made of mixins, one module each:

- :mod:`kvshm.zmq_ctrl.router` (here): its construction, lifecycle, turns and timers,
  receiving and sending (the hot path: ``_turn``, ``_handle``, ``_send``, ``_flush_out``);
- :mod:`kvshm.zmq_ctrl.dispatch`: one request, decoded, checked, handed to its handler,
  answered; latency histograms;
- :mod:`kvshm.zmq_ctrl.handling`: what a handler is, may raise and return;
- :mod:`kvshm.zmq_ctrl.ops_write`, :mod:`~kvshm.zmq_ctrl.ops_read`,
  :mod:`~kvshm.zmq_ctrl.ops_admin`: the built-in handlers by family;
- :mod:`kvshm.zmq_ctrl.sessions`: HELLO, sessions and admission;
- :mod:`kvshm.zmq_ctrl.parked`: deferred replies (parked requests);
- :mod:`kvshm.zmq_ctrl.slices`: large requests in slices, the sliced codec;
- :mod:`kvshm.zmq_ctrl.sends`: zero-copy replies in flight;
- :mod:`kvshm.zmq_ctrl.fastpaths`: the one-key fast path and the batch path (C);
- :mod:`kvshm.zmq_ctrl.sockets`: the ROUTER socket's options and binding;
- :mod:`kvshm.zmq_ctrl.loopstate`: the state the mixins share, declared for the type
  checker (:class:`~kvshm.zmq_ctrl.loopstate.LoopState`, their base).

Every name these define that was importable from this module still is.

Sockets. When :mod:`kvshm.zmq_ctrl._zmqc` is built, the loop polls, receives and sends
through it (direct libzmq calls; the header frame is kept as a libzmq message for its
metadata, zero-copy replies are tracked in C); otherwise through pyzmq, alike.

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
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import zmq

from kvshm.store import Session, Store
from kvshm.zmq_ctrl.admission import HELLO_TIMEOUT_S, MAX_UNADMITTED, AdmissionMixin
from kvshm.zmq_ctrl.dispatch import DispatchMixin
from kvshm.zmq_ctrl.fastpaths import FastPathsMixin
from kvshm.zmq_ctrl.ops_admin import AdminOpsMixin
from kvshm.zmq_ctrl.ops_read import ReadOpsMixin
from kvshm.zmq_ctrl.ops_write import WriteOpsMixin
from kvshm.zmq_ctrl.parked import ParkedMixin, _Parked
from kvshm.zmq_ctrl.protocol import Op
from kvshm.zmq_ctrl.sends import CONN_NOW, SendsMixin, conn_of
from kvshm.zmq_ctrl.sessions import SessionsMixin
from kvshm.zmq_ctrl.slices import SLICE_KEYS, SlicesMixin, _Decoding, _Encoding
from kvshm.zmq_ctrl.sockets import bind, make_router
# Names moved to the loop's other modules, importable from here as before (kvshm.server,
# ops_cluster, the tests and perf/ scripts import them from this module)
from kvshm.zmq_ctrl.dispatch import _BATCHQ_MIN_BYTES, _HELLO, LATENCY_BUCKETS  # noqa: F401
from kvshm.zmq_ctrl.fastpaths import _BATCH_ON, _FAST_ON, _batchq, _fastpath  # noqa: F401
from kvshm.zmq_ctrl.listener import NativeListener
from kvshm.zmq_ctrl.handling import (  # noqa: F401
    _MORE,
    _OUTCOME_STATUS,
    _SAME_NUMBERS,
    RequestChecksMixin,
    _attempt_now,
    _BatchTooLarge,
    _Defer,
    _list,
    _Malformed,
    _Sliced,
    _wire_statuses,
    not_operator,
)
from kvshm.zmq_ctrl.slices import STREAM_HEADER_BYTES, STREAM_REPLY_ITEMS  # noqa: F401

try:    # direct libzmq calls for the hot loop; without them pyzmq does the same
    from kvshm.zmq_ctrl import _zmqc
except ImportError:     # pragma: no cover - the extension is not built, or no libzmq found
    _zmqc = None  # type: ignore[assignment]

#: KVSHM_LEAN_TURNS=0 turns run()'s lean turns off (A/B figures; every turn is a Python
#: one then, the fast path still serving one-key requests)
_LEAN_ON = os.environ.get("KVSHM_LEAN_TURNS", "1") != "0"

__all__ = ["ServiceLoop", "LATENCY_BUCKETS"]

log = logging.getLogger(__name__)


_STALE_CHECK_S = 0.002   # poll interval while zero-copy sends are in flight

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


class ServiceLoop(DispatchMixin, SessionsMixin, AdmissionMixin, ParkedMixin, SlicesMixin,
                  SendsMixin, FastPathsMixin, WriteOpsMixin, ReadOpsMixin, AdminOpsMixin,
                  RequestChecksMixin):
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
        between two slices (default :data:`SLICE_KEYS`; see :mod:`kvshm.zmq_ctrl.slices`).
    hello_timeout : float
        Seconds (>= 0) an accepted connection may go without a HELLO answered OK (or a
        request of an open session) before it is shut down; 0: never. Only with a
        ``door_token`` (default :data:`~kvshm.zmq_ctrl.admission.HELLO_TIMEOUT_S`; see
        :mod:`kvshm.zmq_ctrl.admission`).
    max_unadmitted : int
        Connections (>= 1) held at most without HELLO; beyond, the oldest are shut down
        (also at most a quarter of the soft ``RLIMIT_NOFILE``; default
        :data:`~kvshm.zmq_ctrl.admission.MAX_UNADMITTED`).

    Raises
    ------
    ValueError
        ``slice_keys`` < 1, ``hello_timeout`` < 0, ``max_unadmitted`` < 1.
    OSError
        An endpoint cannot be bound.
    """

    #: Sessions kept at most; beyond, the oldest without grants are closed.
    MAX_SESSIONS = 65536

    def __init__(self, store: Store, endpoints: list[str], hello: dict[str, Any],
                 epoch: int, *, periodic_evict: tuple[float, float, float] | None = None,
                 socket_setup: Callable[[zmq.Socket], None] | None = None,
                 hello_hook: Callable[[bytes, dict[str, Any]], dict[str, Any]] | None = None,
                 context: zmq.Context | None = None, max_frame_bytes: int = -1,
                 log_handshakes: bool = False,
                 sock: zmq.Socket | NativeListener | None = None,
                 bound: Sequence[str] = (), door_token: bytes | None = None,
                 operator_token: bytes | None = None,
                 slice_keys: int = SLICE_KEYS, hello_timeout: float = HELLO_TIMEOUT_S,
                 max_unadmitted: int = MAX_UNADMITTED) -> None:
        if slice_keys < 1:
            raise ValueError("slice_keys must be >= 1")
        self.slice_keys = slice_keys
        self._runnable: collections.deque[_Parked] = collections.deque()
        # large headers being decoded (one RequestDecoder step a turn each), and the
        # later messages of their peers, held until that request is dispatched (a
        # request's effects, its piggybacked COMMITs among them, stay in its peer's order)
        self._decodes: collections.deque[_Decoding] = collections.deque()
        self._held: dict[bytes, collections.deque[tuple[list[Any], Any]]] = {}
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
        if isinstance(sock, NativeListener):
            # kvshm's own ZMTP listener: its calls stand in for _zmqc's (the same turns,
            # fast path and lean turns over it)
            self._zmqc = sock.ops
        #: replies queued by :meth:`_send` while a turn drains the socket (a list), else None
        self._outq: list[tuple[bytes, bytes]] | None = None
        #: replies :meth:`_send` took (sent or queued): a request whose dispatch raised
        #: before any reply is answered INTERNAL (:meth:`_unanswered`), never twice
        self._sends = 0
        self.endpoints: list[str] = list(bound)
        try:
            for ep in endpoints:
                self.endpoints.append(bind(self._sock, ep))
        except OSError:
            self._sock.close(0)
            raise
        self._monitor: zmq.Socket | None = None
        # connections not admitted yet, admitted ones (kvshm.zmq_ctrl.admission); made
        # here, before the fast path that holds the first
        self._unadmitted: "collections.OrderedDict[int, tuple[int, int, float]]" = \
            collections.OrderedDict()
        self._admitted: dict[int, tuple[int, int]] = {}
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
        # peer's connection: sends.conn_of of the request's frame, (fd, dev, inode))
        self._sending: list[tuple[zmq.MessageTracker, list[Any], int, Session, bytes,
                                  float, Any]] = []
        # id of a session whose settle wait ran out -> (it, the tracker it waited for)
        self._unsettled: dict[int, tuple[Session, Any]] = {}
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
        try:
            # the socket monitor (accepted connections; failed handshakes when logged)
            self._init_admission(hello_timeout, max_unadmitted, log_handshakes)
        except (ValueError, zmq.ZMQError):
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._sock.close(0)
            raise

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
        self._unsettled.clear()
        for p in [*self._parked, *self._runnable]:
            if p.cleanup is not None:
                p.cleanup()
        self._parked.clear()
        self._runnable.clear()
        self._decodes.clear()
        self._held.clear()
        self._encodes.clear()
        self._close_admission()
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
            # (the monitor as its descriptor: wait_in polls it with poll(2))
            ev = self._fast.serve(sock, self._wake_r,
                                  self._mon_fd if self._mon_fd >= 0 else None, self._due,
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
            self._on_monitor()
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
        if self._unadmitted:
            self._cut_unadmitted(now)
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
        if self._unadmitted:
            d = self._admission_deadline()
            if d is not None and (first is None or d < first):
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

    def _count_error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def _handle(self, msg: list[zmq.Frame], conn: Any = CONN_NOW) -> None:
        """Serve ``msg`` (a request received now; a held one: ``conn``, the connection
        it came on, :func:`~kvshm.zmq_ctrl.sends.conn_of` taken when it came)."""
        held = self._held
        if held:
            ident = msg[0] if type(msg[0]) is bytes else msg[0].bytes
            q = held.get(ident)
            if q is not None:       # behind its peer's request still being decoded
                if conn is CONN_NOW:
                    # dispatched turns later, when the fd number may be another's
                    conn = conn_of(msg[1]) if len(msg) >= 2 else None
                q.append((msg, conn))
                if len(q) >= HELD_MAX:
                    self._finish_decode(ident)
                return
        sends = self._sends
        try:
            self._dispatch(msg, None, 0.0, conn)
        except Exception as exc:    # a bug outside the handlers: log it, answer, keep serving
            log.exception("internal error dispatching a request")
            self._count_error("internal")
            if self._sends == sends:
                self._unanswered(msg, None, exc)

    def _send(self, ident: bytes, header: bytes, frames: list[Any] = (),  # type: ignore[assignment]
              track: bool = False) -> zmq.MessageTracker | None:
        self._sends += 1
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
        except BaseException:
            # not sent (a frame without the buffer protocol, MemoryError: a bug): not
            # counted, so that the caller's _unanswered (or _reply's) answers INTERNAL
            # instead of the client waiting out its timeout
            self._sends -= 1
            raise
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
