# cython: language_level=3, boundscheck=False, wraparound=False
"""Per-key loops of a batch in C: keys, values, and the TCP mover's payload frames.

Each function does the common case in one C loop and builds no message unless something
fails. Where the input is unusual (a key that is not bytes or str, a value that is not
a plain contiguous buffer, a layout that does not add up) it either hands back ``None``
so that the caller runs its Python path (which raises the same errors as always), or
calls that Python code itself. Results are those of the Python code they replace:

* :func:`keys` -- ``_Session.keys``'s normalisation (str -> UTF-8, checks lengths);
* :func:`value_views` -- ``_Session._values``'s byte views and size checks;
* :func:`plan`, :func:`pack`, :func:`unpack` -- :mod:`kvshm.zmq_ctrl.frames`';
* :func:`fill` -- the per-key part of ``_Session.got`` (a GET reply's values);
* :func:`pack_request` -- ``msgpack.packb`` of a batch PUT's or ALLOC's header frame,
  byte for byte (:func:`kvshm.zmq_ctrl.protocol.encode_request` uses it; the environment
  variable ``KVSHM_FAST_PACK=0``, read at import, turns that off for A/B figures);
* :func:`all_bools` -- the item check of :func:`kvshm.replies.found_of`;
* :func:`pack_fixints` -- msgpack's bytes of a reply's list of small ints (statuses),
  used by :class:`kvshm.zmq_ctrl.protocol.ReplyEncoder` (``KVSHM_FAST_REPLY=0``, read
  at import, turns that off for A/B figures).
"""

from cpython.buffer cimport PyBuffer_IsContiguous
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM, PyList_GET_ITEM
from cpython.long cimport PyLong_AsLongAndOverflow, PyLong_AsLongLongAndOverflow
from cpython.memoryview cimport PyMemoryView_FromObject, PyMemoryView_GET_BUFFER
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.unicode cimport PyUnicode_AsUTF8String
from libc.string cimport memcpy

cdef extern from "Python.h":
    Py_ssize_t PY_SSIZE_T_MAX
    ctypedef struct PyMemoryViewObject:
        int flags
    int _Py_MEMORYVIEW_RELEASED


cdef int _shrunk(Py_ssize_t n, object seq) except -1:
    raise ValueError(f"{n} keys but {len(seq)} values (changed during the call)")


cdef inline bint _live(object m):
    """``m`` (a memoryview) not released: a released one keeps its Py_buffer's buf and
    len, but the memory under them may be gone."""
    return not ((<PyMemoryViewObject *>m).flags & _Py_MEMORYVIEW_RELEASED)


cdef Py_ssize_t _PACK_BELOW = 256 << 10
cdef Py_ssize_t _SSIZE_MAX = PY_SSIZE_T_MAX
cdef Py_ssize_t _PACK_FRAME_BYTES = 8 << 20


def keys(list ks, Py_ssize_t limit):
    """``(keys as bytes, total bytes)`` when every key is a non-empty bytes or str
    (UTF-8) of at most ``limit`` bytes; else None (the caller's Python path raises)."""
    cdef Py_ssize_t n = len(ks), i, total = 0, m
    cdef object k
    cdef list out = PyList_New(n)
    for i in range(n):
        k = ks[i]
        if type(k) is bytes:
            pass
        elif type(k) is str:
            try:
                k = PyUnicode_AsUTF8String(k)
            except UnicodeError:
                return None
        else:
            return None
        m = PyBytes_GET_SIZE(k)
        if m == 0 or m > limit:
            return None
        total += m
        Py_INCREF(k)
        PyList_SET_ITEM(out, i, k)
    return out, total


cdef inline object _view(object v):
    """A 1-D unsigned-byte memoryview over ``v``, or None (not a plain contiguous
    buffer: byte_view decides, and words the error)."""
    cdef object m
    cdef Py_buffer *b
    try:
        m = PyMemoryView_FromObject(v)
    except TypeError:
        return None
    b = PyMemoryView_GET_BUFFER(m)
    if not PyBuffer_IsContiguous(b, c'C'):
        return None
    if b.ndim == 1 and b.itemsize == 1 and (b.format == NULL or
                                            (b.format[0] == b'B' and b.format[1] == 0)):
        return m
    if b.len == 0:
        return None     # the cast may refuse it (a 0 in a shape): byte_view words that
    return m.cast("B")


def value_views(list bkeys, values, Py_ssize_t capacity, Py_ssize_t max_value, byte_view,
                too_large):
    """``(views, sizes)`` of ``values`` (one per key in ``bkeys``, lengths checked by
    the caller), as ``_Session._values`` makes them: ``byte_view(v, what=...)`` words
    every refusal; a value over ``capacity`` or ``max_value`` (when not 0) raises
    ``too_large`` with the usual message (after every value was viewed, as before)."""
    cdef Py_ssize_t n = len(bkeys), i, nb, bad = -1
    cdef list views = PyList_New(n)
    cdef list sizes = PyList_New(n)
    cdef object v, m, sz
    if type(values) is not list and type(values) is not tuple:
        values = list(values)
    for i in range(n):
        if i >= len(values):    # byte_view ran caller code (a tensor's methods) that
            _shrunk(n, values)  # shrank the list: values[i] would read past its end
        v = values[i]
        m = _view(v)
        if m is None:
            m = byte_view(v, what=f"value for key {bkeys[i]!r}")
        nb = (PyMemoryView_GET_BUFFER(m)).len
        if bad < 0 and (nb > capacity or (max_value and nb > max_value)):
            bad = i
        Py_INCREF(m)
        PyList_SET_ITEM(views, i, m)
        sz = nb
        Py_INCREF(sz)
        PyList_SET_ITEM(sizes, i, sz)
    if bad >= 0:
        nb = sizes[bad]
        raise too_large(f"value for key {bkeys[bad]!r} is {nb} bytes; the server "
                        f"takes at most {max_value or capacity}")
    return views, sizes


cdef inline Py_ssize_t _nbytes(object m) except -1:
    if type(m) is memoryview and _live(m):
        return (PyMemoryView_GET_BUFFER(m)).len
    return memoryview(m).nbytes     # a released view: ValueError, as v.nbytes raises


def plan(sizes):
    """:func:`kvshm.zmq_ctrl.frames.plan` in C (ints expected; anything else: the
    Python version's behaviour via ``int()``)."""
    cdef list groups = []
    cdef Py_ssize_t start = -1, acc = 0, i = 0, n, nn
    cdef object s
    for s in sizes:
        n = s
        if n >= _PACK_BELOW:
            if start >= 0:
                groups.append((start, i - start))
                start = -1
            groups.append((i, 1))
            i += 1
            continue
        if start >= 0 and acc + n > _PACK_FRAME_BYTES:
            groups.append((start, i - start))
            start = -1
        if start < 0:
            start = i
            acc = 0
        acc += n
        i += 1
    if start >= 0:
        groups.append((start, i - start))
    return groups


def pack(views):
    """:func:`kvshm.zmq_ctrl.frames.pack` in C: ``(frames, counts)``."""
    cdef Py_ssize_t nv = len(views), i = 0, j, start, acc, n, pos
    cdef list frames = [], counts = []
    cdef object v, joined
    cdef bint plain
    cdef char *dst
    cdef Py_buffer *b
    if type(views) is not list:
        views = list(views)
    while i < nv:
        v = views[i]
        n = _nbytes(v)
        if n >= _PACK_BELOW:
            frames.append(v)
            counts.append(1)
            i += 1
            continue
        start = i
        acc = n
        i += 1
        while i < nv:
            n = _nbytes(views[i])
            if n >= _PACK_BELOW or acc + n > _PACK_FRAME_BYTES:
                break
            acc += n
            i += 1
        if i - start == 1:
            frames.append(v)
            counts.append(1)
            continue
        plain = True
        for j in range(start, i):
            v = views[j]
            if type(v) is not memoryview or \
                    not PyBuffer_IsContiguous(PyMemoryView_GET_BUFFER(v), c'C'):
                plain = False
                break
        if not plain:
            joined = b"".join(views[start:i])
        else:
            joined = PyBytes_FromStringAndSize(NULL, acc)
            dst = PyBytes_AS_STRING(joined)
            pos = 0
            for j in range(start, i):
                b = PyMemoryView_GET_BUFFER(views[j])
                memcpy(dst + pos, b.buf, b.len)
                pos += b.len
        frames.append(joined)
        counts.append(i - start)
    return frames, counts


cdef inline object _frame_view(object f):
    cdef object buf = PyMemoryView_FromObject(f)
    cdef Py_buffer *b = PyMemoryView_GET_BUFFER(buf)
    if b.ndim != 1 or b.itemsize != 1:
        buf = buf.cast("B")
    return buf


def unpack(frames, counts, sizes, slow):
    """:func:`kvshm.zmq_ctrl.frames.unpack` in C for frames that each hold whole values
    (no count of 0), ints everywhere and sizes that add up; anything else is handed to
    ``slow`` (the Python version: same result, same errors)."""
    cdef Py_ssize_t nf = len(frames), ns = len(sizes), fi, i = 0, c, k, pos, n, total = 0
    cdef list out
    cdef object buf, cnt, s
    cdef long long v
    cdef int ovf = 0
    cdef Py_buffer *b
    if len(counts) != nf:
        return slow(frames, counts, sizes)
    for cnt in counts:
        # a count over ns (a hostile peer's 2**62s) could wrap total to ns: over-read
        if type(cnt) is not int or cnt < 1 or cnt > ns:
            return slow(frames, counts, sizes)
        total += <Py_ssize_t>cnt
    if total != ns:
        return slow(frames, counts, sizes)
    for s in sizes:
        # (C compares: no int object per size; past 64 bits: overflow, the slow path)
        if type(s) is not int:
            return slow(frames, counts, sizes)
        v = PyLong_AsLongLongAndOverflow(s, &ovf)
        if ovf or v < 0 or v > _SSIZE_MAX:
            return slow(frames, counts, sizes)
    out = PyList_New(ns)
    for fi in range(nf):
        c = counts[fi]
        buf = _frame_view(frames[fi])
        b = PyMemoryView_GET_BUFFER(buf)
        pos = 0
        for k in range(i, i + c):
            n = sizes[k]
            if n > b.len - pos:         # no sum that wraps round to the frame's length
                return slow(frames, counts, sizes)
            pos += n
        if pos != b.len:
            return slow(frames, counts, sizes)
        pos = 0
        for k in range(i, i + c):
            n = sizes[k]
            s = buf[pos:pos + n]
            Py_INCREF(s)
            PyList_SET_ITEM(out, k, s)
            pos += n
        i += c
    return out


cdef bint _reply_layout_ok(frames, counts, sizes, Py_ssize_t nf, Py_ssize_t ns):
    """A GET reply's layout is plain: one count per frame, each an int in 1..ns (a
    hostile peer's 2**62s could wrap the total round: an over-read), sizes ints in the C
    range, the counts adding up to the hits (sizes >= 0), and each frame exactly the
    sum of its values' sizes."""
    cdef Py_ssize_t total = 0, hits = 0, i = 0, fi, c, n, pos
    cdef object cnt, s, buf
    cdef long long v
    cdef int ovf = 0
    if len(counts) != nf:
        return False
    for cnt in counts:
        if type(cnt) is not int or cnt < 1 or cnt > ns:
            return False
        total += <Py_ssize_t>cnt
    for s in sizes:
        if type(s) is not int:
            return False
        v = PyLong_AsLongLongAndOverflow(s, &ovf)
        if ovf or v > _SSIZE_MAX or v < -_SSIZE_MAX:
            return False
        if v >= 0:
            hits += 1
    if total != hits:
        return False
    for fi in range(nf):
        c = counts[fi]
        buf = _frame_view(frames[fi])
        pos = 0
        while c:
            n = sizes[i]
            i += 1
            if n < 0:
                continue
            if n > PyMemoryView_GET_BUFFER(buf).len - pos:   # no sum that wraps round
                return False
            pos += n
            c -= 1
        if pos != PyMemoryView_GET_BUFFER(buf).len:
            return False
    return True


def fill(frames, counts, list sizes, list outs):
    """The values of a GET reply, ``data`` as ``_Session.got`` makes it (bytes per hit,
    None per miss; with ``outs``, copied into ``outs[i]`` and ``data[i]`` is
    ``outs[i][:size]``), or None when anything is unusual (a size that is not an int,
    a value over several frames, frames that do not add up, an output too small): the
    caller's Python path then does it, or raises as always. ``outs``: 1-D byte
    memoryviews."""
    cdef Py_ssize_t nf = len(frames), ns = len(sizes), fi, i = 0, c, pos, n, k
    cdef list data
    cdef object buf, d, o
    cdef Py_buffer *b
    cdef Py_buffer *ob
    cdef const char *src
    if not _reply_layout_ok(frames, counts, sizes, nf, ns):
        return None
    if outs is not None:
        for i in range(ns):
            n = sizes[i]
            if n < 0:
                continue
            o = outs[i]
            if type(o) is not memoryview or not _live(o) or \
                    PyMemoryView_GET_BUFFER(o).len < n or \
                    PyMemoryView_GET_BUFFER(o).readonly:
                return None
    data = PyList_New(ns)
    i = 0
    fi = 0
    c = 0
    src = NULL
    for k in range(ns):
        n = sizes[k]
        if n < 0:
            d = None
        else:
            while c == 0:
                buf = _frame_view(frames[fi])
                b = PyMemoryView_GET_BUFFER(buf)
                src = <const char *>b.buf
                c = counts[fi]
                fi += 1
            if outs is None:
                o = frames[fi - 1]
                if c == 1 and counts[fi - 1] == 1 and type(o) is bytes:
                    d = o               # the frame is the value (its size checked above)
                else:
                    d = PyBytes_FromStringAndSize(src, n)
            else:
                o = outs[k]
                ob = PyMemoryView_GET_BUFFER(o)
                memcpy(ob.buf, src, n)
                d = o[:n]
            src += n
            c -= 1
        Py_INCREF(d)
        PyList_SET_ITEM(data, k, d)
    return data


def out_views(list bkeys, outs, byte_view):
    """Writable byte views of ``outs``, as ``byte_view(o, writable=True, what=...)``
    makes them (and words every refusal)."""
    cdef Py_ssize_t n = len(bkeys), i
    cdef list views = PyList_New(n)
    cdef object o, m
    if type(outs) is not list and type(outs) is not tuple:
        outs = list(outs)
    for i in range(n):
        if i >= len(outs):
            _shrunk(n, outs)
        o = outs[i]
        m = _view(o)
        if m is None or PyMemoryView_GET_BUFFER(m).readonly:
            m = byte_view(o, writable=True, what=f"output for key {bkeys[i]!r}")
        Py_INCREF(m)
        PyList_SET_ITEM(views, i, m)
    return views


def pack_values(list bkeys, values, Py_ssize_t capacity, Py_ssize_t max_value, byte_view,
                too_large):
    """``(sizes, frames, counts)`` of a PUT over TCP straight from ``values`` (one per
    key in ``bkeys``, lengths checked by the caller), as ``_Session._values`` followed by
    :func:`pack` would make them, without a view per bytes value: the same checks, in
    the same order (every value viewed first, then the sizes), the same errors."""
    cdef Py_ssize_t n = len(bkeys), i, j, nb, bad = -1, start, acc, pos
    cdef list srcs = PyList_New(n)
    cdef list sizes = PyList_New(n)
    cdef list frames = [], counts = []
    cdef object v, m, sz, joined
    cdef char *dst
    cdef Py_buffer *b
    if type(values) is not list and type(values) is not tuple:
        values = list(values)
    for i in range(n):
        if i >= len(values):    # byte_view ran caller code (a tensor's methods) that
            _shrunk(n, values)  # shrank the list: values[i] would read past its end
        v = values[i]
        if type(v) is bytes:
            m = v
            nb = PyBytes_GET_SIZE(v)
        else:
            m = _view(v)
            if m is None:
                m = byte_view(v, what=f"value for key {bkeys[i]!r}")
            nb = PyMemoryView_GET_BUFFER(m).len
        if bad < 0 and (nb > capacity or (max_value and nb > max_value)):
            bad = i
        Py_INCREF(m)
        PyList_SET_ITEM(srcs, i, m)
        sz = nb
        Py_INCREF(sz)
        PyList_SET_ITEM(sizes, i, sz)
    if bad >= 0:
        nb = sizes[bad]
        raise too_large(f"value for key {bkeys[bad]!r} is {nb} bytes; the server "
                        f"takes at most {max_value or capacity}")
    i = 0
    while i < n:
        nb = sizes[i]
        if nb >= _PACK_BELOW:
            v = srcs[i]
            frames.append(v if type(v) is memoryview else PyMemoryView_FromObject(v))
            counts.append(1)
            i += 1
            continue
        start = i
        acc = nb
        i += 1
        while i < n:
            nb = sizes[i]
            if nb >= _PACK_BELOW or acc + nb > _PACK_FRAME_BYTES:
                break
            acc += nb
            i += 1
        joined = PyBytes_FromStringAndSize(NULL, acc)
        dst = PyBytes_AS_STRING(joined)
        pos = 0
        for j in range(start, i):
            v = srcs[j]
            if type(v) is bytes:
                nb = PyBytes_GET_SIZE(v)
                memcpy(dst + pos, PyBytes_AS_STRING(v), nb)
            else:
                b = PyMemoryView_GET_BUFFER(v)
                nb = b.len
                memcpy(dst + pos, b.buf, nb)
            pos += nb
        frames.append(joined)
        counts.append(i - start)
    return sizes, frames, counts


from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE,
                             PyBUF_C_CONTIGUOUS, PyBUF_SIMPLE)


cdef int _try_buffer(object o, Py_buffer *pb):
    try:
        PyObject_GetBuffer(o, pb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
    except (TypeError, ValueError, BufferError):
        return -1
    return 0


def check_outs(list bkeys, outs, byte_view):
    """Raise what ``byte_view(o, writable=True, what=...)`` raises for the first output
    buffer it refuses; makes no view of the plain ones (writable, C-contiguous
    buffers)."""
    cdef Py_ssize_t n = len(bkeys), i, nb
    cdef Py_buffer pb
    cdef object o
    for i in range(n):
        if i >= len(outs):
            _shrunk(n, outs)
        o = outs[i]
        if _try_buffer(o, &pb) == 0:
            nb = pb.len
            PyBuffer_Release(&pb)
            if nb:
                continue
            # empty: byte_view refuses some (a shape with a 0 and more than one dim:
            # memoryview.cast raises), so it decides
        byte_view(o, writable=True, what=f"output for key {bkeys[i]!r}")


def fill_outs(frames, counts, list sizes, outs):
    """The values of a GET reply copied straight into ``outs`` (writable C-contiguous
    buffers, no view made): True, or False when anything is unusual (as :func:`fill`,
    or an output that is not such a buffer): the caller then does it in Python, and
    raises as always. May have copied some values when it returns False."""
    cdef Py_ssize_t nf = len(frames), ns = len(sizes), fi, i, c, pos, n, k
    cdef object buf
    cdef Py_buffer pb
    cdef const char *src = NULL
    if len(outs) != ns or not _reply_layout_ok(frames, counts, sizes, nf, ns):
        return False
    fi = 0
    c = 0
    for k in range(ns):
        n = sizes[k]
        if n < 0:
            continue
        while c == 0:
            buf = _frame_view(frames[fi])
            src = <const char *>PyMemoryView_GET_BUFFER(buf).buf
            c = counts[fi]
            fi += 1
        if _try_buffer(outs[k], &pb) < 0:
            return False
        if pb.len < n:
            PyBuffer_Release(&pb)
            return False
        memcpy(pb.buf, src, n)
        PyBuffer_Release(&pb)
        src += n
        c -= 1
    return True


# ---------------------------------------------------------------- request headers in C

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL
    const char* PyUnicode_AsUTF8AndSize_nx "PyUnicode_AsUTF8AndSize"(object s,
                                                                     Py_ssize_t* size)
    long long PyLong_AsLongLongAndOverflow(object v, int* overflow)

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t


cdef struct _Out:
    char* p
    Py_ssize_t n
    Py_ssize_t cap


cdef inline void _be16(char* d, uint16_t v) noexcept:
    d[0] = <char>(v >> 8)
    d[1] = <char>v


cdef inline void _be32(char* d, uint32_t v) noexcept:
    d[0] = <char>(v >> 24)
    d[1] = <char>(v >> 16)
    d[2] = <char>(v >> 8)
    d[3] = <char>v


cdef inline void _be64(char* d, uint64_t v) noexcept:
    _be32(d, <uint32_t>(v >> 32))
    _be32(d + 4, <uint32_t>v)


cdef inline Py_ssize_t _int_len(long long v) noexcept:
    if 0 <= v < 128 or -32 <= v < 0:
        return 1
    if 0 <= v < 256 or -128 <= v < 0:
        return 2
    if 0 <= v < 65536 or -32768 <= v < 0:
        return 3
    if 0 <= v <= <long long>0xFFFFFFFF or <long long>-2147483648 <= v < 0:
        return 5
    return 9


cdef inline Py_ssize_t _put_int(char* d, long long v) noexcept:
    # msgpack's smallest form of v, as msgpack-python's Packer writes it
    if v >= 0:
        if v < 128:
            d[0] = <char>v
            return 1
        if v < 256:
            d[0] = <char>0xcc
            d[1] = <char>v
            return 2
        if v < 65536:
            d[0] = <char>0xcd
            _be16(d + 1, <uint16_t>v)
            return 3
        if v <= 0xFFFFFFFF:
            d[0] = <char>0xce
            _be32(d + 1, <uint32_t>v)
            return 5
        d[0] = <char>0xcf
        _be64(d + 1, <uint64_t>v)
        return 9
    if v >= -32:
        d[0] = <char>(v & 0xff)
        return 1
    if v >= -128:
        d[0] = <char>0xd0
        d[1] = <char>(v & 0xff)
        return 2
    if v >= -32768:
        d[0] = <char>0xd1
        _be16(d + 1, <uint16_t>(v & 0xffff))
        return 3
    if v >= -2147483648:
        d[0] = <char>0xd2
        _be32(d + 1, <uint32_t>(v & 0xffffffff))
        return 5
    d[0] = <char>0xd3
    _be64(d + 1, <uint64_t>v)
    return 9


cdef inline Py_ssize_t _head_len(Py_ssize_t n, int small, int fix) noexcept:
    # an array, map, str or bin header of n items/bytes (fix: items in the fix form)
    if n < fix:
        return 1
    if n < small:
        return 2
    if n < 65536:
        return 3
    return 5


cdef Py_ssize_t _put_head(char* d, Py_ssize_t n, int kind) noexcept:
    # kind 0: array, 1: map, 2: str, 3: bin
    if kind == 0:
        if n < 16:
            d[0] = <char>(0x90 | n)
            return 1
        if n < 65536:
            d[0] = <char>0xdc
            _be16(d + 1, <uint16_t>n)
            return 3
        d[0] = <char>0xdd
        _be32(d + 1, <uint32_t>n)
        return 5
    if kind == 1:
        if n < 16:
            d[0] = <char>(0x80 | n)
            return 1
        if n < 65536:
            d[0] = <char>0xde
            _be16(d + 1, <uint16_t>n)
            return 3
        d[0] = <char>0xdf
        _be32(d + 1, <uint32_t>n)
        return 5
    if kind == 2:
        if n < 32:
            d[0] = <char>(0xa0 | n)
            return 1
        if n < 256:
            d[0] = <char>0xd9
            d[1] = <char>n
            return 2
        if n < 65536:
            d[0] = <char>0xda
            _be16(d + 1, <uint16_t>n)
            return 3
        d[0] = <char>0xdb
        _be32(d + 1, <uint32_t>n)
        return 5
    if n < 256:
        d[0] = <char>0xc4
        d[1] = <char>n
        return 2
    if n < 65536:
        d[0] = <char>0xc5
        _be16(d + 1, <uint16_t>n)
        return 3
    d[0] = <char>0xc6
    _be32(d + 1, <uint32_t>n)
    return 5


cdef Py_ssize_t _scalar_len(object v) except -2:
    # bytes of v packed, or -1 when this packer does not take it
    cdef Py_ssize_t n
    cdef long long x
    cdef int ovf = 0
    if v is None or v is True or v is False:
        return 1
    if type(v) is bytes:
        n = PyBytes_GET_SIZE(v)
        if n > 0xFFFFFFFF:
            return -1
        return _head_len(n, 256, 0) + n
    if type(v) is int:
        x = PyLong_AsLongLongAndOverflow(v, &ovf)
        if ovf:
            return -1           # past 64 bits (or uint64 past int64): msgpack's job
        return _int_len(x)
    if type(v) is str:
        try:
            PyUnicode_AsUTF8AndSize(v, &n)
        except UnicodeError:
            return -1           # (a lone surrogate) msgpack raises its own error
        if n > 0xFFFFFFFF:
            return -1
        return _head_len(n, 256, 32) + n
    return -1


cdef Py_ssize_t _put_scalar(char* d, object v) noexcept:
    # (v as _scalar_len took it)
    cdef Py_ssize_t n, h
    cdef int ovf = 0
    cdef const char* s
    if v is None:
        d[0] = <char>0xc0
        return 1
    if v is True:
        d[0] = <char>0xc3
        return 1
    if v is False:
        d[0] = <char>0xc2
        return 1
    if type(v) is bytes:
        n = PyBytes_GET_SIZE(v)
        h = _put_head(d, n, 3)
        memcpy(d + h, PyBytes_AS_STRING(v), n)
        return h + n
    if type(v) is int:
        return _put_int(d, PyLong_AsLongLongAndOverflow(v, &ovf))
    s = PyUnicode_AsUTF8AndSize_nx(v, &n)      # (cached by _scalar_len)
    h = _put_head(d, n, 2)
    memcpy(d + h, s, n)
    return h + n


def pack_request(version, op, req_id, epoch, body):
    """The header frame of a request, ``msgpack.packb([version, op, req_id, epoch, body],
    use_bin_type=True)`` byte for byte, in two C passes (sizes, then bytes), or None
    when ``body`` is not of the plain shape this packer takes (then the caller packs it
    with msgpack): a dict of str keys whose values are None, bool, int (64-bit), bytes,
    str, or lists of those; nothing else (no tuple, float, nested dict or list, no int
    or bytes subclass). Used for batch PUT and ALLOC (:mod:`kvshm.zmq_ctrl.protocol`;
    ``KVSHM_FAST_PACK=0`` turns it off)."""
    cdef Py_ssize_t total, m, i, n, k
    cdef list lst
    cdef object key, v, out
    cdef char* d
    cdef long long c_version, c_op, c_req_id, c_epoch
    if type(body) is not dict:
        return None
    # the four head fields: exact ints of 64 bits signed, else msgpack packs them (a bool,
    # a float, None, an int subclass, an int of 2**63 .. 2**64 - 1 as msgpack's uint64)
    for v in (version, op, req_id, epoch):
        if type(v) is not int or not (-0x8000000000000000 <= v <= 0x7FFFFFFFFFFFFFFF):
            return None
    c_version, c_op, c_req_id, c_epoch = version, op, req_id, epoch
    total = 1 + _int_len(c_version) + _int_len(c_op) + _int_len(c_req_id) + _int_len(c_epoch)
    total += _head_len(len(body), 16, 16)
    for key, v in (<dict>body).items():
        if type(key) is not str:
            return None
        m = _scalar_len(key)
        if m < 0:
            return None
        total += m
        if type(v) is list:
            lst = <list>v
            n = len(lst)
            if n > 0xFFFFFFFF:
                return None
            total += _head_len(n, 16, 16)
            for i in range(n):
                m = _scalar_len(lst[i])
                if m < 0:
                    return None
                total += m
        else:
            m = _scalar_len(v)
            if m < 0:
                return None
            total += m
    out = PyBytes_FromStringAndSize(NULL, total)
    d = PyBytes_AS_STRING(out)
    k = 0
    d[0] = <char>0x95
    k = 1
    k += _put_int(d + k, c_version)
    k += _put_int(d + k, c_op)
    k += _put_int(d + k, c_req_id)
    k += _put_int(d + k, c_epoch)
    k += _put_head(d + k, len(body), 1)
    for key, v in (<dict>body).items():
        k += _put_scalar(d + k, key)
        if type(v) is list:
            lst = <list>v
            n = len(lst)
            k += _put_head(d + k, n, 0)
            for i in range(n):
                k += _put_scalar(d + k, lst[i])
        else:
            k += _put_scalar(d + k, v)
    if k != total:              # the body changed between the passes (another thread)
        return None
    return out


def scan_plain(buf, Py_ssize_t pos, Py_ssize_t k):
    """Where the ``k`` msgpack items from byte ``pos`` of ``buf`` end, when every one is a
    bin (8/16/32), an int, nil or a bool and lies inside ``buf``; -1 otherwise (anything
    else, or a truncated item: the caller decodes item by item and raises as always).
    Lets a request's long arrays of keys and sizes be decoded in one ``msgpack.unpackb``
    (:class:`kvshm.zmq_ctrl.protocol.RequestDecoder`)."""
    cdef Py_buffer b
    cdef const unsigned char* p
    cdef Py_ssize_t n, i, end = -1
    cdef unsigned char c
    cdef uint64_t ln
    PyObject_GetBuffer(buf, &b, PyBUF_SIMPLE)
    try:
        p = <const unsigned char*>b.buf
        n = b.len
        if pos < 0 or pos > n or k < 0:
            return -1
        for i in range(k):
            if pos >= n:
                return -1
            c = p[pos]
            if c < 0x80 or c >= 0xe0 or c == 0xc0 or c == 0xc2 or c == 0xc3:
                pos += 1
            elif c == 0xcc or c == 0xd0:
                pos += 2
            elif c == 0xcd or c == 0xd1:
                pos += 3
            elif c == 0xce or c == 0xd2:
                pos += 5
            elif c == 0xcf or c == 0xd3:
                pos += 9
            elif c == 0xc4:
                if n - pos < 2:
                    return -1
                pos += 2 + p[pos + 1]
            elif c == 0xc5:
                if n - pos < 3:
                    return -1
                pos += 3 + ((<Py_ssize_t>p[pos + 1] << 8) | p[pos + 2])
            elif c == 0xc6:
                if n - pos < 5:
                    return -1
                ln = ((<uint64_t>p[pos + 1] << 24) | (<uint64_t>p[pos + 2] << 16) |
                      (<uint64_t>p[pos + 3] << 8) | p[pos + 4])
                if ln > <uint64_t>(n - pos - 5):
                    return -1
                pos += 5 + <Py_ssize_t>ln
            else:
                return -1
            if pos > n:
                return -1
        end = pos
    finally:
        PyBuffer_Release(&b)
    return end


def pack_fixints(list v, Py_ssize_t a, Py_ssize_t b):
    """``msgpack.packb(v[a:b])`` without its array header, when every item is an int
    0 .. 127 (a positive fixint: one byte each, the byte msgpack writes; an int subclass
    such as an IntEnum member, as msgpack packs it, by its value; a bool is not one);
    else None (the caller packs with msgpack). ``0 <= a <= b <= len(v)``, else None. A
    reply's per-key statuses (:class:`kvshm.zmq_ctrl.protocol.ReplyEncoder`; the store's
    :class:`~kvshm.store.Outcome` members are such a subclass)."""
    cdef Py_ssize_t i
    cdef long x
    cdef int ovf = 0
    cdef object it
    cdef char* p
    if a < 0 or b < a or b > len(v):
        return None
    out = PyBytes_FromStringAndSize(NULL, b - a)
    p = PyBytes_AS_STRING(out)
    for i in range(a, b):
        it = <object>PyList_GET_ITEM(v, i)
        if type(it) is not int and (type(it) is bool or not isinstance(it, int)):
            return None
        x = PyLong_AsLongAndOverflow(it, &ovf)
        if ovf or x < 0 or x > 127:
            return None
        p[i - a] = <char>x
    return out


cdef extern from "Python.h":
    PyObject* Py_True
    PyObject* Py_False
    ctypedef struct PyListObject:
        PyObject** ob_item


def all_bools(list v):
    """Whether every item of ``v`` is ``True`` or ``False`` (the bool objects; an int,
    None or a str is not one): an EXISTS / PIN reply's ``found`` list, checked in one C
    loop of pointer compares, no reference taken (:func:`kvshm.replies.found_of`)."""
    cdef Py_ssize_t i, n = len(v)
    cdef PyObject** items = (<PyListObject*>v).ob_item
    cdef PyObject* t = Py_True
    cdef PyObject* f = Py_False
    cdef PyObject* it
    for i in range(n):
        it = items[i]
        if it != t and it != f:
            return False
    return True


# ------------------------------------------------ a GET / LOOKUP reply's sizes and places

cdef inline bint _int_in(object o, long long lo, long long hi):
    """``o`` is an int (not a bool, not a subclass) in [lo, hi]."""
    cdef int ovf = 0
    cdef long long v
    if type(o) is not int:
        return False
    v = PyLong_AsLongLongAndOverflow(o, &ovf)
    return not ovf and lo <= v <= hi


def sizes_ok(list sizes, Py_ssize_t n, long long most):
    """Whether ``sizes`` (a GET or LOOKUP reply's) is ``n`` ints (bools and subclasses
    refused), each -2 (refused), -1 (a miss) or a size in [0, ``most``] bytes: one C
    loop (:func:`kvshm.replies.sizes_of`)."""
    cdef object s
    if len(sizes) != n:
        return False
    for s in sizes:
        if not _int_in(s, -2, most):
            return False
    return True


def places_ok(list offsets, list sizes, long long capacity):
    """Whether each hit of a LOOKUP reply (``sizes[i]`` >= 0; ``sizes`` passed
    :func:`sizes_ok`) lies in a pool of ``capacity`` bytes: ``offsets[i]`` an int with
    ``0 <= offsets[i] <= capacity - sizes[i]``, or byte extents ``[[offset, length],
    ...]`` (lists or tuples of two ints), each inside the pool, their lengths adding up
    to at least ``sizes[i]``. ``offsets`` as long as ``sizes``. Misses' places are not
    looked at (:func:`kvshm.replies.places_of`)."""
    cdef Py_ssize_t i, n = len(sizes)
    cdef long long sz, total, off, ln
    cdef int ovf = 0
    cdef object o, x
    if len(offsets) != n:
        return False
    for i in range(n):
        sz = PyLong_AsLongLongAndOverflow(sizes[i], &ovf)
        if sz < 0:
            continue
        o = offsets[i]
        if type(o) is int:
            if not _int_in(o, 0, capacity - sz):
                return False
            continue
        if (type(o) is not list and type(o) is not tuple) or len(o) == 0:
            return False
        total = 0
        for x in o:
            if (type(x) is not list and type(x) is not tuple) or len(x) != 2 or \
                    not _int_in(x[0], 0, capacity) or not _int_in(x[1], 0, capacity):
                return False
            off = PyLong_AsLongLongAndOverflow(x[0], &ovf)
            ln = PyLong_AsLongLongAndOverflow(x[1], &ovf)
            if off > capacity - ln:
                return False
            total += ln
            if total > capacity:
                return False
        if total < sz:
            return False
    return True
