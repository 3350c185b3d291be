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
"""

from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE,
                             PyBUF_ANY_CONTIGUOUS, PyBUF_WRITABLE)
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset

import time as _time

import zmq
import zmq.backend.cython._zmq as _pyzmq_backend

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
    if not path:
        raise ImportError("kvshm.zmq_ctrl._zmqc: pyzmq's backend has no file")
    cdef bytes bpath = path.encode()
    cdef void *h = dlopen(bpath, RTLD_NOLOAD | RTLD_LAZY)
    if h == NULL:
        raise ImportError(f"kvshm.zmq_ctrl._zmqc: {path} is not loaded")
    # all or nothing: resolve every name before installing any
    cdef void *p[14]
    names = (b"zmq_msg_init", b"zmq_msg_init_data", b"zmq_msg_recv", b"zmq_msg_send",
             b"zmq_msg_data", b"zmq_msg_size", b"zmq_msg_more", b"zmq_msg_close",
             b"zmq_msg_get", b"zmq_msg_gets", b"zmq_errno", b"zmq_send", b"zmq_msg_init_size",
             b"zmq_poll")
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


def recv_multipart(sock, int flags=1, Py_ssize_t copy_threshold=65536, Py_ssize_t keep=-1):
    """One whole multipart message from ``sock`` (see the module docstring)."""
    cdef void *s = _handle(sock)
    cdef kv_zmq_msg_t msg
    cdef int rc, err
    cdef Py_ssize_t n, i = 0
    cdef bint more = True
    cdef Frame fr
    cdef list out = []
    cdef bint block = not (flags & _DONTWAIT)
    while more:
        z_msg_init(&msg)
        while True:
            rc = z_msg_recv(&msg, s, _DONTWAIT)
            if rc >= 0:
                break
            err = z_errno()
            if err == _EAGAIN and block:
                with nogil:
                    rc = z_msg_recv(&msg, s, 0)
                if rc >= 0:
                    break
                err = z_errno()
            if err == _EINTR:
                PyErr_CheckSignals()
                continue
            z_msg_close(&msg)
            if err == _EAGAIN and i == 0 and not block:
                return None
            _raise_errno(err)
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
