# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Bitmap block allocator: contiguous first-fit runs over ``num_blocks`` blocks.

One bit per block, set when the block is free, in 64-bit words. A second-level summary
bitmap has one bit per word, set when that word holds at least one free block, so a
search skips 4096 allocated blocks per summary word and never walks bit by bit: runs are
found with count-trailing-zeros (``__builtin_ctzll``) on whole words.

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
