# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Bitmap block allocator: first-fit runs over ``num_blocks`` blocks, or a few runs.

One bit per block, set when the block is free, in 64-bit words. A second-level summary
bitmap has one bit per word, set when that word holds at least one free block, so a
search skips 4096 allocated blocks per summary word and never walks bit by bit: runs are
found with count-trailing-zeros (``__builtin_ctzll``) on whole words.

A value may also be laid over several runs (:meth:`BitmapAllocator.alloc_extents`) when
no single run holds it: as few runs as the free space allows (the largest free runs, then
the smallest run that holds the rest), at most ``max_extents``. Runs come back in block
order; each is a whole free run but the last taken, so no two are adjacent.

The allocator knows nothing of bytes or memory; the pool and the server map block
indices to byte offsets (``offset = start * block_size``).
"""

from libc.stdint cimport uint64_t, int64_t
from libc.stdlib cimport malloc, free as c_free
from cpython.long cimport PyLong_FromSsize_t
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF

cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil

cdef uint64_t ALL = <uint64_t>0xFFFFFFFFFFFFFFFF

#: Most runs one :meth:`BitmapAllocator.alloc_extents` call may return.
cdef enum:
    _MAX_RUNS = 64
MAX_RUNS = _MAX_RUNS


cdef struct _Cursor:
    # where a scan of the free runs stands: the word being read and its bits not yet seen
    Py_ssize_t w
    uint64_t x


cdef inline int _ctz(uint64_t x) noexcept nogil:
    # x must be non-zero
    return __builtin_ctzll(x)


cdef inline uint64_t _low_mask(int n) noexcept nogil:
    # bits [0, n) set, for 0 <= n <= 64
    if n >= 64:
        return ALL
    return ((<uint64_t>1) << n) - 1


cdef class BitmapAllocator:
    """Allocate runs of contiguous blocks out of ``num_blocks``.

    Parameters
    ----------
    num_blocks : int
        Number of blocks managed, >= 1. Memory used: num_blocks / 8 bytes plus 1/64 of that
        for the summary.

    Raises
    ------
    ValueError
        ``num_blocks`` < 1.
    MemoryError
        The bitmap could not be allocated.

    Notes
    -----
    Not thread-safe: the server owns its allocator from one thread (docs/DESIGN.md,
    "Concurrency").
    """

    cdef uint64_t* _words      # bit set = block free
    cdef uint64_t* _summary    # bit set = word has at least one free block
    cdef Py_ssize_t _num_blocks
    cdef Py_ssize_t _num_words
    cdef Py_ssize_t _num_summary
    cdef Py_ssize_t _num_free
    cdef Py_ssize_t _hint      # every word below this one is full (no free block)

    def __cinit__(self, Py_ssize_t num_blocks):
        cdef Py_ssize_t i
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_blocks = num_blocks
        self._num_words = (num_blocks + 63) // 64
        self._num_summary = (self._num_words + 63) // 64
        self._words = <uint64_t*>malloc(self._num_words * sizeof(uint64_t))
        self._summary = <uint64_t*>malloc(self._num_summary * sizeof(uint64_t))
        if self._words == NULL or self._summary == NULL:
            raise MemoryError(f"cannot allocate a bitmap of {num_blocks} blocks")
        for i in range(self._num_words):
            self._words[i] = ALL
        if num_blocks % 64:
            self._words[self._num_words - 1] = _low_mask(num_blocks % 64)
        for i in range(self._num_summary):
            self._summary[i] = ALL
        if self._num_words % 64:
            self._summary[self._num_summary - 1] = _low_mask(self._num_words % 64)
        self._num_free = num_blocks
        self._hint = 0

    def __dealloc__(self):
        c_free(self._words)
        c_free(self._summary)

    # ---------------------------------------------------------------- internals

    cdef inline void _sync_summary(self, Py_ssize_t w) noexcept nogil:
        cdef uint64_t bit = (<uint64_t>1) << (w & 63)
        if self._words[w]:
            self._summary[w >> 6] |= bit
        else:
            self._summary[w >> 6] &= ~bit

    cdef Py_ssize_t _next_nonfull(self, Py_ssize_t w) noexcept nogil:
        """Smallest word index >= w that has a free block, or -1."""
        cdef Py_ssize_t s = w >> 6
        cdef uint64_t m
        if w >= self._num_words:
            return -1
        m = self._summary[s] & (ALL << (w & 63))
        while m == 0:
            s += 1
            if s >= self._num_summary:
                return -1
            m = self._summary[s]
        return (s << 6) + _ctz(m)

    cdef void _mark(self, Py_ssize_t start, Py_ssize_t n, bint free_them) noexcept nogil:
        """Set (free) or clear (allocate) bits [start, start + n)."""
        cdef Py_ssize_t w = start >> 6
        cdef int b = start & 63
        cdef Py_ssize_t left = n
        cdef int take
        cdef uint64_t mask
        while left > 0:
            take = 64 - b
            if take > left:
                take = <int>left
            mask = _low_mask(take) << b
            if free_them:
                self._words[w] |= mask
            else:
                self._words[w] &= ~mask
            self._sync_summary(w)
            left -= take
            w += 1
            b = 0
        if free_them:
            self._num_free += n
            if (start >> 6) < self._hint:
                self._hint = start >> 6
        else:
            self._num_free -= n

    cdef bint _range_is(self, Py_ssize_t start, Py_ssize_t n, bint free_state) noexcept nogil:
        """True when every block in [start, start + n) is free (free_state) or allocated."""
        cdef Py_ssize_t w = start >> 6
        cdef int b = start & 63
        cdef Py_ssize_t left = n
        cdef int take
        cdef uint64_t mask, bits
        while left > 0:
            take = 64 - b
            if take > left:
                take = <int>left
            mask = _low_mask(take) << b
            bits = self._words[w] & mask
            if free_state:
                if bits != mask:
                    return False
            elif bits != 0:
                return False
            left -= take
            w += 1
            b = 0
        return True

    cdef Py_ssize_t _find(self, Py_ssize_t n) noexcept nogil:
        """First fit: start of the lowest run of n free blocks, or -1."""
        cdef Py_ssize_t w, prev_w = -2, run_start = 0, run_len = 0
        cdef uint64_t x, y
        cdef int p, ones, t
        if n > self._num_free:
            return -1
        # No run starts below the hint; moving it up to the first word with a free block
        # keeps it true and spares the next search the summary words of a full prefix.
        w = self._next_nonfull(self._hint)
        self._hint = self._num_words if w < 0 else w
        if n == 1:
            if w < 0:
                return -1
            return (w << 6) + _ctz(self._words[w])
        while w >= 0:
            if w != prev_w + 1:
                run_len = 0
            x = self._words[w]
            if run_len > 0:
                # a run from the previous word continues at bit 0 of this one
                if x == ALL:
                    run_len += 64
                    if run_len >= n:
                        return run_start
                    prev_w = w
                    w += 1
                    if w >= self._num_words:
                        return -1
                    continue
                t = _ctz(~x)
                if run_len + t >= n:
                    return run_start
                run_len = 0
                x &= ~_low_mask(t)
            while x:
                p = _ctz(x)
                y = ~(x >> p)
                if y == 0:          # p == 0 and the whole word is free
                    ones = 64
                else:
                    ones = _ctz(y)
                if ones >= n:
                    return (w << 6) + p
                if p + ones == 64:  # the run reaches the top bit: it may continue
                    run_start = (w << 6) + p
                    run_len = ones
                    break
                x &= ~_low_mask(p + ones)
            prev_w = w
            if run_len > 0:
                w += 1
                if w >= self._num_words:
                    return -1
            else:
                w = self._next_nonfull(w + 1)
        return -1

    cdef inline Py_ssize_t _alloc(self, Py_ssize_t n) noexcept nogil:
        cdef Py_ssize_t start = self._find(n)
        if start >= 0:
            self._mark(start, n, False)
        return start

    cdef bint _next_run(self, _Cursor* c, Py_ssize_t* start, Py_ssize_t* length
                        ) noexcept nogil:
        """The next maximal free run after the cursor, in block order; False at the end.

        Start with ``c.w = -1, c.x = 0``. Full words are skipped through the summary.
        """
        cdef Py_ssize_t w, n
        cdef uint64_t x, y
        cdef int p, ones, t
        if c.x == 0:
            w = self._next_nonfull(c.w + 1)
            if w < 0:
                c.w = self._num_words
                return False
            c.w = w
            c.x = self._words[w]
        x = c.x
        p = _ctz(x)
        start[0] = (c.w << 6) + p
        y = ~(x >> p)
        ones = 64 if y == 0 else _ctz(y)
        if p + ones < 64:
            c.x = x & ~_low_mask(p + ones)
            length[0] = ones
            return True
        n = ones                # the run reaches the top bit: it may go on
        w = c.w + 1
        while w < self._num_words:
            x = self._words[w]
            if x == ALL:
                n += 64
                w += 1
                continue
            t = _ctz(~x)
            n += t
            c.w = w
            c.x = x & ~_low_mask(t)
            length[0] = n
            return True
        c.w = self._num_words
        c.x = 0
        length[0] = n
        return True

    cdef int _alloc_extents(self, Py_ssize_t n, int k_max, Py_ssize_t* starts,
                            Py_ssize_t* counts) noexcept nogil:
        """Allocate ``n`` blocks as at most ``k_max`` runs; their count, or 0 (nothing
        allocated). Runs are written to ``starts``/``counts`` in block order."""
        cdef Py_ssize_t top_s[_MAX_RUNS]
        cdef Py_ssize_t top_n[_MAX_RUNS]
        cdef Py_ssize_t rs, rn, acc, rest, best_s, best_n, ts, tn
        cdef int have = 0, i, j, k
        cdef _Cursor c
        cdef bint taken
        if n > self._num_free:
            return 0
        rs = self._find(n)
        if rs >= 0:             # one run holds it: first fit, as alloc()
            self._mark(rs, n, False)
            starts[0] = rs
            counts[0] = n
            return 1
        if k_max < 2:
            return 0
        # the k_max longest runs, longest first (equal lengths: lower start first)
        c.w = -1
        c.x = 0
        while self._next_run(&c, &rs, &rn):
            if have == k_max and rn <= top_n[have - 1]:
                continue
            i = have if have < k_max else k_max - 1
            while i > 0 and top_n[i - 1] < rn:
                if i < k_max:
                    top_s[i] = top_s[i - 1]
                    top_n[i] = top_n[i - 1]
                i -= 1
            top_s[i] = rs
            top_n[i] = rn
            if have < k_max:
                have += 1
        # the fewest runs: the k - 1 longest whole, then the shortest run holding the rest
        acc = 0
        k = 0
        while k < have and acc + top_n[k] < n:
            acc += top_n[k]
            k += 1
        if k == have:
            return 0            # more than k_max runs would be needed
        rest = n - acc
        best_s = top_s[k]
        best_n = top_n[k]
        c.w = -1
        c.x = 0
        while self._next_run(&c, &rs, &rn):
            if rn < rest or rn > best_n or (rn == best_n and rs >= best_s):
                continue
            taken = False
            for j in range(k):
                if top_s[j] == rs:
                    taken = True
                    break
            if not taken:
                best_s = rs
                best_n = rn
        top_s[k] = best_s
        top_n[k] = rest
        k += 1
        for i in range(k):
            self._mark(top_s[i], top_n[i], False)
        for i in range(1, k):   # block order
            ts = top_s[i]
            tn = top_n[i]
            j = i
            while j > 0 and top_s[j - 1] > ts:
                top_s[j] = top_s[j - 1]
                top_n[j] = top_n[j - 1]
                j -= 1
            top_s[j] = ts
            top_n[j] = tn
        for i in range(k):
            starts[i] = top_s[i]
            counts[i] = top_n[i]
        return k

    cdef inline int _check_count(self, Py_ssize_t n) except -1:
        if n < 1:
            raise ValueError(f"block count must be >= 1, got {n}")
        return 0

    # ---------------------------------------------------------------- public API

    def alloc(self, Py_ssize_t n):
        """Allocate ``n`` contiguous blocks, first fit.

        Parameters
        ----------
        n : int
            Number of blocks, >= 1.

        Returns
        -------
        int
            Index of the first block of the run, or -1 when no run of ``n`` free blocks
            exists (including ``n > num_blocks``).

        Raises
        ------
        ValueError
            ``n`` < 1.
        """
        self._check_count(n)
        return self._alloc(n)

    def alloc_many(self, counts):
        """Allocate one run per entry of ``counts`` in one call.

        Parameters
        ----------
        counts : sequence of int, or a buffer of int64
            Blocks wanted per run, each >= 1.

        Returns
        -------
        list of int
            Start block of each run, in order; -1 for a run that did not fit (the others
            stay allocated; nothing is rolled back).

        Raises
        ------
        ValueError
            A count < 1 (checked for all counts before anything is allocated).
        """
        cdef const int64_t[:] arr
        cdef Py_ssize_t i, k, s
        cdef list out
        if isinstance(counts, (list, tuple)):
            k = len(counts)
            for i in range(k):
                self._check_count(counts[i])
            out = PyList_New(k)
            for i in range(k):
                s = self._alloc(<Py_ssize_t>counts[i])
                o = PyLong_FromSsize_t(s)
                Py_INCREF(o)
                PyList_SET_ITEM(out, i, o)
            return out
        try:
            arr = counts
        except (TypeError, ValueError):
            return self.alloc_many(list(counts))
        k = arr.shape[0]
        for i in range(k):
            self._check_count(arr[i])
        out = PyList_New(k)
        for i in range(k):
            s = self._alloc(arr[i])
            o = PyLong_FromSsize_t(s)
            Py_INCREF(o)
            PyList_SET_ITEM(out, i, o)
        return out

    def alloc_runs(self, counts, out):
        """:meth:`alloc_many` into a buffer: one run per count, first fit, in order, the
        start block of each written to ``out[i]`` (-1 where it did not fit; the others
        stay allocated). No int object per run (the server's batch PUT).

        ``counts``, ``out``: int64 buffers of one length (``out`` writable). Returns how
        many did not fit. ValueError for lengths that differ or a count < 1 (checked
        before anything is allocated).
        """
        cdef const int64_t[:] c = counts
        cdef int64_t[:] o = out
        cdef Py_ssize_t i, k = c.shape[0], failed = 0
        if o.shape[0] != k:
            raise ValueError(f"{k} counts but room for {o.shape[0]} starts")
        for i in range(k):
            self._check_count(c[i])
        for i in range(k):
            o[i] = self._alloc(c[i])
            if o[i] < 0:
                failed += 1
        return failed

    def free_runs(self, starts, counts):
        """Free runs ``(starts[i], counts[i])`` (int64 buffers of one length), as
        :meth:`free_extents` frees its runs: ValueError, nothing freed, when a run is out
        of range, not all allocated, or overlaps another of them."""
        cdef const int64_t[:] s = starts
        cdef const int64_t[:] c = counts
        cdef Py_ssize_t i, j, k = s.shape[0]
        if c.shape[0] != k:
            raise ValueError(f"{k} starts but {c.shape[0]} counts")
        for i in range(k):
            self._check_run(s[i], c[i])
            if not self._range_is(s[i], c[i], False):
                raise ValueError(
                    f"blocks [{s[i]}, {s[i] + c[i]}) are not all allocated (double free?)")
        for i in range(k):
            if not self._range_is(s[i], c[i], False):     # overlaps an earlier run
                for j in range(i):
                    self._mark(s[j], c[j], False)
                raise ValueError(f"run [{s[i]}, {s[i] + c[i]}) overlaps another run of "
                                 "the same call")
            self._mark(s[i], c[i], True)

    def alloc_extents(self, Py_ssize_t n, int max_extents=8):
        """Allocate ``n`` blocks as one run if one fits, else as few runs as possible.

        Parameters
        ----------
        n : int
            Number of blocks, >= 1.
        max_extents : int
            Most runs the blocks may be split into, 1 to :data:`MAX_RUNS` (64).

        Returns
        -------
        tuple of (int, int), or None
            ``(first block, block count)`` per run, in block order, counts adding up to
            ``n``. One run: the first fit (as :meth:`alloc`). Otherwise the fewest runs
            that hold ``n`` blocks: the longest free runs taken whole (equal lengths:
            lower blocks first), then the shortest free run that holds the rest (best
            fit), of which the first blocks are taken. None when ``n`` blocks do not fit
            in ``max_extents`` runs (nothing is allocated then).

        Raises
        ------
        ValueError
            ``n`` < 1, or ``max_extents`` outside 1..64.
        """
        cdef Py_ssize_t starts[_MAX_RUNS]
        cdef Py_ssize_t counts[_MAX_RUNS]
        cdef int k, i
        self._check_count(n)
        if max_extents < 1 or max_extents > _MAX_RUNS:
            raise ValueError(f"max_extents must be in 1..{_MAX_RUNS}, got {max_extents}")
        with nogil:
            k = self._alloc_extents(n, max_extents, starts, counts)
        if k == 0:
            return None
        if k == 1:
            return ((starts[0], counts[0]),)
        return tuple([(starts[i], counts[i]) for i in range(k)])

    def free_extents(self, extents):
        """Free every run of ``extents`` (``(first block, block count)`` pairs).

        Raises
        ------
        ValueError
            A run is out of range, has a count < 1, or holds a block that is not
            allocated (a double free, or two runs that overlap); nothing is freed then.
        """
        cdef Py_ssize_t start, n, i, k = len(extents)
        for i in range(k):
            start, n = extents[i]
            self._check_run(start, n)
            if not self._range_is(start, n, False):
                raise ValueError(
                    f"blocks [{start}, {start + n}) are not all allocated (double free?)")
        for i in range(k):
            start, n = extents[i]
            if not self._range_is(start, n, False):     # overlaps an earlier run
                for j in range(i):
                    self._mark(extents[j][0], extents[j][1], False)
                raise ValueError(f"run [{start}, {start + n}) overlaps another run of "
                                 "the same extents")
            self._mark(start, n, True)

    def alloc_at(self, Py_ssize_t start, Py_ssize_t n):
        """Allocate exactly blocks [start, start + n), e.g. when restoring a saved layout.

        Raises
        ------
        ValueError
            The run is out of range, ``n`` < 1, or a block in it is already allocated.
        """
        self._check_run(start, n)
        if not self._range_is(start, n, True):
            raise ValueError(f"blocks [{start}, {start + n}) are not all free")
        self._mark(start, n, False)

    cdef int _check_run(self, Py_ssize_t start, Py_ssize_t n) except -1:
        self._check_count(n)
        if start < 0 or start > self._num_blocks - n:
            raise ValueError(
                f"run [{start}, {start + n}) is outside the {self._num_blocks} blocks")
        return 0

    def free(self, Py_ssize_t start, Py_ssize_t n):
        """Free blocks [start, start + n).

        Raises
        ------
        ValueError
            The run is out of range, ``n`` < 1, or a block in it is not allocated (a double
            free); nothing is freed then.
        """
        self._check_run(start, n)
        if not self._range_is(start, n, False):
            raise ValueError(
                f"blocks [{start}, {start + n}) are not all allocated (double free?)")
        self._mark(start, n, True)

    def is_free(self, Py_ssize_t start, Py_ssize_t n=1):
        """True when every block of [start, start + n) is free. ValueError if out of range."""
        self._check_run(start, n)
        return self._range_is(start, n, True)

    def free_map(self):
        """A bytearray of ``num_blocks`` flags: 1 where the block is free, else 0."""
        cdef bytearray out = bytearray(self._num_blocks)
        cdef unsigned char[:] m = out
        cdef Py_ssize_t i
        with nogil:
            for i in range(self._num_blocks):
                m[i] = (self._words[i >> 6] >> (i & 63)) & 1
        return out

    def reset(self):
        """Free every block."""
        if self._num_free != self._num_blocks:
            self._mark(0, self._num_blocks, True)
            self._num_free = self._num_blocks

    @property
    def num_blocks(self):
        """Number of blocks managed."""
        return self._num_blocks

    @property
    def num_free(self):
        """Number of free blocks."""
        return self._num_free

    @property
    def num_used(self):
        """Number of allocated blocks."""
        return self._num_blocks - self._num_free

    @property
    def largest_free_run(self):
        """Length in blocks of the longest run of free blocks (a full scan: O(num_blocks/64))."""
        cdef Py_ssize_t w, best = 0, cur = 0
        cdef uint64_t x, y
        cdef int p, ones, t
        with nogil:
            for w in range(self._num_words):
                x = self._words[w]
                if x == ALL:
                    cur += 64
                    continue
                if x == 0:
                    if cur > best:
                        best = cur
                    cur = 0
                    continue
                t = _ctz(~x)            # trailing ones continue the current run
                cur += t
                if cur > best:
                    best = cur
                cur = 0
                x &= ~_low_mask(t)
                while x:
                    p = _ctz(x)
                    y = ~(x >> p)
                    ones = _ctz(y)      # y != 0: bit 0 of x was clear or p > 0
                    if p + ones == 64:
                        cur = ones
                        break
                    if ones > best:
                        best = ones
                    x &= ~_low_mask(p + ones)
            if cur > best:
                best = cur
        return best

    def __len__(self):
        return self._num_blocks

    def __repr__(self):
        return (f"<BitmapAllocator num_blocks={self._num_blocks} "
                f"num_free={self._num_free}>")
