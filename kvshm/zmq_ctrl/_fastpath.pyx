# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The server's one-key requests decoded, checked, served and answered in C.

:class:`FastPath` serves the plain single-key PUT, GET and EXISTS a remote client sends
(``kvshm.client``'s lean one-key paths, and any client's batch of one): it reads the
request header (msgpack) itself, finds the session of the connection, calls the store and
its index, appends the reply (byte for byte what the Python path encodes) to the loop's
out queue and records the latency, as :meth:`ServiceLoop._dispatch` and its handlers
would. It serves a request only when it is exactly the usual shape; for anything else it
returns False before it changed anything, and the Python path serves the request (with
its checks, errors and statuses). What it declines:

* a header that is not a 5-element array of small ints and a map holding only the op's
  own fields (``keys`` with one ``bin`` key; for PUT ``sizes``, ``counts`` and optionally
  ``sums``, each a list of one int): piggybacked ``commit``/``abort``/``release``, other
  protocol versions, trailing bytes, str keys, big or negative counts...;
* a connection without an open session (HELLO first; a door-less loop's implicit
  sessions), or while a large header of its peer is being decoded (its later messages
  wait behind it);
* an empty key, one over ``max_key_bytes``, a batch limit below one key;
* PUT: a value that is not one copied frame (``bytes``) of exactly ``sizes[0]`` bytes,
  ``counts != [1]``, a value over the store's ``max_value``; every PUT while a tier is
  attached (the Python path parks what must wait for it);
* GET: a hit of a value in several runs or of ``PACK_BELOW`` bytes or more (sent
  zero-copy, tracked), a session with replies unsent, replies in flight (the loop's
  ``_sending``), a tier below;
* EXISTS with a tier below.

Counts: ``counts`` holds how many requests of each op it served and ``declined`` how many
it handed back.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.ref cimport PyObject
from libc.stdint cimport uint8_t, uint64_t, int64_t
from libc.string cimport memcpy, memcmp
from cpython.exc cimport PyErr_CheckSignals
from kvshm.zmq_ctrl._mpint cimport Reader, _int, _one, _pack_int, _be, U32_END, I32_MIN, U64_ALL

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec *ts)
    int CLOCK_MONOTONIC

from zmq import ZMQError as _ZMQError

from kvshm import _index
from kvshm.store.outcome import Outcome
from kvshm.zmq_ctrl.protocol import encode_reply


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


_make_entries = _index.make_entries
_install_entries = _index.install_entries
_pin_for_send = _index.pin_for_send
_unpin_entries = _index.unpin_entries
_OK = Outcome.OK
_POOL_FULL = Outcome.POOL_FULL

__all__ = ["FastPath"]


# ops and statuses (kvshm.zmq_ctrl.protocol.Op / Status; checked by FastPath.__init__)
cdef enum:
    OP_PUT = 6
    OP_GET = 7
    OP_EXISTS = 8

# body fields seen
cdef enum:
    F_KEYS = 1
    F_SIZES = 2
    F_COUNTS = 4
    F_SUMS = 8

#: header frames longer than this are not a one-key request of ours (a key is at most
#: max_key_bytes, which the check below applies)
cdef Py_ssize_t _MAX_HEADER = 4096

cdef inline double _now() noexcept nogil:
    # time.perf_counter() on Linux: CLOCK_MONOTONIC in seconds
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


cdef class FastPath:
    """The one-key fast path of one :class:`~kvshm.zmq_ctrl.router.ServiceLoop`.

    Parameters
    ----------
    loop : ServiceLoop
        Its store, sessions (``_by_ident``), held messages (``_held``), replies in flight
        (``_sending``) and latency histograms are read and updated in place.
    version : int
        ``PROTOCOL_VERSION``.
    buckets : sequence of float
        ``LATENCY_BUCKETS`` (seconds, ascending, the last one infinite).
    pack_below : int
        ``frames.PACK_BELOW``: GET hits below it go out as one copy.
    copy_below : int
        Parts from this size on are sent zero-copy (and tracked) by the loop's sends.
    ops : iterable of int
        The ops to serve (those whose handler is still the loop's own).
    """

    cdef object loop, store, index, pool, by_ident, held, latency, latency_sum, d, pending
    # per request, looked up once here (the store's own objects, for its life; methods
    # of extension types, which cannot be replaced on an instance): the allocator's
    # alloc_many, the pool's write, the index's sync, the store's config and counters
    cdef object alloc_many, pool_write, index_sync, config, store_counters
    # the limits object last seen (StoreConfig.limits may be replaced: looked at per
    # request, its two fields read again only when it changed)
    cdef object limits
    cdef long long max_key, max_batch
    # the loop's latency histograms of PUT, GET, EXISTS (lists, updated in place)
    cdef list hist_put, hist_get, hist_exists
    cdef int version
    cdef long long bs, copy_below
    cdef bint put_on, get_on, exists_on
    cdef double bounds[32]
    cdef int nbounds
    cdef long long n_put, n_get, n_exists
    cdef public long long declined
    #: lean turns run by :meth:`serve` (a turn of the loop done wholly here), and how
    #: often :meth:`serve` handed the loop back to its Python turn
    cdef public long long lean_turns, serve_returns
    cdef double max_wall

    def __init__(self, loop, int version, buckets, long long pack_below,
                 long long copy_below, ops):
        store = loop.store
        self.loop = loop
        self.store = store
        self.index = store.index
        self.d = store.index.mapping
        self.pool = store.pool
        self.by_ident = loop._by_ident
        # a session serves only the connection its HELLO came on (kvshm.zmq_ctrl.sends)
        global _Header, _bound_ok_py
        from kvshm.zmq_ctrl.listener import Header
        from kvshm.zmq_ctrl.sends import bound_ok
        _Header, _bound_ok_py = Header, bound_ok
        self.held = loop._held
        # connections held without HELLO (kvshm.zmq_ctrl.admission): while there are
        # any, a request of an open session admits the connection it came on
        self.pending = loop._unadmitted
        self.latency = loop.latency
        self.latency_sum = loop.latency_sum
        self.alloc_many = store.alloc.alloc_many
        self.pool_write = store.pool.write
        self.index_sync = store.index.sync
        self.config = store.config
        self.store_counters = store.counters
        self.limits = None
        self.max_key = 0
        self.max_batch = 0
        # (ServiceLoop makes a histogram per Op; one made later would be another list)
        self.hist_put = self.latency.setdefault(OP_PUT, [0] * len(buckets))
        self.hist_get = self.latency.setdefault(OP_GET, [0] * len(buckets))
        self.hist_exists = self.latency.setdefault(OP_EXISTS, [0] * len(buckets))
        for op in (OP_PUT, OP_GET, OP_EXISTS):
            self.latency_sum.setdefault(op, 0.0)
        self.version = version
        self.bs = store.block_size
        # GET hits the Python path sends as one copy, not tracked: below PACK_BELOW, and
        # below the size libzmq is given zero-copy (kvshm.zmq_ctrl._zmqc's threshold)
        self.copy_below = min(pack_below, copy_below)
        ops = set(ops)
        self.put_on = OP_PUT in ops
        self.get_on = OP_GET in ops
        self.exists_on = OP_EXISTS in ops
        b = list(buckets)
        if not 0 < len(b) <= 32:
            raise ValueError("1 to 32 latency buckets")
        self.nbounds = len(b)
        for i, x in enumerate(b):
            self.bounds[i] = x
        self.n_put = self.n_get = self.n_exists = 0
        self.declined = 0
        self.lean_turns = 0
        self.serve_returns = 0
        self.max_wall = 0.0

    @property
    def counts(self):
        """Requests served, by op: ``{PUT: n, GET: n, EXISTS: n}`` (a new dict)."""
        return {OP_PUT: self.n_put, OP_GET: self.n_get, OP_EXISTS: self.n_exists}

    cdef inline int _record(self, int op, double t0) except -1:
        # ServiceLoop._record_latency: bisect_left over the bucket bounds
        cdef double dt = _now() - t0
        cdef int i = 0
        cdef list hist
        while i < self.nbounds - 1 and self.bounds[i] < dt:
            i += 1
        if op == OP_PUT:
            hist = self.hist_put
            self.n_put += 1
        elif op == OP_GET:
            hist = self.hist_get
            self.n_get += 1
        else:
            hist = self.hist_exists
            self.n_exists += 1
        hist[i] += 1
        self.latency_sum[op] += dt
        return 0

    def handle(self, list msg, list outq):
        """Serve ``msg`` (``[ident, header, *frames]`` as the loop drained it) and append
        its reply to ``outq``: True. False: not served, nothing changed (the Python
        path serves it)."""
        return self._handle(msg, outq)

    def drain(self, recv, sock, list outq, handle, int most):
        """Receive and serve up to ``most`` messages: ``recv(sock, DONTWAIT, 65536, 1)``
        gives each (None: nothing queued), served here or by ``handle(msg)`` (the Python
        path). Returns how many came. An exception of the fast path itself (a bug) is
        logged and counted (``internal``) and the Python path serves that message;
        ``recv``'s errors propagate."""
        cdef int i
        cdef bint done
        for i in range(most):
            m = recv(sock, 1, 65536, 1)
            if m is None:
                return i
            try:
                done = self._handle(m, outq)
            except Exception:
                self.loop._fast_bug()
                done = False
            if not done:
                handle(m)
        return most

    def serve(self, sock, int wake_fd, mon, double due, poll, recv, send, handle,
              int most):
        """Run the loop's common turns here, until one needs its Python turn.

        A lean turn: wait (``poll(sock, wake_fd, mon, timeout_ms)``, ``_zmqc.poll_in``)
        at most until ``due`` (``time.monotonic()`` seconds: the earliest timer of the
        loop: leases, liveness checks, ticks, the tier, periodic eviction, the full
        collection), then, when only ``sock`` is readable, receive up to ``most``
        messages (``recv(sock, DONTWAIT, 65536, 1)``), each served by :meth:`_handle` or
        else by ``handle(msg)`` (the Python path, the loop's out queue ``_outq`` set as
        its drain sets it), then send the queued replies (``send(sock, (ident,
        header))``; a ``zmq.ZMQError`` is counted as the loop's ``_send`` counts it).

        Returns what the Python turn must still do: -1 the wait was interrupted
        (EINTR); 0, 2, 4 (bit mask as ``poll``'s) the wait ended on a timeout, the wake
        pipe or the monitor socket, nothing received yet; 8 messages were received and
        served, and the rest of the turn (housekeeping, ticks...) must run: a message
        went the Python path, ``due`` came, or the loop was stopped; 16 ``due`` came (or
        the loop was stopped) before the wait. Signals: checked after each lean turn
        (a Python handler's exception propagates)."""
        cdef int i, ev
        cdef bint slow
        cdef double now, t, w0, w
        cdef long tmo
        cdef object loop = self.loop
        cdef list outq
        while True:
            now = _now()
            if now >= due or not loop._running:
                self.serve_returns += 1
                return 16
            t = due - now
            if t > 3600.0:
                t = 3600.0
            tmo = <long>(t * 1000.0) + 1
            ev = poll(sock, wake_fd, mon, tmo)
            if ev != 1:
                self.serve_returns += 1
                return ev
            w0 = _now()
            slow = False
            outq = []
            try:
                for i in range(most):
                    m = recv(sock, 1, 65536, 1)
                    if m is None:
                        break
                    try:
                        done = self._handle(m, outq)
                    except Exception:
                        loop._fast_bug()
                        done = False
                    if not done:
                        if not slow:
                            # the Python path's replies queue behind ours (its _send)
                            slow = True
                            loop._outq = outq
                        handle(m)
            finally:
                if slow:
                    loop._outq = None
                if outq:
                    self._flush(sock, send, outq)
            now = _now()
            w = now - w0
            if w > self.max_wall:
                self.max_wall = w
                mt = loop.max_turn
                if w > mt["wall_s"]:
                    mt["wall_s"] = w
            if slow or now >= due or not loop._running:
                self.serve_returns += 1
                return 8
            self.lean_turns += 1
            PyErr_CheckSignals()

    cdef int _flush(self, sock, send, list outq) except -1:
        # ServiceLoop._flush_out: in order; a failed one dropped (and counted)
        cdef Py_ssize_t i, n = PyList_GET_SIZE(outq)
        for i in range(n):
            m = <object>PyList_GET_ITEM(outq, i)
            try:
                send(sock, m)
            except _ZMQError as exc:
                self.loop._send_failed(m, exc)
        del outq[:]
        return 0

    cdef bint _handle(self, list msg, list outq) except -1:
        cdef Py_buffer hb
        cdef Reader r
        cdef int64_t version = -1, op = -1, req_id = 0, epoch = 0
        cdef bint big = False, rbig = False
        cdef int nfields, i, seen = 0, klen, keylen = 0
        cdef int64_t size = -1, count = -1, csum = 0
        cdef bint has_sum = False, csum_big = False
        cdef const uint8_t *key = NULL
        cdef const uint8_t *q
        cdef double t0
        cdef Py_ssize_t n = PyList_GET_SIZE(msg)
        cdef long long max_key
        if n < 2 or n > 3 or self.held:
            return self._decline()
        store = self.store
        limits = self.config.limits
        if limits is not self.limits:
            self.max_key = limits.max_key_bytes
            self.max_batch = limits.max_batch
            self.limits = limits
        max_key = self.max_key
        if self.max_batch < 1 or store.tier is not None:
            return self._decline()
        t0 = _now()
        ident = <object>PyList_GET_ITEM(msg, 0)
        if type(ident) is not bytes:
            return False
        frame = <object>PyList_GET_ITEM(msg, 1)
        PyObject_GetBuffer(frame, &hb, PyBUF_SIMPLE)
        try:
            if hb.len > _MAX_HEADER or hb.len < 7:
                return self._decline()
            r.p = <const uint8_t *>hb.buf
            r.end = r.p + hb.len
            if r.p[0] != 0x95:
                return self._decline()
            r.p += 1
            if _int(&r, &version, &big) or big or version != self.version:
                return self._decline()
            if _int(&r, &op, &big) or big:
                return self._decline()
            if _int(&r, &req_id, &rbig):
                return self._decline()
            if _int(&r, &epoch, &big):
                return self._decline()
            if r.p >= r.end or (r.p[0] & 0xf0) != 0x80:
                return self._decline()
            nfields = r.p[0] & 0x0f
            r.p += 1
            for i in range(nfields):
                if r.p >= r.end:
                    return self._decline()
                klen = r.p[0] - 0xa0
                if klen < 0 or klen > 31 or r.end - r.p < 1 + klen:
                    return self._decline()
                q = r.p + 1
                r.p += 1 + klen
                if klen == 4 and memcmp(q, b"keys", 4) == 0:
                    if seen & F_KEYS or _one(&r) or r.p >= r.end:
                        return self._decline()
                    seen |= F_KEYS
                    if r.p[0] == 0xc4 and r.end - r.p >= 2:
                        keylen = r.p[1]
                        r.p += 2
                    elif r.p[0] == 0xc5 and r.end - r.p >= 3:
                        keylen = (r.p[1] << 8) | r.p[2]
                        r.p += 3
                    else:
                        return self._decline()      # str key, bin32, nil...: Python
                    if keylen == 0 or keylen > max_key or r.end - r.p < keylen:
                        return self._decline()
                    key = r.p
                    r.p += keylen
                elif klen == 5 and memcmp(q, b"sizes", 5) == 0:
                    if seen & F_SIZES or _one(&r) or _int(&r, &size, &big) or big or size < 0:
                        return self._decline()
                    seen |= F_SIZES
                elif klen == 6 and memcmp(q, b"counts", 6) == 0:
                    if seen & F_COUNTS or _one(&r) or _int(&r, &count, &big) or big:
                        return self._decline()
                    seen |= F_COUNTS
                elif klen == 4 and memcmp(q, b"sums", 4) == 0:
                    if seen & F_SUMS or _one(&r) or _int(&r, &csum, &csum_big):
                        return self._decline()
                    seen |= F_SUMS
                    has_sum = True
                else:
                    return self._decline()
            if r.p != r.end or not (seen & F_KEYS):
                return self._decline()
            if op == OP_PUT:
                if (not self.put_on or seen != (seen | F_SIZES | F_COUNTS) or count != 1
                        or n != 3):
                    return self._decline()
            elif op == OP_GET or op == OP_EXISTS:
                if seen != F_KEYS or n != 2 or not (self.get_on if op == OP_GET
                                                    else self.exists_on):
                    return self._decline()
            else:
                return self._decline()
            bkey = PyBytes_FromStringAndSize(<const char *>key, keylen)
        finally:
            PyBuffer_Release(&hb)
        # the session of this connection, as ServiceLoop._session_of finds it
        p = PyDict_GetItem(self.by_ident, ident)
        if p is NULL:
            return self._decline()
        sess = <object>p
        if sess.closed:
            return self._decline()
        sbound = sess.bound
        if sbound is not None and not _bound_ok(sbound, <object>PyList_GET_ITEM(msg, 1)):
            return self._decline()      # another connection's: "say HELLO" (Python path)
        if self.pending:
            self.loop._admit_live(ident, <object>PyList_GET_ITEM(msg, 1))
        if op == OP_PUT:
            value = <object>PyList_GET_ITEM(msg, 2)
            if type(value) is not bytes or PyBytes_GET_SIZE(value) != size \
                    or size > store.max_value:
                return self._decline()
            sess.seen = t0
            sums = None
            if has_sum:
                sums = [int(<uint64_t>csum) if csum_big else int(csum)]
            try:
                st = self._put1(bkey, value, size, sums)
            except Exception as exc:
                self._internal(ident, req_id, rbig, op, exc, t0)
                return True
            if (type(st) is list and len(st) == 1 and isinstance(st[0], int)
                    and 0 <= st[0] < 128):
                outq.append((ident, self._reply_st(req_id, rbig, <int>st[0])))
            else:                                   # pragma: no cover - one status
                outq.append((ident, encode_reply(0, int(<uint64_t>req_id) if rbig
                                                 else req_id, {"st": st})))
        elif op == OP_EXISTS:
            sess.seen = t0
            found = bkey in self.d
            outq.append((ident, self._reply_found(req_id, rbig, found)))
        else:
            if self.loop._sending or sess.sending:
                return self._decline()
            e = self.d.get(bkey)
            if e is not None:
                if e.nruns != 1 or e.size >= self.copy_below:
                    return self._decline()
                c = e.checksum
                if c is not None and not (type(c) is int and
                                          -0x8000000000000000 <= c <= 0xFFFFFFFFFFFFFFFF):
                    return self._decline()
            sess.seen = t0
            try:
                # Store.pin_for_send([bkey]) (its steps: reads recorded first, the pin
                # loop, the counters), the copy, Store.unpin
                self.index_sync()
                entries, sums, hits, nbytes = _pin_for_send(store, [bkey], None)
                c = self.store_counters
                c["hits"] += hits
                c["misses"] += 1 - hits
                c["gets"] += hits
                c["bytes_out"] += nbytes
                e = entries[0]
                if e is None:
                    outq.append((ident, self._reply_get(req_id, rbig, -1, None)))
                else:
                    try:
                        data = self.pool.read_bytes(e.start * self.bs, e.size)
                    finally:
                        _unpin_entries(store, entries)
                    outq.append((ident, self._reply_get(req_id, rbig, e.size, sums[0]),
                                 data))
            except Exception as exc:
                self._internal(ident, req_id, rbig, op, exc, t0)
                return True
        self._record(<int>op, t0)
        return True

    cdef object _put1(self, bkey, value, long long size, sums):
        """Store.put([bkey], [value], sums) of a key and size already checked (bytes of
        1..max_key_bytes; 0 <= size <= max_value; no tier): its statuses. The same steps
        as Store.put and Store._new_entries for one key in one run; when the allocator has
        no run of the blocks at once (eviction, compaction: nothing allocated yet),
        Store.put itself does the whole."""
        store = self.store
        cdef long long bs = self.bs
        cdef long long nb = (size + bs - 1) // bs if size > 0 else 1
        keys = [bkey]
        want = [nb]
        starts = self.alloc_many(want)
        store._wait = False
        if starts[0] == -1:
            return store.put(keys, [value], sums)
        statuses = [_OK]
        entries, full, split = _make_entries(keys, [size], sums, want, [0], starts, 1,
                                             _POOL_FULL, statuses)
        e = entries[0]
        self.pool_write(e.start * bs, value)
        self.index_sync()       # lock-free reads recorded before this write go first
        _install_entries(store, entries)
        c = self.store_counters
        c["puts"] += 1
        c["bytes_in"] += size
        return statuses

    cdef bint _decline(self):
        self.declined += 1
        return False

    cdef _internal(self, ident, int64_t req_id, bint rbig, int64_t op, exc, double t0):
        # a store bug: logged, counted and answered INTERNAL, as ServiceLoop._dispatch does
        self.loop._fast_internal(ident, int(<uint64_t>req_id) if rbig else req_id,
                                 int(op), exc, t0)

    cdef bytes _head(self, int status, int64_t req_id, bint rbig, const char *tail,
                     Py_ssize_t ntail):
        # [version, status, req_id, {...}] with the map's bytes ``tail``
        cdef uint8_t buf[64]
        cdef int k = 0
        buf[0] = 0x94
        buf[1] = <uint8_t>self.version
        buf[2] = <uint8_t>status
        k = 3 + _pack_int(buf + 3, req_id, rbig)
        memcpy(buf + k, tail, ntail)
        return PyBytes_FromStringAndSize(<char *>buf, k + ntail)

    cdef bytes _reply_st(self, int64_t req_id, bint rbig, int st):
        # {"st": [st]}
        cdef uint8_t t[6]
        t[0] = 0x81
        t[1] = 0xa2
        t[2] = 0x73     # s
        t[3] = 0x74     # t
        t[4] = 0x91
        t[5] = <uint8_t>st
        return self._head(0, req_id, rbig, <char *>t, 6)

    cdef bytes _reply_found(self, int64_t req_id, bint rbig, bint found):
        # {"found": [found]}
        cdef uint8_t t[9]
        t[0] = 0x81
        t[1] = 0xa5
        memcpy(t + 2, b"found", 5)
        t[7] = 0x91
        t[8] = 0xc3 if found else 0xc2
        return self._head(0, req_id, rbig, <char *>t, 9)

    cdef bytes _reply_get(self, int64_t req_id, bint rbig, int64_t size, csum):
        # a miss: {"sizes": [-1], "counts": []}; a hit: {"sizes": [n], "counts": [1]}
        # and "sums": [c] when the entry has a checksum
        cdef uint8_t t[48]
        cdef int k = 0
        cdef int64_t c
        cdef bint cbig = False
        t[0] = 0x82 if (size < 0 or csum is None) else 0x83
        t[1] = 0xa5
        memcpy(t + 2, b"sizes", 5)
        t[7] = 0x91
        k = 8 + _pack_int(t + 8, size, False)
        t[k] = 0xa6
        memcpy(t + k + 1, b"counts", 6)
        k += 7
        if size < 0:
            t[k] = 0x90
            return self._head(0, req_id, rbig, <char *>t, k + 1)
        t[k] = 0x91
        t[k + 1] = 1
        k += 2
        if csum is not None:
            t[k] = 0xa4
            memcpy(t + k + 1, b"sums", 4)
            t[k + 5] = 0x91
            k += 6
            if csum < 0:
                c = csum
            elif csum > 0x7FFFFFFFFFFFFFFF:
                c = <int64_t>(<uint64_t>csum)
                cbig = True
            else:
                c = csum
            k += _pack_int(t + k, c, cbig)
        return self._head(0, req_id, rbig, <char *>t, k)
