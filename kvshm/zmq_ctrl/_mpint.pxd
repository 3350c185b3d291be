# cython: language_level=3
"""msgpack's int and array-header rules in C, shared by the server's C paths
(kvshm.zmq_ctrl._fastpath, kvshm.zmq_ctrl._batchq): reading a msgpack int of any width
from a frame (bounds-checked against its end) and writing one in msgpack's shortest
form, byte for byte what msgpack-python's Packer writes (msgpack spec, "int format
family"). Inline functions: no module of its own at run time."""

from libc.stdint cimport uint8_t, uint64_t, int64_t

cdef extern from *:
    """
    #define KVM_U32_END ((long long)4294967296LL)
    #define KVM_I32_MIN ((long long)-2147483648LL)
    #define KVM_U64_ALL ((unsigned long long)0xFFFFFFFFFFFFFFFFULL)
    """
    const long long U32_END "KVM_U32_END"
    const long long I32_MIN "KVM_I32_MIN"
    const unsigned long long U64_ALL "KVM_U64_ALL"


cdef struct Reader:
    const uint8_t *p
    const uint8_t *end


cdef inline int _int(Reader *r, int64_t *out, bint *big) noexcept nogil:
    """A msgpack int (any width) into ``out``; ``big``: a uint64 above int64's range
    (``out`` holds its bits). 0, or -1 when the next item is no int or is cut short."""
    cdef uint8_t b
    cdef uint64_t u = 0
    cdef int n = 0, i
    big[0] = False
    if r.p >= r.end:
        return -1
    b = r.p[0]
    r.p += 1
    if b <= 0x7f:
        out[0] = b
        return 0
    if b >= 0xe0:
        out[0] = <int64_t>(<signed char>b)
        return 0
    if b == 0xcc or b == 0xd0:
        n = 1
    elif b == 0xcd or b == 0xd1:
        n = 2
    elif b == 0xce or b == 0xd2:
        n = 4
    elif b == 0xcf or b == 0xd3:
        n = 8
    else:
        return -1
    if r.end - r.p < n:
        return -1
    for i in range(n):
        u = (u << 8) | r.p[i]
    r.p += n
    if b >= 0xd0:           # signed: sign-extend from n bytes
        if n < 8 and (u >> (8 * n - 1)) & 1:
            u |= U64_ALL << (8 * n)
        out[0] = <int64_t>u
    else:
        out[0] = <int64_t>u
        if n == 8 and (u >> 63):
            big[0] = True
    return 0


cdef inline int _one(Reader *r) noexcept nogil:
    """A one-element array header; 0, or -1."""
    if r.p >= r.end or r.p[0] != 0x91:
        return -1
    r.p += 1
    return 0


cdef inline int _pack_int(uint8_t *o, int64_t v, bint big) noexcept nogil:
    """msgpack-python's encoding of an int (the smallest that holds it): bytes written."""
    cdef uint64_t u = <uint64_t>v
    cdef int n, i
    cdef uint8_t tag
    if big or v >= 0:
        if not big and v < 128:
            o[0] = <uint8_t>v
            return 1
        if not big and v < 0x100:
            tag, n = 0xcc, 1
        elif not big and v < 0x10000:
            tag, n = 0xcd, 2
        elif not big and v < U32_END:
            tag, n = 0xce, 4
        else:
            tag, n = 0xcf, 8
    else:
        if v >= -32:
            o[0] = <uint8_t>(v & 0xff)
            return 1
        if v >= -128:
            tag, n = 0xd0, 1
        elif v >= -32768:
            tag, n = 0xd1, 2
        elif v >= I32_MIN:
            tag, n = 0xd2, 4
        else:
            tag, n = 0xd3, 8
    o[0] = tag
    for i in range(n):
        o[1 + i] = <uint8_t>((u >> (8 * (n - 1 - i))) & 0xff)
    return 1 + n


cdef inline uint64_t _be(const uint8_t *p, int n) noexcept nogil:
    cdef uint64_t u = 0
    cdef int i
    for i in range(n):
        u = (u << 8) | p[i]
    return u


cdef inline int _pack_array_head(uint8_t *o, Py_ssize_t n) noexcept nogil:
    """A msgpack array header for ``n`` (>= 0, < 2**32) items, in its shortest form
    (fixarray, array 16, array 32); returns its length in bytes."""
    if n <= 15:
        o[0] = <uint8_t>(0x90 | n)
        return 1
    if n <= 0xFFFF:
        o[0] = 0xdc
        o[1] = <uint8_t>(n >> 8)
        o[2] = <uint8_t>n
        return 3
    o[0] = 0xdd
    o[1] = <uint8_t>(n >> 24)
    o[2] = <uint8_t>(n >> 16)
    o[3] = <uint8_t>(n >> 8)
    o[4] = <uint8_t>n
    return 5


cdef inline int _array_head(Reader *r, Py_ssize_t *n) noexcept nogil:
    """A msgpack array header (fixarray, array 16, array 32) into ``n``; 0, or -1 when
    the next item is no array header or is cut short (``r`` unmoved then)."""
    cdef uint8_t b
    if r.p >= r.end:
        return -1
    b = r.p[0]
    if 0x90 <= b <= 0x9f:
        n[0] = b & 0x0f
        r.p += 1
    elif b == 0xdc and r.end - r.p >= 3:
        n[0] = <Py_ssize_t>_be(r.p + 1, 2)
        r.p += 3
    elif b == 0xdd and r.end - r.p >= 5:
        n[0] = <Py_ssize_t>_be(r.p + 1, 4)
        r.p += 5
    else:
        return -1
    return 0
