# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Weighted rendezvous hashing (HRW) over stripes of keys, at C speed.

Each node ``j`` has a 64-bit seed (the hash of its id) and a weight ``w_j`` (its pool
size). A placement key ``k`` hashes once to ``h(k)``; node ``j``'s score is
``w_j / -ln(u)``, ``u = mix(h(k) ^ seed_j)`` mapped to (0, 1); the owners of ``k`` are the
nodes with the highest scores (Schindelhauer and Schomaker's weighted rendezvous; a node
then owns a share ``w_j / sum(w)`` of the keys, and a node that joins or leaves moves
only the keys it wins or held).

``-ln`` is the costly part. It is monotone, so among nodes of one weight the best is the
one with the largest ``u``: the logarithm is taken once per distinct weight and key, not
once per node and key (nodes of a cluster usually share a handful of pool sizes).

The hash of a key is this module's own (64-bit multiply-xorshift over 8-byte words,
splitmix64 finaliser): every client computes the same owners from the same view, on any
host of the same byte order.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.math cimport log
from libc.stdint cimport int32_t, uint64_t, uint8_t
from libc.string cimport memcpy

import numpy as np

cdef uint64_t _C1 = 0x9E3779B97F4A7C15ULL
cdef uint64_t _C2 = 0xBF58476D1CE4E5B9ULL
cdef uint64_t _C3 = 0x94D049BB133111EBULL


cdef inline uint64_t _mix(uint64_t z) noexcept nogil:
    z = (z ^ (z >> 30)) * _C2
    z = (z ^ (z >> 27)) * _C3
    return z ^ (z >> 31)


cdef inline uint64_t _score(uint64_t h, uint64_t seed) noexcept nogil:
    # one multiply: the high bits of the product depend on every bit of h ^ seed (both
    # already full-avalanche hashes), and the shift folds them down
    cdef uint64_t z = (h ^ seed) * _C3
    return z ^ (z >> 29)


#: The low 16 bits of a score carry the node's index, so the best node of a key is a
#: plain max (no branch on which index won); ties in the high 48 bits go to the higher
#: index, on every client alike.
cdef enum:
    _IDX_BITS = 16
cdef uint64_t _IDX_MASK = (1ULL << _IDX_BITS) - 1
MAX_NODES = 1 << _IDX_BITS


cdef inline uint64_t _scored(uint64_t h, uint64_t seed, Py_ssize_t j) noexcept nogil:
    return (_score(h, seed) & ~_IDX_MASK) | <uint64_t>j


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


def hash_key(bytes key):
    """The 64-bit placement hash of ``key`` (as every client computes it)."""
    return _hash(<const uint8_t*>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))


def owners(list keys, object seeds, object weights, int stripe=1, int replicas=1):
    """Owners of each key: an int32 array of shape (len(keys), replicas).

    Parameters
    ----------
    keys : list of bytes
        Placement keys, in request order.
    seeds : sequence of int
        One 64-bit seed per node (:func:`hash_key` of its id).
    weights : sequence of float
        One weight > 0 per node (its pool size in bytes).
    stripe : int
        Keys ``i`` with the same ``i // stripe`` share the owners of the first of them.
    replicas : int
        Owners per key, best first (at most the number of nodes).

    Returns
    -------
    numpy.ndarray
        Node indices (into ``seeds``), best first; -1 where there are fewer nodes than
        ``replicas``.
    """
    cdef Py_ssize_t n = len(keys), m = len(seeds), i, j, s, r, c
    if stripe < 1:
        raise ValueError("stripe must be >= 1")
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if len(weights) != m:
        raise ValueError("one weight per seed")
    if m > MAX_NODES:
        raise ValueError(f"at most {MAX_NODES} nodes")
    out_arr = np.full((n, replicas), -1, dtype=np.int32)
    if n == 0 or m == 0:
        return out_arr
    cdef int32_t[:, ::1] out = out_arr
    cdef uint64_t[::1] sd = np.asarray(seeds, dtype=np.uint64)
    w_arr = np.asarray(weights, dtype=np.float64)
    if not (w_arr > 0).all():
        raise ValueError("weights must be > 0")
    # Distinct weights: classes of nodes, so -ln is taken once per class and key.
    classes, cls_of = np.unique(w_arr, return_inverse=True)
    cdef double[::1] cw = classes
    cdef Py_ssize_t ncls = len(classes)
    cdef int32_t[::1] cof = cls_of.astype(np.int32)
    cdef uint64_t[::1] hashes = np.empty(n, dtype=np.uint64)
    cdef object k
    i = 0
    while i < n:
        k = keys[i]
        if type(k) is not bytes:
            raise TypeError(f"placement keys must be bytes, got {type(k).__name__}")
        hashes[i] = _hash(<const uint8_t*>PyBytes_AS_STRING(k), PyBytes_GET_SIZE(k))
        i += stripe
    cdef int nrep = replicas if replicas < m else <int>m
    # per class: the best nodes' mixed hashes (top nrep; the order of u = the order of
    # the 64-bit value, so no float per node), then merged by score across classes
    best_z_arr = np.zeros((ncls, nrep), dtype=np.uint64)
    best_j_arr = np.full((ncls, nrep), -1, dtype=np.int32)
    cdef uint64_t[:, ::1] bz = best_z_arr
    cdef int32_t[:, ::1] bj = best_j_arr
    top_s_arr = np.zeros(nrep, dtype=np.float64)
    top_j_arr = np.zeros(nrep, dtype=np.int32)
    cdef double[::1] ts = top_s_arr
    cdef int32_t[::1] tj = top_j_arr
    cdef const uint64_t* sp = &sd[0]
    # nodes grouped by class (for one owner per key: one tight loop per class)
    order = np.argsort(cls_of, kind="stable").astype(np.int32)
    sorted_seeds = np.ascontiguousarray(np.asarray(sd)[order])
    bounds = np.searchsorted(cls_of[order], np.arange(ncls + 1)).astype(np.int32)
    cdef uint64_t[::1] ssd = sorted_seeds
    cdef int32_t[::1] ordv = order
    cdef int32_t[::1] bnd = bounds
    cdef const uint64_t* ssp = &ssd[0]
    cdef Py_ssize_t lo, hi
    cdef const int32_t* cp = &cof[0]
    cdef double u, sc
    cdef uint64_t h, z, zbest, a0, a1, a2, a3
    cdef int32_t jbest
    cdef int ntop
    with nogil:
        i = 0
        while i < n:
            h = hashes[i]
            if nrep == 1 and ncls == 1:        # the common case: one weight, one owner
                # four independent maxima (no dependency chain between them)
                a0 = a1 = a2 = a3 = 0
                j = 0
                while j + 4 <= m:
                    z = _scored(h, sp[j], j)
                    a0 = z if z > a0 else a0
                    z = _scored(h, sp[j + 1], j + 1)
                    a1 = z if z > a1 else a1
                    z = _scored(h, sp[j + 2], j + 2)
                    a2 = z if z > a2 else a2
                    z = _scored(h, sp[j + 3], j + 3)
                    a3 = z if z > a3 else a3
                    j += 4
                while j < m:
                    z = _scored(h, sp[j], j)
                    a0 = z if z > a0 else a0
                    j += 1
                a0 = a1 if a1 > a0 else a0
                a2 = a3 if a3 > a2 else a2
                a0 = a2 if a2 > a0 else a0
                ntop = 1
                tj[0] = <int32_t>(a0 & _IDX_MASK)
            elif nrep == 1:                    # one owner, a few weights
                ntop = 0
                for c in range(ncls):
                    lo = bnd[c]
                    hi = bnd[c + 1]
                    zbest = 0
                    for j in range(lo, hi):      # scored with the node's own index
                        z = _scored(h, ssp[j], ordv[j])
                        zbest = z if z > zbest else zbest
                    u = (<double>(zbest >> 11) + 0.5) * (1.0 / 9007199254740992.0)
                    sc = cw[c] / -log(u)
                    if ntop == 0 or sc > ts[0]:
                        ts[0] = sc
                        tj[0] = <int32_t>(zbest & _IDX_MASK)
                        ntop = 1
            else:
                for c in range(ncls):
                    for r in range(nrep):
                        bz[c, r] = 0
                        bj[c, r] = -1
                for j in range(m):
                    z = _scored(h, sp[j], j)
                    c = cp[j]
                    if bj[c, nrep - 1] < 0 or z > bz[c, nrep - 1]:
                        r = nrep - 1
                        while r > 0 and (bj[c, r - 1] < 0 or z > bz[c, r - 1]):
                            bz[c, r] = bz[c, r - 1]
                            bj[c, r] = bj[c, r - 1]
                            r -= 1
                        bz[c, r] = z
                        bj[c, r] = <int32_t>j
                ntop = 0
                for c in range(ncls):
                    for r in range(nrep):
                        if bj[c, r] < 0:
                            break
                        # u in (0, 1): 53 bits, never 0 (ln 0) nor 1 (-ln 1 = 0)
                        u = (<double>(bz[c, r] >> 11) + 0.5) * (1.0 / 9007199254740992.0)
                        sc = cw[c] / -log(u)
                        if ntop == nrep and sc <= ts[nrep - 1]:
                            break
                        s = ntop if ntop < nrep else nrep - 1
                        while s > 0 and sc > ts[s - 1]:
                            ts[s] = ts[s - 1]
                            tj[s] = tj[s - 1]
                            s -= 1
                        ts[s] = sc
                        tj[s] = bj[c, r]
                        if ntop < nrep:
                            ntop += 1
            for s in range(i, i + stripe if i + stripe < n else n):
                for r in range(ntop):
                    out[s, r] = tj[r]
            i += stripe
    return out_arr
