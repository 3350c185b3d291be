# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The key index and the store's per-key loops in C (kvshm.index re-exports them).

:class:`Entry` is one value (C fields; a value in one run keeps no extents tuple, its
``extents`` are made from ``start`` and ``nblocks`` when read). :class:`Index` maps key ->
entry in LRU order (a dict, and a list threaded through the entries) and publishes into the shared table. The module functions are the store's hot loops (PUT's
install, LOOKUP's and GET's pins, unpins, the allocation of a batch's entries), each doing
for every key exactly what the Python methods of :mod:`kvshm.store` they replace did, in
the same order (exact LRU, the shared index's publish order, pins and accounting), with the
store's counters summed once per batch. Paths with a tier below call the store's Python
methods for what a tier adds (``_touch``, ``_tier_leave``, ``discard_key``).
"""

cimport cython
from cpython.dict cimport PyDict_Contains, PyDict_GetItem, PyDict_SetDefault
from cpython.ref cimport PyObject
from cpython cimport array
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.object cimport PyObject_Hash

import array as _array
import os as _os

from types import MappingProxyType

cdef extern from *:
    """
    /* A prefetch of the dict index slot a key's lookup reads first (the one random
       cache line of a lookup in a large dict), a hint only: the loads are the dict's
       public ma_keys and the first bytes of its keys object (in every CPython at least
       this large); a layout other than 3.11-3.13's only makes the hint point elsewhere
       (a prefetch never faults). None on a free-threaded build. */
    #if PY_VERSION_HEX >= 0x030B0000 && !defined(Py_GIL_DISABLED)
    typedef struct {
        Py_ssize_t dk_refcnt;
        uint8_t dk_log2_size;
        uint8_t dk_log2_index_bytes;
        uint8_t dk_kind;
        uint32_t dk_version;
        Py_ssize_t dk_usable;
        Py_ssize_t dk_nentries;
        char dk_indices[];
    } kvi_dictkeys_head;        /* CPython 3.11-3.13's _dictkeysobject (pycore_dict.h) */
    static inline void kvi_dict_prefetch(PyObject *d, Py_hash_t h) {
        const kvi_dictkeys_head *k = (const kvi_dictkeys_head *)((PyDictObject *)d)->ma_keys;
        unsigned ls = k->dk_log2_size & 63, li = k->dk_log2_index_bytes & 63;
        size_t mask = ((size_t)1 << ls) - 1;
        __builtin_prefetch(k->dk_indices + (((size_t)h & mask) << ((li - ls) & 7)), 0, 3);
    }
    /* The next steps of the same lookup, each a few keys after the one before (the
       line it reads prefetched by then): the entry the key's home index slot names
       (kvi_dict_prefetch_entry), then that entry's key and value objects
       (kvi_dict_prefetch_objs: the bytes compared, the old Entry unlinked). Each reads
       only the dict's current keys object (the index slot masked to its size, the
       entry index checked against dk_nentries), never one kept from an earlier step (a
       resize between steps frees it); a general table (kind 0: 24-byte entries of hash,
       key, value) only. A probe past the home slot only makes the hint point elsewhere. */
    typedef struct { Py_hash_t me_hash; PyObject *me_key; PyObject *me_value; } kvi_entry;
    static inline const kvi_entry *kvi_dict_home_entry(PyObject *d, Py_hash_t h) {
        const kvi_dictkeys_head *k = (const kvi_dictkeys_head *)((PyDictObject *)d)->ma_keys;
        unsigned ls = k->dk_log2_size & 63, li = k->dk_log2_index_bytes & 63, w;
        size_t mask = ((size_t)1 << ls) - 1, i = (size_t)h & mask;
        Py_ssize_t ix;
        if (k->dk_kind != 0 || li < ls || li - ls > 3)
            return NULL;
        w = li - ls;
        if (w == 0) ix = ((const int8_t *)k->dk_indices)[i];
        else if (w == 1) ix = ((const int16_t *)k->dk_indices)[i];
        else if (w == 2) ix = ((const int32_t *)k->dk_indices)[i];
        else ix = ((const int64_t *)k->dk_indices)[i];
        if (ix < 0 || ix >= k->dk_nentries)
            return NULL;
        return (const kvi_entry *)(k->dk_indices + ((size_t)1 << li)) + ix;
    }
    static inline void kvi_dict_prefetch_entry(PyObject *d, Py_hash_t h) {
        const kvi_entry *e = kvi_dict_home_entry(d, h);
        if (e != NULL)
            __builtin_prefetch(e, 0, 3);
    }
    static inline void kvi_dict_prefetch_objs(PyObject *d, Py_hash_t h) {
        const kvi_entry *e = kvi_dict_home_entry(d, h);
        if (e != NULL && e->me_hash == h && e->me_key != NULL) {
            __builtin_prefetch(e->me_key, 0, 3);
            __builtin_prefetch(e->me_value, 1, 3);
        }
    }
    static inline PyObject *kvi_dict_home_value(PyObject *d, Py_hash_t h) {
        const kvi_entry *e = kvi_dict_home_entry(d, h);
        return (e != NULL && e->me_hash == h) ? e->me_value : NULL;
    }
    static inline void kvi_prefetch_w(const void *p) { if (p) __builtin_prefetch(p, 1, 3); }
    #define KVI_DICT_PREFETCH 1
    #else
    static inline PyObject *kvi_dict_home_value(PyObject *d, Py_hash_t h) { (void)d; (void)h; return NULL; }
    static inline void kvi_prefetch_w(const void *p) { (void)p; }
    static inline void kvi_dict_prefetch(PyObject *d, Py_hash_t h) { (void)d; (void)h; }
    static inline void kvi_dict_prefetch_entry(PyObject *d, Py_hash_t h) { (void)d; (void)h; }
    static inline void kvi_dict_prefetch_objs(PyObject *d, Py_hash_t h) { (void)d; (void)h; }
    #define KVI_DICT_PREFETCH 0
    #endif
    """
    void kvi_dict_prefetch(object d, Py_hash_t h)
    void kvi_dict_prefetch_entry(object d, Py_hash_t h)
    void kvi_dict_prefetch_objs(object d, Py_hash_t h)
    PyObject* kvi_dict_home_value(object d, Py_hash_t h)
    void kvi_prefetch_w(const void* p)
    int KVI_DICT_PREFETCH

cdef array.array _Q = _array.array("q")

#: :func:`put_packed` prefetches, ``_DICT_AHEAD`` keys ahead, the dict slot of each key
#: it installs (each key's hash computed there, then cached in the bytes object); the
#: environment variable ``KVSHM_PUT_PREFETCH=0`` (read at import) turns that off, for A/B
#: figures. Only where the dict's layout is known (CPython >= 3.11, not free-threaded).
PUT_PREFETCH = bool(KVI_DICT_PREFETCH) and _os.environ.get("KVSHM_PUT_PREFETCH", "1") != "0"
#: With :data:`PUT_PREFETCH`, :func:`put_packed` also prefetches the next steps of each
#: key's dict lookup: ``_DICT_AHEAD2`` keys ahead the entry its home index slot names,
#: ``_DICT_AHEAD3`` ahead that entry's key and value (the old key compared, the old
#: Entry unlinked), ``_DICT_AHEAD4`` ahead the old Entry's neighbours in the LRU list
#: (written by its unlink). ``KVSHM_PUT_PREFETCH_DEEP=0`` (read at import): the first
#: step only, as before. Helps an overwrite in an order other than the keys' last one
#: (each old Entry and its neighbours a random miss).
PUT_PREFETCH_DEEP = PUT_PREFETCH and _os.environ.get("KVSHM_PUT_PREFETCH_DEEP", "1") != "0"
DEF _DICT_AHEAD = 16
DEF _DICT_AHEAD2 = 10
DEF _DICT_AHEAD3 = 4
DEF _DICT_AHEAD4 = 2
cdef object _U64_MAX = 0xFFFFFFFFFFFFFFFF

__all__ = ["Entry", "Index", "PENDING", "LIVE", "DEAD", "MAX_EXTENTS"]

#: Allocated, bytes being written, invisible to readers.
PENDING = 0
#: Committed and visible.
LIVE = 1
#: Replaced or deleted while pinned: invisible, blocks freed when the last pin goes.
DEAD = 2

#: Most block runs one value may be laid over (``Entry.extents``).
MAX_EXTENTS = 8

cdef enum:
    C_PENDING = 0
    C_LIVE = 1
    C_DEAD = 2


cdef class Entry


#: pins one entry may hold (Entry.pins is a C int: the C loops must not wrap it)
cdef int _MAX_PINS = 2147483647


@cython.no_gc
@cython.final
cdef class _More:
    # what few entries have, off the Entry (see Entry._x): their checksum, a tier's meta,
    # and runs other than one run of the whole value (None: that one run)
    cdef object checksum
    cdef object meta
    cdef object ext


cdef inline object _ext_of(Entry e):
    # the runs as kept: None (one run: start, nblocks), () once freed, else a tuple
    if e._freed:
        return ()
    x = e._x
    if x is not None and type(x) is _More:
        return (<_More>x).ext
    return None


cdef inline bint _alone(object v) noexcept:
    # v may be kept in _x alone, as a meta (not None, not an int: those are checksums)
    return v is not None and type(v) is not int and type(v) is not _More


cdef inline _More _more(Entry e):
    # e's side object, made (holding the checksum or the meta kept in _x) if it has none
    cdef _More m
    x = e._x
    if x is not None and type(x) is _More:
        return <_More>x
    m = _More.__new__(_More)
    if type(x) is int:
        m.checksum = x
    elif x is not None:
        m.meta = x
    e._x = m
    return m


cdef inline void _less(Entry e, _More m) noexcept:
    # back to the checksum alone, or the meta alone, in _x when that is all there is
    if m.ext is not None:
        return
    c = m.checksum
    v = m.meta
    if v is None:
        if c is None or type(c) is int:
            e._x = c
    elif c is None and _alone(v):
        e._x = v


cdef inline void _set_ext(Entry e, object ext) except *:
    # ext: None (one run: start, nblocks), () (freed), or a tuple of runs
    cdef _More m
    if ext is not None and len(ext) == 0:
        e._freed = True
        ext = None
    else:
        e._freed = False
    x = e._x
    if x is not None and type(x) is _More:
        m = <_More>x
        m.ext = ext
        if ext is None:
            _less(e, m)
    elif ext is not None:
        _more(e).ext = ext


cdef inline object _csum(Entry e):
    x = e._x
    if x is None or type(x) is int:
        return x
    if type(x) is _More:
        return (<_More>x).checksum
    return None                 # (a meta alone)


cdef inline void _set_csum(Entry e, object c) except *:
    cdef _More m
    x = e._x
    if x is not None and type(x) is _More:
        m = <_More>x
        m.checksum = c
        _less(e, m)
    elif x is None or type(x) is int:
        if c is None or type(c) is int:
            e._x = c
        else:
            _more(e).checksum = c
    elif c is not None:          # beside a meta alone
        _more(e).checksum = c


cdef inline object _meta(Entry e):
    x = e._x
    if x is None or type(x) is int:
        return None
    if type(x) is _More:
        return (<_More>x).meta
    return x


cdef inline void _set_meta(Entry e, object v) except *:
    cdef _More m
    x = e._x
    if x is not None and type(x) is _More:
        m = <_More>x
        m.meta = v
        _less(e, m)
    elif x is None or _alone(x):     # nothing, or a meta alone
        if v is None or _alone(v):
            e._x = v
        else:
            e._x = None
            _more(e).meta = v
    elif v is not None:              # beside a checksum alone
        _more(e).meta = v


cdef inline int _nruns(Entry e):
    x = e._x
    if x is None or type(x) is not _More:
        return 0 if e._freed else 1
    ext = _ext_of(e)
    return 1 if ext is None else len(ext)


# Not tracked by the cyclic collector: a store holds millions of entries, and the young
# collections a batch's new ones set off cost more than the rest of the batch. Only
# ``meta`` can close a cycle (a tier's record of the entry pointing back at it, as
# kvshm.tiers.ssd's ``owner``): the tier breaks it when its record goes.
@cython.no_gc
cdef class Entry:
    """One value: ``nblocks`` blocks in one or more runs (``extents``).

    Attributes
    ----------
    key : bytes
    extents : tuple of (int, int)
        ``(first block, block count)`` of each run, in the order the value's bytes are
        laid (a run's byte offset in the pool is ``first * block_size``); one run in
        the common case, at most :data:`MAX_EXTENTS`; ``()`` once freed.
    start : int
        First block of the first run (-1 once freed).
    nblocks : int
        Blocks held in all, ``max(1, ceil(size / block_size))``.
    size : int
        Value length in bytes.
    pins : int
        Readers holding the entry; a pinned entry is never evicted or reused.
    state : int
        PENDING, LIVE or DEAD.
    checksum : int or None
        xxh64 of the value when the writer asked for end-to-end checksums.
    meta : object
        Opaque per-entry data of a tier (e.g. SSD location).
    """

    # 80 bytes with the object's header (a multiple of 16: what the allocator gives):
    # what every entry needs in C fields, the rest (a checksum, a tier's meta, runs other
    # than one) in _x; was 96 with checksum, meta and the runs each a field of their own
    cdef public object key
    cdef public long long start
    cdef public long long size
    cdef public int nblocks         # (the shared table holds 32-bit block counts)
    cdef public int pins
    cdef public int state
    # in an index's LRU list (there at most once, in one index: a second link would
    # corrupt both lists); in the struct's padding after ``state``
    cdef char _linked
    # freed: its runs are () (and start -1); also in the padding
    cdef char _freed
    # None: no checksum, no meta, one run (start, nblocks); an int: the checksum,
    # nothing else; a _More: the checksum, meta and the runs; any other object: the
    # meta, nothing else (a tier's record of the entry)
    cdef object _x
    # the index's LRU list (borrowed: set only while the index's dict holds the entry)
    cdef PyObject* _prev
    cdef PyObject* _next

    def __init__(self, key, long long start, int nblocks, long long size,
                 checksum=None, extents=None):
        if self._linked:
            raise ValueError(f"{self!r} is in an index: not made again")
        self.key = key
        self.start = start
        self.nblocks = nblocks
        self.size = size
        self.pins = 0
        self.state = C_PENDING
        self._x = None
        self._freed = False
        _set_csum(self, checksum)
        self._prev = NULL
        self._next = NULL
        self._linked = False
        if extents is not None:
            if len(extents) == 1 and extents[0][0] == start and extents[0][1] == nblocks:
                pass            # one run: kept as start and nblocks
            else:
                _set_ext(self, tuple(extents))

    @property
    def checksum(self):
        """xxh64 of the value (int) or None."""
        return _csum(self)

    @checksum.setter
    def checksum(self, value):
        _set_csum(self, value)

    @property
    def meta(self):
        """A tier's opaque per-entry data, or None."""
        return _meta(self)

    @meta.setter
    def meta(self, value):
        _set_meta(self, value)

    @property
    def extents(self):
        ext = _ext_of(self)
        if ext is None:
            return ((self.start, self.nblocks),)
        return ext

    @property
    def nruns(self):
        """``len(extents)``, without making the tuple (1 for a value in one run)."""
        return _nruns(self)

    @extents.setter
    def extents(self, value):
        if len(value) == 1:
            r = value[0]
            if r[1] == self.nblocks:
                # one run of the whole value: kept as start (the callers set start to
                # the same right after, as they always have)
                self.start = r[0]
                _set_ext(self, None)
                return
        _set_ext(self, tuple(value))

    def __repr__(self):
        state = ("pending", "live", "dead")[self.state]
        runs = ",".join(f"{s}+{n}" for s, n in self.extents) or "-"
        return (f"<Entry {self.key!r} blocks={runs} size={self.size} "
                f"pins={self.pins} {state}>")

    def byte_extents(self, long long block_size):
        """``[[offset, length], ...]`` in the pool, covering exactly ``size`` bytes (the
        last run's tail past the value is left out; a value of 0 bytes: one [offset, 0])."""
        cdef long long left, k, s, n
        ext = _ext_of(self)
        if ext is None:
            return [[self.start * block_size, self.size]]
        out = []
        left = self.size
        for s, n in ext:
            k = n * block_size
            if left < k:
                k = left
            out.append([s * block_size, k])
            left -= k
        return out


cdef inline Entry _entry(object x):
    if not isinstance(x, Entry):
        raise TypeError(f"an Entry, not {type(x).__name__}")
    return <Entry>x


cdef inline tuple _runs(Entry e):
    # what the shared table is given (a freed entry: its last start, as before)
    ext = _ext_of(e)
    if ext is None or len(ext) == 0:
        return ((e.start, e.nblocks),)
    return ext


cdef inline object _place(Entry e, long long bs):
    if _nruns(e) == 1:
        return e.start * bs
    return e.byte_extents(bs)


cdef class Index:
    """Committed entries by key, least recently used first.

    The index is the only structure that knows which keys are visible. With a shared table
    attached (:meth:`attach_shared`, a :class:`kvshm._shmindex.IndexWriter`), every entry
    that becomes live is published there for same-host readers, and every entry that
    leaves is unpublished before the call returns, so before its blocks can be freed or
    reused (docs/DESIGN.md, "Same-host reads without a round trip"). The reads those
    readers record are applied (:meth:`sync`) before every LRU decision.

    A dict maps key -> entry; the LRU order is a list threaded through the entries
    themselves (``_prev``/``_next``, borrowed: an entry is linked exactly while the dict
    holds it), oldest at ``_head``.
    """

    cdef dict _d
    cdef object _view               # read-only view of _d (mapping)
    cdef PyObject* _head            # least recently used
    cdef PyObject* _tail            # most recently used
    cdef Py_ssize_t _version        # bumped on every change of order or membership
    cdef public object _shared
    #: Called with each entry a lock-free read touched (the store's tier order).
    cdef public object on_read

    def __init__(self):
        self._d = {}
        self._view = MappingProxyType(self._d)
        self._head = NULL
        self._tail = NULL
        self._version = 0
        self._shared = None
        self.on_read = None

    # ------------------------------------------------------------ the LRU list

    cdef inline void _unlink(self, Entry e) noexcept:
        if e._prev != NULL:
            (<Entry>e._prev)._next = e._next
        else:
            self._head = e._next
        if e._next != NULL:
            (<Entry>e._next)._prev = e._prev
        else:
            self._tail = e._prev
        e._prev = NULL
        e._next = NULL
        e._linked = False

    cdef inline void _link_tail(self, Entry e) noexcept:
        e._linked = True
        e._next = NULL
        e._prev = self._tail
        if self._tail != NULL:
            (<Entry>self._tail)._next = <PyObject*>e
        else:
            self._head = <PyObject*>e
        self._tail = <PyObject*>e

    cdef inline void _to_tail(self, Entry e) noexcept:
        # e is linked: make it the most recently used
        self._version += 1
        if self._tail == <PyObject*>e:
            return
        self._unlink(e)
        self._link_tail(e)

    # ------------------------------------------------------------ shared table

    def attach_shared(self, table):
        """Publish into ``table`` (a :class:`kvshm._shmindex.IndexWriter`) from now on;
        the entries live now are published at once."""
        cdef Entry e
        self._shared = table
        for e in list(_LruIter(self, False)):
            table.publish(e.key, e.size, _runs(e), _csum(e))

    def detach_shared(self):
        """Stop publishing (the server is closing the table)."""
        self._shared = None

    @property
    def shared(self):
        """The attached shared table, or None."""
        return self._shared

    cpdef sync(self):
        """Apply the lock-free reads recorded since the last call, in their global order
        (each makes its key most recently used, if its entry is still the one read).
        Called before every LRU decision and before the store's own LRU touches."""
        cdef PyObject* p
        cdef Entry e
        t = self._shared
        if t is not None:
            d = self._d
            on_read = self.on_read
            for k in t.drain():
                p = PyDict_GetItem(d, k)
                if p is not NULL:
                    e = <Entry>p
                    self._to_tail(e)
                    if on_read is not None:
                        on_read(e)

    def __len__(self):
        return len(self._d)

    def __contains__(self, key):
        return key in self._d

    def get(self, key):
        """The live entry of ``key`` or None; does not touch the LRU order."""
        return self._d.get(key)

    def touch(self, key):
        """Mark ``key`` most recently used (KeyError if it is not here)."""
        self._to_tail(<Entry>self._d[key])

    def insert(self, Entry entry not None):
        """Make ``entry`` the live, most recently used entry of its key.

        Returns the entry it replaced, if any (the caller retires it). The caller
        applies the lock-free reads recorded before the write first (:meth:`sync`, once
        per request, not per key): they happened before it, so they must not end up more
        recent than its keys (without that, a put into free blocks, which evicts
        nothing, left them to the next eviction: the store departed from exact LRU).
        """
        return self._insert(entry)

    cdef object _insert(self, Entry entry):
        old = self._insert_local(entry)
        if self._shared is not None:
            # in place of the old entry's slot: its readers notice before it is freed
            self._shared.publish(entry.key, entry.size, _runs(entry), _csum(entry))
        return old

    cdef object _insert_local(self, Entry entry):  # entry: not None
        # insert without the publish (the caller publishes, before retiring the old)
        cdef dict d = self._d
        cdef object key = entry.key
        cdef PyObject* p
        if type(key) is bytes and not entry._linked:
            # one dict lookup for a new key (setdefault inserts it), two for an old one
            # (found, then replaced): a batch of new keys no longer looks each up twice
            p = PyDict_SetDefault(d, key, entry)
            if p == <PyObject*>entry:
                self._link_tail(entry)
                self._version += 1
                return None
            old = <object>p
        elif type(key) is bytes:
            p = PyDict_GetItem(d, key)
            old = None if p is NULL else <object>p
        else:
            old = d.get(key)        # raises for an unhashable key, before any change
        if entry._linked and old is not entry:
            raise ValueError(f"{entry!r} is in an index already (under another key, or "
                             "in another index)")
        if old is not None and old is not entry and type(key) is bytes \
                and type((<Entry>old).key) is bytes:
            # the key object the dict holds (the first put's, kept by the dict on a
            # replace): one bytes object per key, not the dict's and the newest put's
            # (a request's key is dropped with the request), and the store below finds
            # it by identity, with no compare of the bytes
            key = (<Entry>old).key
            entry.key = key
        d[key] = entry
        if old is not None:
            self._unlink(<Entry>old)
        self._link_tail(entry)
        self._version += 1
        return old

    cpdef remove(self, key):
        e = self._d.pop(key, None)
        if e is not None:
            self._unlink(<Entry>e)
            self._version += 1
            if self._shared is not None:
                self._shared.unpublish(key)
        return e

    def relocate(self, Entry entry not None, extents):
        """Live ``entry`` now lies in ``extents`` (its bytes were copied there; the old
        blocks are freed after this returns). Keeps its LRU position. The one place a
        visible entry's location changes."""
        entry.extents = extents
        entry.start = extents[0][0]
        if self._shared is not None and self._d.get(entry.key) is entry:
            # reads of it recorded so far were of the old slot version: apply them now,
            # the ring would drop them once the version changes
            self.sync()
            # Re-published in place: the slot's version changes, so a lock-free reader
            # that copied from the old runs retries; the old blocks are freed only after.
            self._shared.publish(entry.key, entry.size, _runs(entry), _csum(entry))

    def lru(self):
        """Entries from least to most recently used (do not mutate while iterating:
        RuntimeError, as an OrderedDict's)."""
        self.sync()
        return _LruIter(self, False)

    def oldest_unpinned(self):
        """The least recently used entry without pins, or None.

        Pinned entries met at the old end are moved to the young end on the way (they
        are being read, and a reader that holds pins long must not make every eviction
        scan past them again): amortized O(1) per call, however many pins there are.
        """
        cdef Entry e
        cdef Py_ssize_t i
        self.sync()
        for i in range(len(self._d)):
            e = <Entry>self._head
            if e.pins == 0:
                return e
            self._to_tail(e)
        return None

    def keys(self):
        """Keys from least to most recently used."""
        return _LruIter(self, True)

    def clear(self):
        cdef Entry e
        entries = list(_LruIter(self, False))
        for e in entries:
            e._prev = NULL
            e._next = NULL
            e._linked = False
        self._head = NULL
        self._tail = NULL
        self._version += 1
        self._d.clear()
        if self._shared is not None:
            self._shared.clear()
        return entries

    @property
    def mapping(self):
        """A read-only view of key -> entry, for bulk membership tests (no order)."""
        return self._view


@cython.final
cdef class _LruIter:
    """Entries (or their keys) from the least recently used; RuntimeError after a change."""

    cdef Index _ix
    cdef object _cur                # the entry next() returns, or None
    cdef Py_ssize_t _version
    cdef bint _keys

    def __cinit__(self, Index ix, bint keys):
        self._ix = ix
        self._cur = None if ix._head == NULL else <object>ix._head
        self._version = ix._version
        self._keys = keys

    def __iter__(self):
        return self

    def __next__(self):
        cdef Entry e
        if self._ix._version != self._version:
            raise RuntimeError("the index changed during iteration")
        if self._cur is None:
            raise StopIteration
        e = <Entry>self._cur
        self._cur = None if e._next == NULL else <object>e._next
        return e.key if self._keys else e


# ---------------------------------------------------------------- the store's loops

cdef inline void _free_entry(object store, Entry e) except *:
    # Store._free, without the progress bump (the caller adds them up)
    if _nruns(e) == 1:
        store.alloc.free(e.start, e.nblocks)
    else:
        store.alloc.free_extents(_ext_of(e))
    e.state = C_DEAD
    e.start = -1
    _set_ext(e, ())


def free_entry(store, Entry e not None):
    """Store._free: give back ``e``'s blocks; it is DEAD, with no place, from now on."""
    _free_entry(store, e)
    store.progress += 1


#: :func:`install_entries` (COMMIT of an ALLOC grant, the general PUT) hands the shared
#: table a batch of values in one run each without checksums as C arrays
#: (``IndexWriter.publish_runs``), and the allocator the replaced values of one run each
#: in one ``free_runs`` call; ``KVSHM_INSTALL_RUNS=0`` (read at import), or False: as
#: lists (``publish_many``) and one ``alloc.free`` a value, as before. For A/B figures.
INSTALL_RUNS = _os.environ.get("KVSHM_INSTALL_RUNS", "1") != "0"


def install_entries(store, entries):
    """``store._install(e)`` for each entry, in order (PUT and COMMIT)."""
    cdef Entry e, old
    cdef Index index = store.index
    cdef Py_ssize_t freed = 0, i, n, nold, m
    cdef bint plain
    cdef array.array szs, sts, nbs
    cdef array.array fs = None
    cdef array.array fc = None
    cdef long long* psz = NULL
    cdef long long* pst = NULL
    cdef long long* pnb = NULL
    tier = store.tier
    if tier is not None:
        inst = store._install
        for x in entries:
            inst(x)
        return
    dead = store._dead
    shared = index._shared
    if shared is not None and len(entries) > 1:
        # the same, with the table's publishes made in one call (in the same order,
        # slots prefetched ahead) and every old entry retired after them: nothing runs
        # in between, so no block of an old entry is freed before its key's slot changed
        olds = []
        keys = []
        n = len(entries)
        # values in one run without checksums (the common case) go to the table as C
        # arrays (publish_runs: no tuple or int object per key); any other: publish_many
        plain = INSTALL_RUNS
        if plain:
            szs = array.clone(_Q, n, False)
            sts = array.clone(_Q, n, False)
            nbs = array.clone(_Q, n, False)
            psz = szs.data.as_longlongs
            pst = sts.data.as_longlongs
            pnb = nbs.data.as_longlongs
        i = 0
        for x in entries:
            e = _entry(x)
            o = index._insert_local(e)
            keys.append(e.key)
            if plain:
                if _ext_of(e) is None and _csum(e) is None and type(e.key) is bytes:
                    psz[i] = e.size
                    pst[i] = e.start
                    pnb[i] = e.nblocks
                else:
                    plain = False
            i += 1
            if o is not None:
                olds.append(o)
        if plain:
            shared.publish_runs(keys, szs, sts, nbs)
        else:
            sizes = []
            runs = []
            sums = []
            for x in entries:
                e = <Entry>x
                sizes.append(e.size)
                runs.append(_runs(e))
                sums.append(_csum(e))
            shared.publish_many(keys, sizes, runs, sums)
        nold = len(olds)
        if INSTALL_RUNS and nold > 1:
            # the old values of one run each go back in one free_runs call (as
            # put_packed's), not one Python call of alloc.free each
            fs = array.clone(_Q, nold, False)
            fc = array.clone(_Q, nold, False)
            pst = fs.data.as_longlongs
            pnb = fc.data.as_longlongs
        m = 0
        try:
            for x in entries:
                (<Entry>x).state = C_LIVE
            for o in olds:
                old = _entry(o)
                if old.pins:
                    old.state = C_DEAD
                    dead.add(old)
                elif fs is not None and _nruns(old) == 1:
                    pst[m] = old.start
                    pnb[m] = old.nblocks
                    m += 1
                    old.state = C_DEAD
                    old.start = -1
                    _set_ext(old, ())
                else:
                    _free_entry(store, old)
                    freed += 1
            if m:
                array.resize(fs, m)
                array.resize(fc, m)
                store.alloc.free_runs(fs, fc)
                freed += m
        finally:
            if freed:
                store.progress += freed
        return
    try:
        for x in entries:
            e = _entry(x)
            o = index._insert(e)
            e.state = C_LIVE
            if o is not None:
                old = _entry(o)
                if old.pins:
                    old.state = C_DEAD
                    dead.add(old)
                else:
                    _free_entry(store, old)
                    freed += 1
    finally:
        if freed:
            store.progress += freed


def free_entries(store, entries):
    """``store._free(e)`` for each entry (an aborted ALLOC grant)."""
    cdef Entry e
    cdef Py_ssize_t freed = 0
    try:
        for x in entries:
            e = _entry(x)
            _free_entry(store, e)
            freed += 1
    finally:
        if freed:
            store.progress += freed


def unpin_entries(store, entries):
    """``store._unpin(e)`` for each entry, in order."""
    cdef Entry e
    cdef long long dp = 0, dpe = 0
    try:
        for x in entries:
            e = _entry(x)
            e.pins -= 1
            dp += 1
            if e.pins == 0:
                dpe += 1
                if e.state == C_DEAD and e.start >= 0:
                    store._dead.discard(e)
                    _free_entry(store, e)
                    store.progress += 1
    finally:
        if dp:
            store._pins -= dp
        if dpe:
            store._pinned_entries -= dpe


def pin_entries(store, entries):
    """``store._pin(e)`` for each entry."""
    cdef Entry e
    cdef long long dp = 0, dpe = 0
    try:
        for x in entries:
            e = _entry(x)
            if e.pins >= _MAX_PINS:
                raise OverflowError(f"{e.key!r} has {e.pins} pins (the most an entry holds)")
            if e.pins == 0:
                dpe += 1
            e.pins += 1
            dp += 1
    finally:
        if dp:
            store._pins += dp
        if dpe:
            store._pinned_entries += dpe


def pin_for_send(store, keys, hold):
    """The per-key loop of :meth:`Store.pin_for_send`: (entries, checksums, hits, nbytes).
    The caller has applied the recorded reads (``index.sync()``)."""
    cdef Index index = store.index
    cdef dict d = index._d
    cdef Py_ssize_t n = len(keys), i
    cdef long long hits = 0, nbytes = 0, dp = 0, dpe = 0
    cdef PyObject* p
    cdef Entry e
    out = [None] * n
    sums = [None] * n
    tier = store.tier
    touch = store._touch if tier is not None else None
    try:
        for i in range(n):
            k = keys[i]
            if type(k) is not bytes:
                continue
            p = PyDict_GetItem(d, k)
            if p is NULL:
                continue
            e = _entry(<object>p)
            if e.pins >= _MAX_PINS:
                continue            # a miss: its 32-bit pin count must not wrap
            index._to_tail(e)
            if touch is not None:
                touch(e, hold)
            if e.pins == 0:
                dpe += 1
            e.pins += 1
            dp += 1
            hits += 1
            nbytes += e.size
            out[i] = e
            sums[i] = _csum(e)
    finally:
        if dp:
            store._pins += dp
        if dpe:
            store._pinned_entries += dpe
    return out, sums, hits, nbytes


def lookup_pins(store, keys, hold, bint limited, long long budget, qrefused):
    """The per-key loop of :meth:`Store.lookup`: (offsets, sizes, sums, pinned, nbytes,
    refused). ``limited``: a pin limit applies, ``budget`` blocks of it left;
    ``qrefused`` is the size a key over it gets."""
    cdef Index index = store.index
    cdef dict d = index._d
    cdef Py_ssize_t n = len(keys), i
    cdef long long nbytes = 0, dp = 0, dpe = 0, refused = 0
    cdef long long bs = store.block_size
    cdef PyObject* p
    cdef Entry e
    offsets = [-1] * n
    sizes = [-1] * n
    sums = [None] * n
    pinned = []
    tier = store.tier
    touch = store._touch if tier is not None else None
    try:
        for i in range(n):
            k = keys[i]
            if type(k) is not bytes:
                continue
            p = PyDict_GetItem(d, k)
            if p is NULL:
                continue
            e = _entry(<object>p)
            if e.pins >= _MAX_PINS:
                continue            # a miss: its 32-bit pin count must not wrap
            if limited:
                if e.nblocks > budget:
                    refused += 1
                    sizes[i] = qrefused
                    continue
                budget -= e.nblocks
            index._to_tail(e)
            if touch is not None:
                touch(e, hold)
            if e.pins == 0:
                dpe += 1
            e.pins += 1
            dp += 1
            pinned.append(e)
            nbytes += e.size
            offsets[i] = _place(e, bs)
            sizes[i] = e.size
            sums[i] = _csum(e)
    finally:
        if dp:
            store._pins += dp
        if dpe:
            store._pinned_entries += dpe
    return offsets, sizes, sums, pinned, nbytes, refused


def value_sizes(values):
    """``[memoryview(v).nbytes for v in values]``."""
    cdef Py_ssize_t n = len(values), i
    out = [0] * n
    for i in range(n):
        v = values[i]
        if type(v) is bytes:
            out[i] = len(<bytes>v)
        else:
            out[i] = memoryview(v).nbytes
    return out


def write_layout(entries, values, long long bs):
    """Where PUT copies each value: (offsets, sources), one pair per run."""
    cdef Entry e
    cdef Py_ssize_t n = len(entries), i
    cdef long long pos, o, k
    offs = []
    srcs = []
    for i in range(n):
        x = entries[i]
        if x is None:
            continue
        e = _entry(x)
        v = values[i]
        if _nruns(e) == 1:
            offs.append(e.start * bs)
            srcs.append(v)
            continue
        m = memoryview(v)
        if m.format != "B" or m.ndim != 1:
            m = m.cast("B")
        pos = 0
        for o, k in e.byte_extents(bs):     # the frame's bytes into each run
            offs.append(o)
            srcs.append(m[pos:pos + k])
            pos += k
    return offs, srcs


def value_offsets(entries, long long bs):
    """Where PUT copies each value when every entry is one run: an int64 array of the
    pool offset of each (-1 for None), or None when an entry has several runs (then
    :func:`write_layout`)."""
    cdef Py_ssize_t n = len(entries), i
    cdef Entry e
    cdef array.array out = array.clone(_Q, n, False)
    cdef long long* o = out.data.as_longlongs
    for i in range(n):
        x = entries[i]
        if x is None:
            o[i] = -1
            continue
        e = _entry(x)
        if _nruns(e) != 1:
            return None
        o[i] = e.start * bs
    return out


def small_frames(entries, long long bs, long long pack_below, long long frame_bytes):
    """A GET reply's frames when every hit (entry not None) is one run of fewer than
    ``pack_below`` bytes: the hits packed back to back, a frame closed before it would
    pass ``frame_bytes`` (:func:`kvshm.zmq_ctrl.frames.plan`); None otherwise.

    Returns (sizes, hits, offsets, lengths, counts, queued): per key its size (-1: a
    miss), the hits in order, the pool range of each hit (int64 arrays), values per frame
    and the blocks the frames' bytes count as (``ceil(frame bytes / bs)`` each).
    """
    cdef Py_ssize_t n = len(entries), i, m = 0, cnt = 0
    cdef long long acc = 0, queued = 0, size
    cdef Entry e
    cdef array.array offs = array.clone(_Q, n, False)
    cdef array.array lens = array.clone(_Q, n, False)
    cdef long long* po = offs.data.as_longlongs
    cdef long long* pl = lens.data.as_longlongs
    sizes = [-1] * n
    hits = []
    counts = []
    for i in range(n):
        x = entries[i]
        if x is None:
            continue
        e = _entry(x)
        size = e.size
        if _nruns(e) != 1 or size >= pack_below:
            return None
        if cnt and acc + size > frame_bytes:
            counts.append(cnt)
            queued += (acc + bs - 1) // bs
            cnt = 0
            acc = 0
        sizes[i] = size
        hits.append(e)
        po[m] = e.start * bs
        pl[m] = size
        m += 1
        acc += size
        cnt += 1
    if cnt:
        counts.append(cnt)
        queued += (acc + bs - 1) // bs
    array.resize(offs, m)
    array.resize(lens, m)
    return sizes, hits, offs, lens, counts, queued


def contains_keys(Index index, keys):
    """``[type(k) is bytes and k in index for k in keys]`` (the store's keys are all
    bytes: anything else is absent)."""
    cdef dict d = index._d
    cdef Py_ssize_t n = len(keys), i
    out = [False] * n
    for i in range(n):
        k = keys[i]
        if type(k) is bytes and PyDict_Contains(d, k):
            out[i] = True
    return out


def check_new(store, keys, sizes, pending_budget, ok, invalid_key, invalid_request,
              too_large_st, quota_st):
    """The validation loop of :meth:`Store._new_entries`: (statuses, want, want_idx,
    bad_keys, too_large, quota)."""
    cdef Py_ssize_t n = len(keys), i, kl
    cdef long long bs = store.block_size
    cdef long long max_value = store.max_value
    cdef Py_ssize_t max_key = store.config.limits.max_key_bytes
    cdef long long budget = -1 if pending_budget is None else pending_budget
    cdef long long size, nb
    cdef Py_ssize_t bad_keys = 0, too_large = 0, quota = 0
    statuses = [ok] * n
    want = []
    want_idx = []
    for i in range(n):
        if budget == 0:
            # the principal's quota is spent: every key left holds at least one
            # block, so it is refused (cheaply: a 1 M-key request costs its quota)
            statuses[i:] = [quota_st] * (n - i)
            quota += n - i
            break
        k = keys[i]
        sz = sizes[i]
        if type(k) is not bytes:
            bad_keys += 1
            statuses[i] = invalid_key
            continue
        kl = len(<bytes>k)
        if kl == 0 or kl > max_key:
            bad_keys += 1
            statuses[i] = invalid_key
            continue
        if type(sz) is not int or sz < 0:
            statuses[i] = invalid_request
            continue
        if sz > max_value:
            statuses[i] = too_large_st
            too_large += 1
            continue
        size = sz
        nb = (size + bs - 1) // bs if size > 0 else 1
        if budget > 0:
            if nb > budget:
                statuses[i] = quota_st
                quota += 1
                continue
            budget -= nb
        want.append(nb)
        want_idx.append(i)
    return statuses, want, want_idx, bad_keys, too_large, quota


def make_entries(keys, sizes, sums, want, want_idx, places, Py_ssize_t n,
                 pool_full_st, statuses):
    """Entries of the placed keys (None elsewhere), POOL_FULL where nothing was placed:
    (entries, pool_full, split). ``places`` is a list of runs (or None) per wanted key,
    or a list of start blocks (one run each: every key was placed)."""
    cdef Py_ssize_t j, i, m = len(want_idx), full = 0, split = 0
    cdef Entry e
    entries = [None] * n
    for j in range(m):
        i = want_idx[j]
        ext = places[j]
        if ext is None:
            statuses[i] = pool_full_st
            full += 1
            continue
        e = Entry.__new__(Entry)
        e.key = keys[i]
        e.nblocks = want[j]
        e.size = sizes[i]
        e.pins = 0
        e.state = C_PENDING
        # (a new entry: no meta, no checksum, one run (start, nblocks) until set here)
        if type(ext) is int:
            e.start = ext
        else:
            e.start = ext[0][0]
            if len(ext) > 1:
                split += 1
                _set_ext(e, tuple(ext))
            elif ext[0][1] != e.nblocks:
                _set_ext(e, tuple(ext))
        if sums is not None:
            # an xxh64 (0 .. 2**64 - 1), as Reservations.place keeps; anything else
            # (a hostile -1) is no checksum: the shared table holds a uint64
            c = sums[i]
            _set_csum(e, c if type(c) is int and 0 <= c <= _U64_MAX else None)
        entries[i] = e
    return entries, full, split


def places(entries, long long bs):
    """Per entry (None: -1) its place as ALLOC answers it, the entries that are not None,
    and their bytes: (offsets, granted, nbytes)."""
    cdef Py_ssize_t n = len(entries), i
    cdef long long nbytes = 0
    cdef Entry e
    offsets = [-1] * n
    granted = []
    for i in range(n):
        x = entries[i]
        if x is None:
            continue
        e = _entry(x)
        offsets[i] = _place(e, bs)
        granted.append(e)
        nbytes += e.size
    return offsets, granted, nbytes


def placed(entries):
    """The entries that are not None, and their bytes: (list, nbytes)."""
    cdef long long nbytes = 0
    ok = []
    for x in entries:
        if x is not None:
            nbytes += _entry(x).size
            ok.append(x)
    return ok, nbytes


def sum_blocks(entries):
    """``sum(e.nblocks for e in entries)``."""
    cdef long long n = 0
    for x in entries:
        n += _entry(x).nblocks
    return n


def sum_blocks_bytes(entries):
    """``(sum(e.nblocks for e in entries), sum(e.size for e in entries))``: the blocks
    and bytes of a slice of a grant being settled (ints; TypeError for an item that is
    not an :class:`Entry`)."""
    cdef long long nb = 0, nbytes = 0
    cdef Entry e
    for x in entries:
        e = _entry(x)
        nb += e.nblocks
        nbytes += e.size
    return nb, nbytes


def put_packed(store, keys, values, sizes, ok):
    """:meth:`Store.put` of a plain batch in one C pass, or None (declined: nothing has
    changed; the caller's general path answers it).

    Plain: ``keys`` a list of bytes each 1 .. ``max_key_bytes`` long, ``sizes`` a list of
    int each 0 .. ``store.max_value`` (the bytes of each value of ``values``, a
    :class:`kvshm._pool.PackedValues`), no tier below the pool, and room for every value
    in one free run each without evicting (else None: the general path allocates, evicts
    and refuses as it always has). Does what the general path does for such a batch, in
    the same order (the blocks by first fit in key order, the values copied, the recorded
    reads applied, each key installed as the most recently used in key order, the shared
    table's slots written in key order before any old value's blocks are freed, pinned
    old values kept until their last pin goes, the counters), without a list, tuple or
    int object per key. Returns a Status per key (``ok`` each).
    """
    cdef Py_ssize_t n, i, kl, nold = 0, freed = 0
    cdef long long bs = store.block_size
    cdef long long max_value = store.max_value
    cdef Py_ssize_t max_key = store.config.limits.max_key_bytes
    cdef long long sz, nb, total = 0, nbytes = 0
    cdef int ovf = 0
    cdef bint ahead = PUT_PREFETCH
    cdef bint deep = ahead and PUT_PREFETCH_DEEP
    cdef PyObject* p
    cdef Index index = store.index
    cdef dict d
    cdef Entry e, old
    cdef object k, s, o
    cdef array.array nbs, szs, starts, offs, fs, fc
    cdef long long* pnb
    cdef long long* psz
    cdef long long* pst
    cdef long long* pof
    cdef long long* pfs
    cdef long long* pfc
    if type(keys) is not list or type(sizes) is not list or store.tier is not None:
        return None
    n = len(keys)
    if n == 0 or len(sizes) != n or len(values) != n:
        return None
    nbs = array.clone(_Q, n, False)
    szs = array.clone(_Q, n, False)
    pnb = nbs.data.as_longlongs
    psz = szs.data.as_longlongs
    for i in range(n):
        k = keys[i]
        s = sizes[i]
        if type(k) is not bytes or type(s) is not int:
            return None
        kl = len(<bytes>k)
        sz = PyLong_AsLongLongAndOverflow(s, &ovf)     # (an exact int: never -1 + error)
        if kl == 0 or kl > max_key or ovf or sz < 0 or sz > max_value:
            return None
        nb = (sz + bs - 1) // bs if sz > 0 else 1
        psz[i] = sz
        pnb[i] = nb
        total += nb
        nbytes += sz
    alloc = store.alloc
    if alloc.num_free < total:
        return None                 # evictions: the general path
    starts = array.clone(_Q, n, False)
    pst = starts.data.as_longlongs
    store._wait = False
    if alloc.alloc_runs(nbs, starts):
        # a value with no free run of its own (fragmented): give the runs back (the same
        # free blocks as before, so first fit places alike) and let the general path go
        fs = array.clone(_Q, n, False)
        fc = array.clone(_Q, n, False)
        pfs = fs.data.as_longlongs
        pfc = fc.data.as_longlongs
        for i in range(n):
            if pst[i] >= 0:
                pfs[nold] = pst[i]
                pfc[nold] = pnb[i]
                nold += 1
        array.resize(fs, nold)
        array.resize(fc, nold)
        alloc.free_runs(fs, fc)
        return None
    # the entries, pending, and where their bytes go
    offs = array.clone(_Q, n, False)
    pof = offs.data.as_longlongs
    entries = [None] * n
    for i in range(n):
        e = Entry.__new__(Entry)
        e.key = keys[i]
        e.start = pst[i]
        e.nblocks = <int>pnb[i]
        e.size = psz[i]
        e.pins = 0
        e.state = C_PENDING       # (and, new, no checksum, no meta, one run)
        entries[i] = e
        pof[i] = pst[i] * bs
    store.pool.write_values(offs, values)
    index.sync()                # lock-free reads recorded before this write go first
    # install (install_entries without a tier): every key in the dict and the LRU, then
    # the shared table's slots, then the old values retired
    shared = index._shared
    olds = []
    d = index._d
    if ahead:
        for i in range(n if n < _DICT_AHEAD else _DICT_AHEAD):
            kvi_dict_prefetch(d, PyObject_Hash(keys[i]))
    for i in range(n):
        if ahead and i + _DICT_AHEAD < n:
            # the key's dict slot, for its lookup _DICT_AHEAD keys on (the hash is
            # kept in the bytes object: the lookup does not hash again)
            kvi_dict_prefetch(d, PyObject_Hash(keys[i + _DICT_AHEAD]))
        if deep:
            # the next steps of the lookups of keys closer on, each line prefetched by
            # the step before: the dict entry, its key and value, the old value's
            # neighbours in the LRU list (which its unlink writes)
            if i + _DICT_AHEAD2 < n:
                kvi_dict_prefetch_entry(d, PyObject_Hash(keys[i + _DICT_AHEAD2]))
            if i + _DICT_AHEAD3 < n:
                kvi_dict_prefetch_objs(d, PyObject_Hash(keys[i + _DICT_AHEAD3]))
            if i + _DICT_AHEAD4 < n:
                p = kvi_dict_home_value(d, PyObject_Hash(keys[i + _DICT_AHEAD4]))
                if p != NULL and type(<object>p) is Entry:
                    kvi_prefetch_w((<Entry>p)._prev)
                    kvi_prefetch_w((<Entry>p)._next)
        o = index._insert_local(<Entry>entries[i])
        if o is not None:
            olds.append(o)
    if shared is not None:
        if n > 1:
            shared.publish_runs(keys, szs, starts, nbs)
        else:
            e = <Entry>entries[0]
            shared.publish(e.key, e.size, _runs(e), _csum(e))
    for i in range(n):
        (<Entry>entries[i]).state = C_LIVE
    nold = len(olds)
    if nold:
        dead = store._dead
        fs = array.clone(_Q, nold, False)
        fc = array.clone(_Q, nold, False)
        pfs = fs.data.as_longlongs
        pfc = fc.data.as_longlongs
        nb = 0
        try:
            for o in olds:
                old = _entry(o)
                if old.pins:
                    old.state = C_DEAD
                    dead.add(old)
                elif _nruns(old) == 1:
                    pfs[nb] = old.start
                    pfc[nb] = old.nblocks
                    nb += 1
                    old.state = C_DEAD
                    old.start = -1
                    _set_ext(old, ())
                else:
                    _free_entry(store, old)
                    freed += 1
            if nb:
                array.resize(fs, nb)
                array.resize(fc, nb)
                alloc.free_runs(fs, fc)
                freed += nb
        finally:
            if freed:
                store.progress += freed
    c = store.counters
    c["puts"] += n
    c["bytes_in"] += nbytes
    return [ok] * n
