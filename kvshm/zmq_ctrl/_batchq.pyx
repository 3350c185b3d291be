# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The server's batch EXISTS and MATCH_PREFIX decoded, served and answered in C.

:class:`BatchQuery` takes a plain batch EXISTS or MATCH_PREFIX of an open session
straight from its request frame: it parses the msgpack header itself (each key's length
checked against the frame's end), looks each key up in C without making a ``bytes`` per
key where the server's shared table (:class:`kvshm._shmindex.IndexWriter`, its
``contains_at``) holds every live key, or else with one ``bytes`` and one dict probe a
key, and writes the reply, byte for byte what ``encode_reply`` (or ``ReplyEncoder``)
makes of the Python handler's ``{"found": [...]}`` / ``{"n": ...}``. It serves a
request only when it is exactly the usual shape; for anything else it returns False
before it changed anything, and the Python path (``RequestDecoder``, the handler, its
checks and errors) serves it. What it declines:

* a header that is not a 5-element array of ints (the version ``PROTOCOL_VERSION``)
  and a map of the one field ``keys``: piggybacked ``commit``/``abort``/``release``,
  other fields, trailing bytes, payload frames;
* a ``keys`` array of more than ``max_batch`` items or :data:`PARSE_MAX` (its parse is
  done in one go), or one whose items do not all fit in the frame; an item that is not ``bin`` (str keys, nested arrays, nil...), an empty
  key, a key over ``max_key_bytes``;
* a connection without an open session (HELLO first; a door-less loop's implicit
  sessions); a tier below the pool.

Large requests stay in slices, so a bystander is not starved: a request of more than
``c_slice`` keys (``SLICE_MULT * slice_keys``: a C key costs ~1/4 of a Python one,
so a C slice takes about the ~1 ms of a Python slice) joins the loop's runnable
requests (:class:`kvshm.zmq_ctrl.router.ServiceLoop`'s ``_sliced_c``) and is looked up
one slice a turn; a sliced EXISTS is not a snapshot, as on the Python path. The reply
goes out after its last slice.

Off switch: ``KVSHM_BATCHPATH=0`` in the server's environment (read by
:mod:`kvshm.zmq_ctrl.router` at import): the Python path serves every batch.

Counts: ``counts`` (requests served, per op) and ``declined``.

The client's end, for :mod:`kvshm.zmq_ctrl.protocol`: :func:`pack_keys_request` packs
a request ``{"keys": [...]}`` and :func:`unpack_found_reply` reads a reply
``{"found": [...]}`` in one C loop each (the same bytes and values as msgpack; None
for anything else: the caller's msgpack path). ``KVSHM_BATCHPATH=0`` in the client's
environment turns them off as well.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.ref cimport PyObject
from libc.stdint cimport uint8_t, uint64_t, int64_t
from libc.string cimport memcpy, memcmp
from libc.stdlib cimport malloc, free
from kvshm.zmq_ctrl._mpint cimport Reader, _int, _one, _pack_int, _pack_array_head, _array_head, _be, U32_END, I32_MIN, U64_ALL


from posix.stat cimport struct_stat, fstat as _fstat


cdef object _Header = None      # kvshm.zmq_ctrl.listener.Header (set at the first init)
cdef object _bound_ok_py = None  # kvshm.zmq_ctrl.sends.bound_ok


cdef inline bint _bound_ok(object bound, object hdr) except -1:
    """kvshm.zmq_ctrl.sends.bound_ok in C for the usual cases (no Python fstat): the
    native listener's Header (its connection object is the bound one), a libzmq frame
    (ZMQ_SRCFD is the bound fd and fstat(2) gives the bound st_dev/st_ino)."""
    cdef struct_stat st
    cdef tuple b = <tuple>bound
    cdef long fd
    if type(hdr) is _Header:
        return hdr.conn is b[3]
    if b[3] is not None or type(hdr) is tuple:
        return _bound_ok_py(bound, hdr)
    try:
        fd = hdr.get(2)                 # zmq.SRCFD
    except Exception:
        return False
    if fd < 0 or fd != <long>b[0]:
        return False
    if _fstat(<int>fd, &st) != 0:
        return False
    return <long long>st.st_ino == <long long>b[2] and <long long>st.st_dev == <long long>b[1]


__all__ = ["BatchQuery", "SLICE_MULT", "PARSE_MAX", "pack_keys_request", "unpack_found_reply"]

#: C keys a slice per Python key a slice (``slice_keys``): an EXISTS key costs the
#: server ~0.4-0.5 us of CPU on the Python path (decode, handler, encode), ~0.1-0.15 us
#: here (perf/bench_batchq.py on this VM, mostly the table's probes), so a slice of
#: 4 x 2048 keys takes about the ~1 ms of a Python slice
SLICE_MULT = 4

#: Keys a request may have for this path: its frame is parsed in one go (~10 ns a key
#: on this VM: ~1.3 ms at most); larger requests go the Python path (RequestDecoder
#: over several turns, then the handler's slices)
PARSE_MAX = 131072
cdef Py_ssize_t _PARSE_MAX = PARSE_MAX

cdef enum:
    OP_EXISTS = 8
    OP_MATCH_PREFIX = 9



cdef class _Job:
    """One parsed request: the frame's buffer (held until the reply is made), its keys'
    spans, their results; :meth:`step` looks up the next slice."""

    cdef Py_buffer fb
    cdef bint held
    cdef object spans          # bytearray: int64 (offset, length) per key
    cdef object found          # bytearray: 1/0 per key
    cdef Py_ssize_t n, at, c_slice
    cdef int op, version
    cdef int64_t req_id
    cdef bint rbig, done
    cdef object index, d, more

    def __dealloc__(self):
        self.release()

    cpdef release(self):
        """Let go of the request frame (idempotent): after the reply, or when the
        request is abandoned."""
        if self.held:
            self.held = False
            PyBuffer_Release(&self.fb)

    def step(self, bint force=False):
        """Look up the next slice; ``more`` (the loop's ``_MORE``) while keys are left,
        else the reply header (bytes)."""
        cdef Py_ssize_t a = self.at
        cdef Py_ssize_t b = a + self.c_slice
        cdef Py_ssize_t got
        if b > self.n:
            b = self.n
        got = self._lookup(a, b)
        self.at = a + got
        if self.op == OP_MATCH_PREFIX and got < b - a:
            self.at = self.n + 1        # a miss: the prefix ends here
        if self.at < self.n:
            return self.more
        return self.reply()

    cdef Py_ssize_t _lookup(self, Py_ssize_t a, Py_ssize_t b) except -1:
        # keys a:b into found[a:b]; returns the keys looked up (MATCH_PREFIX: up to the
        # first miss). Store.exists / Store.match_prefix with no tier: the shared table
        # while it holds every live key, else the dict
        cdef bint prefix = self.op == OP_MATCH_PREFIX
        cdef Py_ssize_t i
        cdef const int64_t *sp
        cdef uint8_t *fo
        cdef const char *fp
        shared = self.index.shared
        if shared is not None and shared.unpublished == 0 and b - a > 1:
            return shared.contains_at(self.fb.obj, self.spans, a, b, self.found, prefix)
        fo = <uint8_t *>(<char *>self.found)
        sp = <const int64_t *>(<char *>self.spans)
        fp = <const char *>self.fb.buf
        d = self.d
        for i in range(a, b):
            k = PyBytes_FromStringAndSize(fp + sp[2 * i], sp[2 * i + 1])
            fo[i] = 1 if k in d else 0
            if prefix and not fo[i]:
                return i - a
        return b - a

    cpdef bytes reply(self):
        """The reply header: ``[version, 0, req_id, {"found": [...]}]`` or ``{"n": n}``."""
        cdef uint8_t head[48]
        cdef int k
        cdef Py_ssize_t i, n = self.n, m
        cdef uint8_t *o
        cdef const uint8_t *fo = <const uint8_t *>(<char *>self.found)
        head[0] = 0x94
        head[1] = <uint8_t>self.version
        head[2] = 0
        k = 3 + _pack_int(head + 3, self.req_id, self.rbig)
        head[k] = 0x81
        k += 1
        self.release()
        if self.op == OP_MATCH_PREFIX:
            m = 0
            while m < n and fo[m]:
                m += 1
            head[k] = 0xa1
            head[k + 1] = 0x6e      # n
            k += 2
            k += _pack_int(head + k, m, False)
            return PyBytes_FromStringAndSize(<char *>head, k)
        head[k] = 0xa5
        memcpy(head + k + 1, b"found", 5)
        k += 6
        k += _pack_array_head(head + k, n)
        out = PyBytes_FromStringAndSize(NULL, k + n)
        o = <uint8_t *>PyBytes_AS_STRING(out)
        memcpy(o, head, k)
        o += k
        for i in range(n):
            o[i] = 0xc3 if fo[i] else 0xc2
        return out


cdef class BatchQuery:
    """The batch EXISTS / MATCH_PREFIX path of one
    :class:`~kvshm.zmq_ctrl.router.ServiceLoop`.

    Parameters
    ----------
    loop : ServiceLoop
        Its store, sessions (``_by_ident``), ``_send``, ``_record_latency`` and
        ``_sliced_c`` (a large request's slices) are used.
    version : int
        ``PROTOCOL_VERSION``.
    ops : iterable of int
        The ops to serve (those whose handler is still the loop's own).
    c_slice : int
        Keys a slice (>= 1): requests of more are served in slices.
    more : object
        The loop's ``_MORE`` (a slice step's "more to come").
    """

    cdef object loop, store, index, d, by_ident, more
    cdef int version
    cdef bint exists_on, prefix_on
    cdef public Py_ssize_t c_slice
    cdef public dict counts
    cdef public long long declined

    def __init__(self, loop, int version, ops, Py_ssize_t c_slice, more):
        if c_slice < 1:
            raise ValueError("c_slice must be >= 1")
        self.loop = loop
        self.store = loop.store
        self.index = loop.store.index
        self.d = loop.store.index.mapping
        self.by_ident = loop._by_ident
        # a session serves only the connection its HELLO came on (kvshm.zmq_ctrl.sends)
        global _Header, _bound_ok_py
        from kvshm.zmq_ctrl.listener import Header
        from kvshm.zmq_ctrl.sends import bound_ok
        _Header, _bound_ok_py = Header, bound_ok
        self.version = version
        ops = set(ops)
        self.exists_on = OP_EXISTS in ops
        self.prefix_on = OP_MATCH_PREFIX in ops
        self.c_slice = c_slice
        self.more = more
        self.counts = {OP_EXISTS: 0, OP_MATCH_PREFIX: 0}
        self.declined = 0

    def handle(self, object msg, double t0):
        """Serve ``msg`` (``[ident, header, *frames]``, ``t0``: ``time.perf_counter()``
        when it came): True (answered, or its slices queued). False: not served, nothing
        changed (the Python path serves it)."""
        cdef Py_buffer hb
        cdef Reader r
        cdef int64_t version = -1, op = -1, req_id = 0, epoch = 0
        cdef bint big = False, rbig = False
        cdef Py_ssize_t n, i, klen, max_key, max_batch
        cdef const uint8_t *base
        cdef uint8_t b
        cdef int64_t *sp
        if type(msg) is not list or PyList_GET_SIZE(msg) != 2:
            return self._decline()
        store = self.store
        if store.tier is not None:
            return self._decline()
        limits = store.config.limits
        max_key = limits.max_key_bytes
        max_batch = limits.max_batch
        ident = <object>PyList_GET_ITEM(msg, 0)
        if type(ident) is not bytes:
            return self._decline()
        p = PyDict_GetItem(self.by_ident, ident)
        if p is NULL:
            return self._decline()
        sess = <object>p
        if sess.closed:
            return self._decline()
        sbound = sess.bound
        if sbound is not None and not _bound_ok(sbound, <object>PyList_GET_ITEM(msg, 1)):
            return self._decline()      # another connection's: "say HELLO" (Python path)
        job = _Job()
        PyObject_GetBuffer(<object>PyList_GET_ITEM(msg, 1), &job.fb, PyBUF_SIMPLE)
        job.held = True
        hb = job.fb
        r.p = base = <const uint8_t *>hb.buf
        r.end = r.p + hb.len
        if hb.len < 8 or r.p[0] != 0x95:
            return self._decline()
        r.p += 1
        if _int(&r, &version, &big) or big or version != self.version:
            return self._decline()
        if _int(&r, &op, &big) or big:
            return self._decline()
        if not ((op == OP_EXISTS and self.exists_on) or
                (op == OP_MATCH_PREFIX and self.prefix_on)):
            return self._decline()
        if _int(&r, &req_id, &rbig) or _int(&r, &epoch, &big):
            return self._decline()
        # {"keys": [bin, ...]}
        if r.end - r.p < 6 or r.p[0] != 0x81 or r.p[1] != 0xa4 or memcmp(r.p + 2, b"keys", 4):
            return self._decline()
        r.p += 6
        if _array_head(&r, &n) < 0:
            return self._decline()
        # every key takes at least 2 bytes: a count the frame cannot hold allocates nothing
        if n > max_batch or n > (r.end - r.p) // 2 or n > _PARSE_MAX:
            return self._decline()
        job.spans = bytearray(16 * n)
        job.found = bytearray(n)
        sp = <int64_t *>(<char *>job.spans)
        for i in range(n):
            if r.p >= r.end:
                return self._decline()
            b = r.p[0]
            if b == 0xc4 and r.end - r.p >= 2:
                klen = r.p[1]
                r.p += 2
            elif b == 0xc5 and r.end - r.p >= 3:
                klen = <Py_ssize_t>_be(r.p + 1, 2)
                r.p += 3
            elif b == 0xc6 and r.end - r.p >= 5:
                klen = <Py_ssize_t>_be(r.p + 1, 4)
                r.p += 5
            else:
                return self._decline()      # str, nested, nil, cut short: Python
            if klen == 0 or klen > max_key or klen > r.end - r.p:
                return self._decline()
            sp[2 * i] = r.p - base
            sp[2 * i + 1] = klen
            r.p += klen
        if r.p != r.end:
            return self._decline()
        # served from here on
        sess.seen = t0
        job.n = n
        job.at = 0
        job.c_slice = self.c_slice
        job.op = <int>op
        job.version = self.version
        job.req_id = req_id
        job.rbig = rbig
        job.index = self.index
        job.d = self.d
        job.more = self.more
        self.counts[op] += 1
        rid = int(<uint64_t>req_id) if rbig else req_id
        # taken: a bug from here on is answered INTERNAL (no request goes unanswered)
        try:
            if n > self.c_slice:
                self.loop._sliced_c(ident, sess, rid, int(op), job.step, job.release, t0,
                                    <object>PyList_GET_ITEM(msg, 1))
                return True
            if n:
                job._lookup(0, n)
            head = job.reply()
        except Exception as exc:
            job.release()
            self.loop._fast_internal(ident, rid, int(op), exc, t0)
            return True
        self.loop._send(ident, head)
        self.loop._record_latency(int(op), t0)
        return True

    cdef bint _decline(self):
        self.declined += 1
        return False


# ---------------------------------------------------------------- the client's end

cdef inline int _int_arg(object x, int64_t *v, bint *big) except -1:
    # a Python int msgpack can pack (-2**63 .. 2**64-1): 0, else 1
    if type(x) is bool or not isinstance(x, int):   # (msgpack: bool is not an int)
        return 1
    if -0x8000000000000000 <= x <= 0x7FFFFFFFFFFFFFFF:
        v[0] = x
        big[0] = False
        return 0
    if 0x8000000000000000 <= x <= 0xFFFFFFFFFFFFFFFF:
        v[0] = <int64_t>(<uint64_t>x)
        big[0] = True
        return 0
    return 1


cdef extern from *:
    """
    static inline int kv_bq_isbytes(PyObject *o) { return PyBytes_CheckExact(o); }
    static inline Py_ssize_t kv_bq_blen(PyObject *o) { return PyBytes_GET_SIZE(o); }
    static inline const char *kv_bq_bdata(PyObject *o) { return PyBytes_AS_STRING(o); }
    """
    bint kv_bq_isbytes(PyObject *o)
    Py_ssize_t kv_bq_blen(PyObject *o)
    const char *kv_bq_bdata(PyObject *o)


def pack_keys_request(int version, op, req_id, epoch, list keys, Py_ssize_t start=0,
                      Py_ssize_t stop=-1):
    """``encode_request(op, req_id, epoch, {"keys": keys[start:stop]})`` byte for byte
    (msgpack, ``use_bin_type=True``: ``[version, op, req_id, epoch, {"keys": [bin,
    ...]}]``) in one C loop, when every key is ``bytes`` and the ints fit 64 bits; else
    None (the caller packs with msgpack, which raises what it raises). ``start`` /
    ``stop`` (default: the whole list; ``stop`` -1: its end) pack a part of ``keys``
    without making the slice (a pipelined batch's parts, kvshm.client); they are
    clamped to the list as a slice's bounds are (negative ``start``: 0). The keys are
    read as borrowed references (no reference count written: the key objects' cache
    lines are only read)."""
    cdef Py_ssize_t n = PyList_GET_SIZE(keys), i, total = 0, m
    cdef int64_t v[3]
    cdef bint big[3]
    cdef uint8_t *o
    cdef uint8_t head[64]
    cdef int k
    cdef PyObject *key
    if stop < 0 or stop > n:
        stop = n
    if start < 0:
        start = 0
    if start > stop:
        start = stop
    n = stop - start
    if not 0 <= version < 128:
        return None
    if (_int_arg(op, &v[0], &big[0]) or _int_arg(req_id, &v[1], &big[1])
            or _int_arg(epoch, &v[2], &big[2])):
        return None
    if n > <Py_ssize_t>0xFFFFFFFF:         # (C compares: no int object per key)
        return None
    for i in range(start, stop):
        key = PyList_GET_ITEM(keys, i)
        if not kv_bq_isbytes(key):
            return None
        m = kv_bq_blen(key)
        if m > <Py_ssize_t>0xFFFFFFFF:
            return None
        total += m + (2 if m < 0x100 else 3 if m < 0x10000 else 5)
    head[0] = 0x95
    head[1] = <uint8_t>version
    k = 2
    for i in range(3):
        k += _pack_int(head + k, v[i], big[i])
    head[k] = 0x81
    head[k + 1] = 0xa4
    memcpy(head + k + 2, b"keys", 4)
    k += 6
    k += _pack_array_head(head + k, n)
    out = PyBytes_FromStringAndSize(NULL, k + total)
    o = <uint8_t *>PyBytes_AS_STRING(out)
    memcpy(o, head, k)
    o += k
    for i in range(start, stop):
        # (the list cannot change here: no Python code runs between the two loops)
        key = PyList_GET_ITEM(keys, i)
        m = kv_bq_blen(key)
        if m < 0x100:
            o[0] = 0xc4
            o[1] = <uint8_t>m
            o += 2
        elif m < 0x10000:
            o[0] = 0xc5
            o[1] = <uint8_t>(m >> 8)
            o[2] = <uint8_t>m
            o += 3
        else:
            o[0] = 0xc6
            o[1] = <uint8_t>(m >> 24)
            o[2] = <uint8_t>(m >> 16)
            o[3] = <uint8_t>(m >> 8)
            o[4] = <uint8_t>m
            o += 5
        memcpy(o, kv_bq_bdata(key), m)
        o += m
    return out


def unpack_found_reply(frame, int version):
    """``decode_reply`` of a reply ``[version, status, req_id, {"found": [bool, ...]}]``
    (a batch EXISTS's): ``(status, req_id, {"found": list of bool})``; None for any other
    reply, another version, or anything cut short or left over (the caller's msgpack
    path decodes it, or raises)."""
    cdef Py_buffer fb
    cdef Reader r
    cdef int64_t status, req_id
    cdef bint big, rbig
    cdef Py_ssize_t n, i
    cdef uint8_t b
    try:
        PyObject_GetBuffer(frame, &fb, PyBUF_SIMPLE)
    except (TypeError, BufferError):
        return None         # (not contiguous bytes: msgpack's path says what it is)
    try:
        r.p = <const uint8_t *>fb.buf
        r.end = r.p + fb.len
        if fb.len < 12 or r.p[0] != 0x94 or r.p[1] != version:
            return None
        r.p += 2
        if _int(&r, &status, &big) or big or _int(&r, &req_id, &rbig):
            return None
        if r.end - r.p < 7 or r.p[0] != 0x81 or r.p[1] != 0xa5 or memcmp(r.p + 2, b"found", 5):
            return None
        r.p += 7
        if _array_head(&r, &n) < 0:
            return None
        if n != r.end - r.p:
            return None
        for i in range(n):
            if r.p[i] != 0xc3 and r.p[i] != 0xc2:
                return None
        found = [False] * n
        for i in range(n):
            if r.p[i] == 0xc3:
                found[i] = True
        rid = int(<uint64_t>req_id) if rbig else req_id
        return status, rid, {"found": found}
    finally:
        PyBuffer_Release(&fb)
