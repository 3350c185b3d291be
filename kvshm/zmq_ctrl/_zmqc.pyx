# cython: language_level=3, boundscheck=False, wraparound=False
"""Direct libzmq calls for the control plane's hot loops, without pyzmq's Python layer.

pyzmq costs several microseconds of Python per frame (the ``Flag`` enum arithmetic of
``send_multipart``, a ``Frame`` object per received part). This module calls the libzmq
that pyzmq itself loaded: at import it opens pyzmq's backend extension with
``dlopen(RTLD_NOLOAD)`` and resolves the ``zmq_*`` functions with ``dlsym`` (which searches
that object's dependencies: the bundled libzmq of a wheel or the system one). A socket is
named by pyzmq's ``Socket.underlying`` (or that int itself). If anything cannot be
resolved the import raises ImportError; callers then keep using pyzmq.

API
---
``recv_multipart(sock, flags=DONTWAIT, copy_threshold=65536, keep=-1)``
    One whole multipart message: a list whose items are ``bytes`` (parts smaller than
    ``copy_threshold``) or :class:`Frame` (zero-copy: the part's libzmq message, buffer
    protocol). ``keep``: index of a part always returned as a :class:`Frame` (its
    metadata: ``Frame.get``). With ``DONTWAIT`` it returns None when nothing is queued;
    without, it waits with the GIL released (EAGAIN then: ``zmq.Again``, a receive
    timeout). Errors raise ``zmq.ZMQError``.
``send_parts(sock, parts, flags=0, track_from=-1)``
    Send ``parts`` (any contiguous buffers) as one multipart message; ``flags`` may hold
    ``DONTWAIT``. Parts are copied into libzmq, except from index ``track_from`` on (when
    >= 0) those of at least ``copy_threshold`` bytes (pyzmq's rule): these are sent
    zero-copy, and the call returns a :class:`Tracker` that says when libzmq is done with
    them (it holds their buffers until then; done at once if none). Otherwise returns True.
    Returns False, sending nothing, when ``DONTWAIT`` is given and the socket cannot take
    the message (EAGAIN on its first part). Errors raise ``zmq.ZMQError`` (a failure after
    the first part leaves the message cut short, as pyzmq would).
``Tracker.done``, ``Tracker.wait(timeout)``
    As ``zmq.MessageTracker``: ``wait`` raises ``zmq.NotDone`` after ``timeout`` seconds.
    A tracker dropped before it is done keeps its buffers (libzmq may still read them)
    until a later tracked send or received message, or :func:`sweep`, finds it done.
``poll_in(sock, fd=-1, mon=None, timeout_ms=-1)``
    ``zmq_poll`` for input on a socket, a file descriptor and a second socket: a bit
    mask (1, 2, 4) of what is readable; -1 if a signal interrupted it.
``sweep(timeout=0.0)``
    Let go of dropped trackers' buffers that libzmq is done with (see above).
``send1``, ``recv1``, ``call1`` (send1 + recv1's first slice), ``encode1``
    A remote client's single-key PUT/GET/EXISTS (kvshm.zmq_ctrl.channel.Channel.call1):
    the header packed in C as msgpack packs it, the usual reply read in C (a GET's value
    copied straight from the libzmq message into the caller's buffer); any other reply
    is returned as its parts for the Python path to read.
"""

from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE,
                             PyBUF_ANY_CONTIGUOUS, PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE)
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset

import time as _time

import zmq
import zmq.backend.cython._zmq as _pyzmq_backend

cdef extern from "<poll.h>" nogil:
    ctypedef struct pollfd_t "struct pollfd":
        int fd
        short events
        short revents
    int c_poll "poll"(pollfd_t *fds, unsigned long nfds, int timeout)
    short POLLIN_ "POLLIN"

cdef extern from "<errno.h>" nogil:
    int c_errno "errno"

cdef extern from *:
    """
    #include <dlfcn.h>
    #include <stddef.h>
    typedef struct kv_zmq_msg_t { unsigned char _[64]; } __attribute__((aligned(8))) kv_zmq_msg_t;
    typedef void (kv_zmq_free_fn)(void *data, void *hint);
    typedef struct kv_pollitem_t { void *socket; int fd; short events; short revents; } kv_pollitem_t;
    typedef struct kv_track_t { int refs; } kv_track_t;
    static void kv_track_free(void *data, void *hint) {
        kv_track_t *t = (kv_track_t *)hint;
        if (__atomic_sub_fetch(&t->refs, 1, __ATOMIC_ACQ_REL) == 0) free(t);
    }
    static int kv_track_load(kv_track_t *t) { return __atomic_load_n(&t->refs, __ATOMIC_ACQUIRE); }
    static int kv_track_drop(kv_track_t *t) { return __atomic_sub_fetch(&t->refs, 1, __ATOMIC_ACQ_REL); }
    static void kv_track_add(kv_track_t *t) { __atomic_add_fetch(&t->refs, 1, __ATOMIC_ACQ_REL); }
    """
    ctypedef struct kv_zmq_msg_t:
        pass
    ctypedef void kv_zmq_free_fn(void *data, void *hint) noexcept nogil
    ctypedef struct kv_pollitem_t:
        void *socket
        int fd
        short events
        short revents
    ctypedef struct kv_track_t:
        int refs
    void kv_track_free(void *data, void *hint) noexcept nogil
    int kv_track_load(kv_track_t *t) noexcept nogil
    int kv_track_drop(kv_track_t *t) noexcept nogil
    void kv_track_add(kv_track_t *t) noexcept nogil
    void *dlopen(const char *path, int flags)
    void *dlsym(void *handle, const char *name)
    int RTLD_NOLOAD
    int RTLD_LAZY

ctypedef int (*f_msg_init)(kv_zmq_msg_t *) noexcept nogil
ctypedef int (*f_msg_init_data)(kv_zmq_msg_t *, void *, size_t, kv_zmq_free_fn *, void *) noexcept nogil
ctypedef int (*f_msg_io)(kv_zmq_msg_t *, void *, int) noexcept nogil
ctypedef void *(*f_msg_data)(kv_zmq_msg_t *) noexcept nogil
ctypedef size_t (*f_msg_size)(const kv_zmq_msg_t *) noexcept nogil
ctypedef int (*f_msg_more)(const kv_zmq_msg_t *) noexcept nogil
ctypedef int (*f_msg_get)(const kv_zmq_msg_t *, int) noexcept nogil
ctypedef const char *(*f_msg_gets)(const kv_zmq_msg_t *, const char *) noexcept nogil
ctypedef int (*f_errno)() noexcept nogil
ctypedef int (*f_send)(void *, const void *, size_t, int) noexcept nogil
ctypedef int (*f_poll)(kv_pollitem_t *, int, long) noexcept nogil
ctypedef int (*f_getsockopt)(void *, int, void *, size_t *) noexcept nogil

cdef f_msg_init z_msg_init = NULL
cdef f_msg_init_data z_msg_init_data = NULL
cdef f_msg_io z_msg_recv = NULL
cdef f_msg_io z_msg_send = NULL
cdef f_msg_data z_msg_data = NULL
cdef f_msg_size z_msg_size = NULL
cdef f_msg_more z_msg_more = NULL
cdef f_msg_init z_msg_close = NULL
cdef f_msg_get z_msg_get = NULL
cdef f_msg_gets z_msg_gets = NULL
cdef f_errno z_errno = NULL
cdef f_send z_send = NULL
cdef f_poll z_poll = NULL
cdef f_getsockopt z_getsockopt = NULL

DONTWAIT = 1
SNDMORE = 2
cdef int _DONTWAIT = 1
cdef int _SNDMORE = 2
cdef int _EAGAIN = 11
cdef int _EINTR = 4
cdef int _ENOTSOCK = 88


cdef void *_sym(void *h, bytes name) except NULL:
    cdef void *p = dlsym(h, name)
    if p == NULL:
        raise ImportError(f"kvshm.zmq_ctrl._zmqc: {name.decode()} not found in the libzmq "
                          "pyzmq loaded")
    return p


cdef _load(path):
    """Resolve the libzmq functions through the shared object ``path`` (already loaded)."""
    global z_msg_init, z_msg_init_data, z_msg_recv, z_msg_send, z_msg_data, z_msg_size
    global z_msg_more, z_msg_close, z_msg_get, z_msg_gets, z_errno, z_send, z_poll
    global z_getsockopt
    if not path:
        raise ImportError("kvshm.zmq_ctrl._zmqc: pyzmq's backend has no file")
    cdef bytes bpath = path.encode()
    cdef void *h = dlopen(bpath, RTLD_NOLOAD | RTLD_LAZY)
    if h == NULL:
        raise ImportError(f"kvshm.zmq_ctrl._zmqc: {path} is not loaded")
    # all or nothing: resolve every name before installing any
    cdef void *p[15]
    names = (b"zmq_msg_init", b"zmq_msg_init_data", b"zmq_msg_recv", b"zmq_msg_send",
             b"zmq_msg_data", b"zmq_msg_size", b"zmq_msg_more", b"zmq_msg_close",
             b"zmq_msg_get", b"zmq_msg_gets", b"zmq_errno", b"zmq_send", b"zmq_msg_init_size",
             b"zmq_poll", b"zmq_getsockopt")
    for i, name in enumerate(names):
        p[i] = _sym(h, name)
    z_msg_init = <f_msg_init>p[0]
    z_msg_init_data = <f_msg_init_data>p[1]
    z_msg_recv = <f_msg_io>p[2]
    z_msg_send = <f_msg_io>p[3]
    z_msg_data = <f_msg_data>p[4]
    z_msg_size = <f_msg_size>p[5]
    z_msg_more = <f_msg_more>p[6]
    z_msg_close = <f_msg_init>p[7]
    z_msg_get = <f_msg_get>p[8]
    z_msg_gets = <f_msg_gets>p[9]
    z_errno = <f_errno>p[10]
    z_send = <f_send>p[11]
    z_poll = <f_poll>p[13]
    z_getsockopt = <f_getsockopt>p[14]


def _probe(path):
    """Tests: raise ImportError as the import would if ``path`` gave no libzmq (the
    functions resolved at import stay as they are when it does)."""
    _load(path)


_load(_pyzmq_backend.__file__)


cdef inline void *_handle(object sock) except NULL:
    cdef size_t h
    if type(sock) is int:
        h = sock
    else:
        h = sock.underlying
    if h == 0:
        raise zmq.ZMQError(_ENOTSOCK)
    return <void *>h


cdef class Frame:
    """One received part kept as its libzmq message: zero-copy, read-only buffer
    protocol, ``bytes``/``buffer`` and metadata (``get``) as ``zmq.Frame``."""
    cdef kv_zmq_msg_t msg
    cdef bint live
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __cinit__(self):
        # an empty message (what a Frame made from Python holds: libzmq asserts on a
        # message never initialized); recv_multipart moves a received one over it
        z_msg_init(&self.msg)
        self.live = False

    def __dealloc__(self):
        if self.live:
            z_msg_close(&self.msg)
            self.live = False

    def __len__(self):
        return z_msg_size(&self.msg)

    def __getbuffer__(self, Py_buffer *view, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("a received Frame is read-only")
        self.shape[0] = z_msg_size(&self.msg)
        self.strides[0] = 1
        view.buf = z_msg_data(&self.msg)
        view.obj = self
        view.len = self.shape[0]
        view.readonly = 1
        view.itemsize = 1
        view.format = NULL
        if flags & 4:                                   # PyBUF_FORMAT
            view.format = b"B"
        view.ndim = 1
        view.shape = self.shape
        view.strides = self.strides
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer *view):
        pass

    @property
    def bytes(self):
        return PyBytes_FromStringAndSize(<char *>z_msg_data(&self.msg), z_msg_size(&self.msg))

    @property
    def buffer(self):
        return memoryview(self)

    def get(self, option):
        """A message property: an int option (``zmq.SRCFD``, ``zmq.MORE``) or a metadata
        name (``"Peer-Address"``, ``"User-Id"``). Raises zmq.ZMQError if it has none."""
        cdef const char *s
        cdef int rc
        if isinstance(option, int):
            rc = z_msg_get(&self.msg, <int>option)
            if rc == -1:
                raise zmq.ZMQError(z_errno())
            return rc
        name = option.encode() if isinstance(option, str) else bytes(option)
        s = z_msg_gets(&self.msg, name)
        if s == NULL:
            raise zmq.ZMQError(z_errno())
        return (<bytes>s).decode("utf-8")


cdef object _raise_errno(int err):
    if err == _EAGAIN:
        raise zmq.Again(err)
    raise zmq.ZMQError(err)


# how _recv_msg waits for a part
cdef enum:
    _NOWAIT = 0         # not at all (DONTWAIT, the GIL held): a part already queued
    _WAIT = 1           # DONTWAIT first, then a blocking receive with the GIL released
    _WAIT_NOGIL = 2     # a blocking receive with the GIL released (a reply not yet here)


cdef inline int _recv_msg(void *s, kv_zmq_msg_t *msg, int how,
                          kv_zmq_msg_t *also=NULL) except -1:
    """Receive one part from ``s`` into ``msg`` (initialized here), waiting as ``how``
    says (a blocking receive ends after the socket's RCVTIMEO); EINTR retried once the
    signal handlers ran (an exception they raise propagates). Returns 1 when a part was
    received; 0 on EAGAIN (nothing queued, or RCVTIMEO passed), ``msg`` and ``also``
    closed. Any other libzmq error closes both and raises zmq.ZMQError. The one receive
    loop of this module."""
    cdef int rc, err
    z_msg_init(msg)
    while True:
        if how == _WAIT_NOGIL:
            with nogil:
                rc = z_msg_recv(msg, s, 0)
        else:
            rc = z_msg_recv(msg, s, _DONTWAIT)
            if rc < 0 and how == _WAIT and z_errno() == _EAGAIN:
                with nogil:
                    rc = z_msg_recv(msg, s, 0)
        if rc >= 0:
            return 1
        err = z_errno()
        z_msg_close(msg)
        if err == _EINTR:
            try:
                PyErr_CheckSignals()
            except BaseException:
                if also != NULL:
                    z_msg_close(also)
                raise
            z_msg_init(msg)
            continue
        if also != NULL:
            z_msg_close(also)
        if err == _EAGAIN:
            return 0
        _raise_errno(err)
        return -1


def recv_multipart(sock, int flags=1, Py_ssize_t copy_threshold=65536, Py_ssize_t keep=-1):
    """One whole multipart message from ``sock`` (see the module docstring)."""
    cdef void *s = _handle(sock)
    cdef kv_zmq_msg_t msg
    cdef Py_ssize_t n, i = 0
    cdef bint more = True
    cdef Frame fr
    cdef list out = []
    cdef bint block = not (flags & _DONTWAIT)
    while more:
        if not _recv_msg(s, &msg, _WAIT if block else _NOWAIT):
            if i == 0 and not block:
                return None
            _raise_errno(_EAGAIN)
        more = z_msg_more(&msg)
        n = z_msg_size(&msg)
        if n < copy_threshold and i != keep:
            try:
                out.append(PyBytes_FromStringAndSize(<char *>z_msg_data(&msg), n))
            finally:
                z_msg_close(&msg)
        else:
            fr = Frame.__new__(Frame)
            fr.msg = msg            # libzmq messages move by memcpy of the struct
            fr.live = True
            out.append(fr)
        i += 1
    if _orphans:
        # a message came (often the reply to the send that dropped its tracker): let go
        # of the buffers libzmq is done with, or a caller's value sent zero-copy stays
        # referenced until some later tracked send
        _sweep()
    return out


cdef class Tracker:
    """Whether libzmq is done with the zero-copy parts of one :func:`send_parts` call
    (holds their buffers until then); as ``zmq.MessageTracker``."""
    cdef kv_track_t *t
    cdef Py_buffer *views
    cdef Py_ssize_t nviews
    cdef bint released

    def __cinit__(self):
        self.t = NULL
        self.views = NULL
        self.nviews = 0
        self.released = False

    cdef void _release(self) noexcept:
        cdef Py_ssize_t i
        if self.released:
            return
        self.released = True
        for i in range(self.nviews):
            PyBuffer_Release(&self.views[i])
        free(self.views)
        self.views = NULL
        if self.t != NULL and kv_track_drop(self.t) == 0:
            free(self.t)
        self.t = NULL

    @property
    def done(self):
        if self.released:
            return True
        if self.t == NULL or kv_track_load(self.t) == 1:
            self._release()
            return True
        return False

    def wait(self, timeout=-1):
        """Wait until done; ``timeout`` seconds (< 0: forever), then zmq.NotDone."""
        deadline = None if timeout is None or timeout < 0 else _time.monotonic() + timeout
        pause = 20e-6
        while not self.done:
            if deadline is not None and _time.monotonic() >= deadline:
                raise zmq.NotDone
            _time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def __del__(self):
        if not self.done:
            _orphans.append(self)       # libzmq still reads the buffers: keep them

    def __dealloc__(self):
        # only reached when done (or never sent): __del__ keeps the others alive
        if not self.released and self.t != NULL and kv_track_load(self.t) == 1:
            self._release()


_orphans = []


cdef void _sweep():
    cdef list keep = [t for t in _orphans if not (<Tracker>t).done]
    _orphans[:] = keep


def sweep(timeout=0.0):
    """Let go of the buffers of dropped trackers libzmq is done with, waiting up to
    ``timeout`` seconds for the others; returns how many are still held."""
    deadline = _time.monotonic() + timeout
    while True:
        _sweep()
        if not _orphans or _time.monotonic() >= deadline:
            return len(_orphans)
        _time.sleep(1e-3)


def send_parts(sock, parts, int flags=0, Py_ssize_t track_from=-1,
               Py_ssize_t copy_threshold=65536):
    """Send ``parts`` as one multipart message (see the module docstring)."""
    cdef void *s = _handle(sock)
    cdef Py_ssize_t n = len(parts), i, got = 0, reached = 0
    cdef Py_buffer small[4]
    cdef Py_buffer *views = small
    cdef Py_buffer *held
    cdef kv_zmq_msg_t msg
    cdef int f, rc, err
    cdef Tracker tr = None
    cdef bint block = not (flags & _DONTWAIT)
    if n == 0:
        raise ValueError("send_parts: no parts")
    if n > 4:
        views = <Py_buffer *>malloc(sizeof(Py_buffer) * n)
        if views == NULL:
            raise MemoryError
    try:
        # every part's buffer first: a part without one fails before anything is sent
        # (as pyzmq's type check), not after earlier parts went out with SNDMORE (the
        # socket's next message would then be glued onto this one: another peer's reply)
        for i in range(n):
            PyObject_GetBuffer(parts[i], &views[i], PyBUF_ANY_CONTIGUOUS)
            got += 1
        if track_from >= 0:
            if _orphans:
                _sweep()
            tr = Tracker.__new__(Tracker)
            tr.t = <kv_track_t *>malloc(sizeof(kv_track_t))
            if tr.t == NULL:
                raise MemoryError
            tr.t.refs = 1
            if track_from < n:
                tr.views = <Py_buffer *>malloc(sizeof(Py_buffer) * (n - track_from))
                if tr.views == NULL:
                    raise MemoryError
        for i in range(n):
            reached = i + 1
            f = _SNDMORE if i < n - 1 else 0
            if tr is not None and i >= track_from and views[i].len >= copy_threshold:
                # zero-copy: the tracker takes the buffer over (released when done);
                # parts under copy_threshold are copied below, done at once (as pyzmq)
                held = &tr.views[tr.nviews]
                memcpy(held, &views[i], sizeof(Py_buffer))     # moved (not released below)
                tr.nviews += 1
                z_msg_init_data(&msg, held.buf, held.len, kv_track_free, tr.t)
                kv_track_add(tr.t)
                while True:
                    rc = z_msg_send(&msg, s, f | _DONTWAIT)
                    if rc >= 0:
                        break
                    err = z_errno()
                    if err == _EAGAIN and block:
                        with nogil:
                            rc = z_msg_send(&msg, s, f)
                        if rc >= 0:
                            break
                        err = z_errno()
                    if err == _EINTR:
                        PyErr_CheckSignals()
                        continue
                    z_msg_close(&msg)       # runs kv_track_free: the ref taken above goes
                    if err == _EAGAIN and i == 0 and not block:
                        return False
                    _raise_errno(err)
                continue
            while True:
                rc = z_send(s, views[i].buf, views[i].len, f | _DONTWAIT)
                if rc >= 0:
                    break
                err = z_errno()
                if err == _EAGAIN and block:
                    with nogil:
                        rc = z_send(s, views[i].buf, views[i].len, f)
                    if rc >= 0:
                        break
                    err = z_errno()
                if err == _EINTR:
                    PyErr_CheckSignals()
                    continue
                if err == _EAGAIN and i == 0 and not block:
                    return False
                _raise_errno(err)
    finally:
        for i in range(got):
            if not (tr is not None and track_from <= i < reached
                    and views[i].len >= copy_threshold):
                PyBuffer_Release(&views[i])     # (else the tracker's now)
        if views != small:
            free(views)
    return True if tr is None else tr


def wait_in(sock, int fd=-1, mon=None, long timeout_ms=-1):
    """:func:`poll_in` in fewer system calls (one zmq_poll makes ~4): the socket's
    ``ZMQ_EVENTS`` first (a message queued: 1 at once), else one ``poll(2)`` on its
    ``ZMQ_FD``, ``fd`` and ``mon``, GIL released. Returns the bit mask of :func:`poll_in`
    (1 ``sock``, 2 ``fd``, 4 ``mon``; 0 timeout; -1 EINTR); a 1 may be spurious (a
    command of libzmq, not a message, woke the socket: its next receive finds nothing).
    ``mon``: None; an int, the ``ZMQ_FD`` of a monitor socket the caller reads until
    EAGAIN each time it is told 4 (a 4 may be spurious too); or a socket: then
    :func:`poll_in` itself. Errors raise zmq.ZMQError (libzmq's) or OSError (poll)."""
    cdef int mfd = -1
    if mon is not None:
        if type(mon) is not int:
            return poll_in(sock, fd, mon, timeout_ms)
        mfd = mon
    cdef void *h = _handle(sock)
    cdef int events = 0, zfd = -1, rc, n = 1, out = 0, err, ifd = -1, imon = -1
    cdef size_t sz = sizeof(int)
    cdef pollfd_t p[3]
    if z_getsockopt(h, 15, &events, &sz) != 0:            # ZMQ_EVENTS
        raise zmq.ZMQError(z_errno())
    if events & 1:                                          # ZMQ_POLLIN
        return 1
    sz = sizeof(int)
    if z_getsockopt(h, 14, &zfd, &sz) != 0:                # ZMQ_FD
        raise zmq.ZMQError(z_errno())
    p[0].fd = zfd
    p[0].events = POLLIN_
    p[0].revents = 0
    if fd >= 0:
        ifd = n
        p[n].fd = fd
        p[n].events = POLLIN_
        p[n].revents = 0
        n += 1
    if mfd >= 0:
        imon = n
        p[n].fd = mfd
        p[n].events = POLLIN_
        p[n].revents = 0
        n += 1
    with nogil:
        rc = c_poll(p, n, <int>timeout_ms)
        err = c_errno
    if rc < 0:
        if err == _EINTR:
            return -1
        raise OSError(err, "poll")
    if p[0].revents:
        out |= 1
    if ifd > 0 and p[ifd].revents & POLLIN_:
        out |= 2
    if imon > 0 and p[imon].revents:
        out |= 4
    return out


def poll_in(sock, int fd=-1, mon=None, long timeout_ms=-1):
    """Wait until ``sock`` (and the file descriptor ``fd``, the socket ``mon`` when
    given) can be read, at most ``timeout_ms`` ms (-1: no limit), with the GIL
    released. Returns a bit mask: 1 ``sock``, 2 ``fd``, 4 ``mon`` readable; 0 on timeout;
    -1 when a signal interrupted the wait (EINTR). Errors raise zmq.ZMQError."""
    cdef kv_pollitem_t items[3]
    cdef int n = 1, rc, i, out = 0, ifd = -1, imon = -1
    memset(items, 0, sizeof(items))
    items[0].socket = _handle(sock)
    items[0].events = 1                 # ZMQ_POLLIN
    if fd >= 0:
        ifd = n
        items[n].fd = fd
        items[n].events = 1
        n += 1
    if mon is not None:
        imon = n
        items[n].socket = _handle(mon)
        items[n].events = 1
        n += 1
    if timeout_ms == 0:
        rc = z_poll(items, n, 0)
    else:
        with nogil:
            rc = z_poll(items, n, timeout_ms)
    if rc < 0:
        rc = z_errno()
        if rc == _EINTR:
            return -1
        raise zmq.ZMQError(rc)
    if items[0].revents & 1:
        out |= 1
    if ifd > 0 and items[ifd].revents & 1:
        out |= 2
    if imon > 0 and items[imon].revents & 1:
        out |= 4
    return out


# --------------------------------------------------------------------------- one-key calls
#
# A remote client's single-key PUT / GET / EXISTS (kvshm.client, through Channel.call1):
# the request header is packed here (the bytes msgpack packs for the same request, see
# kvshm.zmq_ctrl.protocol.encode_request) and the usual reply is read here, with no
# Python object made for either; any other reply comes back as the parts of the message
# for the Python path to read (it is never guessed at).

cdef extern from "_kvone.h":
    ctypedef unsigned long long kv_u64
    size_t kv_encode1(unsigned char *buf, int op, kv_u64 rid, kv_u64 epoch, const char *key,
                      size_t klen, int put, kv_u64 size, int has_sum, kv_u64 sum) noexcept
    int kv_reply1(const unsigned char *buf, size_t len, int kind, kv_u64 rid,
                  long long *val) noexcept

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE

#: what :func:`recv1` returns when a slice (the socket's RCVTIMEO) passed with no reply
AGAIN = object()
#: kinds of :func:`recv1`
PUT1 = 0
GET1 = 1
GET1_INTO = 2
EXISTS1 = 3
#: longest key and value :func:`send1` sends (else it returns False: the caller's
#: general path sends it, values of ZERO_COPY bytes or more zero-copy)
DEF _MAX_KEY1 = 4096
MAX_KEY1 = _MAX_KEY1
MAX_VALUE1 = 65535


def encode1(int op, kv_u64 req_id, kv_u64 epoch, bytes key not None, object size=None,
            object checksum=None):
    """The header :func:`send1` sends (for tests: it equals ``encode_request`` of the same
    request). ``size`` None: a GET/EXISTS body, else a PUT body."""
    cdef size_t klen = PyBytes_GET_SIZE(key)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, klen + 80)
    cdef size_t n = kv_encode1(<unsigned char *>PyBytes_AS_STRING(out), op, req_id, epoch,
                               PyBytes_AS_STRING(key), klen, size is not None,
                               0 if size is None else <kv_u64>size, checksum is not None,
                               0 if checksum is None else <kv_u64>checksum)
    return out[:n]


class SendFailed(zmq.ZMQError):
    """libzmq refused a part of a one-key request (:func:`send1`, :func:`call1`)."""


cdef int _send_all(void *s, const void *buf, size_t n, int f) except -1:
    cdef int rc, err
    while True:
        rc = z_send(s, buf, n, f | _DONTWAIT)
        if rc >= 0:
            return 0
        err = z_errno()
        if err == _EAGAIN:
            with nogil:
                rc = z_send(s, buf, n, f)
            if rc >= 0:
                return 0
            err = z_errno()
        if err == _EINTR:
            PyErr_CheckSignals()
            continue
        raise SendFailed(err)


cdef bint _send1(void *s, int op, kv_u64 req_id, kv_u64 epoch, bytes key, object value,
                 object checksum, Py_ssize_t max_size) except -1:
    cdef size_t klen = PyBytes_GET_SIZE(key)
    cdef unsigned char buf[_MAX_KEY1 + 80]
    cdef size_t n
    cdef Py_buffer view
    if klen > _MAX_KEY1:
        return False
    if value is None:
        n = kv_encode1(buf, op, req_id, epoch, PyBytes_AS_STRING(key), klen, 0, 0, 0, 0)
        _send_all(s, buf, n, 0)
        return True
    try:
        PyObject_GetBuffer(value, &view, PyBUF_C_CONTIGUOUS)
    except (TypeError, BufferError, ValueError):
        return False
    try:
        if view.len > 65535 or view.len > max_size:
            return False
        n = kv_encode1(buf, op, req_id, epoch, PyBytes_AS_STRING(key), klen, 1, view.len,
                       checksum is not None, 0 if checksum is None else <kv_u64>checksum)
        _send_all(s, buf, n, _SNDMORE)
        _send_all(s, view.buf, view.len, 0)
    finally:
        PyBuffer_Release(&view)
    return True


def send1(sock, int op, kv_u64 req_id, kv_u64 epoch, bytes key not None, value=None,
          checksum=None, Py_ssize_t max_size=65535):
    """Send one single-key request: PUT of ``value`` (a C-contiguous buffer, with its
    xxh64 ``checksum`` or None) when given, else a GET/EXISTS (``op``) of ``key``.

    Returns False, sending nothing, when the key is over MAX_KEY1 bytes, ``value`` has no
    C-contiguous buffer or is over ``max_size`` or MAX_VALUE1 bytes; True when sent.
    Raises SendFailed (a zmq.ZMQError) when libzmq refuses (after the header went out,
    the socket holds half a message: the caller drops it)."""
    return _send1(_handle(sock), op, req_id, epoch, key, value, checksum, max_size)


def call1(sock, int kind, int op, kv_u64 req_id, kv_u64 epoch, bytes key not None, value,
          checksum, Py_ssize_t max_size, out, Py_ssize_t copy_threshold=65536):
    """:func:`send1` (``value`` None unless ``kind`` is PUT1), then :func:`recv1`'s
    first slice, in one call. Returns None when nothing was sent, else what recv1
    returns."""
    cdef void *s = _handle(sock)
    if not _send1(s, op, req_id, epoch, key, value if kind == 0 else None, checksum,
                  max_size):
        return None
    return _recv1(s, kind, req_id, out, copy_threshold)


cdef object _part(kv_zmq_msg_t *msg, Py_ssize_t copy_threshold):
    """A received part as recv_multipart returns it (the message is closed or moved)."""
    cdef Frame fr
    cdef Py_ssize_t n = z_msg_size(msg)
    if n < copy_threshold:
        try:
            return PyBytes_FromStringAndSize(<char *>z_msg_data(msg), n)
        finally:
            z_msg_close(msg)
    fr = Frame.__new__(Frame)
    fr.msg = msg[0]
    fr.live = True
    return fr


cdef list _rest(void *s, list out, bint more, Py_ssize_t copy_threshold):
    """The remaining parts of a message already begun (they are queued: whole messages
    arrive at once)."""
    cdef kv_zmq_msg_t msg
    while more:
        if not _recv_msg(s, &msg, _NOWAIT):
            _raise_errno(_EAGAIN)
        more = z_msg_more(&msg)
        out.append(_part(&msg, copy_threshold))
    return out


cdef object _recv1(void *s, int kind, kv_u64 req_id, object out,
                   Py_ssize_t copy_threshold):
    cdef kv_zmq_msg_t msg, val
    cdef long long v = 0
    cdef bint more, fast
    cdef Py_ssize_t n
    cdef Py_buffer ob
    cdef list parts
    cdef object res
    if not _recv_msg(s, &msg, _WAIT_NOGIL):
        return AGAIN
    more = z_msg_more(&msg)
    fast = kv_reply1(<const unsigned char *>z_msg_data(&msg), z_msg_size(&msg),
                     1 if kind == GET1_INTO else kind, req_id, &v) == 1
    if fast and (kind != GET1 and kind != GET1_INTO or v < 0):
        if not more:
            z_msg_close(&msg)
            return (v != 0) if kind == EXISTS1 else v
        fast = False
    elif fast and not more:
        fast = False                    # a hit without its frame
    if not fast or not more:
        parts = [_part(&msg, copy_threshold)]
        return _rest(s, parts, more, copy_threshold)
    # a hit: the value is the next (and last) part
    if not _recv_msg(s, &val, _NOWAIT, &msg):
        _raise_errno(_EAGAIN)
    n = z_msg_size(&val)
    res = None
    if n == v and not z_msg_more(&val):
        if kind == GET1:
            res = PyBytes_FromStringAndSize(<char *>z_msg_data(&val), n)
        else:
            try:
                PyObject_GetBuffer(out, &ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
            except (TypeError, BufferError, ValueError):
                pass                    # the caller's reading says what is wrong
            else:
                if ob.len >= n:
                    memcpy(ob.buf, z_msg_data(&val), n)
                    res = n
                PyBuffer_Release(&ob)
    if res is not None:
        z_msg_close(&val)
        z_msg_close(&msg)
        return res
    more = z_msg_more(&val)
    parts = [_part(&msg, copy_threshold)]
    parts.append(_part(&val, copy_threshold))
    return _rest(s, parts, more, copy_threshold)


def recv1(sock, int kind, kv_u64 req_id, out=None, Py_ssize_t copy_threshold=65536):
    """Wait one slice (the socket's RCVTIMEO) for the reply to the one-key request
    ``req_id`` of ``kind`` (PUT1, GET1, GET1_INTO with ``out``, a writable C-contiguous
    buffer, EXISTS1), the GIL released.

    Returns, for the usual reply: PUT1 0; GET1 the value as ``bytes``, -1 for a miss;
    GET1_INTO the size copied into ``out``, -1 for a miss; EXISTS1 True/False. AGAIN when
    the slice passed with no message. Any other message (another status or request id,
    other fields, a value larger than ``out``): its parts as a list, as
    :func:`recv_multipart` returns them, for the caller to read. Raises zmq.ZMQError
    for libzmq's errors other than EAGAIN."""
    return _recv1(_handle(sock), kind, req_id, out, copy_threshold)
