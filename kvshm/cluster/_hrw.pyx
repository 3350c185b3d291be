# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Weighted rendezvous hashing (HRW) over buckets of the key space, at C speed.

The owners of a key are the owners of its *bucket*: the top ``BUCKET_BITS`` bits of the
key's 64-bit placement hash (:func:`hash_key`). A bucket ``b`` has its own hash
``g(b)``; node ``j`` (64-bit seed ``s_j``, the hash of its id; weight ``w_j``, its pool
size) scores ``q_j = E(t_j) / w_j`` with ``t_j`` in (0, 1) taken from
``score(g(b), s_j)`` and ``E(t) = -ln(1 - t)``: an exponential race, so the node with
the smallest ``q`` owns a share ``w_j / sum(w)`` of the buckets (Schindelhauer and
Schomaker's weighted rendezvous). Owners are ordered by ``(q, t, -j)``. A node that
joins takes only the buckets it wins, and their previous owner is exactly their second
choice; a node that leaves moves only the buckets it held.

Why buckets: with ``2**BUCKET_BITS`` buckets a :class:`Ring` precomputes the top
owners of every bucket once per member list (about 40 ms for 64 nodes, done by the
view follower before the new view is used), and then the owners of a key are a hash
and a table read, whatever the weights or the number of owners asked for (10 k keys:
about 0.2 ms, ``perf/bench_cluster.py``). A call with few keys before the table is
built, or asking for more owners than the table holds, computes the same rows
directly: one function, two speeds. The price is granularity: a node's share is its
share of the buckets (64 nodes: about 4096 buckets each, within a few per cent of its
weight).

No ``-ln`` per (bucket, node): ``t <= E(t)``, so ``t_j / w_j`` is a lower bound of
``q_j``. One pass keeps the ``R + 1`` smallest bounds; ``E`` is evaluated for the ``R``
best; when the next bound is above the worst of them the answer is found (nearly
always); otherwise a second pass evaluates ``E`` for every node whose bound is below it.
The result is the exact order of ``q``, not an approximation.

Determinism: the hashes are integer arithmetic; ``E`` is this module's own (a
series in IEEE-754 ``+ - * /`` and ``frexp`` only, compiled with ``-ffp-contract=off``),
not the platform's ``log``, so every client on every host computes the same owners from
the same member list.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.math cimport INFINITY, frexp
from libc.stdint cimport int16_t, int32_t, int64_t, uint64_t, uint8_t
from libc.string cimport memcpy

import numpy as np

cdef uint64_t _C1 = 0x9E3779B97F4A7C15ULL
cdef uint64_t _C2 = 0xBF58476D1CE4E5B9ULL
cdef uint64_t _C3 = 0x94D049BB133111EBULL

#: Bits of the bucket index: 2**17 buckets.
BUCKET_BITS = 17
cdef int _BITS = 17
cdef Py_ssize_t _NBUCKETS = 1 << 17
#: Owners per bucket the table holds (more are computed per call).
TABLE_COLUMNS = 2
cdef int _COLS = 2
#: Nodes at most (the table stores node indices as int16).
MAX_NODES = 1 << 15
#: A call of fewer keys than this computes its rows directly until the table is built.
DIRECT_BELOW = 2048

cdef double _LN2 = 0.6931471805599453
cdef double _SQRT_HALF = 0.7071067811865476
cdef double _TWO_M53 = 1.0 / 9007199254740992.0      # 2**-53
#: Relative slack of the pruning bound (covers the rounding of t / w and of E).
cdef double _SLACK = 1e-9
cdef double _THIRD = 1.0 / 3.0
cdef uint64_t _IDX_MASK = 0xFFFF


cdef inline uint64_t _mix(uint64_t z) noexcept nogil:
    z = (z ^ (z >> 30)) * _C2
    z = (z ^ (z >> 27)) * _C3
    return z ^ (z >> 31)


cdef inline uint64_t _score(uint64_t h, uint64_t seed) noexcept nogil:
    # one multiply: the high bits of the product depend on every bit of h ^ seed (both
    # already full-avalanche hashes), and the shift folds them down
    cdef uint64_t z = (h ^ seed) * _C3
    return z ^ (z >> 29)


cdef inline uint64_t _hash(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    cdef uint64_t h = _C1 ^ (<uint64_t>n * _C3)
    cdef uint64_t w
    cdef Py_ssize_t i = 0
    while i + 8 <= n:
        memcpy(&w, p + i, 8)
        h = _mix(h ^ (w * _C1)) + _C2
        i += 8
    if i < n:
        w = 0
        memcpy(&w, p + i, n - i)
        h = _mix(h ^ (w * _C1) ^ 0xFF) + _C2
    return _mix(h)


cdef inline uint64_t _bucket_hash(uint64_t b) noexcept nogil:
    return _mix((b + 1) * _C1 + _C2)


cdef inline double _neg_ln1m(double t) noexcept nogil:
    """-ln(1 - t) for t in (0, 1): 2 atanh(y) as a series in y**2 (|y| <= 0.172, 12
    terms: relative error about 1e-16). Non-decreasing in t below 0.25."""
    cdef double y, y2, p, m
    cdef int e = 0
    if t < 0.25:
        y = t / (2.0 - t)              # -ln(1 - t) = 2 atanh(t / (2 - t))
    else:
        m = frexp(1.0 - t, &e)         # 1 - t = m 2**e, m in [0.5, 1); exact
        if m < _SQRT_HALF:
            m = m * 2.0
            e -= 1
        y = (1.0 - m) / (1.0 + m)      # -ln m = 2 atanh((1 - m) / (1 + m))
    y2 = y * y
    p = 1.0 / 23.0
    p = p * y2 + 1.0 / 21.0
    p = p * y2 + 1.0 / 19.0
    p = p * y2 + 1.0 / 17.0
    p = p * y2 + 1.0 / 15.0
    p = p * y2 + 1.0 / 13.0
    p = p * y2 + 1.0 / 11.0
    p = p * y2 + 1.0 / 9.0
    p = p * y2 + 1.0 / 7.0
    p = p * y2 + 1.0 / 5.0
    p = p * y2 + 1.0 / 3.0
    p = p * y2 + 1.0
    return 2.0 * y * p - <double>e * _LN2


def neg_ln1m(double t):
    """``-ln(1 - t)`` as placement computes it (``t`` in (0, 1)); for tests."""
    if not 0.0 < t < 1.0:
        raise ValueError("t must be in (0, 1)")
    return _neg_ln1m(t)


cdef inline bint _before(double qa, double ta, int32_t ja, double qb, double tb,
                         int32_t jb) noexcept nogil:
    """Owner order: smaller q, then smaller t, then the higher node index."""
    if qa != qb:
        return qa < qb
    if ta != tb:
        return ta < tb
    return ja > jb


cdef inline double _t_of(uint64_t z) noexcept nogil:
    # t = (2 k + 1) 2**-53 for the top 52 bits k of ~z: exact, in (0, 1); larger z,
    # smaller t
    return <double>(<int64_t>(((~z) >> 12) * 2 + 1)) * _TWO_M53


cdef inline uint64_t _umin(uint64_t a, uint64_t b) noexcept nogil:
    return a if a < b else b


cdef inline uint64_t _umax(uint64_t a, uint64_t b) noexcept nogil:
    return a if a > b else b


cdef int _top(uint64_t g, const uint64_t* sd, const double* iw, Py_ssize_t m, int nrep,
              int32_t* out) noexcept nogil:
    """The ``nrep`` best nodes (indices into ``sd``) for bucket hash ``g``, best first,
    into ``out``. ``1 <= nrep <= min(m, 8)``."""
    cdef uint64_t v[9]          # the kk smallest bounds, ascending, node index in the low bits
    cdef double bl[9]
    cdef int32_t bj[9]
    cdef double rq[8]
    cdef double rt[8]
    cdef int32_t rj[8]
    cdef int kk = nrep + 1 if nrep < m else nrep
    cdef int r, s
    cdef Py_ssize_t j
    cdef double t, lo, hi, q, u
    cdef uint64_t z, x
    cdef bint separated = True
    cdef uint64_t a0, a1, a2, a3, a4
    a0 = a1 = a2 = a3 = a4 = 0xFFFFFFFFFFFFFFFFULL
    # pass 1, branch-free: t / w <= E(t) / w. A positive double's bits order as its
    # value; the low 16 bits (cleared: still a lower bound) carry the node index. The
    # kk smallest stay in registers (a chain through memory would cost ~5x).
    if kk <= 2:
        for j in range(m):
            lo = _t_of(_score(g, sd[j])) * iw[j]
            memcpy(&x, &lo, 8)
            x = (x & ~_IDX_MASK) | <uint64_t>j
            a1 = _umin(a1, _umax(a0, x))
            a0 = _umin(a0, x)
    elif kk <= 3:
        for j in range(m):
            lo = _t_of(_score(g, sd[j])) * iw[j]
            memcpy(&x, &lo, 8)
            x = (x & ~_IDX_MASK) | <uint64_t>j
            a2 = _umin(a2, _umax(a1, x))
            a1 = _umin(a1, _umax(a0, x))
            a0 = _umin(a0, x)
    elif kk <= 5:
        for j in range(m):
            lo = _t_of(_score(g, sd[j])) * iw[j]
            memcpy(&x, &lo, 8)
            x = (x & ~_IDX_MASK) | <uint64_t>j
            a4 = _umin(a4, _umax(a3, x))
            a3 = _umin(a3, _umax(a2, x))
            a2 = _umin(a2, _umax(a1, x))
            a1 = _umin(a1, _umax(a0, x))
            a0 = _umin(a0, x)
    if kk <= 5:
        v[0] = a0
        v[1] = a1
        v[2] = a2
        v[3] = a3
        v[4] = a4
    else:
        for r in range(kk):
            v[r] = 0xFFFFFFFFFFFFFFFFULL
        for j in range(m):
            lo = _t_of(_score(g, sd[j])) * iw[j]
            memcpy(&x, &lo, 8)
            x = (x & ~_IDX_MASK) | <uint64_t>j
            r = kk - 1
            while r > 0:
                v[r] = _umin(v[r], _umax(v[r - 1], x))
                r -= 1
            v[0] = _umin(v[0], x)
    for r in range(kk):
        bj[r] = <int32_t>(v[r] & _IDX_MASK)
        x = v[r] & ~_IDX_MASK
        memcpy(&bl[r], &x, 8)
    # Nearly always the bounds alone give the order: E(t) <= t + t**2/2 + t**3/3 +
    # t**4 / (4 (1 - t)); if the interval of each of the nrep best ends below the next
    # one's bound, that is the order of the exact scores (every other node's bound is
    # at least bl[kk - 1]).
    for r in range(kk - 1 if kk - 1 < nrep else nrep):
        t = _t_of(_score(g, sd[bj[r]]))
        hi = (t * (1.0 + t * (0.5 + t * _THIRD)) + t * t * t * t / (4.0 * (1.0 - t))) \
            * iw[bj[r]]
        if hi * (1.0 + _SLACK) >= bl[r + 1] * (1.0 - _SLACK):
            separated = False
            break
    if separated:
        for r in range(nrep):
            out[r] = bj[r]
        return nrep
    # exact: u = the worst exact score of the nrep best bounds bounds the nrep-th best
    # score; every node whose bound is below u is scored exactly
    u = 0.0
    for r in range(nrep):
        t = _t_of(_score(g, sd[bj[r]]))
        q = _neg_ln1m(t) * iw[bj[r]]
        u = q if q > u else u
    for r in range(nrep):
        rq[r] = INFINITY
        rt[r] = 1.0
        rj[r] = -1
    for j in range(m):
        t = _t_of(_score(g, sd[j]))
        if t * iw[j] * (1.0 - _SLACK) > u:
            continue
        q = _neg_ln1m(t) * iw[j]
        if rj[nrep - 1] >= 0 and not _before(q, t, <int32_t>j, rq[nrep - 1],
                                             rt[nrep - 1], rj[nrep - 1]):
            continue
        s = nrep - 1
        while s > 0 and (rj[s - 1] < 0 or _before(q, t, <int32_t>j, rq[s - 1],
                                                  rt[s - 1], rj[s - 1])):
            rq[s] = rq[s - 1]
            rt[s] = rt[s - 1]
            rj[s] = rj[s - 1]
            s -= 1
        rq[s] = q
        rt[s] = t
        rj[s] = <int32_t>j
    for r in range(nrep):
        out[r] = rj[r]
    return nrep


def hash_key(bytes key):
    """The 64-bit placement hash of ``key`` (as every client computes it)."""
    return _hash(<const uint8_t*>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))


def bucket_of(bytes key):
    """The bucket of ``key``: the top :data:`BUCKET_BITS` bits of :func:`hash_key`."""
    return _hash(<const uint8_t*>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)) >> (64 - _BITS)


cdef class Ring:
    """Owners over one member list (immutable once made; build one per view).

    Parameters
    ----------
    seeds : sequence of int
        One 64-bit seed per node (:func:`hash_key` of its id), in the member list's
        order (node index = position).
    weights : sequence of float
        One weight > 0 per node (its pool size in bytes).

    Raises
    ------
    ValueError
        More than :data:`MAX_NODES` nodes, a weight not > 0 (or not finite), or not one
        weight per seed.
    """

    cdef uint64_t[::1] _seeds
    cdef double[::1] _iw
    cdef readonly Py_ssize_t nodes
    cdef int _cols
    cdef object _table           # int16 (NBUCKETS, cols) once built, else None

    def __init__(self, seeds, weights):
        sd = np.ascontiguousarray(np.asarray(seeds, dtype=np.uint64))
        w = np.ascontiguousarray(np.asarray(weights, dtype=np.float64))
        if sd.ndim != 1 or w.shape != sd.shape:
            raise ValueError("one weight per seed")
        if len(sd) > MAX_NODES:
            raise ValueError(f"at most {MAX_NODES} nodes")
        if len(w) and not (np.isfinite(w).all() and (w > 0).all()):
            raise ValueError("weights must be finite and > 0")
        self.nodes = len(sd)
        self._seeds = sd if len(sd) else np.zeros(1, np.uint64)
        # 1 / w: q = E(t) * (1 / w) (one rounding, the same everywhere)
        self._iw = (1.0 / w) if len(w) else np.zeros(1, np.float64)
        self._cols = <int>min(self.nodes, _COLS)
        self._table = None

    @property
    def built(self):
        """Whether the bucket table is precomputed."""
        return self._table is not None

    def build(self):
        """Precompute the top owners of every bucket (idempotent; releases the GIL)."""
        if self._table is not None or self.nodes == 0:
            return
        tab = np.empty((_NBUCKETS, self._cols), dtype=np.int16)
        cdef int16_t[:, ::1] tv = tab
        cdef Py_ssize_t b, m = self.nodes
        cdef int r, cols = self._cols
        cdef int32_t row[8]
        cdef const uint64_t* sp = &self._seeds[0]
        cdef const double* wp = &self._iw[0]
        with nogil:
            for b in range(_NBUCKETS):
                _top(_bucket_hash(<uint64_t>b), sp, wp, m, cols, row)
                for r in range(cols):
                    tv[b, r] = <int16_t>row[r]
        self._table = tab

    def bucket_owners(self, Py_ssize_t bucket, int replicas=1):
        """The owners of one bucket, best first (computed, not read from the table)."""
        if not 0 <= bucket < _NBUCKETS:
            raise ValueError("bucket out of range")
        cdef int nrep = <int>min(replicas, self.nodes, 8)
        out = np.full(replicas, -1, dtype=np.int32)
        if nrep <= 0:
            return out
        cdef int32_t row[8]
        _top(_bucket_hash(<uint64_t>bucket), &self._seeds[0], &self._iw[0], self.nodes,
             nrep, row)
        for r in range(nrep):
            out[r] = row[r]
        return out

    def owners(self, list keys, int stripe=1, int replicas=1):
        """Owners of each key: an int32 array of shape (len(keys), replicas).

        Parameters
        ----------
        keys : list of bytes
            Placement keys, in request order.
        stripe : int
            Keys ``i`` with the same ``i // stripe`` share the owners of the first of
            them.
        replicas : int
            Owners per key, best first (1-8).

        Returns
        -------
        numpy.ndarray
            Node indices, best first; -1 where there are fewer nodes than ``replicas``.

        Raises
        ------
        ValueError
            ``stripe`` < 1 or ``replicas`` outside 1-8.
        TypeError
            A placement key is not bytes.
        """
        cdef Py_ssize_t n = len(keys), m = self.nodes, i, s, e
        if stripe < 1:
            raise ValueError("stripe must be >= 1")
        if not 1 <= replicas <= 8:
            raise ValueError("replicas must be 1-8")
        out_arr = np.full((n, replicas), -1, dtype=np.int32)
        if n == 0 or m == 0:
            return out_arr
        cdef int nrep = replicas if replicas < m else <int>m
        cdef Py_ssize_t nstripes = (n + stripe - 1) // stripe
        if self._table is None and nrep <= self._cols and nstripes >= DIRECT_BELOW:
            self.build()
        cdef bint use_table = self._table is not None and nrep <= self._cols
        cdef int32_t[:, ::1] out = out_arr
        cdef uint64_t[::1] bk = np.empty(nstripes, dtype=np.uint64)
        cdef object k
        cdef Py_ssize_t c = 0
        i = 0
        while i < n:
            k = keys[i]
            if type(k) is not bytes:
                raise TypeError(f"placement keys must be bytes, got {type(k).__name__}")
            bk[c] = _hash(<const uint8_t*>PyBytes_AS_STRING(k), PyBytes_GET_SIZE(k)) \
                >> (64 - _BITS)
            c += 1
            i += stripe
        cdef int16_t[:, ::1] tv
        cdef int32_t row[8]
        cdef int r
        cdef const uint64_t* sp = &self._seeds[0]
        cdef const double* wp = &self._iw[0]
        if use_table:
            tv = self._table
            with nogil:
                for c in range(nstripes):
                    s = c * stripe
                    e = s + stripe if s + stripe < n else n
                    for i in range(s, e):
                        for r in range(nrep):
                            out[i, r] = tv[bk[c], r]
            return out_arr
        with nogil:
            for c in range(nstripes):
                _top(_bucket_hash(bk[c]), sp, wp, m, nrep, row)
                s = c * stripe
                e = s + stripe if s + stripe < n else n
                for i in range(s, e):
                    for r in range(nrep):
                        out[i, r] = row[r]
        return out_arr


def owners(list keys, object seeds, object weights, int stripe=1, int replicas=1):
    """Owners of each key over one member list: ``Ring(seeds, weights).owners(keys,
    stripe, replicas)`` (a one-off; keep a :class:`Ring` to reuse its table)."""
    return Ring(seeds, weights).owners(keys, stripe, replicas)
