# cython: language_level=3, boundscheck=False, wraparound=False
"""A client-side ZMTP 3.x connection (NULL mechanism) on a plain stream socket.

The sync client's :class:`kvshm.zmq_ctrl.channel.Channel` speaks ZMTP itself to the
server's ROUTER instead of going through libzmq: one request costs a ``sendmsg`` and a
``poll`` + ``recv`` on the caller's thread, with none of libzmq's I/O-thread hand-offs
(eventfd signals, mailbox polls, ``epoll_ctl``) on the client's end.

Wire format (rfc.zeromq.org 23/ZMTP 3.0 and 37/ZMTP 3.1)
-------------------------------------------------------
- Greeting, 64 bytes each way: signature ``FF 00*8 7F``, version ``03 01``, mechanism
  ``"NULL"`` padded with zeros to 20 bytes, as-server ``00``, 31 zero bytes of filler.
  The peer's must carry the signature and a major version of 3 or more, and NULL (a CURVE
  server's: :class:`MechanismMismatch`).
- Then this end's READY command (properties ``Socket-Type`` = ``DEALER`` and ``Identity``
  = the routing id given) and the peer's READY (``Socket-Type`` ROUTER or DEALER), or its
  ERROR command (:class:`PeerError`, its reason).
- Frames: a flags byte (``0x01`` MORE, ``0x02`` LONG: a 64-bit size follows instead of one
  byte, ``0x04`` COMMAND; other bits must be zero), the size (network order), the body.
  Received commands: PING is answered with PONG (its context echoed), PONG is ignored,
  ERROR and anything else end the connection (:class:`PeerError`, :class:`ZmtpError`).

Bounds against a hostile peer: a command is at most ``MAX_COMMAND`` bytes; a frame's
buffer grows with the bytes actually received (from at most ``FIRST_ALLOC`` bytes,
doubling), so a huge declared size costs no memory until its bytes arrive; sizes of 2**63
and more are refused. Every wait is a ``poll(2)`` with a timeout, with the GIL released.

API
---
``Conn(fd)``: takes over a connected stream socket (made non-blocking, close-on-exec).
``Conn.handshake(routing_id, timeout_ms)``, ``Conn.send(header, frames, timeout_ms)``,
``Conn.recv(timeout_ms, into=None)`` (one whole message as a list of ``bytes``, or None
when none completed in time; a message begun stays buffered for the next call; ``into``
names buffers the payload of a message goes into straight from the socket, the
kernel's one copy: no bytes object per frame, no second copy; kvshm.zmq_ctrl.channel
passes it for a batch GET into caller buffers unless ``KVSHM_ZMTP_INTO=0`` is in the
environment), ``Conn.end_into()``, ``Conn.call1`` and
``Conn.recv1`` (the one-key request path, as kvshm.zmq_ctrl._zmqc's: the header packed and
the usual reply read in C), ``Conn.alive(idle_ms)``, ``Conn.close()``.

Errors: :class:`PeerClosed` (the peer closed the connection, or it was reset),
:class:`Timeout` (a send did not complete in time: the connection is then unusable),
:class:`ZmtpError` (a protocol violation), :class:`PeerError` (an ERROR command),
:class:`MechanismMismatch`; OSError for other system call errors. After any of them the
connection is closed (:attr:`Conn.closed`).

kvshm.zmq_ctrl.channel uses it for tcp:// and ipc:// endpoints without CURVE unless
``KVSHM_ZMTP=0`` is in the environment (then libzmq carries them, as it always carries
CURVE and inproc endpoints and the async client).
"""

from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_ANY_CONTIGUOUS,
                             PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE)
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_CheckSignals
from cpython.object cimport PyObject
from cpython.ref cimport Py_XDECREF
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memmove

import os as _os

cdef extern from "Python.h":
    int _PyBytes_Resize(PyObject **bytes, Py_ssize_t newsize) except -1
    long long PyLong_AsLongLongAndOverflow(object v, int *overflow) except? -1
    PyObject *PyBytes_FromStringAndSize_p "PyBytes_FromStringAndSize"(
        const char *v, Py_ssize_t n) except NULL
    char *PyBytes_AS_STRING_p "PyBytes_AS_STRING"(PyObject *o)

cdef extern from *:
    """
    #include <poll.h>
    #include <errno.h>
    #include <fcntl.h>
    #include <unistd.h>
    #include <time.h>
    #include <sys/types.h>
    #include <sys/socket.h>
    #include <sys/uio.h>
    static long long kz_now_ms(void) {
        struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
        return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    }
    static long long kz_now_us(void) {
        struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
        return (long long)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
    }
    static int kz_poll1(int fd, short ev, int ms) {
        struct pollfd p; p.fd = fd; p.events = ev; p.revents = 0;
        int rc = poll(&p, 1, ms);
        return rc > 0 ? p.revents : rc;
    }
    static ssize_t kz_writev(int fd, struct iovec *iov, int n) {
        struct msghdr m; memset(&m, 0, sizeof m);
        m.msg_iov = iov; m.msg_iovlen = n;
        return sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    static ssize_t kz_recv(int fd, void *buf, size_t n) {
        return recv(fd, buf, n, MSG_DONTWAIT);
    }
    /* a blocking receive of at most ms milliseconds (SO_RCVTIMEO, set when it differs
       from *cur): one system call waits and reads */
    static ssize_t kz_recv_wait(int fd, void *buf, size_t n, int ms, int *cur) {
        if (ms != *cur) {
            struct timeval tv; tv.tv_sec = ms / 1000; tv.tv_usec = (ms % 1000) * 1000;
            if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0) return -1;
            *cur = ms;
        }
        return recv(fd, buf, n, 0);
    }
    /* recvmsg into n iovecs: without waiting (ms < 0), else as kz_recv_wait */
    static ssize_t kz_recvv(int fd, struct iovec *iov, int n, int ms, int *cur) {
        struct msghdr m; memset(&m, 0, sizeof m);
        m.msg_iov = iov; m.msg_iovlen = n;
        if (ms < 0) return recvmsg(fd, &m, MSG_DONTWAIT);
        if (ms != *cur) {
            struct timeval tv; tv.tv_sec = ms / 1000; tv.tv_usec = (ms % 1000) * 1000;
            if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0) return -1;
            *cur = ms;
        }
        return recvmsg(fd, &m, 0);
    }
    static int kz_setup(int fd) {
        int fl = fcntl(fd, F_GETFL);
        /* blocking: receives wait with SO_RCVTIMEO, sends never block (MSG_DONTWAIT) */
        if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0) return -1;
        fl = fcntl(fd, F_GETFD);
        if (fl < 0 || fcntl(fd, F_SETFD, fl | FD_CLOEXEC) < 0) return -1;
        return 0;
    }
    static int kz_errno(void) { return errno; }

    """
    struct iovec:
        void *iov_base
        size_t iov_len
    long long kz_now_ms() noexcept nogil
    long long kz_now_us() noexcept nogil
    int kz_poll1(int fd, short ev, int ms) noexcept nogil
    Py_ssize_t kz_writev(int fd, iovec *iov, int n) noexcept nogil
    Py_ssize_t kz_recv(int fd, void *buf, size_t n) noexcept nogil
    Py_ssize_t kz_recv_wait(int fd, void *buf, size_t n, int ms, int *cur) noexcept nogil
    Py_ssize_t kz_recvv(int fd, iovec *iov, int n, int ms, int *cur) noexcept nogil
    int kz_setup(int fd) noexcept nogil
    int kz_errno() noexcept nogil
    int close(int fd) noexcept nogil
    short POLLIN
    short POLLOUT
    short POLLERR
    short POLLHUP
    int EAGAIN
    int EWOULDBLOCK
    int EINTR
    int ECONNRESET
    int EPIPE

cdef extern from "_kvone.h":
    ctypedef unsigned long long kv_u64
    size_t kv_encode1(unsigned char *buf, int op, kv_u64 rid, kv_u64 epoch, const char *key,
                      size_t klen, int put, kv_u64 size, int has_sum, kv_u64 sum) noexcept
    int kv_reply1(const unsigned char *buf, size_t len, int kind, kv_u64 rid,
                  long long *val) noexcept


class ZmtpError(OSError):
    """The peer broke the ZMTP protocol (a bad greeting, flags, command, size)."""


class PeerClosed(ZmtpError):
    """The peer closed (or reset) the connection."""


class Timeout(ZmtpError):
    """A send or the handshake did not complete in time (the connection is closed)."""


class PeerError(ZmtpError):
    """The peer sent an ERROR command; ``reason``: its text."""

    def __init__(self, reason):
        super().__init__(f"the peer sent ZMTP ERROR: {reason!r}")
        self.reason = reason


class FrameTooLarge(ZmtpError):
    """A message from the peer would pass the connection's bound
    (:attr:`Conn.max_message`, bytes): the connection is closed at its frame's header,
    before its bytes are received or anything is allocated for them."""

    def __init__(self, size, bound):
        super().__init__(f"the peer sent a ZMTP message of {size} bytes or more, past "
                         f"this connection's bound of {bound} bytes")
        self.size = size
        self.bound = bound


class MechanismMismatch(ZmtpError):
    """The peer's greeting names another security mechanism than NULL (``mechanism``)."""

    def __init__(self, mechanism):
        super().__init__(f"the peer speaks the ZMTP {mechanism!r} mechanism, not NULL")
        self.mechanism = mechanism


#: what :meth:`Conn.recv1` returns when its slice passed with no message
AGAIN = object()
PUT1 = 0
GET1 = 1
GET1_INTO = 2
EXISTS1 = 3
DEF _MAX_KEY1 = 4096
MAX_KEY1 = _MAX_KEY1
MAX_VALUE1 = 65535
#: longest command body accepted (bytes): PING's context is at most 16, ERROR's reason 255
DEF _MAX_COMMAND = 65536
MAX_COMMAND = _MAX_COMMAND
#: receive buffer (bytes); bodies of larger frames are received straight into their bytes
DEF _RBUF = 262144
#: a frame's first buffer is at most this large; it doubles as its bytes arrive
DEF _FIRST_ALLOC = 1048576
FIRST_ALLOC = _FIRST_ALLOC
DEF _IOV_MAX = 512
#: most iovecs of one receive straight into the destinations (:meth:`Conn.recv`'s into)
DEF _RIOV = 128
#: a long frame's header: the bytes a receive that ends a frame (with more to come) also
#: asks for, into the buffer, so that the next frame's body is received in place too
DEF _HDR_LONG = 9

GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + b"NULL" + b"\x00" * 16
            + b"\x00" + b"\x00" * 31)


cdef bytes _prop(bytes name, bytes value):
    return bytes((len(name),)) + name + len(value).to_bytes(4, "big") + value


cdef bytes _cmd_frame(bytes name, bytes body):
    cdef bytes data = bytes((len(name),)) + name + body
    if len(data) <= 255:
        return bytes((0x04, len(data))) + data
    return b"\x06" + len(data).to_bytes(8, "big") + data


def _parse_props(bytes data):
    """ZMTP metadata: (name-len, name, 4-byte value-len, value)* -> dict (names lower case)."""
    cdef Py_ssize_t i = 0, n = len(data), ln, lv
    props = {}
    while i < n:
        ln = data[i]
        if ln == 0 or i + 1 + ln + 4 > n:
            raise ZmtpError("a malformed property in the peer's READY")
        name = data[i + 1:i + 1 + ln]
        i += 1 + ln
        lv = int.from_bytes(data[i:i + 4], "big")
        i += 4
        if lv > n - i:
            raise ZmtpError("a property value runs past the peer's READY")
        props[name.lower()] = data[i:i + lv]
        i += lv
    return props


cdef class Conn:
    """One ZMTP connection over a connected stream socket's descriptor (taken over: it is
    closed by :meth:`close`). Not thread-safe: the Channel's lock serialises its use."""

    cdef int fd
    cdef readonly int pid
    cdef unsigned char *rbuf
    cdef Py_ssize_t rs, re
    cdef list parts                 # frames of the message being received
    cdef PyObject *fr               # the frame being filled (a bytes object), or NULL
    cdef Py_ssize_t fr_size, fr_got, fr_alloc
    cdef bint fr_more
    cdef long long last_us          # kz_now_us() of the last byte received or sent
    cdef readonly object peer       # the peer's READY properties (dict)
    cdef int rcv_ms                 # the socket's SO_RCVTIMEO now (ms; 0: none)
    # destinations (recv's ``into``): the message being received has them (dmsg); its
    # payload bytes go, in order, into dv[0][:dlen[0]], dv[1][:dlen[1]], ...; di/doff:
    # where the next byte goes; dleft: bytes still to place; fr_dir: the frame being
    # received is placed there (not in a bytes object); dgot: buffers held; dtotal: bytes
    # to place in all; dend_at (dnf payload frames; NULL: not given): where in those bytes
    # each payload frame must end (>= 0: exactly there; < 0: at most at -x - 1, a part
    # of a value that continues in the next frame): a frame that does not is not placed
    cdef bint dmsg, fr_dir
    cdef Py_buffer *dv
    cdef Py_ssize_t *dlen
    cdef Py_ssize_t dgot, di, doff, dleft, dtotal, dnf
    cdef long long *dend_at
    cdef object into                # recv's ``into`` during one call, else None
    #: the most bytes one received message may hold, its frames together (default
    #: 2**62: none); a frame header past it raises FrameTooLarge and closes
    cdef public long long max_message
    cdef long long msg_got          # bytes of the message being received, so far

    def __cinit__(self, int fd):
        self.fd = -1
        self.rbuf = <unsigned char *>malloc(_RBUF)
        if self.rbuf == NULL:
            raise MemoryError
        if kz_setup(fd) < 0:
            raise OSError(kz_errno(), "fcntl on the ZMTP socket failed")
        self.fd = fd
        self.pid = _os.getpid()
        self.parts = []
        self.last_us = kz_now_us()
        self.max_message = 1LL << 62
        self.msg_got = 0

    def __dealloc__(self):
        if self.fd >= 0:
            close(self.fd)
            self.fd = -1
        Py_XDECREF(self.fr)
        self.fr = NULL
        self._dend()
        free(self.rbuf)
        self.rbuf = NULL

    @property
    def closed(self):
        return self.fd < 0

    def fileno(self):
        return self.fd

    def close(self):
        """Close the descriptor (idempotent). In a forked child it only closes the
        child's copy: the parent's connection is not disturbed (no shutdown)."""
        if self.fd >= 0:
            close(self.fd)
            self.fd = -1
        Py_XDECREF(self.fr)
        self.fr = NULL
        self._dend()
        self.parts = []
        self.msg_got = 0

    def end_into(self):
        """Called when a call that passed ``into`` to :meth:`recv` is done with it: when
        a message with destinations is still being received (the call gave up on it:
        its deadline, an exception), the connection is closed, as its further bytes
        would go into buffers the caller has taken back. Returns True when it closed."""
        if not self.dmsg:
            return False
        self.close()
        self.rs = self.re = 0           # (the rest of that message: never parsed)
        return True

    cdef void _dend(self) noexcept:
        """Release the destinations (the message that had them is whole, or given up)."""
        cdef Py_ssize_t i
        for i in range(self.dgot):
            PyBuffer_Release(&self.dv[i])
        free(self.dv)
        free(self.dlen)
        free(self.dend_at)
        self.dv = NULL
        self.dlen = NULL
        self.dend_at = NULL
        self.dnf = 0
        self.dgot = 0
        self.dleft = 0
        self.dtotal = 0
        self.dmsg = False
        self.fr_dir = False

    cdef int _dstart(self, object plan) except -1:
        """Take ``plan`` (``into``'s answer for a message's first frame): None, or
        ``(buffers, sizes)``, the payload's bytes to go into ``buffers[i][:sizes[i]]`` in
        order (a negative size: none for that buffer, which is not looked at). Each
        other buffer must be writable and C-contiguous and its size an int of at most
        its length: else nothing is taken (the payload is received as usual). A third
        item, when given: ``view(obj)``, called for an object without the buffer
        protocol (a torch tensor), returns one over its memory (or raises: nothing
        taken). A fourth, when given and not None: the reply's ``counts`` (values per
        payload frame, :mod:`kvshm.zmq_ctrl.frames`): each frame's bytes are then placed
        only when its length is the one counts and sizes give it (checked as its header
        arrives, before a byte of it is written); a frame that does not fit ends the
        placing (it and the frames after it are received as usual, and the caller's
        check of the lengths, ``frames.placed``, refuses the reply). Counts that do not
        add up to the sizes: nothing taken."""
        cdef Py_ssize_t n, i, total = 0
        cdef long long v
        cdef int ovf = 0
        cdef object bufs, sizes, sz, view = None, o, counts = None
        if plan is None:
            return 0
        bufs, sizes = plan[0], plan[1]
        if len(plan) > 2:
            view = plan[2]
        if len(plan) > 3:
            counts = plan[3]
        n = len(bufs)
        if len(sizes) != n:
            return 0
        self.dv = <Py_buffer *>malloc(sizeof(Py_buffer) * (n + 1))
        self.dlen = <Py_ssize_t *>malloc(sizeof(Py_ssize_t) * (n + 1))
        if self.dv == NULL or self.dlen == NULL:
            self._dend()
            raise MemoryError
        try:
            for i in range(n):
                sz = sizes[i]
                if type(sz) is not int:
                    self._dend()
                    return 0
                v = PyLong_AsLongLongAndOverflow(sz, &ovf)
                if ovf:
                    self._dend()
                    return 0
                if v < 0:
                    continue                # (a miss)
                o = bufs[i]
                try:
                    try:
                        PyObject_GetBuffer(o, &self.dv[self.dgot],
                                           PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
                    except TypeError:
                        if view is None:
                            raise
                        o = view(o)         # (a tensor: its memory as a buffer)
                        PyObject_GetBuffer(o, &self.dv[self.dgot],
                                           PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
                except Exception:
                    self._dend()
                    return 0
                self.dgot += 1
                if v > self.dv[self.dgot - 1].len:
                    self._dend()
                    return 0
                self.dlen[self.dgot - 1] = <Py_ssize_t>v
                total += <Py_ssize_t>v
        except BaseException:
            # (a KeyboardInterrupt in a view or a sequence's item, an error of one:
            # the buffers taken so far are not to stay exported)
            self._dend()
            raise
        if counts is not None and self._dlayout(counts, total) < 0:
            self._dend()
            return 0
        self.di = 0
        self.doff = 0
        self.dleft = total
        self.dtotal = total
        self.dmsg = True
        return 0

    cdef int _dlayout(self, object counts, Py_ssize_t total) except -2:
        """Where each payload frame ends (``dend_at``) from ``counts`` and the sizes
        taken (``dlen``): 0, or -1 when counts do not fit them (not a list of ints >= 0,
        a count of 0 that continues no value of one frame, not adding up)."""
        cdef Py_ssize_t nf, f, k = 0, j, c, nxt
        cdef long long cum = 0, gend = 0
        cdef bint group = False
        cdef int ovf = 0
        cdef object it
        if type(counts) is not list:
            return -1
        nf = len(counts)
        self.dend_at = <long long *>malloc(sizeof(long long) * (nf + 1))
        if self.dend_at == NULL:
            raise MemoryError
        for f in range(nf):
            it = counts[f]
            if type(it) is not int:
                return -1
            c = <Py_ssize_t>PyLong_AsLongLongAndOverflow(it, &ovf)
            if ovf or c < 0:
                return -1
            nxt = -1
            if f + 1 < nf:
                it = counts[f + 1]
                if type(it) is not int:
                    return -1
                nxt = <Py_ssize_t>PyLong_AsLongLongAndOverflow(it, &ovf)
                if ovf:
                    return -1
            if c == 0:
                if not group:           # continues no value of one frame
                    return -1
                self.dend_at[f] = gend if nxt != 0 else -gend - 1
                if nxt != 0:
                    group = False
                continue
            if nxt == 0:                # a value over this frame and the next ones
                if c != 1 or k >= self.dgot:
                    return -1
                gend = cum + self.dlen[k]
                k += 1
                cum = gend
                group = True
                self.dend_at[f] = -gend - 1
                continue
            if c > self.dgot - k:
                return -1
            for j in range(k, k + c):
                cum += self.dlen[j]
            k += c
            self.dend_at[f] = cum
        if k != self.dgot or cum != total:
            return -1
        self.dnf = nf
        return 0

    cdef bint _dfits(self, unsigned long long size) noexcept:
        """Whether the payload frame of ``size`` bytes starting now ends where
        ``dend_at`` says it must."""
        cdef Py_ssize_t f = len(self.parts) - 1     # (parts: the header, then frames)
        cdef long long end, x
        if f < 0 or f >= self.dnf or size > <unsigned long long>self.dleft:
            return False
        end = <long long>(self.dtotal - self.dleft) + <long long>size
        x = self.dend_at[f]
        if x >= 0:
            return end == x
        return end <= -x - 1

    cdef void _dput(self, const unsigned char *src, Py_ssize_t n) noexcept:
        """``n`` more bytes of the frame being placed (n <= dleft): copied from ``src``,
        or (src NULL) already received in place."""
        cdef Py_ssize_t k
        self.dleft -= n
        self.fr_got += n
        while n > 0:
            k = self.dlen[self.di] - self.doff
            if k == 0:
                self.di += 1
                self.doff = 0
                continue
            if k > n:
                k = n
            if src != NULL:
                memcpy(<char *>self.dv[self.di].buf + self.doff, src, k)
                src += k
            self.doff += k
            n -= k

    cdef int _fail(self, exc) except -1:
        self.close()
        raise exc

    cdef int _check_open(self) except -1:
        if self.fd < 0:
            raise PeerClosed("the ZMTP connection is closed")
        return 0

    # ------------------------------------------------------------------ sending

    cdef int _write_iov(self, iovec *iov, int n, long long deadline) except -1:
        """Write the n iovecs whole (iov is advanced in place), waiting for room until
        ``deadline`` (kz_now_ms). Raises Timeout / PeerClosed (connection closed)."""
        cdef Py_ssize_t w
        cdef int err, rc, i = 0, left
        while i < n:
            w = kz_writev(self.fd, &iov[i], n - i)
            if w >= 0:
                while i < n and <size_t>w >= iov[i].iov_len:
                    w -= iov[i].iov_len
                    i += 1
                if i < n and w > 0:
                    iov[i].iov_base = <char *>iov[i].iov_base + w
                    iov[i].iov_len -= w
                continue
            err = kz_errno()
            if err == EINTR:
                PyErr_CheckSignals()
                continue
            if err == EAGAIN or err == EWOULDBLOCK:
                left = <int>max(0, deadline - kz_now_ms())
                if left == 0:
                    self._fail(Timeout("the ZMTP send did not complete in time"))
                with nogil:
                    rc = kz_poll1(self.fd, POLLOUT, left)
                if rc < 0 and kz_errno() == EINTR:
                    PyErr_CheckSignals()
                continue
            if err == EPIPE or err == ECONNRESET:
                self._fail(PeerClosed(err, "the peer closed the ZMTP connection"))
            self._fail(OSError(err, _os.strerror(err)))
        self.last_us = kz_now_us()
        return 0

    def write_raw(self, data, int timeout_ms):
        """Write ``data`` (a buffer) whole within ``timeout_ms`` (the greeting)."""
        cdef Py_buffer v
        cdef iovec io[1]
        self._check_open()
        PyObject_GetBuffer(data, &v, PyBUF_ANY_CONTIGUOUS)
        try:
            io[0].iov_base = v.buf
            io[0].iov_len = v.len
            self._write_iov(io, 1, kz_now_ms() + timeout_ms)
        finally:
            PyBuffer_Release(&v)

    def send(self, header, frames, int timeout_ms):
        """Send ``[header, *frames]`` (any contiguous buffers) as one message, all its
        bytes written within ``timeout_ms``. Raises Timeout (some bytes may have gone:
        the connection is closed), PeerClosed, OSError; TypeError/BufferError for a part
        without a contiguous buffer, before anything is sent."""
        cdef Py_ssize_t n = 1 + len(frames), i, k
        cdef Py_buffer *views
        cdef unsigned char *hdrs
        cdef iovec *iov
        cdef int got = 0, m, j, cap = 2 * <int>min(n, _IOV_MAX)
        cdef unsigned long long size
        cdef unsigned char *h
        cdef long long deadline = kz_now_ms() + timeout_ms
        self._check_open()
        views = <Py_buffer *>malloc(sizeof(Py_buffer) * n)
        hdrs = <unsigned char *>malloc(9 * n)
        iov = <iovec *>malloc(sizeof(iovec) * 2 * min(n, _IOV_MAX))
        if views == NULL or hdrs == NULL or iov == NULL:
            free(views); free(hdrs); free(iov)
            raise MemoryError
        try:
            PyObject_GetBuffer(header, &views[0], PyBUF_ANY_CONTIGUOUS)
            got = 1
            for i in range(1, n):
                PyObject_GetBuffer(frames[i - 1], &views[i], PyBUF_ANY_CONTIGUOUS)
                got += 1
            i = 0
            while i < n:
                m = 0
                k = i
                while k < n and m + 2 <= cap:
                    size = views[k].len
                    h = hdrs + 9 * k
                    if size <= 255:
                        h[0] = 1 if k < n - 1 else 0
                        h[1] = <unsigned char>size
                        iov[m].iov_len = 2
                    else:
                        h[0] = 3 if k < n - 1 else 2
                        for j in range(8):
                            h[1 + j] = <unsigned char>(size >> (8 * (7 - j)))
                        iov[m].iov_len = 9
                    iov[m].iov_base = h
                    m += 1
                    if size:
                        iov[m].iov_base = views[k].buf
                        iov[m].iov_len = size
                        m += 1
                    k += 1
                self._write_iov(iov, m, deadline)
                i = k
        finally:
            for i in range(got):
                PyBuffer_Release(&views[i])
            free(views); free(hdrs); free(iov)

    # ---------------------------------------------------------------- receiving

    cdef int _fill(self, long long deadline, bint first) except -1:
        """Receive more bytes (into the frame being filled when it is large and the
        buffer is empty, else into the buffer). Returns 1 when some arrived, 0 when
        ``deadline`` passed first. Raises PeerClosed (the peer closed), OSError."""
        cdef Py_ssize_t r, want, need, k, off, j
        cdef int err, rc, left, m = 0
        cdef void *dst
        cdef int direct                 # 0: into the buffer, 1: the frame's bytes,
        cdef iovec iov[_RIOV + 1]       # 2: the destinations (recv's into)
        while True:
            direct = 0
            want = 0
            need = self.fr_size - self.fr_got
            if self.rs == self.re and need >= (_RBUF >> 2) and self.fr_dir:
                # straight into the destinations, as many as one receive can take
                m = 0
                j = self.di
                off = self.doff
                while want < need and m < _RIOV:
                    k = self.dlen[j] - off
                    if k > 0:
                        if k > need - want:
                            k = need - want
                        iov[m].iov_base = <char *>self.dv[j].buf + off
                        iov[m].iov_len = k
                        m += 1
                        want += k
                    j += 1
                    off = 0
                if want >= (_RBUF >> 2):
                    direct = 2
            elif self.rs == self.re and need >= (_RBUF >> 2) and self.fr != NULL:
                if self.fr_got == self.fr_alloc:
                    self._grow()
                iov[0].iov_base = PyBytes_AS_STRING_p(self.fr) + self.fr_got
                want = self.fr_alloc - self.fr_got
                iov[0].iov_len = want
                m = 1
                direct = 1
            if direct:
                if want == need and self.fr_more:
                    # the frame's last bytes, and the next frame's header with them
                    self.rs = self.re = 0
                    iov[m].iov_base = self.rbuf
                    iov[m].iov_len = _HDR_LONG
                    m += 1
            else:
                if self.rs == self.re:
                    self.rs = self.re = 0
                elif self.re == _RBUF:
                    memmove(self.rbuf, self.rbuf + self.rs, self.re - self.rs)
                    self.re -= self.rs
                    self.rs = 0
                dst = self.rbuf + self.re
                want = _RBUF - self.re
            left = <int>max(0, deadline - kz_now_ms())
            if direct:
                if left > 0:
                    with nogil:
                        r = kz_recvv(self.fd, iov, m, left, &self.rcv_ms)
                else:
                    r = kz_recvv(self.fd, iov, m, -1, &self.rcv_ms)
            elif left > 0:
                with nogil:
                    r = kz_recv_wait(self.fd, dst, want, left, &self.rcv_ms)
            else:
                r = kz_recv(self.fd, dst, want)
            if r > 0:
                if direct:
                    k = min(r, want)
                    if direct == 2:
                        self._dput(NULL, k)
                    else:
                        self.fr_got += k
                    self.re += r - k        # (the next header, when asked for)
                else:
                    self.re += r
                self.last_us = kz_now_us()
                return 1
            if r == 0:
                self._fail(PeerClosed("the peer closed the ZMTP connection"))
            err = kz_errno()
            if err == EINTR:
                PyErr_CheckSignals()
            elif err == EAGAIN or err == EWOULDBLOCK:
                if left == 0 or kz_now_ms() >= deadline:
                    return 0
            elif err == ECONNRESET or err == EPIPE:
                self._fail(PeerClosed(err, "the peer reset the ZMTP connection"))
            else:
                self._fail(OSError(err, _os.strerror(err)))

    cdef int _grow(self) except -1:
        cdef Py_ssize_t na = min(self.fr_size, self.fr_alloc * 2)
        _PyBytes_Resize(&self.fr, na)
        self.fr_alloc = na
        return 0

    cdef int _command(self, const unsigned char *p, Py_ssize_t n) except -1:
        """Act on one command received after the handshake (PING, PONG), or fail."""
        cdef Py_ssize_t ln
        cdef bytes name, body
        if n < 1 or p[0] + 1 > n or p[0] == 0:
            self._fail(ZmtpError("a malformed ZMTP command"))
        ln = p[0]
        name = PyBytes_FromStringAndSize(<const char *>p + 1, ln)
        body = PyBytes_FromStringAndSize(<const char *>p + 1 + ln, n - 1 - ln)
        if name == b"PING":
            # PING: 2-byte TTL (deciseconds), then a context of up to 16 bytes to echo
            if len(body) < 2:
                self._fail(ZmtpError("a malformed ZMTP PING"))
            self.write_raw(_cmd_frame(b"PONG", body[2:18]), 1000)
            return 0
        if name == b"PONG":
            return 0
        if name == b"ERROR":
            reason = body[1:1 + body[0]].decode("utf-8", "replace") if body else ""
            self._fail(PeerError(reason))
        self._fail(ZmtpError(f"an unexpected ZMTP command {name!r} from the peer"))

    cdef object _parse(self):
        """Take frames from the buffer; returns the message when one completed, else
        None (more bytes are needed)."""
        cdef Py_ssize_t avail, take, hl
        cdef unsigned char fl
        cdef unsigned long long size
        cdef int j
        cdef list msg
        cdef object obj
        while True:
            if self.fr_dir:
                take = min(self.re - self.rs, self.fr_size - self.fr_got)
                if take > 0:
                    self._dput(self.rbuf + self.rs, take)
                    self.rs += take
                if self.fr_got < self.fr_size:
                    return None
                self.fr_dir = False
                self.parts.append(self.fr_size)     # (its length: placed, not here)
                if not self.fr_more:
                    msg = self.parts
                    self.parts = []
                    self.msg_got = 0
                    self._dend()
                    return msg
                continue
            if self.fr != NULL:
                take = min(self.re - self.rs, self.fr_size - self.fr_got)
                while take > 0:
                    if self.fr_got == self.fr_alloc:
                        self._grow()
                    hl = min(take, self.fr_alloc - self.fr_got)
                    memcpy(PyBytes_AS_STRING_p(self.fr) + self.fr_got, self.rbuf + self.rs, hl)
                    self.fr_got += hl
                    self.rs += hl
                    take -= hl
                if self.fr_got < self.fr_size:
                    return None
                obj = <object>self.fr           # (a new reference)
                Py_XDECREF(self.fr)
                self.fr = NULL
                self.parts.append(obj)
                if not self.fr_more:
                    msg = self.parts
                    self.parts = []
                    self.msg_got = 0
                    if self.dmsg:
                        self._dend()
                    return msg
                if self.into is not None and not self.dmsg and len(self.parts) == 1:
                    self._dstart(self.into(obj))
                continue
            avail = self.re - self.rs
            if avail < 2:
                return None
            fl = self.rbuf[self.rs]
            if fl & 0xF8:
                self._fail(ZmtpError(f"bad ZMTP frame flags 0x{fl:02x}"))
            if fl & 2:
                if avail < 9:
                    return None
                size = 0
                for j in range(8):
                    size = (size << 8) | self.rbuf[self.rs + 1 + j]
                if size >> 63:
                    self._fail(ZmtpError(f"a ZMTP frame of {size} bytes (2**63 or more)"))
                hl = 9
            else:
                size = self.rbuf[self.rs + 1]
                hl = 2
            if fl & 4:
                if fl & 1 or self.parts:
                    self._fail(ZmtpError("a ZMTP command inside a message"))
                if size > _MAX_COMMAND:
                    self._fail(ZmtpError(f"a ZMTP command of {size} bytes (at most "
                                         f"{_MAX_COMMAND})"))
                if avail < hl + <Py_ssize_t>size:
                    return None
                self.rs += hl + size
                self._command(self.rbuf + self.rs - size, size)
                continue
            if size > <unsigned long long>(self.max_message - self.msg_got):
                self.rs = self.re = 0       # (the rest of it: never parsed)
                self._fail(FrameTooLarge(self.msg_got + size, self.max_message))
            self.msg_got += size
            self.rs += hl
            self.fr_size = size
            self.fr_got = 0
            self.fr_more = fl & 1
            if self.dmsg and self.dend_at != NULL and not self._dfits(size):
                self._dend()                # (not where the layout has it: not placed)
            if self.dmsg and self.fr_size <= self.dleft:
                self.fr_dir = True          # (placed in the destinations: see top)
                continue
            self.fr_alloc = min(size, _FIRST_ALLOC)
            self.fr = PyBytes_FromStringAndSize_p(NULL, self.fr_alloc)

    def recv(self, int timeout_ms, into=None):
        """One whole message (a list of ``bytes``), or None when none completed within
        ``timeout_ms`` (0: only what is here now; a message begun stays for the next
        call; it returns by its deadline even while the peer goes on sending: at most
        one more buffer of bytes is read once it passed). Raises PeerClosed, ZmtpError, PeerError, OSError (the connection is then
        closed).

        ``into``: a callable given the first frame (``bytes``) of each message with more
        frames that completes in this call; it returns None, or ``(buffers, sizes)``:
        the rest of that message's bytes (its payload, whatever its frame boundaries)
        go in order straight into ``buffers[0][:sizes[0]]``, ``buffers[1][:sizes[1]]``,
        ... (the kernel copies them there: no bytes object, no second copy). Each frame
        so placed is an ``int`` (its length) in the message; a frame larger than the
        room left is received as usual (``bytes``). With ``(buffers, sizes, view,
        counts)`` the frame boundaries are checked too: a frame whose length is not
        the one counts and sizes give it is not placed, nor any after it (see
        ``_dstart``). Buffers that are not writable and
        C-contiguous, or smaller than their size: nothing is placed. The buffers are
        held until the message is whole or the connection closes; a caller that gives
        up on the message calls :meth:`end_into`."""
        self.into = into
        try:
            return self._recv(timeout_ms)
        finally:
            self.into = None

    cdef object _recv(self, int timeout_ms):
        cdef long long deadline = kz_now_ms() + timeout_ms
        cdef bint first = True
        cdef object m
        while True:
            if self.fd < 0:
                # messages that were whole when the peer closed are still handed out
                m = self._parse() if self.re > self.rs else None
                if m is None:
                    self.rs = self.re = 0
                    raise PeerClosed("the ZMTP connection is closed")
                return m
            m = self._parse()
            if m is not None:
                return m
            if not first and kz_now_ms() >= deadline:
                return None             # (bytes may still be coming: never past it)
            if not self._fill(deadline, first):
                return None
            first = False

    def read_raw(self, Py_ssize_t n, int timeout_ms):
        """Exactly ``n`` bytes (n <= the buffer), within ``timeout_ms`` (the greeting).
        Raises Timeout, PeerClosed."""
        cdef long long deadline = kz_now_ms() + timeout_ms
        cdef bytes out
        self._check_open()
        while self.re - self.rs < n:
            if not self._fill(deadline, False):
                self._fail(Timeout("no ZMTP greeting from the peer in time"))
        out = PyBytes_FromStringAndSize(<const char *>self.rbuf + self.rs, n)
        self.rs += n
        return out

    def read_command(self, int timeout_ms):
        """The next command frame's body (the handshake's READY or ERROR)."""
        cdef long long deadline = kz_now_ms() + timeout_ms
        cdef unsigned char fl
        cdef Py_ssize_t hl, size, j
        cdef bytes out
        self._check_open()
        while True:
            if self.re - self.rs >= 2:
                fl = self.rbuf[self.rs]
                if fl & 0xF9 or not fl & 4:
                    self._fail(ZmtpError(f"the peer sent no ZMTP command (flags 0x{fl:02x}) "
                                         "in the handshake"))
                hl = 2
                if fl & 2:
                    hl = 9
                if self.re - self.rs >= hl:
                    if fl & 2:
                        size = 0
                        for j in range(8):
                            if self.rbuf[self.rs + 1 + j] and j < 5:
                                self._fail(ZmtpError("a ZMTP handshake command over "
                                                     f"{_MAX_COMMAND} bytes"))
                            size = (size << 8) | self.rbuf[self.rs + 1 + j]
                    else:
                        size = self.rbuf[self.rs + 1]
                    if size > _MAX_COMMAND:
                        self._fail(ZmtpError(f"a ZMTP handshake command over {_MAX_COMMAND} "
                                             "bytes"))
                    if self.re - self.rs >= hl + size:
                        out = PyBytes_FromStringAndSize(
                            <const char *>self.rbuf + self.rs + hl, size)
                        self.rs += hl + size
                        return out
            if not self._fill(deadline, False):
                self._fail(Timeout("no ZMTP handshake from the peer in time"))

    def handshake(self, bytes routing_id not None, int timeout_ms):
        """The greeting and READY exchange (NULL mechanism), this end a DEALER with
        ``routing_id`` as its Identity. Raises Timeout, PeerClosed, ZmtpError (not a ZMTP
        3 peer, a bad READY), MechanismMismatch, PeerError (the peer's ERROR)."""
        cdef long long deadline = kz_now_ms() + timeout_ms
        self.write_raw(GREETING, timeout_ms)
        try:
            g = self.read_raw(64, max(0, deadline - kz_now_ms()))
        except PeerClosed:
            # a peer of another mechanism may close as soon as it read this greeting:
            # what it sent of its own before may name its mechanism
            if self.re - self.rs >= 32 and self.rbuf[self.rs] == 0xFF:
                mech = PyBytes_FromStringAndSize(<const char *>self.rbuf + self.rs + 12,
                                                 20).rstrip(b"\x00")
                if mech != b"NULL":
                    raise MechanismMismatch(mech.decode("ascii", "replace")) from None
            raise
        if g[0] != 0xFF or not g[9] & 1:
            self._fail(ZmtpError("the peer is not a ZeroMQ peer (bad ZMTP signature)"))
        if g[10] < 3:
            self._fail(ZmtpError(f"the peer speaks ZMTP {g[10]}.{g[11]}, not 3.x"))
        mech = g[12:32].rstrip(b"\x00")
        if mech != b"NULL":
            self._fail(MechanismMismatch(mech.decode("ascii", "replace")))
        self.write_raw(_cmd_frame(b"READY", _prop(b"Socket-Type", b"DEALER")
                                + _prop(b"Identity", routing_id)),
                       max(0, deadline - kz_now_ms()))
        body = self.read_command(max(0, deadline - kz_now_ms()))
        ln = body[0] if body else 0
        name = body[1:1 + ln]
        if name == b"ERROR":
            rl = body[1 + ln] if len(body) > 1 + ln else 0
            self._fail(PeerError(body[2 + ln:2 + ln + rl].decode("utf-8", "replace")))
        if name != b"READY" or ln == 0:
            self._fail(ZmtpError(f"the peer's ZMTP handshake command is {name!r}, not READY"))
        try:
            props = _parse_props(body[1 + ln:])
        except ZmtpError as exc:
            self._fail(exc)
        st = props.get(b"socket-type")
        if st not in (b"ROUTER", b"DEALER"):
            self._fail(ZmtpError(f"the peer is a ZeroMQ {st!r} socket, not a ROUTER"))
        self.peer = props

    def alive(self, int idle_ms):
        """False when the peer is found to have closed the connection (then closed here):
        checked (a poll and, when readable, a receive into the buffer) only when nothing
        was received or sent for ``idle_ms``. True otherwise."""
        cdef int rc
        if self.fd < 0:
            return False
        if kz_now_us() - self.last_us < idle_ms * 1000:
            return True
        rc = kz_poll1(self.fd, POLLIN, 0)
        if rc <= 0:
            return True
        try:
            while self.re < _RBUF or self.rs > 0:
                if not self._fill(0, True):
                    break
                if self.re == _RBUF and self.rs == 0:
                    break               # stray messages enough to fill it: it is alive
        except (PeerClosed, OSError):
            return False
        return True

    def poll(self, int timeout_ms, int events=1):
        """1 (POLLIN) when bytes are buffered or arrive within ``timeout_ms`` (a message
        may be whole: :meth:`recv` tells), or the peer closed; else 0. For callers that
        wait as on a zmq socket (``events`` must include POLLIN, 1)."""
        cdef int rc
        if self.re > self.rs and self.fr == NULL and not self.fr_dir or self.fd < 0:
            return 1
        with nogil:
            rc = kz_poll1(self.fd, POLLIN, timeout_ms)
        return 1 if rc > 0 else 0

    # -------------------------------------------------------------- one-key path

    def call1(self, int kind, int op, kv_u64 req_id, kv_u64 epoch, bytes key not None,
              value, checksum, Py_ssize_t max_size, out, int send_ms, int slice_ms):
        """Send one single-key request (as kvshm.zmq_ctrl._zmqc.call1: PUT of ``value``
        when ``kind`` is PUT1, else a GET/EXISTS of ``key``), all bytes within
        ``send_ms``, then :meth:`recv1`'s first slice. Returns None when nothing was
        sent (a key over MAX_KEY1, a value over ``max_size`` / MAX_VALUE1 bytes or without
        a C-contiguous buffer), else what recv1 returns."""
        cdef size_t klen = PyBytes_GET_SIZE(key)
        cdef unsigned char buf[_MAX_KEY1 + 80 + 18]
        cdef size_t n
        cdef Py_buffer view
        cdef iovec io[2]
        cdef int cnt = 1
        self._check_open()
        if klen > _MAX_KEY1:
            return None
        if kind != PUT1:
            n = kv_encode1(buf + 2, op, req_id, epoch, PyBytes_AS_STRING(key), klen, 0, 0,
                           0, 0)
            if n <= 255:
                buf[0] = 0
                buf[1] = <unsigned char>n
                io[0].iov_base = buf
                io[0].iov_len = n + 2
            else:
                n = kv_encode1(buf + 9, op, req_id, epoch, PyBytes_AS_STRING(key), klen,
                               0, 0, 0, 0)
                self._long_hdr(buf, n, 0)
                io[0].iov_base = buf
                io[0].iov_len = n + 9
            self._write_iov(io, 1, kz_now_ms() + send_ms)
            return self._recv1(kind, req_id, out, slice_ms)
        try:
            PyObject_GetBuffer(value, &view, PyBUF_C_CONTIGUOUS)
        except (TypeError, BufferError, ValueError):
            return None
        try:
            if view.len > MAX_VALUE1 or view.len > max_size:
                return None
            n = kv_encode1(buf + 9, op, req_id, epoch, PyBytes_AS_STRING(key), klen, 1,
                           view.len, checksum is not None,
                           0 if checksum is None else <kv_u64>checksum)
            if n <= 255:
                memmove(buf + 2, buf + 9, n)
                buf[0] = 1
                buf[1] = <unsigned char>n
                n += 2
            else:
                self._long_hdr(buf, n, 1)
                n += 9
            if view.len <= 255:
                buf[n] = 0
                buf[n + 1] = <unsigned char>view.len
                n += 2
            else:
                self._long_hdr(buf + n, view.len, 0)
                n += 9
            io[0].iov_base = buf
            io[0].iov_len = n
            io[1].iov_base = view.buf
            io[1].iov_len = view.len
            self._write_iov(io, 2 if view.len else 1, kz_now_ms() + send_ms)
        finally:
            PyBuffer_Release(&view)
        return self._recv1(kind, req_id, out, slice_ms)

    cdef void _long_hdr(self, unsigned char *h, unsigned long long size, int more) noexcept:
        cdef int j
        h[0] = 2 | more
        for j in range(8):
            h[1 + j] = <unsigned char>(size >> (8 * (7 - j)))

    cdef object _fast1(self, int kind, kv_u64 req_id, object out, int *st):
        """The usual reply read straight from the buffer. ``st``: 1 read (the result
        returned), 0 more bytes are needed to tell, 2 not the usual reply or not
        readable here (the general reading takes it)."""
        cdef const unsigned char *p = self.rbuf + self.rs
        cdef Py_ssize_t avail = self.re - self.rs
        cdef Py_ssize_t n1, n2, j
        cdef long long v = 0
        cdef Py_buffer ob
        cdef object res
        st[0] = 2
        if self.fr != NULL or self.fr_dir or self.parts:
            return None
        if avail < 2:
            st[0] = 0
            return None
        if p[0] & 0xFE:
            return None                 # (a long, command or unusual frame: general path)
        n1 = p[1]
        if avail < 2 + n1:
            st[0] = 0
            return None
        if kv_reply1(p + 2, n1, 1 if kind == GET1_INTO else kind, req_id, &v) != 1:
            return None
        if not p[0] & 1:
            if (kind == GET1 or kind == GET1_INTO) and v >= 0:
                return None             # a hit without its frame
            self.rs += 2 + n1
            st[0] = 1
            return (v != 0) if kind == EXISTS1 else v
        if kind != GET1 and kind != GET1_INTO or v < 0:
            return None
        p += 2 + n1
        avail -= 2 + n1
        if avail < 2:
            st[0] = 0
            return None
        if p[0] & 0xFD:
            return None                 # (MORE, or a command: general path)
        if p[0] & 2:
            if avail < 9:
                st[0] = 0
                return None
            n2 = 0
            for j in range(8):
                n2 = (n2 << 8) | p[1 + j]
            p += 9
            avail -= 9
        else:
            n2 = p[1]
            p += 2
            avail -= 2
        if n2 != v or (p - self.rbuf) + n2 > _RBUF or n1 + n2 > self.max_message:
            return None                 # (larger than the buffer: general path)
        if avail < n2:
            st[0] = 0
            return None
        if kind == GET1:
            res = PyBytes_FromStringAndSize(<const char *>p, n2)
        else:
            try:
                PyObject_GetBuffer(out, &ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
            except (TypeError, BufferError, ValueError):
                return None             # the caller's reading says what is wrong
            try:
                if ob.len < n2:
                    return None
                memcpy(ob.buf, p, n2)
            finally:
                PyBuffer_Release(&ob)
            res = n2
        self.rs = (p - self.rbuf) + n2
        st[0] = 1
        return res

    cdef object _recv1(self, int kind, kv_u64 req_id, object out, int slice_ms):
        cdef long long deadline = kz_now_ms() + slice_ms
        cdef bint first = True
        cdef object m
        cdef int st = 0
        while True:
            if self.fd < 0:
                return self._recv(0)    # (buffered whole messages, else PeerClosed)
            m = self._fast1(kind, req_id, out, &st)
            if st == 1:
                return m
            if st == 2:
                m = self._parse()
                if m is not None:
                    return m
            if not first and kz_now_ms() >= deadline:
                return AGAIN            # (bytes may still be coming: never past it)
            if not self._fill(deadline, first):
                return AGAIN
            first = False

    def recv1(self, int kind, kv_u64 req_id, out, int slice_ms):
        """Wait up to ``slice_ms`` for the reply to the one-key request ``req_id`` of
        ``kind``. Returns as kvshm.zmq_ctrl._zmqc.recv1: the usual reply's value (PUT1 0;
        GET1 ``bytes`` or -1; GET1_INTO the size copied into ``out`` or -1; EXISTS1 a
        bool), AGAIN when the slice passed, or any other message as its list of parts.
        Raises as :meth:`recv`."""
        self._check_open()
        return self._recv1(kind, req_id, out, slice_ms)
