# cython: language_level=3, boundscheck=False, wraparound=False
"""The native listener's per-connection hot path in C: ZMTP 3.x frames read, parsed,
assembled into messages, and replies framed and written (kvshm.zmq_ctrl.listener).

Control stays in Python (:class:`kvshm.zmq_ctrl.listener.NativeListener`: accepts,
the READY and PING commands, routing ids, closing, epoll); what runs per request is here:

- :meth:`Conn.read`: up to 4 ``recv(2)`` of at most 256 KiB into the listener's scratch
  buffer (:class:`Wire`), or of a large frame straight into its own ``bytearray``; the
  bytes parsed at once, what is left of a frame kept in the connection's read buffer
  (only that: a stalled peer holds the bytes it sent);
- parsing: the greeting (signature, version 3 or more, NULL), frame headers (short,
  long; flags other than MORE, LONG, COMMAND are an error), commands (at most 64 KiB;
  handed to the listener's ``_command``), messages assembled until a frame without
  MORE, each delivered as ``[routing id, Header, *frames]`` (frames of :data:`BIG`
  bytes and more as ``bytearray``, smaller as ``bytes``) to :attr:`Wire.ready`;
- bounds, as before: a frame over ``max_frame_bytes``, an unended message past
  ``untrusted_message_bytes`` on a connection the listener's ``trust`` does not vouch
  for or past ``max_message_bytes`` on any closes the connection; a frame counts its
  bytes plus :data:`FRAME_COST`; past :data:`READY_MAX` messages waiting for the loop,
  or :data:`MSGS_TURN` messages or :data:`CMDS_MAX` commands of one connection in one
  go, the rest stays unparsed (the connection in
  the listener's backlog, not read) until the loop takes messages;
- :meth:`Conn.send`: a reply framed (flags, 1- or 8-byte size) and written with one
  ``sendmsg(2)`` of the headers and the parts' own buffers (no join); what the kernel
  did not take is queued (:attr:`Conn.out`, copied bytes counted against
  ``max_out_bytes``, messages against ``max_out_messages``: past either the connection
  is closed as ``unread_output``) and written by :meth:`Conn.flush` (a ``sendmsg`` of up
  to 64 queued parts) when the socket is writable.

Errors: nothing here raises for what a peer sends: a protocol error closes the
connection (the listener's ``_protocol_error(conn, why)``); a system call error other
than EAGAIN/EINTR closes it too (``_close(conn, None)``). ``send`` raises TypeError or
BufferError for a part without a contiguous buffer (the caller's bug), before writing.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_ANY_CONTIGUOUS
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.bytearray cimport (PyByteArray_FromStringAndSize, PyByteArray_AS_STRING,
                                PyByteArray_GET_SIZE)
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy, memmove

import collections as _collections
import errno as _errno
import select as _select
import time as _time

import zmq as _zmq

cdef extern from *:
    """
    #include <errno.h>
    #include <string.h>
    #include <sys/types.h>
    #include <sys/socket.h>
    #include <sys/uio.h>
    static ssize_t zs_writev(int fd, struct iovec *iov, int n) {
        struct msghdr m; memset(&m, 0, sizeof m);
        m.msg_iov = iov; m.msg_iovlen = n;
        return sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    static ssize_t zs_recv(int fd, void *buf, size_t n) {
        return recv(fd, buf, n, MSG_DONTWAIT);
    }
    static int zs_errno(void) { return errno; }
    static int zs_again(int e) { return e == EAGAIN || e == EWOULDBLOCK; }
    """
    struct iovec:
        void *iov_base
        size_t iov_len
    Py_ssize_t zs_writev(int fd, iovec *iov, int n) noexcept nogil
    Py_ssize_t zs_recv(int fd, void *buf, size_t n) noexcept nogil
    int zs_errno() noexcept nogil
    int zs_again(int e) noexcept nogil
    int EINTR

#: Frames of this size and more are read into their own buffer and sent without joining.
BIG = 65536
#: Messages parsed and not yet taken by the loop at most (a ROUTER's RCVHWM is 1000).
READY_MAX = 1024
#: Commands parsed at most in one go of a connection.
CMDS_MAX = 64
#: Messages parsed at most in one go of a connection (a read or a backlog parse): the
#: rest waits in its backlog while the others are read, so that a pipelining peer's
#: requests are taken in turns with other connections' (libzmq's ROUTER fair-queues
#: its pipes), not all before them.
MSGS_TURN = 16
#: Bytes a frame counts against the message bounds beside its own.
FRAME_COST = 32
#: Bytes one ``recv(2)`` into the scratch buffer asks for.
READ_BYTES = 262144

DEF _BIG = 65536
DEF _READY_MAX = 1024
DEF _CMDS_MAX = 64
DEF _MSGS_TURN = 16
DEF _FRAME_COST = 32
DEF _READ = 262144
DEF _MAX_CMD = 65536
DEF _IOV = 64           # parts one sendmsg writes at most
DEF _INLINE = 4096      # a small reply is framed into a stack buffer (one copy, one iovec)

# connection states
GREETING = 0
READY = 1
OPEN = 2
CLOSED = 3
DEF _GREETING = 0
DEF _READY = 1
DEF _OPEN = 2
DEF _CLOSED = 3


class ProtocolError(ValueError):
    """What a peer sent is not ZMTP 3 as the listener takes it (the connection goes);
    ``str()`` is the reason counted (``bad_greeting``, ``bad_mechanism``, ``bad_frame``,
    ``bad_ready``, ``id_taken``, ``frame_too_large``, ``message_too_large``)."""


class Header(bytes):
    """A request's first frame, with the facts of the connection it came on:
    ``get(zmq.SRCFD)`` its descriptor, ``get("Peer-Address")``, ``get("User-Id")`` (""
    under NULL), ``get("Socket-Type")``, ``get("Identity")`` (as ``zmq.Frame.get``;
    unknown names raise ``zmq.ZMQError(EINVAL)``; ``SRCFD`` is -1 once the connection is
    closed). ``buffer`` and ``bytes`` as a frame's."""

    def get(self, option):
        cdef Conn c = self._conn
        if option == _zmq.SRCFD:
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
        raise _zmq.ZMQError(_errno.EINVAL)

    @property
    def conn(self):
        """The :class:`Conn` it came on: one object per accepted connection, never
        another connection's (a session is bound to it: kvshm.zmq_ctrl.sends.bound_ok)."""
        return self._conn

    @property
    def buffer(self):
        return memoryview(self)

    @property
    def bytes(self):
        return bytes(self)


cdef class Tracker:
    """Whether the zero-copy parts of one send are written (or dropped with their
    connection): ``done``; ``wait(timeout)`` (seconds; None or < 0: no limit) flushes
    that connection until then and raises ``zmq.NotDone`` at ``timeout``."""

    cdef public bint done
    cdef public object _conn

    def __init__(self, conn=None):
        self.done = conn is None
        self._conn = conn

    def wait(self, timeout=-1):
        cdef Conn c
        end = None if timeout is None or timeout < 0 else _time.monotonic() + timeout
        while not self.done:
            c = self._conn
            if c is None or c.state == _CLOSED:
                self.done = True
                return
            c.flush()
            if self.done:
                return
            left = -1 if end is None else int(max(0.0, end - _time.monotonic()) * 1000)
            if left == 0:
                raise _zmq.NotDone()
            p = _select.poll()
            p.register(c.fd, _select.POLLOUT)
            try:
                p.poll(left)
            except InterruptedError:
                pass


cdef class Wire:
    """What a listener's connections share: the bounds (bytes; <= 0 given to the
    listener is ``1 << 62`` here), the scratch buffer reads go into (256 KiB), the
    messages received and not taken yet (``ready``, a deque) and the connections whose
    bytes wait to be parsed (``backlog``, fd -> Conn)."""

    cdef public object ready, backlog
    cdef public long long max_frame_bytes, max_message_bytes, untrusted_message_bytes
    cdef public long long max_out_bytes, max_out_messages
    cdef unsigned char *scratch

    def __cinit__(self):
        self.scratch = <unsigned char *>malloc(_READ)
        if self.scratch == NULL:
            raise MemoryError()

    def __init__(self, long long max_frame_bytes, long long max_message_bytes,
                 long long untrusted_message_bytes, long long max_out_bytes,
                 long long max_out_messages):
        self.ready = _collections.deque()
        self.backlog = {}
        self.max_frame_bytes = max_frame_bytes
        self.max_message_bytes = max_message_bytes
        self.untrusted_message_bytes = untrusted_message_bytes
        self.max_out_bytes = max_out_bytes
        self.max_out_messages = max_out_messages

    def __dealloc__(self):
        free(self.scratch)
        self.scratch = NULL


cdef inline Py_ssize_t _hdr(unsigned char *h, Py_ssize_t size, bint more) noexcept:
    """A frame's header for a body of ``size`` bytes into ``h`` (2 or 9 bytes)."""
    cdef int i
    if size < 256:
        h[0] = 1 if more else 0
        h[1] = <unsigned char>size
        return 2
    h[0] = 3 if more else 2
    for i in range(8):
        h[8 - i] = <unsigned char>((<unsigned long long>size) >> (8 * i))
    return 9


cdef class Conn:
    """One accepted connection of a listener (see the module). The attributes are the
    listener's to read and set (its control logic); ``rbuf`` is a copy of the bytes read
    and not parsed yet."""

    cdef public object owner, sock, ident, frames, big, out, peer, stype
    cdef public int fd, state
    cdef public long long held, big_at, out_bytes, out_msgs
    cdef int turn_msgs      # messages delivered in this go (read or parse)
    cdef public bint big_more, trusted, writing
    cdef public double deadline
    cdef Wire wire
    cdef unsigned char *rb
    cdef Py_ssize_t rlen, rcap
    cdef object __weakref__

    @property
    def is_open(self):
        """Whether the connection is still open (not closed by either end)."""
        return self.state != _CLOSED

    def __init__(self, owner, Wire wire, sock, str peer):
        self.owner = owner
        self.wire = wire
        self.sock = sock
        self.fd = sock.fileno()
        self.state = _GREETING
        self.ident = b""
        self.frames = []        # the frames of the message being received
        self.held = 0           # its bytes so far (and the frame being read)
        self.big = None         # a large frame being read into its own buffer
        self.big_at = 0
        self.big_more = False
        # queued output: [view, tracker or None, copied bytes, last part of a message]
        self.out = _collections.deque()
        self.out_bytes = 0
        self.out_msgs = 0
        self.deadline = 0.0
        self.trusted = False
        self.peer = peer
        self.stype = ""
        self.writing = False    # EPOLLOUT asked for

    def __dealloc__(self):
        free(self.rb)
        self.rb = NULL

    @property
    def rbuf(self):
        """The bytes read and not parsed yet (a copy)."""
        return PyBytes_FromStringAndSize(<char *>self.rb, self.rlen) if self.rlen else b""

    def drop(self):
        """Forget what is being received and queued (the connection is closed): the
        read buffer, the message begun, a large frame's buffer; queued output's
        trackers are done."""
        for item in self.out:
            if item[1] is not None:
                item[1].done = True
        self.out.clear()
        self.frames = []
        self.big = None
        free(self.rb)
        self.rb = NULL
        self.rlen = self.rcap = 0

    # ------------------------------------------------------------------ receiving

    def read(self):
        """Read what the socket has (at most 4 reads) and parse it; closes the
        connection at its end or on an error."""
        cdef Wire w = self.wire
        cdef Py_ssize_t n, want
        cdef int e, fd = self.fd
        cdef char *p
        self.turn_msgs = 0
        for _ in range(4):
            if fd in w.backlog:
                return          # its bytes read wait for the loop to take messages
            if self.big is not None:
                big = self.big
                p = PyByteArray_AS_STRING(big) + self.big_at
                want = PyByteArray_GET_SIZE(big) - self.big_at
                with nogil:
                    n = zs_recv(fd, p, want)
                    e = zs_errno()
                if n < 0:
                    if zs_again(e) or e == EINTR:
                        return
                    self.owner._close(self, None)
                    return
                if n == 0:
                    self.owner._close(self, None)
                    return
                self.big_at += n
                if self.big_at < PyByteArray_GET_SIZE(big):
                    continue
                self.big = None
                self.frames.append(big)
                if not self.big_more:
                    self._deliver()
                if self.rlen:
                    self._parse_rbuf()
                if self.state == _CLOSED:
                    return
                continue
            with nogil:
                n = zs_recv(fd, w.scratch, _READ)
                e = zs_errno()
            if n < 0:
                if zs_again(e) or e == EINTR:
                    return
                self.owner._close(self, None)
                return
            if n == 0:
                self.owner._close(self, None)
                return
            if self.rlen:
                if self._append(w.scratch, n) < 0:
                    return
                self._parse_rbuf()
            else:
                self._parse_into(w.scratch, n)
            if self.state == _CLOSED:
                return
            if n < _READ and self.big is None:
                return

    def parse(self):
        """Parse the bytes read and left unparsed (the listener's backlog)."""
        self.turn_msgs = 0
        self._parse_rbuf()

    cdef int _append(self, const unsigned char *data, Py_ssize_t n) except -1:
        cdef Py_ssize_t cap
        cdef unsigned char *nb
        if self.rlen + n > self.rcap:
            cap = max(self.rlen + n, min(2 * self.rcap, self.rlen + n + _READ))
            nb = <unsigned char *>realloc(self.rb, cap)
            if nb == NULL:
                raise MemoryError()
            self.rb = nb
            self.rcap = cap
        memcpy(self.rb + self.rlen, data, n)
        self.rlen += n
        return 0

    cdef int _parse_rbuf(self) except -1:
        cdef Py_ssize_t at
        if not self.rlen:
            return 0
        at = self._parse(self.rb, self.rlen)
        if at < 0 or self.state == _CLOSED:
            return 0
        if at:
            memmove(self.rb, self.rb + at, self.rlen - at)
            self.rlen -= at
            if self.rlen == 0 or self.rcap > 2 * _READ and self.rlen < self.rcap // 4:
                # let go of a buffer a large burst grew
                if self.rlen == 0:
                    free(self.rb)
                    self.rb = NULL
                    self.rcap = 0
                else:
                    self.rb = <unsigned char *>realloc(self.rb, self.rlen)
                    self.rcap = self.rlen
        return 0

    cdef int _parse_into(self, const unsigned char *buf, Py_ssize_t n) except -1:
        cdef Py_ssize_t at = self._parse(buf, n)
        if at < 0 or self.state == _CLOSED:
            return 0
        if at < n:
            self._append(buf + at, n - at)
        return 0

    cdef Py_ssize_t _parse(self, const unsigned char *buf, Py_ssize_t n) except -2:
        """Parse ``buf[:n]``; returns the bytes consumed, -1 when the connection was
        closed (``buf`` must not be used then: it may be the freed read buffer)."""
        cdef Wire w = self.wire
        cdef Py_ssize_t at = 0, hl, have
        cdef unsigned long long size
        cdef long long held
        cdef int flags, cmds = 0, i
        cdef unsigned char g9
        ready = w.ready
        why = None
        while self.state != _CLOSED:
            if at < n and (len(ready) >= _READY_MAX or cmds >= _CMDS_MAX
                           or self.turn_msgs >= _MSGS_TURN):
                w.backlog[self.fd] = self       # parsed later (recv_message)
                break
            if self.state == _GREETING:
                if n - at < 64:
                    if n - at >= 1 and buf[at] != 0xFF:
                        why = "bad_greeting"
                    elif n - at >= 10 and buf[at + 9] & 1 != 1:
                        why = "bad_greeting"
                    break
                if buf[at] != 0xFF or not buf[at + 9] & 1 or buf[at + 10] < 3:
                    why = "bad_greeting"
                    break
                # the mechanism: "NULL" padded with zeros (20 bytes at 12)
                if (buf[at + 12] != ord("N") or buf[at + 13] != ord("U")
                        or buf[at + 14] != ord("L") or buf[at + 15] != ord("L")):
                    why = "bad_mechanism"
                    break
                for i in range(16, 32):
                    if buf[at + i] != 0:
                        why = "bad_mechanism"
                        break
                if why is not None:
                    break
                at += 64
                self.state = _READY
                continue
            if n - at < 2:
                break
            flags = buf[at]
            if flags & 0xF8:
                why = "bad_frame"
                break
            if flags & 2:
                if n - at < 9:
                    break
                size = 0
                for i in range(1, 9):
                    size = (size << 8) | buf[at + i]
                hl = 9
            else:
                size = buf[at + 1]
                hl = 2
            if flags & 4:       # a command
                if size > _MAX_CMD:
                    why = "bad_frame"
                    break
                if <unsigned long long>(n - at - hl) < size:
                    break
                body = PyBytes_FromStringAndSize(<const char *>buf + at + hl, <Py_ssize_t>size)
                at += hl + <Py_ssize_t>size
                cmds += 1
                try:
                    self.owner._command(self, body)
                except ProtocolError as exc:
                    why = str(exc)
                    break
                if self.state == _CLOSED:
                    return -1
                continue
            if self.state != _OPEN:
                why = "bad_ready"
                break
            if size > <unsigned long long>w.max_frame_bytes:
                why = "frame_too_large"
                break
            # a frame costs its bytes and FRAME_COST (its slot, its object): a message of
            # empty frames is bounded too
            held = self.held + <long long>size + _FRAME_COST
            if held > w.untrusted_message_bytes and not self.trusted:
                if not self._trust():
                    why = "message_too_large"
                    break
                if self.state == _CLOSED:
                    return -1
            if held > w.max_message_bytes:
                why = "message_too_large"
                break
            if <unsigned long long>(n - at - hl) < size:
                if size >= _BIG and not self.trusted:
                    # read in place (a buffer of its whole size, made at once) only for a
                    # connection trust vouches for: an untrusted one's frame grows with
                    # the bytes it sent (its read buffer), so peers that declare a large
                    # frame and stall hold only what they sent
                    self._trust()
                    if self.state == _CLOSED:
                        return -1
                if size >= _BIG and self.trusted:
                    # its own buffer (not zero-filled: every byte is read into), read
                    # into directly from here on
                    have = n - at - hl
                    big = PyByteArray_FromStringAndSize(NULL, <Py_ssize_t>size)
                    memcpy(PyByteArray_AS_STRING(big), buf + at + hl, have)
                    self.big = big
                    self.big_at = have
                    self.big_more = flags & 1
                    self.held = held
                    at = n
                break
            if size >= _BIG:
                fr = PyByteArray_FromStringAndSize(<const char *>buf + at + hl,
                                                   <Py_ssize_t>size)
            else:
                fr = PyBytes_FromStringAndSize(<const char *>buf + at + hl,
                                               <Py_ssize_t>size)
            at += hl + <Py_ssize_t>size
            self.frames.append(fr)
            self.held = held
            if not flags & 1:
                self._deliver()
        if why is not None:
            self.owner._protocol_error(self, why)
            return -1
        if self.state == _CLOSED:
            return -1
        return at

    cdef int _trust(self) except -1:
        tr = self.owner.trust
        self.trusted = tr is None or bool(tr(self.fd, self.ident))
        return self.trusted

    cdef int _deliver(self) except -1:
        frames = self.frames
        self.frames = []
        self.held = 0
        h = Header(frames[0])
        h._conn = self
        frames[0] = h
        frames.insert(0, self.ident)
        self.wire.ready.append(frames)
        self.turn_msgs += 1
        return 0

    # ------------------------------------------------------------------ sending

    def queue(self, data):
        """Queue ``data`` (bytes: a greeting, a command) and flush."""
        self.out.append([memoryview(data), None, len(data), False])
        self.out_bytes += len(data)
        self.flush()

    def send(self, parts, Py_ssize_t track_from=-1):
        """Send ``parts[1:]`` (the routing id first, not sent) as one message: parts
        from ``track_from`` on zero-copy (held until written; a :class:`Tracker` is
        returned for them), else True. Raises TypeError/BufferError for a part without
        a contiguous buffer (nothing sent then)."""
        cdef Py_ssize_t n = len(parts), i, k, total = 0, hl, m, copied
        cdef Py_buffer views[_IOV]
        cdef iovec iov[2 * _IOV]
        cdef unsigned char hdrs[9 * _IOV]
        cdef unsigned char inline_buf[_INLINE + 9]
        cdef int nv = 0, niov = 0, e
        cdef Py_ssize_t sent
        cdef Wire w = self.wire
        if self.state == _CLOSED or n < 2:
            return Tracker(None) if track_from >= 0 else True
        if n - 1 > _IOV:
            return self._send_queued(parts, track_from)
        try:
            for i in range(1, n):
                PyObject_GetBuffer(parts[i], &views[nv], PyBUF_ANY_CONTIGUOUS)
                nv += 1
            if not self.out:
                if n == 2 and track_from < 0 and views[0].len <= _INLINE:
                    # the common reply: one small frame, framed in place, one copy
                    hl = _hdr(inline_buf, views[0].len, False)
                    memcpy(inline_buf + hl, views[0].buf, views[0].len)
                    iov[0].iov_base = inline_buf
                    iov[0].iov_len = hl + views[0].len
                    niov = 1
                else:
                    k = 0
                    for i in range(nv):
                        hl = _hdr(hdrs + k, views[i].len, i < nv - 1)
                        iov[niov].iov_base = hdrs + k
                        iov[niov].iov_len = hl
                        niov += 1
                        k += hl
                        if views[i].len:
                            iov[niov].iov_base = views[i].buf
                            iov[niov].iov_len = views[i].len
                            niov += 1
                for i in range(niov):
                    total += iov[i].iov_len
                while True:
                    with nogil:
                        sent = zs_writev(self.fd, iov, niov)
                        e = zs_errno()
                    if sent >= 0 or e != EINTR:
                        break
                if sent < 0:
                    if not zs_again(e):
                        self.owner._close(self, None)
                        return Tracker(None) if track_from >= 0 else True
                    sent = 0
                if sent == total:
                    return Tracker(None) if track_from >= 0 else True
                if niov == 1:
                    # the rest of the small reply, copied
                    rest = PyBytes_FromStringAndSize(<char *>inline_buf + sent,
                                                     total - sent)
                    self.out.append([memoryview(rest), None, total - sent, True])
                    self.out_bytes += total - sent
                    self.out_msgs += 1
                    self._want(True)
                    return True
                return self._send_queued(parts, track_from, sent)
        finally:
            for i in range(nv):
                PyBuffer_Release(&views[i])
        return self._send_queued(parts, track_from)   # behind what is queued

    cdef object _send_queued(self, parts, Py_ssize_t track_from, Py_ssize_t skip=0):
        """Queue ``parts[1:]`` (as the old listener did: small parts and headers
        joined, large and zero-copy ones held as views), less the first ``skip`` bytes
        of the message (written already), then flush."""
        cdef Py_ssize_t n = len(parts), i, size, copied = 0, drop
        cdef unsigned char h[9]
        cdef Py_ssize_t hl
        cdef Wire w = self.wire
        tracker = Tracker(self) if track_from >= 0 else None
        small = []
        items = []
        for i in range(1, n):
            p = parts[i]
            v = memoryview(p)
            if v.ndim != 1 or v.itemsize != 1:
                v = v.cast("B")
            size = v.nbytes
            hl = _hdr(h, size, i < n - 1)
            small.append(PyBytes_FromStringAndSize(<char *>h, hl))
            zc = tracker is not None and i >= track_from
            if size >= _BIG or zc:
                b = b"".join(small)
                items.append([memoryview(b), None, len(b), False])
                small = []
                items.append([v, None, 0 if zc else size, False])
            else:
                small.append(p)
        if small:
            b = b"".join(small)
            items.append([memoryview(b), None, len(b), False])
        while skip and items:
            item = items[0]
            size = item[0].nbytes
            drop = min(size, skip)
            skip -= drop
            if drop == size:
                del items[0]
            else:
                item[0] = item[0][drop:]
                if item[2]:
                    item[2] -= drop
        for item in items:
            copied += item[2]
        if not items:       # (all written: skip covered it)
            if tracker is not None:
                tracker.done = True
            return tracker if tracker is not None else True
        items[len(items) - 1][1] = tracker
        items[len(items) - 1][3] = True
        if self.out and (self.out_bytes + copied > w.max_out_bytes
                         or self.out_msgs >= w.max_out_messages):
            self.owner._unread_output(self)
            if tracker is not None:
                tracker.done = True
            return tracker if tracker is not None else True
        self.out.extend(items)
        self.out_bytes += copied
        self.out_msgs += 1
        self.flush()
        return tracker if tracker is not None else True

    def flush(self):
        """Write what is queued (``sendmsg`` of up to 64 parts at a time) until the
        kernel takes no more; asks the listener for EPOLLOUT while some is left."""
        cdef Py_buffer views[_IOV]
        cdef iovec iov[_IOV]
        cdef int nv, i, e
        cdef Py_ssize_t sent, size
        out = self.out
        while out and self.state != _CLOSED:
            nv = 0
            try:
                for item in out:
                    if nv == _IOV:
                        break
                    PyObject_GetBuffer(item[0], &views[nv], PyBUF_ANY_CONTIGUOUS)
                    iov[nv].iov_base = views[nv].buf
                    iov[nv].iov_len = views[nv].len
                    nv += 1
                while True:
                    with nogil:
                        sent = zs_writev(self.fd, iov, nv)
                        e = zs_errno()
                    if sent >= 0 or e != EINTR:
                        break
            finally:
                for i in range(nv):
                    PyBuffer_Release(&views[i])
            if sent < 0:
                if zs_again(e):
                    break
                self.owner._close(self, None)
                return
            while out and (sent or not out[0][0].nbytes):
                item = out[0]
                v = item[0]
                size = v.nbytes
                if sent >= size:
                    sent -= size
                    self.out_bytes -= item[2]
                    out.popleft()
                    if item[3]:
                        self.out_msgs -= 1
                    if item[1] is not None:
                        item[1].done = True
                else:
                    item[0] = v[sent:]
                    if item[2]:
                        self.out_bytes -= sent
                        item[2] -= sent
                    sent = 0
            if out and out[0][0].nbytes:
                continue
        if self.state != _CLOSED:
            self._want(bool(out))

    cdef int _want(self, bint want) except -1:
        if want != self.writing:
            self.writing = want
            self.owner._want_write(self, want)
        return 0
