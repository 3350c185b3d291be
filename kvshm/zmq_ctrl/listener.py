"""kvshm's own ZMTP 3 listener for ``tcp://`` and ``ipc://`` (NULL mechanism), in place
of libzmq's ROUTER socket: ``kvshm serve --listener native`` (or ``KVSHM_LISTENER=native``).

Why. libzmq's I/O thread costs ~20-25 us of the server's ~40-50 us CPU per one-key
request (about 28 system calls a request; a one-thread ZMTP server makes ~3:
``perf/bench_srvio.py``), and two of its behaviours are findings of kvshm's tests: its ipc
listener aborts the process on ``EMFILE`` from ``accept(2)``, and ``ZMQ_MAXMSGSIZE`` bounds
a frame, not a message (a peer that never ends a message makes the server hold all of it).

What. :class:`NativeListener` is socket-like for :class:`~kvshm.zmq_ctrl.router.ServiceLoop`:
its :attr:`NativeListener.ops` stands in for :mod:`kvshm.zmq_ctrl._zmqc` (``poll_in``,
``wait_in``, ``recv_multipart``, ``send_parts``, ``sweep``), so the loop's turns, its
one-key fast path and its lean turns run unchanged over it. Each connection is one
non-blocking socket in one ``epoll`` set, in the loop's thread:

- accept: never blocks; ``EMFILE``/``ENFILE`` (no descriptor free) is logged, the
  listening socket left out of the poll for :data:`ACCEPT_BACKOFF_S` and tried again;
- handshake: greeting and READY parsed as they come (a stalled peer holds only its own
  connection; it is closed after :data:`HANDSHAKE_S`, or by admission's
  ``--hello-timeout``); a bad signature, a version before 3, a mechanism other than NULL,
  a malformed READY or a socket type a ROUTER does not take closes the connection;
- routing ids: the peer's ``Identity`` property, else one assigned here (``b"\\0n"`` and
  14 random bytes: not to be guessed, a session outliving its connection); no handover: a connection claiming the routing id of a connected peer is
  closed at its READY;
- receive: a message of ``[routing id, header, *frames]`` once its last frame came; the
  header a :class:`Header` (``bytes`` with ``get(zmq.SRCFD)``: the connection's own
  descriptor, for admission's and :func:`~kvshm.zmq_ctrl.sends.conn_of`'s fstat and
  ``SO_PEERCRED``); frames of 64 KiB and more read straight into their own buffer;
- bounds: a frame over ``max_frame_bytes`` closes the connection; so do the bytes of an
  unended message past ``untrusted_message_bytes`` on a connection not admitted (no HELLO
  answered OK on it, its routing id no open session's: ``trust``), or past
  ``max_message_bytes`` on any;
- send: written at once where the kernel takes it, else queued (zero-copy parts held,
  not copied, until written; their :class:`Tracker` then done); a connection whose queue
  holds more than ``max_out_bytes`` of copied bytes or ``max_out_messages`` messages (a
  peer that does not read) is closed, as a ROUTER drops past its high-water mark.

``inproc://`` (the management port's own client) is served by an inner libzmq ROUTER the
listener owns and polls beside its connections (received from when its descriptor was
readable); CURVE is libzmq's alone (kvshm.server keeps the libzmq ROUTER then).

Where. This module is the socket-like facade and the loop's calls (``poll_in``,
``recv_message``, ``send_message``); what runs per request, each connection's frames read,
parsed and assembled and its replies framed and written, is C
(:mod:`kvshm.zmq_ctrl._zmtpsrv`: :class:`Header`, :class:`Tracker`, the bounds); binding,
accepting and closing are :mod:`kvshm.zmq_ctrl.listener_endpoints`; the greeting, READY
and PING are :mod:`kvshm.zmq_ctrl.listener_handshake`. Its names (``NativeListener``,
``Header``, ``Tracker``, ``ProtocolError``, ``parse_props``, the bounds' defaults,
``READY_MAX``, ``CMDS_MAX``) are importable from here as before.
"""

from __future__ import annotations

import collections
import errno
import os
import select
import time
from typing import Any, Callable, Sequence

import zmq

from kvshm.zmq_ctrl.listener_endpoints import ACCEPT_BACKOFF_S, Endpoints
from kvshm.zmq_ctrl.listener_handshake import (GREET, SERVER_READY, Handshake, ProtocolError,
                                               command, ended, greeting, parse_props)

try:    # the per-connection hot path (frames read, parsed, written) in C
    from kvshm.zmq_ctrl import _zmtpsrv
    from kvshm.zmq_ctrl._zmtpsrv import (BIG, CMDS_MAX, FRAME_COST, READY_MAX, Header,
                                         Tracker)
except ImportError:     # pragma: no cover - not built: NativeListener() raises
    _zmtpsrv = None  # type: ignore[assignment]
    BIG, CMDS_MAX, FRAME_COST, READY_MAX = 65536, 64, 32, 1024
    Header = Tracker = None  # type: ignore[assignment,misc]

try:    # the inner inproc ROUTER's messages as the loop takes them from libzmq
    from kvshm.zmq_ctrl import _zmqc
except ImportError:     # pragma: no cover - not built
    _zmqc = None  # type: ignore[assignment]

__all__ = ["ACCEPT_BACKOFF_S", "BIG", "CMDS_MAX", "FRAME_COST", "GREET", "HANDSHAKE_S",
           "MAX_OUT_BYTES", "MAX_OUT_MESSAGES", "READY_MAX", "SERVER_READY",
           "UNTRUSTED_MESSAGE_BYTES", "Header", "NativeListener", "ProtocolError", "Tracker",
           "command", "ended", "greeting", "parse_props"]

#: Seconds a connection may take to finish ZMTP's greeting and READY (libzmq's
#: ``ZMQ_HANDSHAKE_IVL`` default).
HANDSHAKE_S = 30.0
#: Bytes of an unended message a connection not admitted yet may make the server hold
#: (a HELLO is a few hundred bytes).
UNTRUSTED_MESSAGE_BYTES = 1 << 20
#: Replies queued at most to a connection that does not read, in copied bytes and in
#: messages (a ROUTER's SNDHWM is 1000 messages); beyond, it is closed.
MAX_OUT_BYTES = 64 << 20
MAX_OUT_MESSAGES = 4096
# (READY_MAX: messages parsed and not yet received by the loop at most: past it, a
# connection's bytes read stay unparsed, and it is not read, until the loop has taken
# some; CMDS_MAX: commands parsed at most in one go of a connection; BIG: frames of this
# size and more are read into their own buffer and sent without joining; FRAME_COST:
# bytes a frame counts against the message bounds beside its own: kvshm.zmq_ctrl._zmtpsrv)

_CLOSED = 3
_EPOLLOUT = select.EPOLLOUT
_EPOLL_READ = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR


class NativeListener(Endpoints, Handshake):
    """A ZMTP 3 ROUTER of kvshm's own over ``tcp://`` and ``ipc://`` (see the module).

    Parameters
    ----------
    context : zmq.Context
        For the inner libzmq ROUTER of ``inproc://`` endpoints (made at their bind).
    max_frame_bytes : int
        Largest frame taken (bytes; a larger one closes its connection); <= 0: no limit.
    max_message_bytes : int
        Largest unended message held (bytes, all its frames); <= 0: no limit.
    untrusted_message_bytes : int
        The same, on a connection ``trust`` does not vouch for (default
        :data:`UNTRUSTED_MESSAGE_BYTES`).
    max_out_bytes, max_out_messages : int
        Copied bytes and messages queued at most to a connection that does not read.
    handshake_s : float
        Seconds a connection may take to finish its greeting and READY.

    Raises
    ------
    ValueError
        A bound < 0 where a count is needed (``max_out_messages`` < 1).
    ImportError
        kvshm.zmq_ctrl._zmtpsrv is not built (``python setup.py build_ext --inplace``).
    """

    def __init__(self, context: zmq.Context | None = None, *, max_frame_bytes: int = -1,
                 max_message_bytes: int = -1,
                 untrusted_message_bytes: int = UNTRUSTED_MESSAGE_BYTES,
                 max_out_bytes: int = MAX_OUT_BYTES, max_out_messages: int = MAX_OUT_MESSAGES,
                 handshake_s: float = HANDSHAKE_S, ipv6: bool = False) -> None:
        self.closed = True      # (until made: __del__ of a half-made one)
        if max_out_messages < 1:
            raise ValueError("max_out_messages must be >= 1")
        if _zmtpsrv is None:
            raise ImportError("the native listener needs kvshm.zmq_ctrl._zmtpsrv: build it "
                              "with `python setup.py build_ext --inplace` (or pip install .)")
        self._ctx = context
        self.max_frame_bytes = max_frame_bytes if max_frame_bytes > 0 else 1 << 62
        self.max_message_bytes = max_message_bytes if max_message_bytes > 0 else 1 << 62
        self.untrusted_message_bytes = min(untrusted_message_bytes, self.max_message_bytes)
        self.max_out_bytes = max_out_bytes
        self.max_out_messages = max_out_messages
        self.handshake_s = handshake_s
        self.ipv6 = ipv6
        self.ops = _Ops
        #: what the connections share (bounds, scratch buffer, messages received)
        self._wire = _zmtpsrv.Wire(self.max_frame_bytes, self.max_message_bytes,
                                   self.untrusted_message_bytes, max_out_bytes,
                                   max_out_messages)
        self._ep = select.epoll()
        self._efd = self._ep.fileno()
        self._listeners: dict[int, tuple[Any, str, str | None]] = {}
        self._conns: dict[int, Any] = {}
        self._by_ident: dict[bytes, Any] = {}
        self._handshaking: "collections.OrderedDict[int, Any]" = collections.OrderedDict()
        self._ready: collections.deque[list[Any]] = self._wire.ready
        # connections whose bytes read wait to be parsed (READY_MAX reached)
        self._backlog: dict[int, Any] = self._wire.backlog
        self._accept_retry = 0.0        # monotonic time the listeners come back; 0: in
        self._accept_warned = 0.0
        self._inner: zmq.Socket | None = None
        self._inner_fd = -1
        self._turns = 0
        self._last = ""
        self.closed = False
        # descriptors of the loop's own in the epoll set (wake pipe 2, monitor 4), the
        # events of the last wait still to serve, and whether there are any (or a timer
        # of the listener's: accept back-off, handshake deadlines)
        self._extra: dict[int, int] = {}
        self._pending: Any = ()
        self._events_due = False
        self._inner_more = True
        #: admission's hooks (ServiceLoop sets them): a connection accepted (fd), ended
        #: (fd), and whether a connection (fd, routing id) may hold a large message
        self.on_accept: Callable[[int], None] | None = None
        self.on_close: Callable[[int], None] | None = None
        self.trust: Callable[[int, bytes], bool] | None = None
        #: connections closed for a reason, by reason (bad_greeting, bad_mechanism,
        #: bad_ready, id_taken, handshake_timeout, frame_too_large, message_too_large,
        #: unread_output, accept_no_fd)
        self.counts: dict[str, int] = {}
        self._sockopts: dict[int, Any] = {}

    # ------------------------------------------------------------- socket-like surface

    def setsockopt(self, option: int, value: Any) -> None:
        """Options for the inner inproc ROUTER (LINGER, HANDOVER, ...), kept until it is
        made; the listener's own bounds are its constructor's."""
        self._sockopts[option] = value
        if self._inner is not None:
            self._inner.setsockopt(option, value)

    def getsockopt_string(self, option: int) -> str:
        """``zmq.LAST_ENDPOINT``: the address of the last bind."""
        if option == zmq.LAST_ENDPOINT:
            return self._last
        raise zmq.ZMQError(errno.EINVAL)

    def getsockopt(self, option: int) -> Any:
        if option == zmq.LAST_ENDPOINT:
            return self._last.encode()
        if option == zmq.FD:
            return self._efd
        raise zmq.ZMQError(errno.EINVAL)

    @property
    def context(self) -> zmq.Context:
        if self._ctx is None:
            self._ctx = zmq.Context.instance()
        return self._ctx

    def fileno(self) -> int:
        """The epoll descriptor: readable while a connection, a listening socket or the
        inner socket has something (see :meth:`poll_in` for queued messages)."""
        return self._efd

    def close(self, linger: int | None = None) -> None:
        """Close every connection, listening socket (ipc paths unlinked) and the inner
        socket. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._close_all()
        self._ep.close()
        self._ready.clear()

    def __enter__(self) -> "NativeListener":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            import warnings
            warnings.warn("NativeListener not closed", ResourceWarning, stacklevel=2)
            self.close()

    @property
    def connections(self) -> int:
        """Connections open now (handshaking or open)."""
        return len(self._conns)

    def connection(self, fd: int, dev: int, ino: int) -> Any | None:
        """The open connection (a :attr:`Header.conn`) that a connection taken earlier as
        ``(fd, st_dev, st_ino)`` (:func:`~kvshm.zmq_ctrl.sends.conn_of`: a request
        decoded over turns, or held behind one) still is, or None where it has ended:
        the fd closed, or its number another connection's now (fstat gives another
        inode). One fstat; raises nothing."""
        c = self._conns.get(fd)
        if c is None or not c.is_open:
            return None
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        if st.st_dev != dev or st.st_ino != ino:
            return None
        return c

    # ------------------------------------------------------------------- the loop's calls

    def poll_in(self, fd: int = -1, mon: Any = None, timeout_ms: int = -1) -> int:
        """Wait at most ``timeout_ms`` (-1: no limit) for something to receive (1), ``fd``
        readable (2) or ``mon`` (an fd or a zmq socket) readable (4); 0: timeout, -1:
        interrupted. A 1 may be spurious (a write or an accept to do: the next
        :meth:`recv_message` does it and may find no message). One ``epoll_wait``: ``fd``
        and ``mon`` join the listener's epoll set at their first wait; the events it
        returns are what the next :meth:`recv_message` serves (no second wait)."""
        now_bits = 0
        if self._ready or self._events_due or self._backlog or (
                self._inner_more and self._inner is not None
                and self._inner.getsockopt(zmq.EVENTS) & zmq.POLLIN):
            now_bits = 1
            timeout_ms = 0
        else:
            if self._accept_retry:
                left = int(max(0.0, self._accept_retry - time.monotonic()) * 1000) + 1
                timeout_ms = left if timeout_ms < 0 else min(timeout_ms, left)
            if self._handshaking:
                first = next(iter(self._handshaking.values())).deadline
                left = int(max(0.0, first - time.monotonic()) * 1000) + 1
                timeout_ms = left if timeout_ms < 0 else min(timeout_ms, left)
        extra = self._extra
        if fd >= 0 and fd not in extra:
            self._watch(fd, 2)
        mfd = -1
        if mon is not None:
            mfd = mon if type(mon) is int else int(mon.getsockopt(zmq.FD))
            if mfd not in extra:
                self._watch(mfd, 4)
        try:
            evs = self._ep.poll(timeout_ms / 1000.0 if timeout_ms >= 0 else -1, 256)
        except InterruptedError:
            return -1
        bits = now_bits
        keep = []
        for e in evs:
            b = extra.get(e[0])
            if b is None:
                keep.append(e)
                bits |= 1
            elif (b == 2 and e[0] == fd) or (b == 4 and e[0] == mfd):
                bits |= b
        self._pending = keep
        self._events_due = bool(keep)
        if not bits and (self._accept_retry or self._handshaking):
            bits = 1        # a timer of the listener's own: the next receive runs it
            self._events_due = True
        return bits

    def _watch(self, fd: int, bit: int) -> None:
        self._extra[fd] = bit
        try:
            self._ep.register(fd, select.EPOLLIN)
        except FileExistsError:
            pass

    def recv_message(self, flags: int = 1, copy_threshold: int = 65536,
                     keep: int = -1) -> list[Any] | None:
        """The next message received, ``[routing id (bytes), header (Header), *frames]``
        (frames of 64 KiB and more as bytearray, smaller as bytes), or None: none now.
        Does the accepts, reads, writes and handshake timeouts the last :meth:`poll_in`
        saw due; never blocks."""
        ready = self._ready
        if ready:
            self._turns += 1
            if self._inner is not None and self._turns & 63 == 0:
                m = self._inner_recv()
                if m is not None:
                    return m
            return ready.popleft()
        # the connections the last wait found readable are read before the backlog is
        # parsed on: a connection with more parsed than its turn's share (MSGS_TURN)
        # waits for the others, as a ROUTER's fair queue
        if self._events_due:
            self._events_due = False
            self._events()
            if ready:
                return ready.popleft()
        if self._backlog:
            for c in list(self._backlog.values()):
                del self._backlog[c.fd]
                c.parse()
            if ready:
                return ready.popleft()
        if self._inner_more and self._inner is not None:
            # (only when its descriptor was readable or a call on it may have taken in
            # a message: a libzmq call a request costs ~1 us otherwise)
            return self._inner_recv()
        return None

    def send_message(self, parts: Sequence[Any], track_from: int = -1) -> Any:
        """Send ``[routing id, *frames]`` to its connection (frames from ``track_from``
        on zero-copy: held until written; a :class:`Tracker` is returned for them).
        A routing id no connection has is dropped (as a ROUTER does); a connection
        whose queue passes its bound is closed. Returns True, or the Tracker."""
        ident = parts[0]
        if type(ident) is not bytes:
            ident = bytes(ident)
        c = self._by_ident.get(ident)
        if c is None:
            inner = self._inner
            if inner is not None:
                # a call on it may take in a message its descriptor then says nothing of
                self._inner_more = True
                try:
                    if _zmqc is not None:
                        return _zmqc.send_parts(inner, parts, 0, track_from)
                    if track_from >= 0:
                        fr = [zmq.Frame(p, track=True) for p in parts[track_from:]]
                        inner.send_multipart([*parts[:track_from], *fr], copy=False)
                        return zmq.MessageTracker(*[f.tracker for f in fr])
                    inner.send_multipart(list(parts), copy=False)
                    return True
                except zmq.ZMQError:
                    pass
            return Tracker(None) if track_from >= 0 else True
        return c.send(parts, track_from)

    def send_parts(self, parts: Sequence[Any], flags: int = 0, track_from: int = -1,
                   copy_threshold: int = 65536) -> Any:
        """``_zmqc.send_parts``'s signature: :meth:`send_message`."""
        ident = parts[0]
        if type(ident) is bytes:
            c = self._by_ident.get(ident)
            if c is not None:
                return c.send(parts, track_from)
        return self.send_message(parts, track_from)

    def send_multipart(self, parts: Sequence[Any], flags: int = 0, copy: bool = True,
                       track: bool = False) -> Any:
        """``zmq.Socket.send_multipart`` for the loop's pyzmq calls: :meth:`send_message`
        (parts held until written, not copied: as pyzmq's ``copy=False``)."""
        return self.send_message(parts, 1 if track else -1)

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[Any]:
        """``zmq.Socket.recv_multipart`` with ``zmq.NOBLOCK``: :meth:`recv_message`, or
        ``zmq.Again`` when none is here."""
        m = self.recv_message()
        if m is None:
            raise zmq.Again()
        return m

    # ------------------------------------------------------------------- internals

    def _inner_recv(self) -> list[Any] | None:
        inner = self._inner
        assert inner is not None
        if _zmqc is not None:
            m = _zmqc.recv_multipart(inner, 1, 65536, 1)
        else:
            try:
                m = inner.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                m = None
        if m is None:
            self._inner_more = False
            return None
        self._inner_more = True         # maybe more: looked at before the next wait
        if type(m[0]) is not bytes:
            m[0] = m[0].bytes
        return m

    def _events(self) -> None:
        now = 0.0
        if self._accept_retry:
            now = time.monotonic()
            if now >= self._accept_retry:
                self._accept_retry = 0.0
                for fd in self._listeners:
                    try:
                        self._ep.register(fd, select.EPOLLIN)
                    except OSError:
                        pass
        if self._handshaking:
            now = now or time.monotonic()
            while self._handshaking:
                c = next(iter(self._handshaking.values()))
                if c.deadline > now:
                    break
                self._close(c, "handshake_timeout")
        evs = self._pending
        self._pending = ()
        conns = self._conns
        for fd, ev in evs:
            c = conns.get(fd)
            if c is None:
                if fd in self._listeners:
                    self._accept(fd)
                elif fd == self._inner_fd:
                    self._inner_more = True
                continue
            if ev & _EPOLLOUT:
                c.flush()
                if c.state == _CLOSED:
                    continue
            if ev & _EPOLL_READ:
                c.read()


def _sweep(timeout: float = 0.0) -> int:
    return _zmqc.sweep(timeout) if _zmqc is not None else 0


class _Ops:
    """The :mod:`kvshm.zmq_ctrl._zmqc` calls the loop makes, over a :class:`NativeListener`
    (the listener is the ``sock`` they are given: each is the listener's own method,
    unbound, so that a call is one Python frame)."""

    DONTWAIT = 1
    poll_in = NativeListener.poll_in
    wait_in = NativeListener.poll_in
    recv_multipart = NativeListener.recv_message
    send_parts = NativeListener.send_parts
    sweep = staticmethod(_sweep)
