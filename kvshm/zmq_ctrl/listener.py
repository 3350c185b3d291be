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
listener owns and polls beside its connections; CURVE is libzmq's alone (kvshm.server
keeps the libzmq ROUTER then).
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import select
import socket
import stat
import struct
import time
from typing import Any, Callable, Sequence

import zmq

log = logging.getLogger("kvshm.zmq_ctrl.listener")

#: Seconds a connection may take to finish ZMTP's greeting and READY (libzmq's
#: ``ZMQ_HANDSHAKE_IVL`` default).
HANDSHAKE_S = 30.0
#: Seconds the listening sockets stay out of the poll after ``accept(2)`` found no
#: descriptor free (EMFILE, ENFILE, ENOBUFS, ENOMEM).
ACCEPT_BACKOFF_S = 0.1
#: Bytes of an unended message a connection not admitted yet may make the server hold
#: (a HELLO is a few hundred bytes).
UNTRUSTED_MESSAGE_BYTES = 1 << 20
#: Replies queued at most to a connection that does not read, in copied bytes and in
#: messages (a ROUTER's SNDHWM is 1000 messages); beyond, it is closed.
MAX_OUT_BYTES = 64 << 20
MAX_OUT_MESSAGES = 4096
#: Frames of this size and more are read into their own buffer (no copy out of the
#: connection's read buffer), and sent without joining.
BIG = 65536

_READ = 262144
#: Messages parsed and not yet received by the loop at most: past it, a connection's
#: bytes read stay unparsed (and it is not read) until the loop has taken some (a
#: ROUTER's RCVHWM, 1000 a pipe: a peer's burst of tiny messages cannot grow the server)
READY_MAX = 1024
#: Commands (PING, SUBSCRIBE...) parsed at most in one go of a connection, the rest left
#: unparsed as past READY_MAX (a peer's flood of commands cannot hold the loop's turn:
#: a well-behaved peer sends a PING in seconds)
CMDS_MAX = 64
#: Bytes a frame of a message being received counts against the message bounds beside
#: its own (the list slot and object that hold it)
_FRAME_COST = 32
_SIG_OK = b"\xff"
_SOCKET_TYPES = (b"DEALER", b"ROUTER", b"REQ")
_NO_FD_FREE = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

# connection states
_GREETING, _READY, _OPEN, _CLOSED = 0, 1, 2, 3


def _greeting() -> bytes:
    # signature, version 3.0, NULL, as-server 0 (NULL has no server role), filler
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32


def _command(name: bytes, props: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    body = bytes([len(name)]) + name
    for k, v in props:
        body += bytes([len(k)]) + k + struct.pack(">I", len(v)) + v
    if len(body) > 255:
        return b"\x06" + struct.pack(">Q", len(body)) + body
    return bytes([0x04, len(body)]) + body


_GREET = _greeting()
_SERVER_READY = _command(b"READY", [(b"Socket-Type", b"ROUTER")])


class ProtocolError(ValueError):
    """What a peer sent is not ZMTP 3 as this listener takes it (the connection goes)."""


def parse_props(body: bytes | memoryview, at: int) -> dict[bytes, bytes]:
    """The properties of a ZMTP command body from offset ``at``: name (1-byte length),
    value (4-byte big-endian length). Raises :class:`ProtocolError` when malformed."""
    out: dict[bytes, bytes] = {}
    n = len(body)
    while at < n:
        k = body[at]
        if k == 0 or at + 1 + k + 4 > n:
            raise ProtocolError("malformed property")
        name = bytes(body[at + 1:at + 1 + k])
        at += 1 + k
        (v,) = struct.unpack_from(">I", body, at)
        at += 4
        if at + v > n:
            raise ProtocolError("malformed property value")
        out[name.lower()] = bytes(body[at:at + v])
        at += v
    return out


class Header(bytes):
    """A request's first frame, with the facts of the connection it came on:
    ``get(zmq.SRCFD)`` its descriptor, ``get("Peer-Address")``, ``get("User-Id")`` (""
    under NULL), ``get("Socket-Type")``, ``get("Identity")`` (as ``zmq.Frame.get``;
    unknown names raise ``zmq.ZMQError(EINVAL)``; ``SRCFD`` is -1 once the connection is
    closed). ``buffer`` and ``bytes`` as a frame's."""

    _conn: "_Conn"

    def get(self, option: Any) -> Any:
        c = self._conn
        if option == zmq.SRCFD:
            # -1 once its connection is closed: the number may be another peer's by now
            return c.fd if c.state != _CLOSED else -1
        if isinstance(option, bytes):
            option = option.decode()
        if option == "Peer-Address":
            return c.peer
        if option == "User-Id":
            return ""
        if option == "Socket-Type":
            return c.stype
        if option == "Identity":
            return c.ident.decode(errors="replace")
        raise zmq.ZMQError(errno.EINVAL)

    @property
    def buffer(self) -> memoryview:
        return memoryview(self)

    @property
    def bytes(self) -> bytes:   # type: ignore[override]
        return bytes(self)


class Tracker:
    """Whether the zero-copy parts of one send are written (or dropped with their
    connection): ``done``; ``wait(timeout)`` flushes that connection until then and
    raises ``zmq.NotDone`` at ``timeout`` seconds."""

    __slots__ = ("done", "_conn")

    def __init__(self, conn: "_Conn | None") -> None:
        self.done = conn is None
        self._conn = conn

    def wait(self, timeout: float | None = -1) -> None:
        end = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        while not self.done:
            c = self._conn
            if c is None or c.state == _CLOSED:
                self.done = True
                return
            c.owner._flush(c)
            if self.done:
                return
            left = -1 if end is None else int(max(0.0, end - time.monotonic()) * 1000)
            if left == 0:
                raise zmq.NotDone()
            p = select.poll()
            p.register(c.fd, select.POLLOUT)
            try:
                p.poll(left)
            except InterruptedError:
                pass


class _Conn:
    __slots__ = ("owner", "sock", "fd", "state", "rbuf", "ident", "frames", "held", "big",
                 "big_at", "big_more", "out", "out_bytes", "out_msgs", "deadline", "trusted",
                 "peer", "stype", "writing", "__weakref__")

    def __init__(self, owner: "NativeListener", sock: socket.socket, peer: str) -> None:
        self.owner = owner
        self.sock = sock
        self.fd = sock.fileno()
        self.state = _GREETING
        self.rbuf = bytearray()
        self.ident = b""
        self.frames: list[Any] = []     # the frames of the message being received
        self.held = 0                   # its bytes so far (and the frame being read)
        self.big: bytearray | None = None   # a large frame being read into its own buffer
        self.big_at = 0
        self.big_more = False
        # queued output: [view, tracker or None, copied bytes, last part of a message]
        self.out: collections.deque[list[Any]] = collections.deque()
        self.out_bytes = 0
        self.out_msgs = 0
        self.deadline = 0.0
        self.trusted = False
        self.peer = peer
        self.stype = ""
        self.writing = False            # EPOLLOUT asked for


try:    # the inner inproc ROUTER's messages as the loop takes them from libzmq
    from kvshm.zmq_ctrl import _zmqc
except ImportError:     # pragma: no cover - not built
    _zmqc = None  # type: ignore[assignment]


class NativeListener:
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
    """

    def __init__(self, context: zmq.Context | None = None, *, max_frame_bytes: int = -1,
                 max_message_bytes: int = -1,
                 untrusted_message_bytes: int = UNTRUSTED_MESSAGE_BYTES,
                 max_out_bytes: int = MAX_OUT_BYTES, max_out_messages: int = MAX_OUT_MESSAGES,
                 handshake_s: float = HANDSHAKE_S, ipv6: bool = False) -> None:
        if max_out_messages < 1:
            raise ValueError("max_out_messages must be >= 1")
        self._ctx = context
        self.max_frame_bytes = max_frame_bytes if max_frame_bytes > 0 else 1 << 62
        self.max_message_bytes = max_message_bytes if max_message_bytes > 0 else 1 << 62
        self.untrusted_message_bytes = min(untrusted_message_bytes, self.max_message_bytes)
        self.max_out_bytes = max_out_bytes
        self.max_out_messages = max_out_messages
        self.handshake_s = handshake_s
        self.ipv6 = ipv6
        self.ops = _Ops
        self._ep = select.epoll()
        self._efd = self._ep.fileno()
        self._listeners: dict[int, tuple[socket.socket, str, str | None]] = {}
        self._conns: dict[int, _Conn] = {}
        self._by_ident: dict[bytes, _Conn] = {}
        self._handshaking: "collections.OrderedDict[int, _Conn]" = collections.OrderedDict()
        self._ready: collections.deque[list[Any]] = collections.deque()
        # connections whose bytes read wait to be parsed (READY_MAX reached)
        self._backlog: dict[int, _Conn] = {}
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

    def bind(self, endpoint: str) -> None:
        """Bind ``tcp://host:port`` (port 0: a free one), ``ipc://path`` or
        ``inproc://name`` (the inner libzmq ROUTER). Raises ``zmq.ZMQError`` as
        ``zmq.Socket.bind`` (EADDRINUSE, EINVAL for another scheme)."""
        if endpoint.startswith("inproc://"):
            if self._inner is None:
                if self._ctx is None:
                    self._ctx = zmq.Context.instance()
                s = self._ctx.socket(zmq.ROUTER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.ROUTER_HANDOVER, 0)
                for k, v in self._sockopts.items():
                    s.setsockopt(k, v)
                self._inner = s
                self._inner_fd = s.getsockopt(zmq.FD)
                self._ep.register(self._inner_fd, select.EPOLLIN)
            self._inner.bind(endpoint)
            self._last = self._inner.getsockopt_string(zmq.LAST_ENDPOINT)
            return
        if endpoint.startswith("tcp://"):
            hostport = endpoint[len("tcp://"):]
            host, _, port = hostport.rpartition(":")
            if host.startswith("[") and host.endswith("]"):
                host = host[1:-1]
            if host in ("*", ""):
                host = "::" if self.ipv6 else "0.0.0.0"
            fam = socket.AF_INET6 if ":" in host else socket.AF_INET
            try:
                portn = int(port)
            except ValueError:
                raise zmq.ZMQError(errno.EINVAL, f"bad port in {endpoint}") from None
            s = socket.socket(fam, socket.SOCK_STREAM)
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, portn))
                s.listen(1024)
            except OSError as exc:
                s.close()
                raise zmq.ZMQError(exc.errno or errno.EINVAL, str(exc)) from None
            name = s.getsockname()
            h = f"[{name[0]}]" if fam == socket.AF_INET6 else name[0]
            bound = f"tcp://{h}:{name[1]}"
            path = None
        elif endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://"):]
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                try:
                    if stat.S_ISSOCK(os.lstat(path).st_mode):
                        os.unlink(path)     # as libzmq: a stale socket file goes
                except FileNotFoundError:
                    pass
                s.bind(path)
                s.listen(1024)
            except OSError as exc:
                s.close()
                raise zmq.ZMQError(exc.errno or errno.EINVAL, str(exc)) from None
            bound = f"ipc://{path}"
        else:
            raise zmq.ZMQError(errno.EPROTONOSUPPORT,
                               f"the native listener serves tcp:// and ipc://, not {endpoint}")
        s.setblocking(False)
        self._listeners[s.fileno()] = (s, bound, path)
        self._ep.register(s.fileno(), select.EPOLLIN)
        self._last = bound

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
        for c in list(self._conns.values()):
            self._close(c, None)
        for s, _bound, path in self._listeners.values():
            s.close()
            if path is not None:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        self._listeners.clear()
        if self._inner is not None:
            self._inner.close(0)
            self._inner = None
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
        if self._backlog:
            for c in list(self._backlog.values()):
                del self._backlog[c.fd]
                self._parse(c, c.rbuf)
            if ready:
                return ready.popleft()
        if self._events_due:
            self._events_due = False
            self._events()
            if ready:
                return ready.popleft()
        if self._inner is not None:
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
        n = len(parts)
        if n == 2 and track_from < 0 and not c.out:
            # the common reply: one small frame, written at once (no queue, no views)
            p = parts[1]
            size = len(p) if type(p) is bytes else memoryview(p).nbytes
            if size < 256:
                data = bytes((0, size)) + p
            else:
                data = b"\x02" + struct.pack(">Q", size) + p
            try:
                k = c.sock.send(data)
            except (BlockingIOError, InterruptedError):
                k = 0
            except OSError:
                self._close(c, None)
                return True
            if k < len(data):
                c.out.append([memoryview(data)[k:], None, len(data) - k, True])
                c.out_bytes += len(data) - k
                c.out_msgs += 1
                self._flush(c)
            return True
        tracker = Tracker(c) if track_from >= 0 else None
        small: list[Any] = []
        items: list[list[Any]] = []
        copied = 0
        for i in range(1, n):
            p = parts[i]
            size = len(p) if type(p) is bytes else memoryview(p).nbytes
            more = i < n - 1
            if size < 256:
                hdr = bytes((1 if more else 0, size))
            else:
                hdr = bytes((3 if more else 2,)) + struct.pack(">Q", size)
            small.append(hdr)
            if size >= BIG or (tracker is not None and i >= track_from):
                if small:
                    b = b"".join(small)
                    items.append([memoryview(b), None, len(b), False])
                    copied += len(b)
                    small = []
                v = memoryview(p)
                if v.ndim != 1 or v.itemsize != 1:
                    v = v.cast("B")
                zc = tracker is not None and i >= track_from
                items.append([v, None, 0 if zc else v.nbytes, False])
                if not zc:
                    copied += v.nbytes
            else:
                small.append(p)
        if small:
            b = b"".join(small)
            items.append([memoryview(b), None, len(b), False])
            copied += len(b)
        items[-1][1] = tracker
        items[-1][3] = True
        if c.out and (c.out_bytes + copied > self.max_out_bytes
                      or c.out_msgs >= self.max_out_messages):
            log.warning("peer %s reads no replies (%d bytes, %d messages queued): its "
                        "connection is closed", c.ident.hex(), c.out_bytes, c.out_msgs)
            self._close(c, "unread_output")
            return tracker if tracker is not None else True
        c.out.extend(items)
        c.out_bytes += copied
        c.out_msgs += 1
        self._flush(c)
        return tracker if tracker is not None else True

    def send_parts(self, parts: Sequence[Any], flags: int = 0, track_from: int = -1,
                   copy_threshold: int = 65536) -> Any:
        """``_zmqc.send_parts``'s signature: :meth:`send_message`."""
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

    def shut(self, conn: tuple[int, int, int] | None) -> bool:
        """Close the connection ``conn`` names, ``(fd, st_dev, st_ino)``, if it is one of
        this listener's still (as :func:`~kvshm.zmq_ctrl.admission.shut_conn`, with no
        descriptor needed: it works while none is free). Returns True when closed."""
        if conn is None:
            return False
        c = self._conns.get(conn[0])
        if c is None:
            return False
        try:
            st = os.fstat(c.fd)
        except OSError:
            return False
        if (st.st_dev, st.st_ino) != (conn[1], conn[2]):
            return False
        self._close(c, "shut")
        return True

    # ------------------------------------------------------------------- internals

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

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
                continue
            if ev & select.EPOLLOUT:
                self._flush(c)
                if c.state == _CLOSED:
                    continue
            if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                self._read(c)

    def _accept(self, lfd: int) -> None:
        ls, bound, path = self._listeners[lfd]
        for _ in range(64):
            try:
                s, addr = ls.accept()
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno in _NO_FD_FREE:
                    self._count("accept_no_fd")
                    now = time.monotonic()
                    if now - self._accept_warned > 5.0:
                        self._accept_warned = now
                        log.warning("cannot accept on %s: %s; trying again in %g s",
                                    bound, exc.strerror, ACCEPT_BACKOFF_S)
                    self._accept_retry = now + ACCEPT_BACKOFF_S
                    for fd in self._listeners:
                        try:
                            self._ep.unregister(fd)
                        except OSError:
                            pass
                    return
                log.debug("accept on %s: %s", bound, exc)
                continue
            s.setblocking(False)
            if path is None:
                try:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
                peer = addr[0] if isinstance(addr, tuple) else str(addr)
            else:
                peer = ""
            c = _Conn(self, s, peer)
            c.deadline = time.monotonic() + self.handshake_s
            self._conns[c.fd] = c
            self._handshaking[c.fd] = c
            try:
                self._ep.register(c.fd, select.EPOLLIN)
            except OSError:
                self._close(c, None)
                continue
            c.out.append([memoryview(_GREET), None, len(_GREET), False])
            c.out_bytes += len(_GREET)
            self._flush(c)
            if c.state == _CLOSED:
                continue
            if self.on_accept is not None:
                try:
                    self.on_accept(c.fd)
                except Exception:
                    log.exception("internal error in the accept hook")

    def _close(self, c: _Conn, why: str | None) -> None:
        if c.state == _CLOSED:
            return
        if why is not None:
            self._count(why)
            log.debug("connection on fd %d closed: %s", c.fd, why)
        c.state = _CLOSED
        fd = c.fd
        self._conns.pop(fd, None)
        self._handshaking.pop(fd, None)
        self._backlog.pop(fd, None)
        if c.ident and self._by_ident.get(c.ident) is c:
            del self._by_ident[c.ident]
        for item in c.out:
            if item[1] is not None:
                item[1].done = True
        c.out.clear()
        c.frames = []
        c.big = None
        c.rbuf = bytearray()
        if self.on_close is not None:
            try:
                self.on_close(fd)      # before the number can be another's
            except Exception:
                log.exception("internal error in the close hook")
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):
            pass
        c.sock.close()

    def _flush(self, c: _Conn) -> None:
        out = c.out
        sock = c.sock
        while out:
            bufs = ([item[0] for item in itertools.islice(out, 64)] if len(out) > 1
                    else [out[0][0]])
            try:
                n = sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(c, None)
                return
            while out and (n or not out[0][0].nbytes):
                item = out[0]
                v = item[0]
                if n >= v.nbytes:
                    n -= v.nbytes
                    c.out_bytes -= item[2]
                    out.popleft()
                    if item[3]:
                        c.out_msgs -= 1
                    if item[1] is not None:
                        item[1].done = True
                else:
                    item[0] = v[n:]
                    if item[2]:
                        c.out_bytes -= n
                        item[2] -= n
                    n = 0
            if out and out[0][0].nbytes:
                continue
        want = bool(out)
        if want != c.writing and c.state != _CLOSED:
            c.writing = want
            try:
                self._ep.modify(c.fd, select.EPOLLIN | (select.EPOLLOUT if want else 0))
            except OSError:
                pass

    def _read(self, c: _Conn) -> None:
        sock = c.sock
        for _ in range(4):
            if c.fd in self._backlog:
                return          # its bytes read wait for the loop to take messages
            big = c.big
            try:
                if big is not None:
                    mv = memoryview(big)
                    n = sock.recv_into(mv[c.big_at:])
                    mv.release()
                    if n == 0:
                        self._close(c, None)
                        return
                    c.big_at += n
                    if c.big_at < len(big):
                        continue
                    c.big = None
                    c.frames.append(big)
                    if not c.big_more:
                        self._deliver(c)
                    if c.rbuf:
                        self._parse(c, c.rbuf)
                    if c.state == _CLOSED:
                        return
                    continue
                data = sock.recv(_READ)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(c, None)
                return
            if not data:
                self._close(c, None)
                return
            if c.rbuf:
                c.rbuf += data
                self._parse(c, c.rbuf)
            else:
                self._parse(c, data)
            if c.state == _CLOSED:
                return
            if len(data) < _READ and c.big is None:
                return

    def _parse(self, c: _Conn, buf: Any) -> None:
        """Parse ``buf`` (``c.rbuf``, or bytes just read while it was empty); what is
        left of it unparsed stays in ``c.rbuf``."""
        at = 0
        n = len(buf)
        ready = self._ready
        cmds = 0        # commands parsed in this call: as many at most as messages
        try:
            while c.state != _CLOSED:
                if (len(ready) >= READY_MAX or cmds >= CMDS_MAX) and at < n:
                    self._backlog[c.fd] = c     # parsed later (recv_message)
                    break
                if c.state == _GREETING:
                    if n - at < 64:
                        if n - at >= 1 and buf[at] != 0xFF:
                            raise ProtocolError("bad_greeting")
                        if n - at >= 10 and buf[at + 9] & 1 != 1:
                            raise ProtocolError("bad_greeting")
                        break
                    g = buf[at:at + 64]
                    at += 64
                    if g[0] != 0xFF or not g[9] & 1 or g[10] < 3:
                        raise ProtocolError("bad_greeting")
                    mech = bytes(g[12:32]).rstrip(b"\0")
                    if mech != b"NULL":
                        raise ProtocolError("bad_mechanism")
                    c.state = _READY
                    continue
                if n - at < 2:
                    break
                flags = buf[at]
                if flags & 0xF8:
                    raise ProtocolError("bad_frame")
                if flags & 2:
                    if n - at < 9:
                        break
                    (size,) = struct.unpack_from(">Q", buf, at + 1)
                    hl = 9
                else:
                    size = buf[at + 1]
                    hl = 2
                if flags & 4:       # a command
                    if size > 65536:
                        raise ProtocolError("bad_frame")
                    if n - at < hl + size:
                        break
                    body = bytes(buf[at + hl:at + hl + size])
                    at += hl + size
                    cmds += 1
                    self._command(c, body)
                    continue
                if c.state != _OPEN:
                    raise ProtocolError("bad_ready")
                if size > self.max_frame_bytes:
                    raise ProtocolError("frame_too_large")
                # a frame costs its bytes and _FRAME_COST (its slot, its object): a
                # message of empty frames is bounded too
                held = c.held + size + _FRAME_COST
                if held > self.untrusted_message_bytes and not c.trusted:
                    tr = self.trust
                    c.trusted = tr is None or tr(c.fd, c.ident)
                    if not c.trusted:
                        raise ProtocolError("message_too_large")
                if held > self.max_message_bytes:
                    raise ProtocolError("message_too_large")
                if n - at < hl + size:
                    if size >= BIG and not c.trusted:
                        # read in place (a buffer of its whole size, made at once) only
                        # for a connection trust vouches for: an untrusted one's frame
                        # grows with the bytes it sent (its read buffer), so peers that
                        # declare a large frame and stall hold only what they sent
                        tr = self.trust
                        c.trusted = tr is None or tr(c.fd, c.ident)
                    if size >= BIG and c.trusted:
                        # its own buffer, read into directly from here on
                        have = n - at - hl
                        big = bytearray(size)
                        big[:have] = buf[at + hl:n]
                        c.big, c.big_at, c.big_more = big, have, bool(flags & 1)
                        c.held = held
                        at = n
                    break
                if size >= BIG:
                    fr: Any = bytearray(buf[at + hl:at + hl + size])
                else:
                    fr = bytes(buf[at + hl:at + hl + size])
                at += hl + size
                c.frames.append(fr)
                c.held = held
                if not flags & 1:
                    self._deliver(c)
        except ProtocolError as exc:
            why = str(exc)
            if why in ("message_too_large", "frame_too_large"):
                log.warning("connection on fd %d (%s) closed: %s", c.fd,
                            c.ident.hex() or c.peer, why.replace("_", " "))
            self._close(c, why)
            return
        if c.state != _CLOSED:
            if buf is c.rbuf:
                if at:
                    del buf[:at]
            elif at < n:
                c.rbuf = bytearray(buf[at:])

    def _deliver(self, c: _Conn) -> None:
        frames = c.frames
        c.frames = []
        c.held = 0
        h = Header(frames[0])
        h._conn = c
        frames[0] = h
        self._ready.append([c.ident, *frames])

    def _command(self, c: _Conn, body: bytes) -> None:
        if not body or len(body) < 1 + body[0]:
            raise ProtocolError("bad_ready")
        name = body[1:1 + body[0]]
        if c.state == _READY:
            if name != b"READY":
                raise ProtocolError("bad_ready")
            try:
                props = parse_props(body, 1 + body[0])
            except ProtocolError:
                raise ProtocolError("bad_ready") from None
            st = props.get(b"socket-type", b"")
            if st not in _SOCKET_TYPES:
                raise ProtocolError("bad_ready")
            c.stype = st.decode()
            ident = props.get(b"identity", b"")
            if len(ident) > 255:
                raise ProtocolError("bad_ready")
            if ident:
                old = self._by_ident.get(ident)
                if old is not None and _ended(old.sock):
                    self._close(old, None)      # its end not read yet: no handover
                if ident in self._by_ident:
                    log.info("connection on fd %d claims the routing id of a connected "
                             "peer (%s): closed", c.fd, ident.hex())
                    raise ProtocolError("id_taken")
            else:
                # random, not a count: a session outlives its connection, and an id
                # a peer could guess (b"\0n" + 1, 2, ...) would let another peer claim
                # it at its READY and be served in that session
                while True:
                    ident = b"\0n" + os.urandom(14)
                    if ident not in self._by_ident:
                        break
            c.ident = ident
            self._by_ident[ident] = c
            self._handshaking.pop(c.fd, None)
            c.state = _OPEN
            c.out.append([memoryview(_SERVER_READY), None, len(_SERVER_READY), False])
            c.out_bytes += len(_SERVER_READY)
            self._flush(c)
            return
        if name == b"PING" and len(body) >= 1 + body[0] + 2:
            if c.out:
                # output is queued still (the peer does not read, or not yet): no PONG
                # more, at most one pending, as libzmq (a PING flood from a peer that
                # never reads cannot grow the queue, nor cost a sendmsg a PING)
                return
            ctx = body[1 + body[0] + 2:][:16]
            b = b"\x04PONG" + ctx
            pong = bytes([0x04, len(b)]) + b
            c.out.append([memoryview(pong), None, len(pong), False])
            c.out_bytes += len(pong)
            self._flush(c)
        # other commands (PONG, SUBSCRIBE...) are ignored, as a ROUTER does


def _ended(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` has closed it (end of stream or an error waiting),
    without taking any byte."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


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
