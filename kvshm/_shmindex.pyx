# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The shared index: a hash table in its own POSIX shm segment that same-host clients read
without asking the server (docs/DESIGN.md, "Same-host reads without a round trip").

The server is the only writer (:class:`IndexWriter`); clients map the table read-only
(:class:`IndexReader`, ``PROT_READ``: a reader cannot corrupt it) and read optimistically.

Index segment layout (layout 5)::

    [ header: 4096 bytes | 2 x capacity slots of 64 bytes |
      wide records: W of 64 bytes | W of 128 bytes | W of 256 bytes ]   (W = wide capacity)

Header: magic ``KVSHMIX1``, layout version, epoch (the server instance, as in HELLO),
nslots and base (the table: ``nslots`` slots from slot ``base``; it grows (:data:`GROWTH`) up
to ``capacity``), block size, state (OPEN / CLOSED: a stopped server, or one ``kvshm ctl
cleanup`` found dead), a table sequence (odd only while the header's names of the tables
change), the count of live keys the table does not hold (too long, table full) and flags
(misses are final: no tier below the pool), capacity, wide records, and old_nslots /
old_base (the table a growth or rebuild moves the entries from; 0 slots: none). The
segment has room for two tables of ``capacity`` slots (slots [0, capacity) and [capacity,
2 x capacity): a growth moves the table to the other half) and 3/4 capacity wide records of each class,
but only the slots in use are reserved (``posix_fallocate``) and touched, and the old
table's are given back (punched) once moved: memory follows the keys stored, not the
pool's blocks.

Growth (from 13/16 full, by half: :data:`GROWTH`) and rebuilds (tombstones) are incremental, one bounded
step per publish or unpublish (:meth:`IndexWriter.create`): while both tables are named,
new keys go to the new one, a key still in the old one is moved before it is changed, and
each move writes the new slot before the old one becomes a tombstone; readers look in the
old table first, then the new one, and check the table sequence again before a miss. A
new table's slots start at versions above every version written before, so a token of an
older table never matches a later entry. Slot (one 64-byte cache line)::

    @0 version u64 (seqlock: odd while the server writes the slot; only ever grows)
    @8 meta u64: size (bits 0-39: a value of at most SLOT_SIZE_MAX = 1 TiB - 1 bytes;
       a larger one is not published), hash tag (40-47: the key hash's low byte), key
       length (48-55), state (56-57: empty/live/tombstone), flags (58: has checksum;
       59-60: wide record class, 0 none, 1/2/3 a record of 64/128/256 bytes), extent
       count - 1 (61-63)
    @16 48 bytes: the key, then (flags & 1) its checksum u64, then the extents,
    (first block u32, block count u32) each; an entry whose key, checksum and extents
    do not fit in 48 bytes (a key over 40 bytes, or a 40-byte key with a checksum or
    more than one run) has them in a wide record instead, the smallest of 64, 128 or
    256 bytes that holds them (a key of 41-56 bytes in one run: 64), whose index (u32)
    in its class the 48 bytes then begin with. A wide record changes only while
    the version of the slot that points at it is odd, and is reused only after that
    slot's version changed, so the slot's seqlock covers it too. An overwrite keeps
    the entry's record while it holds what is written, else takes a larger one and
    gives the old one back once the slot's version changed.

A probe reads one cache line a slot: the version, then the meta word, whose bits 40-57
(tag, length, state) it compares with the key's in one comparison before it compares
the key's bytes; a 40-byte key (a hex chunk hash) in one run is all in the line. The
table keeps only the hash's low byte, so a growth or rebuild hashes each moved key
again. Layout 4 had 128-byte slots (the full hash @8, the key @24, the size @120);
layout 5 halves the table's memory per key. A reader refuses a table of another layout
(ValueError; :func:`kvshm.localread.attach` then leaves the client to ask the server).

A reader loads the version (acquire), the fields, copies the value out of the pool,
fences (acquire) and loads the version again; any change means the entry moved, was
overwritten or deleted meanwhile, and the read is retried or sent to the server. The
server changes a slot's version before the entry's blocks can be freed or reused
(:meth:`IndexWriter.unpublish`), so a racing reader never keeps bytes of another key.
Deletion leaves tombstones; the table is rebuilt (moved, step by step, into a table of
the same size in the other half) when they pile up.

Batch lookups (:meth:`IndexReader.exists_batch`, :meth:`IndexReader.match_prefix`) take
every key's bytes and hash under the GIL, then (the GIL released from 2,048 keys) look
them up with the slots of the keys :data:`PREFETCH_AHEAD` places later prefetched, so that many
misses of the table's memory overlap; the header's tables are read once per
:data:`BATCH_CHUNK` keys and a chunk's misses count only when its table sequence did not
change meanwhile (else each is looked up again alone). Each hit is validated by its
slot's version like any read. ``KVSHM_NO_FAST_BATCH_READS`` (set to anything but "" or
"0" when the reader is made; :attr:`IndexReader.fast_batch` after) makes them look up
one key at a time instead (the header read for each), for A/B figures and tests.

Batches of :data:`BATCH_THREADS_MIN` keys or more may be looked up by more threads
(:attr:`IndexReader.batch_threads`, from ``KVSHM_BATCH_READ_THREADS``: 1 to 8, the
caller's included; 1, the default (:func:`default_batch_threads`), turns it off). The
caller still copies and hashes every segment under the GIL; each segment is then offered
in pieces of 512 keys to the process's helper threads (made at the first such batch, one
batch at a time has them), which look pieces up while the caller copies the next
segment, and the caller takes the pieces left (a batch uses the first
``batch_threads - 1`` helpers made: those another reader made beyond stay asleep). Each
piece is the same lookup (the same
prefetching, per-hit seqlock check and per-chunk table sequence check); the answer is
the one-thread answer of the keys. A helper spins ~0.1 ms for more work after a piece,
then sleeps; a helper that is not running (a busy machine) only leaves its pieces to the
caller, but one preempted inside a piece is waited for. The stats counter ``retries``
may miss increments made by helpers.

Reads segment (writable by same-user clients)::

    [ header: 256 bytes (magic KVSHMRR1, nrec, head @64, tail @128) | nrec x 16 bytes ]

Every lock-free read, once its copy is validated, takes tickets (a CAS on ``head``: the
global order of reads) and writes ``(seq, slot, version)`` records; the server applies them in ticket order
(:meth:`IndexWriter.drain`) before its own LRU touches and before every eviction
decision, so the LRU stays exact. A full ring makes readers ask the server instead.
"""

import fcntl
import operator
import os
import time
import warnings

import posix_ipc

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memchr, memcmp, memcpy, memset
from libc.stdlib cimport malloc, realloc, free as c_free
from posix.mman cimport (mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_PRIVATE,
                         MAP_ANONYMOUS)
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE,
                             PyBUF_ANY_CONTIGUOUS, PyBUF_WRITABLE)
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from libc.errno cimport errno

cdef extern from "<sys/mman.h>" nogil:
    void* MAP_FAILED
    int MAP_POPULATE
    int madvise(void* addr, size_t length, int advice)

cdef extern from *:
    """
    #ifndef MADV_POPULATE_READ
    #define MADV_POPULATE_READ 22   /* Linux 5.14 */
    #endif
    """
    int MADV_POPULATE_READ

cdef extern from "<fcntl.h>" nogil:
    int posix_fallocate(int fd, long offset, long length)

cdef extern from "<sys/file.h>" nogil:
    int flock(int fd, int op)
    int LOCK_SH
    int LOCK_NB
    int LOCK_UN

cdef extern from "<unistd.h>" nogil:
    int c_close_fd "close"(int fd)

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL
    PyObject** PySequence_Fast_ITEMS(object o)

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #include <time.h>
    static inline uint64_t kvx_load_acq(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline uint64_t kvx_load_rlx(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    static inline void kvx_store_rel(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
    static inline void kvx_store_rlx(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
    static inline void kvx_fence_acq(void) { __atomic_thread_fence(__ATOMIC_ACQUIRE); }
    static inline void kvx_fence_rel(void) { __atomic_thread_fence(__ATOMIC_RELEASE); }
    static inline int kvx_cas(uint64_t *p, uint64_t *expected, uint64_t desired) {
        return __atomic_compare_exchange_n(p, expected, desired, 0,
                                           __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
    }
    static inline void kvx_prefetch(const void *p) { __builtin_prefetch(p, 0, 1); }
    /* A slot a publish is about to write (one cache line: layout 5), for writing. */
    static inline void kvx_prefetch_slot_w(const void *p) {
        __builtin_prefetch(p, 1, 3);
    }
    /* Prefetch a key's home slot and the one after it in the table of n slots from
       slot base, and in the old one (on slots from obase) when on != 0. A macro: GCC
       takes a function that only prefetches for one without effects and may drop
       its calls (it did, with a Cython inline method). */
    #define KVX_PREFETCH_KEY(slots, h, base, n, obase, on) do {                         \
        uint64_t kvx_pk_ = (base) + kvx_home((h), (n));                                  \
        __builtin_prefetch((slots) + kvx_pk_ * 64, 0, 1);                                \
        __builtin_prefetch((slots) + (kvx_pk_ + 1) * 64, 0, 1);                          \
        if (on) {                                                                        \
            kvx_pk_ = (obase) + kvx_home((h), (on));                                     \
            __builtin_prefetch((slots) + kvx_pk_ * 64, 0, 1);                            \
            __builtin_prefetch((slots) + (kvx_pk_ + 1) * 64, 0, 1);                      \
        }                                                                                \
    } while (0)
    static inline void kvx_pause(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__)
        __asm__ __volatile__("yield");
    #endif
    }
    /* a key's home slot in a table of n slots: the hash's high bits scaled to n (any n,
       not only powers of two: the table grows by a fraction) */
    static inline uint64_t kvx_home(uint64_t h, uint64_t n) {
        return (uint64_t)(((unsigned __int128)h * n) >> 64);
    }
    static inline uint64_t kvx_fmix(uint64_t h) {
        h ^= h >> 33; h *= 0xff51afd7ed558ccdULL;
        h ^= h >> 33; h *= 0xc4ceb9fe1a85ec53ULL;
        h ^= h >> 33; return h;
    }
    /* 64-bit hash of a key: 8 bytes a step, mixed, then murmur3's finalizer. The
       server and every reader run this same function (the table stores it). */
    static inline uint64_t kvx_hash(const char *s, size_t n) {
        uint64_t h = 0x9e3779b97f4a7c15ULL ^ (n * 0xc2b2ae3d27d4eb4fULL);
        uint64_t w;
        while (n >= 8) {
            memcpy(&w, s, 8);
            h ^= w * 0x87c37b91114253d5ULL;
            h = (h << 31) | (h >> 33);
            h *= 0x4cf5ad432745937fULL;
            s += 8; n -= 8;
        }
        w = 0;
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        /* the same word memcpy makes of the 0-7 bytes left, without a call */
        for (size_t b = 0; b < n; b++) w |= (uint64_t)(unsigned char)s[b] << (8 * b);
    #else
        memcpy(&w, s, n);
    #endif
        h ^= w * 0x87c37b91114253d5ULL;
        return kvx_fmix(h);
    }
    /* kvx_hash(s, n), copying the key to d on the way: the words the hash reads are
       the words written (d must have room for n + 8 bytes: the last word is written
       whole, its bytes past n zero) */
    static inline uint64_t kvx_hash_copy(const char *s, size_t n, char *d) {
        uint64_t h = 0x9e3779b97f4a7c15ULL ^ (n * 0xc2b2ae3d27d4eb4fULL);
        uint64_t w;
        char *d0 = d;
        while (n >= 8) {
            memcpy(&w, s, 8);
            memcpy(d, &w, 8);
            h ^= w * 0x87c37b91114253d5ULL;
            h = (h << 31) | (h >> 33);
            h *= 0x4cf5ad432745937fULL;
            s += 8; d += 8; n -= 8;
        }
        #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        /* the 0-7 bytes left as one word (byte b at bits 8b), by whole loads, not a
           byte loop: a key of 8 bytes or more ends with them, so the 8 bytes that end
           the key (read backwards from its end, all in it) shifted down leave them;
           a shorter one is read in (overlapping) 4-byte or 1-byte loads */
        if (n == 0) {
            w = 0;
        } else if (d != d0) {
            memcpy(&w, s + n - 8, 8);
            w >>= 8 * (8 - n);
        } else if (n >= 4) {
            uint32_t lo, hi;
            memcpy(&lo, s, 4); memcpy(&hi, s + n - 4, 4);
            w = (uint64_t)lo | ((uint64_t)hi << (8 * (n - 4)));
        } else {
            w = (uint64_t)(unsigned char)s[0] | ((uint64_t)(unsigned char)s[n >> 1] << (8 * (n >> 1)))
                | ((uint64_t)(unsigned char)s[n - 1] << (8 * (n - 1)));
        }
        memcpy(d, &w, 8);
    #else
        w = 0;
        memcpy(&w, s, n);
        memcpy(d, s, n);
    #endif
        h ^= w * 0x87c37b91114253d5ULL;
        return kvx_fmix(h);
    }
    /* memcmp(a, b, n) == 0 for the short keys of a slot, inline */
    static inline int kvx_keyeq(const char *a, const char *b, size_t n) {
        uint64_t x, y;
        while (n >= 8) {
            memcpy(&x, a, 8); memcpy(&y, b, 8);
            if (x != y) return 0;
            a += 8; b += 8; n -= 8;
        }
        while (n--) if (*a++ != *b++) return 0;
        return 1;
    }
    /* kvx_keyeq(a, b, n) for a batch lookup (n >= 1): word by word with no branch per
       word, the last word masked to the key's bytes. Both may be read up to n rounded
       up to 8 bytes: a, a key in a batch's scratch (room for 8 bytes after every key);
       b, a slot's key (in the slot's C_DATA bytes or a wide record, both multiples of
       8 bytes from the key's start). */
    static inline int kvx_keyeq_w(const char *a, const char *b, size_t n) {
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        uint64_t x, y, d;
        size_t last = (n - 1) & ~(size_t)7;          /* where the last word starts */
        memcpy(&x, a + last, 8); memcpy(&y, b + last, 8);
        d = (x ^ y) & (~0ULL >> (8 * (last + 8 - n)));
        for (size_t i = 0; i < last; i += 8) {
            memcpy(&x, a + i, 8); memcpy(&y, b + i, 8);
            if (x != y) return 0;
        }
        return d == 0;
    #else
        return kvx_keyeq(a, b, n);
    #endif
    }
    /* Bumped in the child of every fork() (pthread_atfork): a reader made before a fork
       sees another generation in the child and sends its reads to the server (whose
       client then says it was made before fork), with no getpid() per read. */
    #include <pthread.h>
    static volatile uint64_t kvx_fork_gen = 0;
    /* Batch lookup helpers: at most KVX_MAXH threads of the process (made at the first
       batch that asks for them). One batch at a time holds them (kvx_pool_take; another
       batch meanwhile looks its keys up alone). The batch's thread publishes a segment
       as pieces (kvx_work_publish: the ticket, gen << 40 | pieces << 20 | next piece),
       then it and the helpers claim pieces (a CAS on the ticket) until none is left, and
       it waits for the pieces claimed to finish: a helper that is not running (a busy
       machine) costs nothing but its wake-up. A helper spins ~KVX_SPIN pauses for the
       next segment (they come every ~50 us), then sleeps on the condition variable. */
    #include <sched.h>
    #define KVX_MAXH 7
    #define KVX_SPIN 4000
    /* a helper looks up pieces of the batch holding the helpers only when its index is
       below that batch's count (IndexReader.batch_threads - 1): helpers another batch
       started beyond it stay asleep */
    #define KVX_MINE(idx) ((idx) < __atomic_load_n(&kvx_work.active, __ATOMIC_ACQUIRE))
    #define KVX_SET_ACTIVE(n) __atomic_store_n(&kvx_work.active, (n), __ATOMIC_RELEASE)
    typedef void (*kvx_piecefn)(void *self, void *desc, uint32_t piece);
    static struct {
        kvx_piecefn fn;
        void *self, *desc;      /* written before the ticket that names them */
        uint64_t ticket;
        uint64_t finished;      /* pieces of the ticket's segment finished */
        uint64_t gen;
        uint64_t helped;        /* pieces helpers ran (stats) */
        int busy, nstarted, sleepers;
        int active;             /* helpers (by index) the batch holding them may use */
        pthread_mutex_t mu;
        pthread_cond_t cv;
        uint64_t hpieces[KVX_MAXH];     /* pieces each helper ran (stats) */
    } kvx_work = {NULL, NULL, NULL, 0, 0, 0, 0, 0, 0, 0, 0,
                  PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, {0}};
    /* claim a piece of the published segment: 1 (its index in *piece), 0 (none left) */
    static inline int kvx_work_claim(uint32_t *piece) {
        uint64_t t = __atomic_load_n(&kvx_work.ticket, __ATOMIC_ACQUIRE);
        for (;;) {
            uint32_t next = (uint32_t)(t & 0xFFFFF), np = (uint32_t)((t >> 20) & 0xFFFFF);
            if (next >= np) return 0;
            if (__atomic_compare_exchange_n(&kvx_work.ticket, &t, t + 1, 0,
                                            __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                *piece = next;
                return 1;
            }
        }
    }
    static void *kvx_helper_main(void *arg) {
        uint32_t piece;
        int spins = 0, idx = (int)(intptr_t)arg;
        for (;;) {
            if (KVX_MINE(idx) && kvx_work_claim(&piece)) {
                kvx_work.fn(kvx_work.self, kvx_work.desc, piece);
                __atomic_add_fetch(&kvx_work.helped, 1, __ATOMIC_RELAXED);
                __atomic_add_fetch(&kvx_work.hpieces[idx], 1, __ATOMIC_RELAXED);
                __atomic_add_fetch(&kvx_work.finished, 1, __ATOMIC_RELEASE);
                spins = 0;
                continue;
            }
            if (++spins < KVX_SPIN) { kvx_pause(); continue; }
            pthread_mutex_lock(&kvx_work.mu);
            __atomic_add_fetch(&kvx_work.sleepers, 1, __ATOMIC_SEQ_CST);
            for (;;) {
                uint64_t t = __atomic_load_n(&kvx_work.ticket, __ATOMIC_SEQ_CST);
                if (KVX_MINE(idx) && (t & 0xFFFFF) < ((t >> 20) & 0xFFFFF)) break;
                pthread_cond_wait(&kvx_work.cv, &kvx_work.mu);
            }
            __atomic_sub_fetch(&kvx_work.sleepers, 1, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&kvx_work.mu);
            spins = 0;
        }
        return NULL;
    }
    /* take the helpers for one batch, with up to n of them started: how many there are
       (0: none: another batch has them, or no thread could be made) */
    static int kvx_pool_take(int n) {
        int expected = 0;
        if (n > KVX_MAXH) n = KVX_MAXH;
        if (n <= 0 || !__atomic_compare_exchange_n(&kvx_work.busy, &expected, 1, 0,
                                                   __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            return 0;
        while (kvx_work.nstarted < n) {
            pthread_t th;
            pthread_attr_t at;
            int bad;
            pthread_attr_init(&at);
            pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
            pthread_attr_setstacksize(&at, 256 << 10);
            bad = pthread_create(&th, &at, kvx_helper_main,
                                 (void *)(intptr_t)kvx_work.nstarted);
            pthread_attr_destroy(&at);
            if (bad) break;
            kvx_work.nstarted++;
        }
        if (kvx_work.nstarted == 0) {
            __atomic_store_n(&kvx_work.busy, 0, __ATOMIC_RELEASE);
            return 0;
        }
        if (kvx_work.nstarted < n) n = kvx_work.nstarted;
        KVX_SET_ACTIVE(n);
        return n;
    }
    static uint64_t kvx_helped(void) { return __atomic_load_n(&kvx_work.helped, __ATOMIC_RELAXED); }
    static int kvx_helpers(void) { return kvx_work.nstarted; }
    static uint64_t kvx_helper_pieces(int i) {
        return __atomic_load_n(&kvx_work.hpieces[i], __ATOMIC_RELAXED);
    }
    static void kvx_pool_give(void) { __atomic_store_n(&kvx_work.busy, 0, __ATOMIC_RELEASE); }
    /* publish a segment of np pieces (np < 2 ** 20): fn(self, desc, piece) each */
    static void kvx_work_publish(void *fn, void *self, void *desc, uint32_t np) {
        kvx_work.fn = (kvx_piecefn)fn;
        kvx_work.self = self;
        kvx_work.desc = desc;
        __atomic_store_n(&kvx_work.finished, 0, __ATOMIC_RELAXED);
        kvx_work.gen = (kvx_work.gen + 1) & 0xFFFFFF;
        __atomic_store_n(&kvx_work.ticket, (kvx_work.gen << 40) | ((uint64_t)np << 20),
                         __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&kvx_work.sleepers, __ATOMIC_SEQ_CST)) {
            pthread_mutex_lock(&kvx_work.mu);
            pthread_cond_broadcast(&kvx_work.cv);
            pthread_mutex_unlock(&kvx_work.mu);
        }
    }
    /* (the batch's thread) a piece it ran is finished */
    static inline void kvx_work_finished(void) {
        __atomic_add_fetch(&kvx_work.finished, 1, __ATOMIC_RELEASE);
    }
    /* wait until all np pieces are finished (they are all claimed) */
    static void kvx_work_wait(uint32_t np) {
        int spins = 0;
        while (__atomic_load_n(&kvx_work.finished, __ATOMIC_ACQUIRE) != np) {
            if (++spins < 2000) kvx_pause();
            else sched_yield();         /* a helper preempted mid-piece: let it run */
        }
    }
    static void kvx_on_fork_child(void) {
        kvx_fork_gen++;
        /* the child has none of the parent's threads (nor its batch) */
        kvx_work.nstarted = 0;
        kvx_work.busy = 0;
        kvx_work.sleepers = 0;
        kvx_work.active = 0;
        kvx_work.ticket = 0;
        pthread_mutex_init(&kvx_work.mu, NULL);
        pthread_cond_init(&kvx_work.cv, NULL);
    }
    static int kvx_atfork_done = 0;
    static inline int kvx_watch_forks(void) {
        if (kvx_atfork_done) return 0;
        kvx_atfork_done = 1;
        return pthread_atfork(NULL, NULL, kvx_on_fork_child);
    }
    static inline uint64_t kvx_forks(void) { return kvx_fork_gen; }
    #include <fcntl.h>
    /* give back the pages of [off, off + len) of fd (FALLOC_FL_PUNCH_HOLE | KEEP_SIZE) */
    static inline int kvx_punch(int fd, long off, long len) { return fallocate(fd, 0x02 | 0x01, off, len); }
    static inline double kvx_fine_now(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec + ts.tv_nsec * 1e-9;
    }
    static inline double kvx_thread_cpu(void) {
        struct timespec ts;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
        return ts.tv_sec + ts.tv_nsec * 1e-9;
    }
    /* A batch key's bytes from a borrowed reference: 1 (bytes, or str: its cached
       UTF-8), 0 (another type, or a str with no UTF-8 form), -1 (an error is set) */
    static inline int kvx_key_of(PyObject *o, const char **p, Py_ssize_t *n) {
        if (PyBytes_CheckExact(o)) {
            *p = PyBytes_AS_STRING(o);
            *n = PyBytes_GET_SIZE(o);
            return 1;
        }
        if (PyUnicode_CheckExact(o)) {
            *p = PyUnicode_AsUTF8AndSize(o, n);
            if (*p != NULL) return 1;
            if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return -1;
            PyErr_Clear();
        }
        return 0;
    }
    /* items[i] = True where out[i] == hit, else False (a new list's items), with the
       references added once for each of the two, not one Py_INCREF an item */
    static inline void kvx_fill_bools(PyObject **items, const char *out, Py_ssize_t n,
                                      char hit) {
        Py_ssize_t i, hits = 0;
        PyObject *t = Py_True, *f = Py_False;
        for (i = 0; i < n; i++) {
            int h = out[i] == hit;
            items[i] = h ? t : f;
            hits += h;
        }
        t->ob_refcnt += hits;
        f->ob_refcnt += n - hits;
    }
    static inline double kvx_now(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
        return ts.tv_sec + ts.tv_nsec * 1e-9;
    }
    """
    uint64_t kvx_load_acq(const uint64_t* p) nogil
    uint64_t kvx_load_rlx(const uint64_t* p) nogil
    void kvx_store_rel(uint64_t* p, uint64_t v) nogil
    void kvx_store_rlx(uint64_t* p, uint64_t v) nogil
    void kvx_fence_acq() nogil
    void kvx_fence_rel() nogil
    int kvx_cas(uint64_t* p, uint64_t* expected, uint64_t desired) nogil
    void kvx_prefetch(const void* p) nogil
    void kvx_prefetch_slot_w(const void* p) nogil
    void KVX_PREFETCH_KEY(const char* slots, uint64_t h, uint64_t base, uint64_t n,
                          uint64_t obase, uint64_t on) nogil
    void kvx_pause() nogil
    int kvx_pool_take(int n) nogil
    void kvx_pool_give() nogil
    uint64_t kvx_helped() nogil
    int kvx_helpers() nogil
    uint64_t kvx_helper_pieces(int i) nogil
    int kvx_work_claim(uint32_t* piece) nogil
    void kvx_work_publish(void* fn, void* self, void* desc, uint32_t np) nogil
    void kvx_work_finished() nogil
    void kvx_work_wait(uint32_t np) nogil
    uint64_t kvx_hash(const char* s, size_t n) nogil
    uint64_t kvx_hash_copy(const char* s, size_t n, char* d) nogil
    uint64_t kvx_home(uint64_t h, uint64_t n) nogil
    int kvx_keyeq(const char* a, const char* b, size_t n) nogil
    int kvx_keyeq_w(const char* a, const char* b, size_t n) nogil
    double kvx_now() nogil
    int kvx_key_of(PyObject* o, const char** p, Py_ssize_t* n) except -1
    double kvx_fine_now() nogil
    void kvx_fill_bools(PyObject** items, const char* out, Py_ssize_t n, char hit)
    double kvx_thread_cpu() nogil
    int kvx_punch(int fd, long off, long length) nogil
    int kvx_watch_forks() nogil
    uint64_t kvx_forks() nogil


if kvx_watch_forks() != 0:
    raise ImportError("kvshm._shmindex: pthread_atfork failed")


#: Most block runs one entry may have (kvshm.index.MAX_EXTENTS).
MAX_EXTENTS = 8
#: Longest key the table holds (in a wide record when its key, checksum and runs do not
#: fit in a slot's SLOT_DATA bytes); longer keys are not published (readers ask the server).
KEY_MAX = 152
#: Bytes per slot (one cache line).
SLOT_SIZE = 64
#: Bytes of a slot shared by the key, the checksum and the runs.
SLOT_DATA = 48
#: Largest value size a slot holds (40 bits of its meta word: 1 TiB - 1); a larger value
#: is not published (readers ask the server).
SLOT_SIZE_MAX = (1 << 40) - 1
#: Bytes of the largest wide record class (key, checksum and runs of an entry a slot
#: cannot hold; the smaller classes are 64 and 128 bytes).
WIDE_SIZE = 256
#: Slots a table starts with (at most its capacity); it grows as :data:`GROWTH` says.
INITIAL_SLOTS = 4096
#: The table's growth, ``(at, by)`` in sixteenths: a growth starts when live keys and
#: tombstones fill ``at``/16 of the slots, and adds ``by``/16 slots (at least 64); a new key
#: is refused (or the growth under way finished at once) at ``at + 1``/16. (13, 8): from
#: 13/16 full by half, the table between ~0.54 and ~0.81 full as keys come, ~158 to ~236
#: bytes of it per key (layout 4's 128-byte slots); it was (11, 8) before: from 11/16 by
#: half, 0.46 to 0.69 full, ~186 to ~279 bytes per key. (13, 4), by a quarter, holds it at
#: 0.65-0.81 (158-197 bytes) but moves each key about twice as often while the table
#: fills: publish CPU 2,173 against 1,278 ns/key in one run of perf/bench_growth.py at 2 M
#: keys (load 6.4), with lookups the same at the same load.
GROWTH = (13, 8)
#: Environment variable: ``AT,BY`` (sixteenths, as :data:`GROWTH`) when an
#: :class:`IndexWriter` is made without ``growth=`` (A/B figures; "11,8": the old policy).
ENV_GROWTH = "KVSHM_INDEX_GROWTH"
#: Old slots one step of a growth or rebuild looks at (its live ones are moved).
MIGRATE_STEP = 64
#: Slots one step of a growth reserves, or gives back once moved.
RESERVE_STEP = 2048
#: Bytes of the index segment's header.
HEADER_SIZE = 4096
#: Seconds a table that /dev/shm had no room to grow or rebuild waits before it tries again.
ROOM_RETRY_S = 1.0
#: Records of the reads ring.
RING_RECORDS = 65536
#: Environment variable: set (to anything but "" or "0") when an :class:`IndexReader` is
#: made, its batch lookups go one key at a time (no prefetch; A/B figures, tests).
ENV_NO_FAST_BATCH = "KVSHM_NO_FAST_BATCH_READS"
#: Environment variable: threads (1 to 8, this one included) a batch lookup of at least
#: :data:`BATCH_THREADS_MIN` keys looks its keys up with (read when an
#: :class:`IndexReader` is made; :attr:`IndexReader.batch_threads` after); 1: this thread
#: only. Default :func:`default_batch_threads`.
ENV_BATCH_THREADS = "KVSHM_BATCH_READ_THREADS"


def default_batch_threads():
    """Threads a batch lookup uses when :data:`ENV_BATCH_THREADS` is not set: 1 (the
    caller's only). More threads are opt-in: not yet measured faster on a quiet host,
    they cost CPU (helpers spin for work) and on a busy one (an inference host's cores
    run the engine) a helper preempted inside a piece makes the caller wait; a CPU
    quota (cgroup) is not seen in the affinity mask a count could be taken from."""
    return 1


def batch_helper_stats():
    """The batch lookups' helper threads of this process: ``{"threads": made,
    "pieces": pieces of segments they looked up, "by_helper": each helper's pieces, in
    the order made}`` (:attr:`IndexReader.batch_threads`; a batch uses the first
    ``batch_threads - 1`` helpers only)."""
    return {"threads": kvx_helpers(), "pieces": kvx_helped(),
            "by_helper": [kvx_helper_pieces(i) for i in range(kvx_helpers())]}


def _growth(growth):
    """``growth`` (None: :data:`ENV_GROWTH`, else :data:`GROWTH`) checked: ``(at, by)``,
    whole numbers (an int, not a float or a str), 8 <= at <= 14 (a growth needs half the
    slots live: below 8/16 the table would refuse keys it never grows for),
    1 <= by <= 16 (ValueError otherwise, naming the argument or the variable as given)."""
    src = "growth"
    shown = growth
    if growth is None:
        v = os.environ.get(ENV_GROWTH, "").strip()
        if not v:
            return GROWTH
        src = ENV_GROWTH
        shown = v
        try:
            growth = tuple(int(x) for x in v.split(","))
        except ValueError:
            raise ValueError(f"{ENV_GROWTH}={v!r}: not AT,BY (whole sixteenths)") from None
    try:
        at, by = growth
        at, by = operator.index(at), operator.index(by)
    except (TypeError, ValueError):
        raise ValueError(f"{src}={shown!r}: not (at, by) in whole sixteenths") from None
    if not (8 <= at <= 14 and 1 <= by <= 16):
        raise ValueError(f"{src}={shown!r}: at must be 8 .. 14 and by 1 .. 16 (sixteenths)")
    return (int(at), int(by))


def growth_policy(growth=None):
    """The table growth ``(at, by)`` an :class:`IndexWriter` made with ``growth=`` would
    take (None: :data:`ENV_GROWTH` if set, else :data:`GROWTH`), checked as
    :meth:`IndexWriter.create` checks it. Raises ValueError (naming the argument or the
    variable) for a bad one; a server checks it before making its pool."""
    return _growth(growth)


def _env_threads():
    v = os.environ.get(ENV_BATCH_THREADS, "")
    if v.strip() == "":
        return default_batch_threads()
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{ENV_BATCH_THREADS}={v!r}: not a whole number") from None
    return max(1, min(8, n))           # (C_MAX_THREADS)

_MAGIC = b"KVSHMIX1"
_RING_MAGIC = b"KVSHMRR1"
_LAYOUT = 5     # (3: size @24, key @32; 4: 128-byte slots, key @24, size @120;
                #  5: 64-byte slots, meta word @8, key @16)

DEF C_MAX_EXT = 8
DEF C_KEY_MAX = 152
DEF C_SLOT = 64
DEF C_DATA = 48
DEF C_SIZE_BITS = 40              # (SLOT_SIZE_MAX: 2 ** 40 - 1)
DEF C_WIDE = 256
DEF C_RECS_BYTES = 448       # a record of each class (64 + 128 + 256) per wide record index
DEF WIDE_CHUNK = 4096        # wide records of a class reserved at a time
DEF C_HEADER = 4096
DEF C_RING_HEADER = 256
# growth / rebuild steps (incremental: one step per publish or unpublish)
DEF STEP_RESERVE = 2048      # slots reserved (posix_fallocate) per step: 256 KiB
DEF STEP_PUNCH = 2048        # old slots given back (punched) per step
DEF P_IDLE = 0
DEF P_RESERVE = 1
DEF P_MIGRATE = 2
DEF P_CLEAN = 3

# slot states
DEF S_EMPTY = 0
DEF S_LIVE = 1
DEF S_TOMB = 2
# header states
DEF H_OPEN = 1
DEF H_CLOSED = 2
# header flags
DEF F_MISSES_FINAL = 1
# slot flags
DEF SF_SUM = 1
# flags bits 1-2: the entry's wide record class (0: none, key and runs in the slot;
# 1, 2, 3: a record of 64, 128, 256 bytes: REC_BYTES(c) = 32 << c)
DEF SF_REC_SHIFT = 1
DEF C_REC_CLASSES = 3

#: Result of a read that must be asked of the server instead (busy slot, closed or dead
#: server, key not publishable, misses not final, ring full).
FALLBACK = -2
#: Result of a read that found nothing (and misses are final).
MISS = -1

DEF R_FALLBACK = -2
DEF R_MISS = -1
DEF R_HIT = 0
DEF R_MORE = 1          # (batch lookups: the probe goes on past the slots looked at)
DEF TRIES = 4
# get()'s copies this large or larger release the GIL (a smaller one into the new bytes
# takes less than the release; get_into's always do: the caller's buffer may be slow)
DEF NOGIL_COPY = 262144
# keys whose slots the batch lookups prefetch ahead of the one looked up
DEF AHEAD = 24
# keys a batch lookup answers under one look at the header's tables (its misses are
# checked against the table sequence once per chunk)
DEF C_CHUNK = 256
# slots a batch lookup looks at from a key's home before it puts the key aside (the
# two it prefetched), and the slots after those it then prefetches for it
DEF FIRST_SLOTS = 2
# keys of up to C_LINE_KEY bytes in one run (and no checksum) lie in the slot (from its
# byte 16); longer ones (or with more runs) in a wide record
DEF C_LINE_KEY = 40
DEF MORE_SLOTS = 4
#: Keys ahead of the one looked up whose slots a batch lookup prefetches.
PREFETCH_AHEAD = AHEAD
#: :meth:`IndexWriter.publish_many` and :meth:`~IndexWriter.publish_runs` prefetch each
#: key's home slot (one cache line) for writing; False: for reading (as before). Read
#: at import from ``KVSHM_PUBLISH_PREFETCH_W`` (``0``: off), for A/B figures.
PUBLISH_PREFETCH_W = os.environ.get("KVSHM_PUBLISH_PREFETCH_W", "1") != "0"
#: Keys a batch lookup answers under one look at the header's tables.
BATCH_CHUNK = C_CHUNK
# a batch lookup's segment: keys copied and hashed into the reader's scratch, then
# looked up, at most C_SEG keys and C_SEG_BYTES of their bytes (the scratch, ~150 KB,
# stays in the L2 cache between the copy and the lookup)
DEF C_SEG = 4096
DEF C_SEG_BYTES = 98304
#: Most keys (and :data:`BATCH_SEGMENT_BYTES` most key bytes) a batch lookup copies, hashes
#: and looks up at a time (one segment; the GIL is released per segment for >= 2048 keys).
BATCH_SEGMENT = C_SEG
BATCH_SEGMENT_BYTES = C_SEG_BYTES
# batch lookups split over helper threads (IndexReader.batch_threads): batches of at
# least C_THREADS_MIN keys, segments of at least C_SPLIT_MIN keys, in pieces of C_PIECE
DEF C_THREADS_MIN = 32768
DEF C_SPLIT_MIN = 2048
DEF C_PIECE = 512
DEF C_MAX_PIECES = 16            # (C_SEG / C_PIECE and more)
DEF C_MAX_THREADS = 8
#: Fewest keys of a batch lookup that is split over :attr:`IndexReader.batch_threads`.
BATCH_THREADS_MIN = C_THREADS_MIN
DEF VOID_SLOT = 0xFFFFFFFF


cdef struct Header:
    char magic[8]
    uint32_t layout
    uint32_t header_size
    uint64_t epoch
    uint64_t nslots
    uint64_t slot_size
    uint64_t block_size
    uint32_t key_max
    uint32_t max_extents
    uint64_t state          # @56
    uint64_t table_seq      # @64
    uint64_t unpublished    # @72
    uint64_t flags          # @80
    uint64_t live           # @88
    uint64_t tombs          # @96
    uint64_t num_blocks     # @104
    char token[16]          # @112
    uint64_t capacity       # @128: slots the segment has room for (nslots grows to it)
    uint64_t wide_capacity  # @136: wide records after the slots
    uint64_t base           # @144: first slot of the table (of 2 x capacity)
    uint64_t old_nslots     # @152: slots of the table being migrated from (0: none)
    uint64_t old_base       # @160: its first slot


cdef struct Slot:
    # one cache line (layout 5)
    uint64_t version        # @0
    # @8: size (bits 0-39), hash tag (40-47: the hash's low byte), key length (48-55),
    # state (56-57), flags (58-59), runs - 1 (60-62): read with one load, decoded by
    # the _m_* functions below; a probe compares bits 40-57 with _m_want(hash, length)
    uint64_t meta
    # @16: the key, then the checksum (flags & 1), then nextents x (u32, u32): unaligned
    char key[C_DATA]


cdef inline uint64_t _m_size(uint64_t m) noexcept nogil:
    return m & ((<uint64_t>1 << C_SIZE_BITS) - 1)


cdef inline uint32_t _m_keylen(uint64_t m) noexcept nogil:
    return <uint32_t>((m >> 48) & 0xFF)


cdef inline uint32_t _m_state(uint64_t m) noexcept nogil:
    return <uint32_t>((m >> 56) & 3)


cdef inline uint32_t _m_flags(uint64_t m) noexcept nogil:
    return <uint32_t>((m >> 58) & 7)


cdef inline uint32_t _m_rec(uint64_t m) noexcept nogil:
    # the wide record class (0: none; 1, 2, 3: 64, 128, 256 bytes)
    return <uint32_t>((m >> 59) & 3)


cdef inline uint32_t _m_next(uint64_t m) noexcept nogil:
    return <uint32_t>(((m >> 61) & 7) + 1)


cdef inline uint64_t _m_want(uint64_t h, uint64_t n) noexcept nogil:
    # bits 40-57 of the meta word of a live slot holding a key of hash h, n bytes
    return (h & 0xFF) | ((n & 0xFF) << 8) | (<uint64_t>S_LIVE << 16)


cdef inline bint _m_is(uint64_t m, uint64_t want) noexcept nogil:
    return ((m >> 40) & 0x3FFFF) == want


cdef inline uint64_t _m_make(uint64_t size, uint64_t h, uint64_t n, uint64_t state,
                             uint64_t flags, uint64_t ne) noexcept nogil:
    # (size < 2 ** C_SIZE_BITS, n <= 255, 1 <= ne <= 8)
    return (size | ((h & 0xFF) << 40) | ((n & 0xFF) << 48) | (state << 56) |
            ((flags & 7) << 58) | (((ne - 1) & 7) << 61))


cdef inline uint64_t _rec_offset(uint64_t wide_cap, uint32_t c, uint32_t w) noexcept nogil:
    # byte offset from the records' start of record w of class c (1 .. 3): the classes'
    # regions of wide_cap records each follow one another (64-, 128-, then 256-byte)
    return wide_cap * ((<uint64_t>32 << c) - 64) + (<uint64_t>w << (5 + c))


cdef inline uint32_t _rec_class(uint64_t need) noexcept nogil:
    # the smallest record class holding ``need`` bytes of key, checksum and runs
    if need <= 64:
        return 1
    if need <= 128:
        return 2
    return 3


cdef inline uint64_t _m_with_state(uint64_t m, uint64_t state) noexcept nogil:
    return (m & ~(<uint64_t>3 << 56)) | (state << 56)


cdef struct SegWork:
    # a segment split into pieces of ``piece`` keys for helper threads (_probe_seg)
    const char* arena
    const uint32_t* offs
    const uint64_t* hashes
    Py_ssize_t nk
    Py_ssize_t piece
    char* out
    bint prefix
    uint32_t np                       # pieces
    Py_ssize_t done[C_MAX_PIECES]     # each piece's _probe_all


cdef struct Rec:
    uint64_t seq
    uint32_t slot
    uint32_t ver


cdef struct Found:
    uint64_t slot
    uint64_t version
    uint64_t size
    uint64_t checksum
    int has_sum
    int nextents
    uint32_t ext[C_MAX_EXT][2]


cdef inline const char* _slot_key(const Slot* s, const char* wide, uint64_t wide_cap,
                                 size_t n, size_t* room) noexcept nogil:
    """Where the key (``n`` bytes) of slot ``s`` lies (its checksum and runs follow it),
    and in ``room`` the bytes there; NULL when a key of ``n`` bytes cannot lie there, or
    for a wide record index past the table's (a torn read)."""
    cdef uint32_t w
    cdef uint32_t c = _m_rec(s.meta)
    if c:
        memcpy(&w, s.key, 4)
        if w >= wide_cap or n > (<size_t>32 << c) or n > C_KEY_MAX:
            return NULL
        room[0] = <size_t>32 << c
        return wide + _rec_offset(wide_cap, c, w)
    if n > C_DATA:
        return NULL
    room[0] = C_DATA
    return s.key


#: Byte offset of the header's state word (kvshm.segments marks dead servers' tables).
STATE_OFFSET = 56
#: The table layout this build writes and reads (the header's u32 at :data:`LAYOUT_OFFSET`;
#: a reader refuses a table of another layout with ValueError, and its client asks the
#: server instead). 5: 64-byte slots, the meta word at byte 8 (:data:`SLOT_META_OFFSET`),
#: the key from byte 16 (:data:`SLOT_KEY_OFFSET`).
LAYOUT = _LAYOUT
#: Byte offset of the header's layout word.
LAYOUT_OFFSET = 8
#: Byte offset in a slot of its meta word (u64: size in bits 0-39, hash tag 40-47, key
#: length 48-55, state 56-57, flags 58-59, runs - 1 60-62).
SLOT_META_OFFSET = 8
#: Byte offset in a slot of its 48 bytes of key, checksum and runs (or wide record index).
SLOT_KEY_OFFSET = 16
#: Byte offset in a slot of the u64 whose low 40 bits are its value's size (the meta word).
SLOT_SIZE_OFFSET = SLOT_META_OFFSET
#: Value of the state word of a closed table.
STATE_CLOSED = H_CLOSED


def _norm(name):
    if not isinstance(name, str):
        raise TypeError(f"segment name must be str, got {type(name).__name__}")
    bare = name[1:] if name.startswith("/") else name
    if not bare or "/" in bare or len(bare) > 250 or "\0" in bare:
        raise ValueError(f"invalid shared-memory name {name!r}")
    return "/" + bare


cdef int _key_ptr(object key, const char** p, Py_ssize_t* n) except -1:
    """Pointer and length of a bytes or str key (str: its cached UTF-8)."""
    if type(key) is bytes:
        p[0] = PyBytes_AS_STRING(key)
        n[0] = PyBytes_GET_SIZE(key)
        return 1
    if type(key) is str:
        try:
            p[0] = PyUnicode_AsUTF8AndSize(key, n)
        except UnicodeEncodeError:
            return 0
        return 1
    return 0


def key_hash(key):
    """The table's 64-bit hash of ``key`` (bytes or str)."""
    cdef const char* p
    cdef Py_ssize_t n
    if not _key_ptr(key, &p, &n):
        raise TypeError("key must be bytes or str")
    return kvx_hash(p, n)


def _batch_key_hash(bytes key):
    """(for tests) :func:`key_hash` as a batch lookup computes it (kvx_hash_copy, the key
    copied to a scratch on the way): ``(hash, the bytes copied)``."""
    cdef Py_ssize_t n = len(key)
    cdef bytearray d = bytearray(n + 8)
    cdef uint64_t h = kvx_hash_copy(key, n, <char*>d)
    return h, bytes(d[:n])


def _batch_key_equal(bytes a, bytes b):
    """(for tests) The batch lookups' key comparison (kvx_keyeq_w) of ``a`` (as in a
    batch's scratch) with the first ``len(a)`` bytes of ``b`` (as in a slot: ``b`` must
    have ``len(a)`` rounded up to 8 bytes or more); ValueError otherwise."""
    cdef Py_ssize_t n = len(a)
    if n < 1 or len(b) < (n + 7) // 8 * 8:
        raise ValueError("a must not be empty and b must hold len(a) rounded up to 8")
    cdef bytearray sa = bytearray(a) + bytearray(8)
    return bool(kvx_keyeq_w(<char*>sa, b, n))


cdef uint64_t _pow2(uint64_t n):
    cdef uint64_t p = 64
    while p < n:
        p <<= 1
    return p


def default_slots(Py_ssize_t num_blocks):
    """Capacity (most slots) of the table of a pool of ``num_blocks`` blocks: the next power
    of two >= 2 x blocks (every live entry holds a block, so the table is at most half
    full). The table starts with :data:`INITIAL_SLOTS` and grows (:data:`GROWTH`) as keys come:
    only the slots in use take memory."""
    return _pow2(2 * max(1, num_blocks))


#: A reader pre-faults a table up to this size (the pool's rule, kvshm.client).
POPULATE_MAX_BYTES = 256 << 20


cdef char* _map(int fd, size_t size, bint writable, bint populate=False) except NULL:
    cdef void* p
    cdef int prot = PROT_READ | (PROT_WRITE if writable else 0)
    cdef int flags = MAP_SHARED | (MAP_POPULATE if populate else 0)
    with nogil:
        p = mmap(NULL, size, prot, flags, fd, 0)
    if p == MAP_FAILED:
        raise OSError(errno, f"mmap of {size} bytes failed: {os.strerror(errno)}")
    return <char*>p


cdef object _create_segment(str name, size_t size, size_t reserve=0):
    """Create ``name`` of ``size`` bytes, of which the first ``reserve`` (0: all) are
    reserved with posix_fallocate (a full /dev/shm is an error here, never a SIGBUS when
    the server first touches a slot; a table reserves the rest as it grows)."""
    cdef int rc, fd
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
    except posix_ipc.ExistentialError:
        raise FileExistsError(f"shared-memory segment {name} already exists") from None
    except posix_ipc.PermissionsError as exc:
        raise PermissionError(f"cannot create shared-memory segment {name}: {exc}") from None
    fd = shm.fd
    if reserve == 0 or reserve > size:
        reserve = size
    try:
        os.ftruncate(fd, size)
    except OSError:
        shm.close_fd()
        shm.unlink()
        raise
    with nogil:
        rc = posix_fallocate(fd, 0, reserve)
    if rc != 0:
        shm.close_fd()
        shm.unlink()
        raise OSError(rc, f"cannot reserve {size} bytes for shared-memory segment {name} "
                          f"({os.strerror(rc)}); free space in /dev/shm, or ask for fewer "
                          "index slots (shared_index_slots)")
    return shm


cdef class IndexWriter:
    """The server's side of the shared index and of the reads ring.

    Made with :meth:`create`; holds an ``flock`` on both segments (its liveness proof, as
    the pool's) until :meth:`unlink`. Runs in the server's one store thread.
    """

    cdef char* _map
    cdef size_t _map_size
    cdef Header* _h
    cdef char* _slots
    cdef uint64_t _nslots
    cdef uint64_t _cap        # slots the segment has room for (the table grows to it)
    cdef char* _wide          # the wide records (three classes: 64, 128, 256 bytes)
    cdef uint64_t _wide_cap   # wide records of each class the segment has room for
    # per class (index 1 .. 3; 0 unused)
    cdef uint64_t _wide_res[4]    # reserved (posix_fallocate) so far
    cdef uint64_t _wide_next[4]   # never used at or above this
    cdef uint32_t* _wfree[4]      # freed records (a stack)
    cdef uint64_t _wfree_n[4]
    cdef uint64_t _wfree_cap[4]
    cdef uint64_t _live
    cdef uint64_t _tombs
    cdef uint64_t _limit      # live + tombs above this: refuse (or finish a growth first)
    cdef uint64_t _trigger    # live + tombs above this: start a growth or rebuild
    cdef uint64_t _base       # first slot of the table (region 0 or region 1)
    cdef uint64_t _half       # slots of a region (the capacity): 2 regions in the segment
    cdef uint64_t _room       # slots of the segment (2 x capacity)
    cdef int _phase           # P_IDLE / P_RESERVE / P_MIGRATE / P_CLEAN
    cdef uint64_t _obase      # the table migrated from (while P_MIGRATE)
    cdef uint64_t _onslots
    cdef uint64_t _cursor     # next old slot the migration looks at
    cdef uint64_t _pbase      # the table reserved (while P_RESERVE)
    cdef uint64_t _pn
    cdef uint64_t _pdone
    cdef uint64_t _cbase      # the slots given back (while P_CLEAN)
    cdef uint64_t _cn
    cdef uint64_t _cdone
    cdef double _room_retry_at  # /dev/shm refused a table: no growth or rebuild before this
    cdef uint64_t _vmax       # highest slot version written
    cdef uint64_t _vbase      # versions of a new table start above every one before
    cdef uint64_t _work       # slots of table upkeep in the current call
    cdef uint64_t _move_step  # old slots a migration step looks at
    cdef uint64_t _at16       # growth from _at16/16 full (live + tombs), refusals at +1/16
    cdef uint64_t _by16       # a growth adds _by16/16 slots
    cdef readonly uint64_t max_step
    cdef readonly double max_step_s
    cdef readonly double max_step_cpu_s
    cdef readonly uint64_t steps
    cdef readonly double steps_cpu_s
    cdef readonly uint64_t sync_finishes
    cdef char* _ring
    cdef size_t _ring_size
    cdef uint64_t _nrec
    cdef uint64_t _tail
    cdef double _stuck_since
    cdef uint64_t _stuck_at
    cdef uint64_t _stuck_head    # head when the stuck ticket was first seen
    cdef uint64_t _skip_to       # dropping unwritten tickets below this (0: not dropping)
    cdef readonly str name
    cdef readonly str reads_name
    cdef readonly uint64_t epoch
    cdef readonly uint64_t rebuilds
    cdef readonly uint64_t skipped_records
    cdef readonly uint64_t reads_applied
    cdef set _unpub
    cdef long _pid
    cdef int _lock_fd
    cdef int _ring_lock_fd
    cdef bint _unlinked

    def __cinit__(self):
        self._map = NULL
        self._ring = NULL
        cdef int c
        for c in range(4):
            self._wfree[c] = NULL
            self._wfree_n[c] = self._wfree_cap[c] = self._wide_res[c] = self._wide_next[c] = 0
        self._lock_fd = -1
        self._ring_lock_fd = -1
        self._unpub = set()

    def __init__(self):
        raise TypeError("use IndexWriter.create(...)")

    @staticmethod
    def create(str name, str reads_name, uint64_t nslots, *, uint64_t epoch,
               uint64_t block_size, uint64_t num_blocks, bytes token=b"\0" * 16,
               bint misses_final=True, uint64_t ring_records=RING_RECORDS,
               uint64_t initial_slots=INITIAL_SLOTS, uint64_t migrate_step=MIGRATE_STEP,
               growth=None):
        """Create the index segment ``name`` and the reads ring ``reads_name``
        (``ring_records`` records), both mode 0600.

        ``nslots``: the table's capacity in slots (rounded up to a power of two; the
        segment's size is ``HEADER_SIZE + capacity * SLOT_SIZE`` bytes, and as many again
        for 3/4 * capacity wide records of each class: 64, 128 and WIDE_SIZE bytes). It starts with ``initial_slots``
        (at most the capacity) reserved and grows as ``growth`` says (``(at, by)`` in
        sixteenths: from ``at``/16 full by ``by``/16; None: :data:`ENV_GROWTH` if set,
        else :data:`GROWTH`; ValueError for one out of range), so the memory it takes
        follows the keys stored. A growth (or a rebuild that drops
        tombstones) is incremental: the new table lies in the other half of the slots
        (the segment has room for two tables of ``capacity`` slots; only the ones in use
        are reserved), and each publish or unpublish does one bounded step of it
        (reserve up to 2,048 slots, move the live entries of ``migrate_step`` old slots,
        or give back up to 2,048 old slots), readers looking in both tables meanwhile.

        ``misses_final``: a key absent from the table is absent from the store (no tier
        below the pool); readers then answer misses themselves.

        ``migrate_step``: old slots one step of a growth or rebuild looks at (one step
        per publish or unpublish; more than 256 / ((at + 1) * by) for a growth to end
        before the new table is full, else the rest is done at once and counted in
        ``sync_finishes``).

        Raises FileExistsError, PermissionError, OSError (ENOSPC and other errno).
        """
        cdef IndexWriter self = IndexWriter.__new__(IndexWriter)
        cdef uint64_t cap = _pow2(nslots)
        cdef uint64_t n = min(cap, max(<uint64_t>1, initial_slots))
        cdef uint64_t wcap = min(cap - cap // 4, 0xFFFFFFFF)
        cdef uint64_t nrec = _pow2(ring_records)
        cdef Header* h
        if len(token) != 16:
            raise ValueError("token must be 16 bytes")
        at, by = _growth(growth)
        self._at16 = at
        self._by16 = by
        self.name = _norm(name)
        self.reads_name = _norm(reads_name)
        self._pid = os.getpid()
        self._map_size = C_HEADER + 2 * cap * C_SLOT + wcap * C_RECS_BYTES
        self._ring_size = C_RING_HEADER + nrec * sizeof(Rec)
        shm = _create_segment(self.name, self._map_size, C_HEADER + n * C_SLOT)
        try:
            self._map = _map(shm.fd, self._map_size, True)
            self._lock_fd = os.dup(shm.fd)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            shm.close_fd()
            shm.unlink()
            self._cleanup()
            raise
        shm.close_fd()
        try:
            rshm = _create_segment(self.reads_name, self._ring_size)
        except BaseException:
            self._unlinked = True
            posix_ipc.unlink_shared_memory(self.name)
            self._cleanup()
            raise
        try:
            self._ring = _map(rshm.fd, self._ring_size, True)
            self._ring_lock_fd = os.dup(rshm.fd)
            fcntl.flock(self._ring_lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            rshm.close_fd()
            rshm.unlink()
            self._unlinked = True
            posix_ipc.unlink_shared_memory(self.name)
            self._cleanup()
            raise
        rshm.close_fd()
        self._nslots = n
        self._cap = cap
        self._half = cap
        self._move_step = max(<uint64_t>1, migrate_step)
        self._room = 2 * cap
        self._wide = self._map + C_HEADER + 2 * cap * C_SLOT
        self._wide_cap = wcap
        self._set_limits()
        self._slots = self._map + C_HEADER
        self._nrec = nrec
        self.epoch = epoch
        h = <Header*>self._map
        self._h = h
        h.layout = _LAYOUT
        h.header_size = C_HEADER
        h.epoch = epoch
        h.nslots = n
        h.capacity = cap
        h.wide_capacity = wcap
        h.slot_size = C_SLOT
        h.block_size = block_size
        h.num_blocks = num_blocks
        h.key_max = C_KEY_MAX
        h.max_extents = C_MAX_EXT
        cdef bytes magic = _MAGIC, rmagic = _RING_MAGIC
        memcpy(h.token, <char*>token, 16)
        h.flags = F_MISSES_FINAL if misses_final else 0
        memcpy(self._ring, <char*>rmagic, 8)
        (<uint64_t*>(self._ring + 8))[0] = nrec
        (<uint64_t*>(self._ring + 16))[0] = epoch
        kvx_store_rel(&h.state, H_OPEN)
        kvx_fence_rel()
        memcpy(h.magic, <char*>magic, 8)      # last: a reader sees a whole header
        return self

    cdef _cleanup(self):
        if self._map != NULL:
            munmap(self._map, self._map_size)
            self._map = NULL
        if self._ring != NULL:
            munmap(self._ring, self._ring_size)
            self._ring = NULL
        for fd in (self._lock_fd, self._ring_lock_fd):
            if fd >= 0:
                os.close(fd)
        self._lock_fd = self._ring_lock_fd = -1

    # ------------------------------------------------------------ properties

    @property
    def nslots(self):
        """Slots in use now (the table grows up to :attr:`capacity`)."""
        return self._nslots

    @property
    def capacity(self):
        """Most slots the table may grow to."""
        return self._cap

    @property
    def live(self):
        """Keys in the table."""
        return self._live

    @property
    def tombstones(self):
        return self._tombs

    @property
    def unpublished(self):
        """Live keys the table does not hold (too long for a slot, or table full)."""
        return len(self._unpub)

    @property
    def closed(self):
        return self._map == NULL

    def info(self):
        """What a client needs to attach (sent in HELLO)."""
        return {"name": self.name, "reads": self.reads_name, "epoch": self.epoch,
                "slots": self._nslots}

    @property
    def growth(self):
        """``(at, by)``: the table grows from ``at``/16 full by ``by``/16 (:data:`GROWTH`)."""
        return (int(self._at16), int(self._by16))

    def stats(self):
        return {"live": self._live, "tombstones": self._tombs, "slots": self._nslots,
                "capacity": self._cap, "growth": self.growth,
                "unpublished": len(self._unpub), "rebuilds": self.rebuilds,
                "max_step_slots": self.max_step, "max_step_s": self.max_step_s,
                "max_step_cpu_s": self.max_step_cpu_s, "steps": self.steps,
                "steps_cpu_s": self.steps_cpu_s,
                "sync_finishes": self.sync_finishes, "phase": self._phase,
                "skipped_records": self.skipped_records, "reads_applied": self.reads_applied,
                "wide_used": sum(self._wide_next[c] - self._wfree_n[c] for c in range(1, 4)),
                "wide_by_class": {str(32 << c): self._wide_next[c] - self._wfree_n[c]
                                  for c in range(1, 4)}}     # (str keys: sent in STATS)

    cdef inline int _check(self) except -1:
        if self._map == NULL:
            raise ValueError(f"index {self.name} is closed")
        return 0

    cdef inline Slot* _slot(self, uint64_t i) noexcept nogil:
        return <Slot*>(self._slots + i * C_SLOT)

    cdef void _set_limits(self) noexcept nogil:
        cdef uint64_t n = self._nslots
        self._limit = n - (n * (15 - self._at16)) // 16     # (at + 1)/16
        self._trigger = self._limit - n // 16     # at/16: the growth is done by (at + 1)/16

    # ------------------------------------------------------------ writes

    cdef int64_t _find_in(self, uint64_t base, uint64_t nslots, const char* k,
                          Py_ssize_t n, uint64_t h, int64_t* free_at) noexcept nogil:
        """Slot (of the segment) holding the key in the table of ``nslots`` slots from
        ``base``, or -1 (``free_at``: first tombstone or empty on its way)."""
        cdef uint64_t i = kvx_home(h, nslots)
        cdef uint64_t probes, m, want = _m_want(h, n)
        cdef uint32_t st
        cdef Slot* s
        cdef const char* kp
        cdef size_t room
        free_at[0] = -1
        for probes in range(nslots):
            s = self._slot(base + i)
            m = s.meta
            st = _m_state(m)
            if st == S_EMPTY:
                if free_at[0] < 0:
                    free_at[0] = base + i
                return -1
            if st == S_TOMB:
                if free_at[0] < 0:
                    free_at[0] = base + i
            elif _m_is(m, want):
                kp = _slot_key(s, self._wide, self._wide_cap, n, &room)
                if kp != NULL and memcmp(kp, k, n) == 0:
                    return base + i
            i += 1
            if i == nslots:
                i = 0
        return -1

    cdef int64_t _find(self, const char* k, Py_ssize_t n, uint64_t h,
                       int64_t* free_at) noexcept nogil:
        """Slot holding the key, or -1 (``free_at``: first tombstone or empty on its way,
        in the table). A key still in the table a migration moves from is moved first."""
        cdef int64_t i = self._find_in(self._base, self._nslots, k, n, h, free_at)
        cdef int64_t j, dummy
        if i < 0 and self._onslots:
            j = self._find_in(self._obase, self._onslots, k, n, h, &dummy)
            if j >= 0:
                i = self._move(<uint64_t>j)
        return i

    cdef int64_t _move(self, uint64_t j) noexcept nogil:
        """Move the live entry of old slot ``j`` into the table (it is not there: a key
        is in one of them): the copy is written first, then the old slot becomes a
        tombstone, so a reader that looks in the old table, then the new one, never
        misses it. Its wide record, if any, goes along (the old slot no longer points at
        it once the new one may change it). Returns the new slot. (Layout 5 keeps the
        hash's low byte only: the key's hash is computed again here, from its bytes.)"""
        cdef Slot* src = self._slot(j)
        cdef size_t room
        cdef uint32_t kl = _m_keylen(src.meta)
        cdef const char* kp = _slot_key(src, self._wide, self._wide_cap, kl, &room)
        cdef uint64_t i, probes
        cdef Slot* d
        if kp == NULL:
            # not what the server wrote (a same-user process scribbled a wide record
            # index past the records, or a length): no key compare could match it, so
            # it is dropped rather than hashed from memory it does not name
            self._begin_write(src)
            src.meta = _m_with_state(src.meta, S_TOMB)
            self._end_write(src)
            self._live -= 1            # (an old table's tombstones are not counted)
            self._h.live = self._live
            self._work += 1
            return -1
        i = kvx_home(kvx_hash(kp, kl), self._nslots)
        for probes in range(self._nslots):
            if _m_state(self._slot(self._base + i).meta) != S_LIVE:
                break
            i += 1
            if i == self._nslots:
                i = 0
        d = self._slot(self._base + i)
        if _m_state(d.meta) == S_TOMB:
            self._tombs -= 1
        self._begin_write(d)
        memcpy(<char*>d + 8, <char*>src + 8, C_SLOT - 8)     # all but the version
        self._end_write(d)
        self._begin_write(src)
        src.meta = _m_with_state(src.meta, S_TOMB)
        self._end_write(src)
        self._work += 1
        return <int64_t>(self._base + i)

    cdef int64_t _wide_alloc(self, uint32_t c) noexcept:
        """A free wide record of class ``c`` (1 .. 3: 64, 128, 256 bytes), reserved; -1
        when none is left (or /dev/shm is full)."""
        cdef uint64_t m
        cdef int rc
        cdef long off, length
        if self._wfree_n[c]:
            self._wfree_n[c] -= 1
            return self._wfree[c][self._wfree_n[c]]
        if self._wide_next[c] >= self._wide_cap:
            return -1
        if self._wide_next[c] >= self._wide_res[c]:
            m = min(<uint64_t>WIDE_CHUNK, self._wide_cap - self._wide_res[c])
            off = <long>(self._wide - self._map) + \
                <long>_rec_offset(self._wide_cap, c, <uint32_t>self._wide_res[c])
            length = m << (5 + c)
            with nogil:
                rc = posix_fallocate(self._lock_fd, off, length)
            if rc != 0:
                return -1
            self._wide_res[c] += m
        self._wide_next[c] += 1
        return <int64_t>(self._wide_next[c] - 1)

    cdef void _wide_free(self, uint32_t w, uint32_t c) noexcept:
        """Give wide record ``w`` of class ``c`` back (its slot's version has changed
        already)."""
        cdef uint32_t* grown
        cdef uint64_t n
        if self._wfree_n[c] == self._wfree_cap[c]:
            n = max(<uint64_t>1024, 2 * self._wfree_cap[c])
            grown = <uint32_t*>realloc(self._wfree[c], n * sizeof(uint32_t))
            if grown == NULL:
                return                  # kept out of use: costs a record, nothing else
            self._wfree[c] = grown
            self._wfree_cap[c] = n
        self._wfree[c][self._wfree_n[c]] = w
        self._wfree_n[c] += 1

    cdef inline void _begin_write(self, Slot* s) noexcept nogil:
        # a slot of a new table (zeros) starts above every version used before: a token
        # (slot, version) of an older table never matches an entry of a later one
        cdef uint64_t v = s.version
        if v < self._vbase:
            v = self._vbase
        kvx_store_rlx(&s.version, v + 1)
        kvx_fence_rel()

    cdef inline void _end_write(self, Slot* s) noexcept nogil:
        cdef uint64_t v = s.version + 1
        kvx_store_rel(&s.version, v)
        if v > self._vmax:
            self._vmax = v

    cdef inline void _set_unpublished(self):
        kvx_store_rel(&self._h.unpublished, len(self._unpub))

    def publish(self, key, uint64_t size, extents, checksum=None):
        """Make ``key`` -> (size, extents, checksum) visible to readers (a new key, or
        an overwrite in place: the slot's version changes, so readers of the old value
        notice before its blocks can be reused).

        ``extents``: (first block, block count) runs, at most MAX_EXTENTS. Returns the
        slot, or -1 when the key is not published (too long, too many runs, table
        full): readers then ask the server for it.
        """
        cdef int64_t r
        self._work = 0
        r = self._publish(key, size, extents, checksum)
        if self._work > self.max_step:
            self.max_step = self._work
        return r

    cdef inline void _prefetch_home(self, uint64_t h, bint w) noexcept:
        # the home slot of a key a publish of the batch comes to soon: both lines for
        # writing (``w``, PUBLISH_PREFETCH_W), else the first for reading
        cdef Slot* s = self._slot(self._base + kvx_home(h, self._nslots))
        if w:
            kvx_prefetch_slot_w(s)
        else:
            kvx_prefetch(s)

    def publish_many(self, keys, sizes, extents, checksums=None):
        """:meth:`publish` of each ``(keys[i], sizes[i], extents[i], checksums[i])``, in
        order (``checksums`` None: none), with the slots of the keys ahead prefetched
        (a batch's table misses overlap). Returns how many were not published."""
        cdef Py_ssize_t i, n = len(keys), refused = 0, pn
        cdef const char* pk
        cdef uint64_t size
        cdef bint w = PUBLISH_PREFETCH_W
        self._check()
        if len(sizes) != n or len(extents) != n or (checksums is not None and
                                                     len(checksums) != n):
            raise ValueError("keys, sizes, extents and checksums differ in length")
        for i in range(min(n, 16)):
            if type(keys[i]) is bytes:
                _key_ptr(keys[i], &pk, &pn)
                self._prefetch_home(kvx_hash(pk, pn), w)
        for i in range(n):
            if i + 16 < n and type(keys[i + 16]) is bytes:
                _key_ptr(keys[i + 16], &pk, &pn)
                self._prefetch_home(kvx_hash(pk, pn), w)
            size = sizes[i]
            self._work = 0
            if self._publish(keys[i], size, extents[i],
                             None if checksums is None else checksums[i]) < 0:
                refused += 1
            if self._work > self.max_step:
                self.max_step = self._work
        return refused

    def publish_runs(self, keys, sizes, starts, counts):
        """:meth:`publish_many` of values in one run each and without checksums, from C
        arrays: ``keys[i]`` -> (``sizes[i]``, ``((starts[i], counts[i]),)``), in order,
        with no tuple or int object per key (the server's batch PUT).

        ``keys``: a list of bytes; ``sizes``, ``starts``, ``counts``: int64 buffers as long
        as ``keys``. Every argument is checked before any slot changes (TypeError: a key
        not bytes; ValueError: lengths differ, a run out of 0 .. 2**32 - 1, a negative
        size). Returns how many were not published (too long, table full)."""
        cdef Py_ssize_t i, n, refused = 0, pn
        cdef const int64_t[:] sz = sizes
        cdef const int64_t[:] st = starts
        cdef const int64_t[:] ct = counts
        cdef uint64_t* hs
        cdef uint32_t ext[1][2]
        cdef const char* pk
        cdef object k
        cdef bint w = PUBLISH_PREFETCH_W
        self._check()
        if type(keys) is not list:
            raise TypeError("keys must be a list")
        n = len(keys)
        if sz.shape[0] != n or st.shape[0] != n or ct.shape[0] != n:
            raise ValueError("keys, sizes, starts and counts differ in length")
        for i in range(n):
            if type(keys[i]) is not bytes:
                raise TypeError("keys must be bytes")
            if (st[i] < 0 or ct[i] < 0 or st[i] > <int64_t>0xFFFFFFFF
                    or ct[i] > <int64_t>0xFFFFFFFF or sz[i] < 0):
                raise ValueError(f"bad run ({st[i]}, {ct[i]}) or size {sz[i]}")
        hs = <uint64_t*>malloc(max(n, 1) * sizeof(uint64_t))
        if hs == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                k = keys[i]
                pn = PyBytes_GET_SIZE(k)
                hs[i] = kvx_hash(PyBytes_AS_STRING(k), pn) if 0 < pn <= C_KEY_MAX else 0
            for i in range(min(n, AHEAD)):
                self._prefetch_home(hs[i], w)
            for i in range(n):
                if i + AHEAD < n:
                    self._prefetch_home(hs[i + AHEAD], w)
                k = keys[i]
                pk = PyBytes_AS_STRING(k)
                pn = PyBytes_GET_SIZE(k)
                self._work = 0
                if pn == 0 or pn > C_KEY_MAX:
                    self._refuse(k, pk, pn)
                    refused += 1
                else:
                    ext[0][0] = <uint32_t>st[i]
                    ext[0][1] = <uint32_t>ct[i]
                    if self._publish_c(pk, pn, hs[i], <uint64_t>sz[i], ext, 1, False, 0) < 0:
                        refused += 1
                if self._work > self.max_step:
                    self.max_step = self._work
        finally:
            c_free(hs)
        return refused

    cdef int64_t _publish(self, key, uint64_t size, extents, checksum) except -2:
        cdef long long a, b
        cdef const char* k
        cdef Py_ssize_t n
        cdef Py_ssize_t j, ne
        cdef uint32_t ext[C_MAX_EXT][2]
        cdef uint64_t csum = 0
        self._check()
        if not _key_ptr(key, &k, &n):
            raise TypeError("key must be bytes or str")
        ne = len(extents)
        if n == 0 or n > C_KEY_MAX or ne == 0 or ne > C_MAX_EXT:
            self._refuse(key, k, n)
            return -1
        if checksum is not None:
            csum = <uint64_t>checksum
        for j in range(ne):
            ra, rb = extents[j]
            try:
                a = ra
                b = rb
            except OverflowError:     # past 64 bits: out of range as well
                a = b = -1
            if a < 0 or b < 0 or a > 0xFFFFFFFF or b > 0xFFFFFFFF:
                raise ValueError(f"bad extent {extents[j]!r}")
            ext[j][0] = <uint32_t>a
            ext[j][1] = <uint32_t>b
        return self._publish_c(k, n, kvx_hash(k, n), size, ext, ne, checksum is not None,
                               csum)

    cdef int64_t _publish_c(self, const char* k, Py_ssize_t n, uint64_t h, uint64_t size,
                            uint32_t (*ext)[2], Py_ssize_t ne, bint has_sum, uint64_t csum
                            ) except -2:
        # _publish once its arguments are C values: the key's bytes k[:n] (1 .. KEY_MAX)
        # and hash, 1 .. MAX_EXTENTS runs in range
        cdef int64_t i, free_at
        cdef Slot* s
        cdef Py_ssize_t j
        cdef char* tail
        cdef char* rec
        cdef bint fresh
        cdef int64_t w = -1
        cdef uint32_t w32 = 0, nw32, st, flags, oc = 0, c = 0
        cdef uint64_t m, need
        if size >> C_SIZE_BITS:        # past the slot's 40-bit size: the server answers it
            self._refuse(None, k, n)
            return -1
        if self._phase != P_IDLE:
            self._step()
        i = self._find(k, n, h, &free_at)
        if i < 0:
            if self._unpub:
                self._unpub.discard(bytes(k[:n]))
                self._set_unpublished()
            if self._live + self._tombs >= self._trigger:
                if self._phase == P_IDLE:
                    self._start()
                if self._live + self._tombs >= self._limit:
                    # a growth not done by now (not for steps of the sizes above, nor
                    # for migrate_step >= 6): finish it at once rather than refuse the key
                    for j in range(3):
                        if self._phase == P_IDLE:
                            self._start()
                        if self._phase == P_IDLE:
                            break
                        self._finish()
                        if self._live + self._tombs < self._limit:
                            break
                # (the table may have moved meanwhile: where the key goes, again)
                i = self._find(k, n, h, &free_at)
            if free_at < 0 or (_m_state(self._slot(free_at).meta) == S_EMPTY and
                               self._live + self._tombs >= self._limit):
                self._unpub.add(bytes(k[:n]))
                self._set_unpublished()
                return -1
            i = free_at
        s = self._slot(i)
        m = s.meta
        st = _m_state(m)
        fresh = st != S_LIVE
        if not fresh:
            oc = _m_rec(m)             # its record class now (0: none)
            if oc:
                memcpy(&w32, s.key, 4)
        # a wide record, of the smallest class that holds them, for what a slot cannot
        # hold; once wide, an entry stays wide (its record is kept while it holds what
        # an overwrite writes, else a larger one is taken and the old one given back
        # after the slot's version changed)
        need = n + 8 * ne + (8 if has_sum else 0)
        c = oc
        if (oc == 0 and need > C_DATA) or (oc != 0 and need > (<uint64_t>32 << oc)):
            c = _rec_class(need)
            while c <= C_REC_CLASSES:
                w = self._wide_alloc(c)
                if w >= 0:
                    break
                c += 1                 # none left of that class: a larger one
            if w < 0:                  # none left: as a key too long for the table
                self._refuse(None, k, n)
                return -1
        self._begin_write(s)
        if fresh:
            if st == S_TOMB:
                self._tombs -= 1
            self._live += 1
        if w >= 0:
            nw32 = <uint32_t>w
            rec = self._wide + _rec_offset(self._wide_cap, c, nw32)
            memcpy(rec, k, n)
            memcpy(s.key, &nw32, 4)
        elif c:
            rec = self._wide + _rec_offset(self._wide_cap, c, w32)
        else:
            rec = s.key
            if fresh:
                memcpy(rec, k, n)
        tail = rec + n
        flags = c << SF_REC_SHIFT
        if has_sum:
            flags |= SF_SUM
            memcpy(tail, &csum, 8)
            tail += 8
        memcpy(tail, ext, ne * 8)
        s.meta = _m_make(size, h, n, S_LIVE, flags, ne)
        self._end_write(s)
        if w >= 0 and oc:
            self._wide_free(w32, oc)   # the smaller record it had (its version changed)
        self._h.live = self._live
        self._h.tombs = self._tombs
        return i

    cdef _refuse(self, key, const char* k, Py_ssize_t n):
        # not publishable: it must not stay visible with an old value either
        self._unpublish(k, n)
        self._unpub.add(bytes(k[:n]))
        self._set_unpublished()

    cdef bint _unpublish(self, const char* k, Py_ssize_t n):
        cdef int64_t free_at
        cdef uint64_t h = kvx_hash(k, n)
        cdef int64_t i = self._find(k, n, h, &free_at)
        cdef Slot* s
        if i < 0:
            return False
        cdef uint32_t w
        s = self._slot(i)
        self._begin_write(s)
        s.meta = _m_with_state(s.meta, S_TOMB)
        self._end_write(s)
        if _m_rec(s.meta):
            memcpy(&w, s.key, 4)
            self._wide_free(w, _m_rec(s.meta))
        self._live -= 1
        self._tombs += 1
        self._h.live = self._live
        self._h.tombs = self._tombs
        return True

    def unpublish(self, key):
        """Remove ``key`` from the table: its slot's version has changed when this returns,
        so its blocks may be freed or reused afterwards. Returns whether it was there."""
        cdef const char* k
        cdef Py_ssize_t n
        self._check()
        if not _key_ptr(key, &k, &n):
            raise TypeError("key must be bytes or str")
        if self._unpub:
            b = bytes(k[:n])
            if b in self._unpub:
                self._unpub.discard(b)
                self._set_unpublished()
        if n == 0 or n > C_KEY_MAX:
            return False
        self._work = 0
        if self._phase != P_IDLE:
            self._step()
        r = self._unpublish(k, n)
        if self._tombs > self._nslots // 4 and self._phase == P_IDLE:
            self._start()
        if self._work > self.max_step:
            self.max_step = self._work
        return r

    def contains_many(self, keys):
        """Whether each key is in the table: a list of bool (a key not bytes: False),
        the slots of the keys ahead prefetched. The server's own batch EXISTS: with
        :attr:`unpublished` 0 every live key is here, so a key not here is absent."""
        cdef Py_ssize_t i, n = len(keys)
        cdef int64_t free_at
        cdef uint64_t* hs
        cdef const char** ks
        cdef Py_ssize_t* ns
        cdef object k
        self._check()
        if type(keys) is not list:
            keys = list(keys)           # held while the pointers into its keys are used
            n = len(keys)
        out = [False] * n
        hs = <uint64_t*>malloc(max(n, 1) * sizeof(uint64_t))
        ks = <const char**>malloc(max(n, 1) * sizeof(char*))
        ns = <Py_ssize_t*>malloc(max(n, 1) * sizeof(Py_ssize_t))
        try:
            if hs == NULL or ks == NULL or ns == NULL:
                raise MemoryError()
            for i in range(n):
                k = keys[i]
                ns[i] = 0
                if type(k) is bytes:
                    ns[i] = PyBytes_GET_SIZE(k)
                    ks[i] = PyBytes_AS_STRING(k)
                    if ns[i] > C_KEY_MAX:
                        ns[i] = 0
                    if ns[i]:
                        hs[i] = kvx_hash(ks[i], ns[i])
            for i in range(min(n, AHEAD)):
                if ns[i]:
                    kvx_prefetch(self._slot(self._base + kvx_home(hs[i], self._nslots)))
            for i in range(n):
                if i + AHEAD < n and ns[i + AHEAD]:
                    kvx_prefetch(self._slot(self._base +
                                            kvx_home(hs[i + AHEAD], self._nslots)))
                # (in the table, or in the one a migration moves from: looked up, not moved)
                if ns[i] and (self._find_in(self._base, self._nslots, ks[i], ns[i], hs[i],
                                            &free_at) >= 0 or
                              (self._onslots and self._find_in(
                                  self._obase, self._onslots, ks[i], ns[i], hs[i],
                                  &free_at) >= 0)):
                    out[i] = True
        finally:
            c_free(hs)
            c_free(ks)
            c_free(ns)
        return out

    def contains_at(self, frame, spans, Py_ssize_t a, Py_ssize_t b, out,
                    bint prefix=False):
        """:meth:`contains_many` of keys that lie in a buffer: key ``i`` is the bytes
        ``frame[spans[2i] : spans[2i] + spans[2i+1]]`` (``spans``: int64 pairs, native
        order, each inside ``frame``: the caller checked them, :mod:`kvshm.zmq_ctrl.
        _batchq` against the request frame it parsed). Keys ``a:b`` are looked up (their
        slots prefetched ahead) and ``out[i]`` (a writable buffer of at least ``b``
        bytes) set to 1 (in the table) or 0; a key over the table's key limit is 0.
        ``prefix``: stop at the first key absent. Returns the keys looked up (``b - a``,
        or up to the first absent one with ``prefix``). ValueError: a span outside
        ``frame``, ``out`` too short."""
        cdef Py_buffer fb, sb, ob
        cdef const uint8_t* fp
        cdef const int64_t* sp
        cdef uint8_t* op
        cdef Py_ssize_t i, j, m
        cdef int64_t free_at, o, ln
        cdef uint64_t hs[AHEAD]
        self._check()
        PyObject_GetBuffer(frame, &fb, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(spans, &sb, PyBUF_SIMPLE)
            try:
                PyObject_GetBuffer(out, &ob, PyBUF_WRITABLE)
                try:
                    if a < 0 or b < a or sb.len < 16 * b or ob.len < b:
                        raise ValueError("contains_at: spans or out too short")
                    fp = <const uint8_t*>fb.buf
                    sp = <const int64_t*>sb.buf
                    op = <uint8_t*>ob.buf
                    for i in range(a, b):
                        o = sp[2 * i]
                        ln = sp[2 * i + 1]
                        if o < 0 or ln < 0 or o > fb.len or ln > fb.len - o:
                            raise ValueError("contains_at: a span outside the frame")
                    # a ring of the hashes AHEAD keys ahead, their home slots prefetched
                    m = b - a
                    for j in range(min(m, AHEAD)):
                        i = a + j
                        ln = sp[2 * i + 1]
                        if 0 < ln <= C_KEY_MAX:
                            hs[j] = kvx_hash(<const char*>fp + sp[2 * i], ln)
                            kvx_prefetch(self._slot(self._base +
                                                    kvx_home(hs[j], self._nslots)))
                    for j in range(m):
                        i = a + j
                        ln = sp[2 * i + 1]
                        op[i] = 0
                        if 0 < ln <= C_KEY_MAX:
                            o = sp[2 * i]
                            if (self._find_in(self._base, self._nslots,
                                              <const char*>fp + o, ln, hs[j % AHEAD],
                                              &free_at) >= 0 or
                                    (self._onslots and self._find_in(
                                        self._obase, self._onslots, <const char*>fp + o,
                                        ln, hs[j % AHEAD], &free_at) >= 0)):
                                op[i] = 1
                        if prefix and not op[i]:
                            return j
                        if j + AHEAD < m:
                            i += AHEAD
                            ln = sp[2 * i + 1]
                            if 0 < ln <= C_KEY_MAX:
                                hs[j % AHEAD] = kvx_hash(<const char*>fp + sp[2 * i], ln)
                                kvx_prefetch(self._slot(self._base + kvx_home(
                                    hs[j % AHEAD], self._nslots)))
                    return m
                finally:
                    PyBuffer_Release(&ob)
            finally:
                PyBuffer_Release(&sb)
        finally:
            PyBuffer_Release(&fb)

    def clear(self):
        """Remove every key (PURGE). Every used slot's version changes (a growth or rebuild
        under way is finished first)."""
        cdef uint64_t i
        cdef Slot* s
        cdef int c
        self._check()
        self._finish()
        for i in range(self._nslots):
            s = self._slot(self._base + i)
            if _m_state(s.meta) != S_EMPTY:
                self._begin_write(s)
                s.meta = 0
                self._end_write(s)
        self._live = self._tombs = 0
        self._h.live = self._h.tombs = 0
        for c in range(1, 4):       # every slot's version changed: all records are free
            self._wfree_n[c] = 0
            self._wide_next[c] = 0
        self._unpub.clear()
        self._set_unpublished()

    # ------------------------------------------------------------ growth, rebuilds
    #
    # The table moves between two regions of the segment (slots [0, capacity) and
    # [capacity, 2 x capacity)), a bounded step per publish or unpublish, never in one go:
    #   P_RESERVE: the new table's slots are reserved (posix_fallocate) STEP_RESERVE at a
    #              time, while the old one still takes the keys (started at at/16 full, it
    #              has room until (at + 1)/16);
    #   P_MIGRATE: the header names both tables (an odd table sequence only while it
    #              changes the names); new keys go to the new table, and migrate_step old slots
    #              a step are looked at, their live entries moved (the copy first, then the
    #              old slot a tombstone); readers look in the old table, then the new one;
    #   P_CLEAN:   the header names the new table alone; the old slots' memory is given back
    #              (punched) STEP_PUNCH at a time.
    # A rebuild (tombstones) is the same move into a table of the same size.

    cdef int _start(self) except -1:
        """Start a growth (live keys at least half the slots, room to grow) or a
        rebuild (tombstones): one step now, the rest in later calls."""
        cdef uint64_t n = self._nslots, new
        if self._phase != P_IDLE or self._lock_fd < 0:
            return 0
        if self._room_retry_at != 0 and kvx_now() < self._room_retry_at:
            return 0
        if self._live >= n // 2 and n < self._cap:
            new = min(self._cap, n + max(<uint64_t>64, (n * self._by16) // 16))
        elif self._tombs > 0 and self._tombs >= n // 16:
            new = n
        else:
            return 0
        self._pbase = self._half if self._base == 0 else 0
        self._pn = new
        self._pdone = 0
        self._phase = P_RESERVE
        self._step()
        return 0

    cdef int _finish(self) except -1:
        """Run the growth or rebuild under way to its end (a PURGE, or a table full before
        its steps were done: counted in sync_finishes)."""
        if self._phase == P_IDLE:
            return 0
        self.sync_finishes += 1
        while self._phase != P_IDLE:
            self._step()
        return 0

    cdef int _step(self) except -1:
        """One bounded step of the growth or rebuild under way."""
        cdef double t0 = kvx_fine_now(), c0 = kvx_thread_cpu(), dt
        cdef uint64_t m, j, end
        cdef int rc
        cdef long off, length
        if self._phase == P_RESERVE:
            m = min(<uint64_t>STEP_RESERVE, self._pn - self._pdone)
            off = C_HEADER + (self._pbase + self._pdone) * C_SLOT
            length = m * C_SLOT
            with nogil:
                rc = posix_fallocate(self._lock_fd, off, length)
            self._work += m
            if rc != 0:
                # /dev/shm is full: the table stays as it is for ROOM_RETRY_S (keys that
                # do not fit are not published), then a growth or rebuild is tried again
                # (space freed meanwhile: the table takes new keys, and drops its
                # tombstones, again); what was reserved is given back
                self._room_retry_at = kvx_now() + ROOM_RETRY_S
                self._cbase = self._pbase
                self._cn = self._pdone
                self._cdone = 0
                self._phase = P_CLEAN
            else:
                self._pdone += m
                if self._pdone == self._pn:
                    self._begin_migration()
        elif self._phase == P_MIGRATE:
            end = min(self._onslots, self._cursor + self._move_step)
            for j in range(self._cursor, end):
                if _m_state(self._slot(self._obase + j).meta) == S_LIVE:
                    self._move(self._obase + j)
            self._work += end - self._cursor
            self._cursor = end
            if end == self._onslots:
                self._end_migration()
        elif self._phase == P_CLEAN:
            m = min(<uint64_t>STEP_PUNCH, self._cn - self._cdone)
            if m:
                off = C_HEADER + (self._cbase + self._cdone) * C_SLOT
                length = m * C_SLOT
                with nogil:
                    kvx_punch(self._lock_fd, off, length)   # (failure: memory kept)
            self._work += m
            self._cdone += m
            if self._cdone == self._cn:
                self._phase = P_IDLE
        dt = kvx_fine_now() - t0
        if dt > self.max_step_s:
            self.max_step_s = dt
        dt = kvx_thread_cpu() - c0
        if dt > self.max_step_cpu_s:
            self.max_step_cpu_s = dt
        self.steps += 1
        self.steps_cpu_s += dt
        return 0

    # The header's names of the tables change under the table sequence (odd meanwhile:
    # a seqlock, with the release fence after the odd store), and readers check it again
    # only before a miss: a hit, and the slots a probe touches, come from the names as
    # loaded. So each name is a release store, in the order old_base, old_nslots, base,
    # nslots, and readers load them with acquire loads in the opposite order (nslots,
    # base, old_nslots, old_base; _find, _probe_all, validate): a reader that sees a name
    # stored later sees every one stored before it. Every mix a reader can then load
    # names slots that are reserved (the new table is reserved whole before it is named,
    # and the old one is given back only after it is no longer named). With relaxed
    # stores (what x86 gives anyway: its stores are seen in program order) an ARM
    # reader could load the new nslots with the old base: a probe of [0, new nslots)
    # of the old half, whose slots past the old table are not reserved (a fault there
    # reserves a page, a SIGBUS when /dev/shm is full). tests/test_shmindex_order.py
    # reads this contract from the source (no ARM host here to run it on).
    cdef void _begin_migration(self) noexcept:
        cdef Header* h = self._h
        self._vbase = (self._vmax + 2) & ~(<uint64_t>1)
        self._obase = self._base
        self._onslots = self._nslots
        self._cursor = 0
        self._base = self._pbase
        self._nslots = self._pn
        self._tombs = 0                # the old table's tombstones go with it
        self._set_limits()
        kvx_store_rlx(&h.table_seq, h.table_seq + 1)
        kvx_fence_rel()
        kvx_store_rel(&h.old_base, self._obase)
        kvx_store_rel(&h.old_nslots, self._onslots)
        kvx_store_rel(&h.base, self._base)
        kvx_store_rel(&h.nslots, self._nslots)
        kvx_store_rel(&h.table_seq, h.table_seq + 1)
        h.tombs = 0
        self._phase = P_MIGRATE

    cdef void _end_migration(self) noexcept:
        cdef Header* h = self._h
        kvx_store_rlx(&h.table_seq, h.table_seq + 1)
        kvx_fence_rel()
        # (old_nslots first: a reader that loads 0 there looks at old_base no more)
        kvx_store_rel(&h.old_nslots, 0)
        kvx_store_rel(&h.old_base, 0)
        kvx_store_rel(&h.table_seq, h.table_seq + 1)
        self._cbase = self._obase
        self._cn = self._onslots
        self._cdone = 0
        self._onslots = 0
        self._phase = P_CLEAN
        self.rebuilds += 1

    def set_misses_final(self, bint final):
        """Whether readers may answer misses themselves (False with a tier below)."""
        self._check()
        kvx_store_rel(&self._h.flags, F_MISSES_FINAL if final else 0)

    # ------------------------------------------------------------ reads ring

    def drain(self, double stuck_after=0.05):
        """Apply the reads recorded by lock-free readers, in ticket order: returns the
        keys read (oldest first) whose entry is still the one they read.

        A ticket taken but not yet written stops the drain (its reader is between the
        two steps); one that stays unwritten for ``stuck_after`` seconds (a reader killed
        there) is skipped, and with it every unwritten ticket taken before it was first
        seen stuck (they are as old: a client that took many tickets and wrote nothing
        costs one period, not one per ticket). The ring is writable by clients: a head
        further than the ring from the tail is dropped, and the tail is written back
        whatever a client left there.
        """
        cdef uint64_t* headp
        cdef uint64_t* tailp
        cdef uint64_t head, t, seq, mask
        cdef Rec* recs
        cdef Rec* r
        cdef uint32_t slot, ver
        cdef Slot* s
        cdef double now
        cdef const char* kp
        cdef size_t room
        cdef list out = []
        if self._ring == NULL:
            return out
        headp = <uint64_t*>(self._ring + 64)
        tailp = <uint64_t*>(self._ring + 128)
        head = kvx_load_acq(headp)
        t = self._tail
        if t == head:
            if kvx_load_rlx(tailp) != t:    # a client wrote it: readers' room check wraps
                kvx_store_rel(tailp, t)
            return out
        mask = self._nrec - 1
        recs = <Rec*>(self._ring + C_RING_HEADER)
        if head - t > self._nrec:       # not what readers write (the ring is writable):
            # drop it rather than trust it (a head moved back counts as nothing skipped)
            if head - t < (<uint64_t>1 << 63):
                self.skipped_records += head - t
            t = head
            self._skip_to = 0
        while t != head:
            r = &recs[t & mask]
            seq = kvx_load_acq(&r.seq)
            if seq != t + 1:
                if self._skip_to != 0 and t != self._skip_to and \
                        self._skip_to - t <= head - t:
                    self.skipped_records += 1      # as old as the stuck one it follows
                    t += 1
                    continue
                self._skip_to = 0
                now = kvx_now()
                if self._stuck_at != t + 1:
                    self._stuck_at = t + 1
                    self._stuck_since = now
                    self._stuck_head = head
                    break
                if now - self._stuck_since < stuck_after:
                    break
                self.skipped_records += 1      # a reader died between ticket and record
                self._skip_to = self._stuck_head
                t += 1
                continue
            slot = r.slot
            ver = r.ver
            t += 1
            # only a slot of the table(s) in use: a void record (its read was redone),
            # a stale one of a table given back, or a client's (the ring is writable)
            # never makes the server touch an unreserved page of the segment (a fault
            # there reserves it, or is a SIGBUS when /dev/shm is full)
            if not ((self._base <= slot < self._base + self._nslots) or
                    (self._onslots and self._obase <= slot < self._obase + self._onslots)):
                continue
            s = self._slot(slot)
            if _m_state(s.meta) == S_LIVE and <uint32_t>s.version == ver:
                kp = _slot_key(s, self._wide, self._wide_cap, _m_keylen(s.meta), &room)
                if kp != NULL:
                    out.append(PyBytes_FromStringAndSize(kp, _m_keylen(s.meta)))
        self._tail = t
        kvx_store_rel(tailp, t)
        self.reads_applied += len(out)
        return out

    # ------------------------------------------------------------ lifetime

    def close(self):
        """Mark the table closed (readers stop using it at once) and unmap. Idempotent."""
        if self._map != NULL and self._pid == os.getpid():
            kvx_store_rel(&self._h.state, H_CLOSED)
        if self._map != NULL:
            munmap(self._map, self._map_size)
            self._map = NULL
            self._h = NULL
        if self._ring != NULL:
            munmap(self._ring, self._ring_size)
            self._ring = NULL

    def unlink(self):
        """Close, then remove both segment names and drop the liveness locks. Idempotent;
        only in the creating process."""
        if self._pid != os.getpid():
            raise PermissionError(f"only the creating process may unlink {self.name}")
        self.close()
        if not self._unlinked:
            self._unlinked = True
            for nm in (self.name, self.reads_name):
                try:
                    posix_ipc.unlink_shared_memory(nm)
                except posix_ipc.ExistentialError:
                    pass
        for fd in (self._lock_fd, self._ring_lock_fd):
            if fd >= 0:
                os.close(fd)
        self._lock_fd = self._ring_lock_fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unlink()

    def __dealloc__(self):
        cdef int c
        for c in range(4):
            c_free(self._wfree[c])
            self._wfree[c] = NULL
        if self._map != NULL:
            munmap(self._map, self._map_size)
        if self._ring != NULL:
            munmap(self._ring, self._ring_size)
        if self._lock_fd >= 0:
            c_close_fd(self._lock_fd)
        if self._ring_lock_fd >= 0:
            c_close_fd(self._ring_lock_fd)

    def __del__(self):
        if self._map != NULL and self._pid == os.getpid() and not self._unlinked:
            try:
                self.unlink()
            except Exception:
                pass
            warnings.warn(f"IndexWriter {self.name} was never unlinked", ResourceWarning,
                          source=self)


cdef void _probe_piece(IndexReader self, SegWork* w, uint32_t p) noexcept nogil:
    """One piece of a segment (any thread: the batch's or a helper)."""
    cdef Py_ssize_t a = <Py_ssize_t>p * w.piece
    w.done[p] = self._probe_all(w.arena, w.offs + a, w.hashes + a, min(w.piece, w.nk - a),
                                w.out + a, w.prefix)


cdef inline bint _stopped(const char* end, Py_ssize_t done, bint prefix) noexcept nogil:
    """Whether a :meth:`IndexReader._probe_all` that looked up all its ``done`` keys
    (``end``: just past their answers) stopped at its last one (a fallback, or with
    ``prefix`` a key not found): it returns the keys looked up, that key included, so
    a stop at the last key reads as no stop; the keys after it must not be looked up
    as if it had not been (a fallback there answered as a miss)."""
    return done > 0 and (end[-1] == R_FALLBACK or (prefix and end[-1] != R_HIT))


cdef Py_ssize_t _fill_seg(PyObject** items, Py_ssize_t s0, Py_ssize_t nk, Py_ssize_t maxk,
                          char* arena, uint32_t* offs, uint64_t* hashes,
                          Py_ssize_t cap) except -2:
    """Copy and hash the keys of one segment from ``items[s0]`` (at most C_SEG keys and
    ``cap`` bytes of theirs) into ``arena`` / ``offs`` / ``hashes``: how many, or -1
    when one of them is not a key the table can hold (another type, empty, over
    ``maxk`` bytes). ``items``: a list's or tuple's, borrowed (no Python code runs)."""
    cdef Py_ssize_t i = s0, total = 0, n
    cdef const char* k
    while i < nk and i - s0 < C_SEG:
        if i + 8 < nk:
            kvx_prefetch(items[i + 8])  # the key object's header, 8 ahead
        if not kvx_key_of(items[i], &k, &n):
            n = 0
        if not 0 < n <= maxk:
            return -1
        if total + n + 8 > cap:         # (+ 8: kvx_hash_copy's last word)
            break                       # the segment's bytes are full
        offs[i - s0] = <uint32_t>total
        hashes[i - s0] = kvx_hash_copy(k, n, arena + total)
        total += n
        i += 1
    offs[i - s0] = <uint32_t>total
    return i - s0


cdef class IndexReader:
    """A client's read-only view of the server's shared index, with lock-free reads
    through the pool mapped in this process.

    Parameters
    ----------
    name, reads_name : str
        The index and reads-ring segments (from the server's HELLO).
    pool : kvshm.Pool
        The server's pool, attached in this process; a view of it is held (so the pool
        refuses to close) until :meth:`close`.
    epoch : int
        The server instance the client said HELLO to; a table of another epoch is refused.

    Reads return hits, :data:`MISS` (final: the store does not hold the key) or
    :data:`FALLBACK` (ask the server: a slot kept changing, the server stopped or died,
    the key is not publishable, misses are not final, or the reads ring is full). Every
    value copied is validated against the slot's version after the copy.
    """

    cdef char* _map
    cdef size_t _map_size
    cdef const Header* _h
    cdef const char* _slots
    cdef uint64_t _sink          # what _prefault read (so that the reads are made)
    cdef uint64_t _pf_base       # the table _prefault last looked at (base, nslots)
    cdef uint64_t _pf_n
    cdef uint64_t _cap           # slots mapped (2 regions of the table's capacity)
    cdef const char* _wide
    cdef uint64_t _wide_cap
    cdef uint64_t _bs
    cdef char* _ring
    cdef size_t _ring_size
    cdef uint64_t _nrec
    cdef Py_buffer _pool_buf
    cdef bint _has_buf
    cdef char* _base
    cdef uint64_t _pool_size
    cdef int _fd
    cdef int _busy
    cdef uint64_t _forkgen
    cdef char* _scr[2]           # batch lookups' scratch: hashes + offsets, key bytes
    cdef size_t _scr_cap[2]
    cdef bint _scr_busy
    cdef double _next_check
    cdef bint _dead
    cdef readonly str name
    cdef readonly uint64_t epoch
    cdef readonly uint64_t max_key
    cdef public uint64_t hits
    cdef public uint64_t misses
    cdef public uint64_t fallbacks
    cdef public uint64_t retries
    cdef public bint fast_batch
    cdef int _threads
    cdef public Py_ssize_t threads_min
    cdef object _pool

    def __cinit__(self):
        self._map = NULL
        self._ring = NULL
        self._fd = -1

    def __init__(self, str name, str reads_name, pool, uint64_t epoch,
                 uint64_t max_key=C_KEY_MAX):
        cdef const Header* h
        name = _norm(name)
        reads_name = _norm(reads_name)
        try:
            shm = posix_ipc.SharedMemory(name, read_only=True)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"no shared-memory segment {name}") from None
        except posix_ipc.PermissionsError as exc:
            raise PermissionError(f"cannot open shared-memory segment {name}: {exc}") from None
        try:
            total = shm.size
            if total < C_HEADER + C_SLOT:
                raise ValueError(f"{name} is not a kvshm index ({total} bytes)")
            # PROT_READ: a reader cannot write it. Not MAP_POPULATE: a read fault on a
            # slot the table has not reached yet would reserve it in /dev/shm
            self._map = _map(shm.fd, total, False, False)
            self._map_size = total
            self._fd = os.dup(shm.fd)
        finally:
            shm.close_fd()
        h = <const Header*>self._map
        self._h = h
        if (h.magic[:8] != _MAGIC or h.layout != _LAYOUT or h.slot_size != C_SLOT
                or h.key_max != C_KEY_MAX or h.wide_capacity > 0xFFFFFFFF
                or h.capacity > (<uint64_t>1 << 40)
                or 2 * h.capacity * C_SLOT + h.wide_capacity * C_RECS_BYTES + C_HEADER > total
                or h.capacity == 0
                or not self._nslots_ok(h.capacity)):
            self._unmap()
            raise ValueError(f"{name} is not a kvshm index of layout {_LAYOUT}")
        if h.epoch != epoch:
            found = h.epoch
            self._unmap()
            raise ValueError(f"{name} belongs to server epoch {found}, not {epoch}")
        self.epoch = epoch
        self.fast_batch = os.environ.get(ENV_NO_FAST_BATCH, "") in ("", "0")
        self._threads = _env_threads()
        self.threads_min = C_THREADS_MIN
        self._forkgen = kvx_forks()
        self._cap = 2 * h.capacity
        self._wide = self._map + C_HEADER + 2 * h.capacity * C_SLOT
        self._wide_cap = h.wide_capacity
        self._bs = h.block_size
        self._slots = self._map + C_HEADER
        self._prefault()
        self.name = name
        self.max_key = min(max_key, C_KEY_MAX)
        try:
            rshm = posix_ipc.SharedMemory(reads_name)
        except (posix_ipc.ExistentialError, posix_ipc.PermissionsError) as exc:
            self._unmap()
            raise FileNotFoundError(f"cannot open reads ring {reads_name}: {exc}") from None
        try:
            rsize = rshm.size
            if rsize < C_RING_HEADER + sizeof(Rec):
                raise ValueError(f"{reads_name} is not a kvshm reads ring")
            self._ring = _map(rshm.fd, rsize, True)
            self._ring_size = rsize
        except BaseException:
            self._unmap()
            raise
        finally:
            rshm.close_fd()
        # the record count from the segment's size, not from its header: clients may
        # write the header (the server's count is the one of the size it made)
        nrec = (rsize - C_RING_HEADER) // sizeof(Rec)
        if (self._ring[:8] != _RING_MAGIC or nrec == 0 or (nrec & (nrec - 1))
                or C_RING_HEADER + nrec * sizeof(Rec) != rsize):
            self._unmap()
            raise ValueError(f"{reads_name} is not a kvshm reads ring")
        self._nrec = nrec
        try:
            self._pool = pool
            view = pool.view(0, pool.size, readonly=True)
            PyObject_GetBuffer(view, &self._pool_buf, PyBUF_SIMPLE)
        except BaseException:
            self._unmap()
            raise
        self._has_buf = True
        self._base = <char*>self._pool_buf.buf
        self._pool_size = self._pool_buf.len
        if h.num_blocks * h.block_size > self._pool_size:
            self.close()
            raise ValueError(f"{name} describes a pool larger than the one attached")

    cdef inline bint _nslots_ok(self, uint64_t cap) noexcept nogil:
        cdef uint64_t n = kvx_load_acq(&self._h.nslots)
        return n != 0 and n <= cap

    cdef void _prefault(self) noexcept:
        # the slots in use now, when few enough (the pool's rule, kvshm.client): the
        # first reads do not fault them in one by one (and a batch lookup's prefetches,
        # which a page not yet mapped here drops, work from its first key). At attach,
        # and from a batch lookup once the table has moved (grown) since
        # (nslots, then base, each once: the order _begin_migration's stores keep; base
        # loaded twice round nslots could name slots of neither table)
        cdef uint64_t n = kvx_load_acq(&self._h.nslots)
        cdef uint64_t b = kvx_load_acq(&self._h.base)
        cdef size_t used = C_HEADER + (b + n) * C_SLOT, off, start
        cdef uint64_t acc = 0
        self._pf_base = b
        self._pf_n = n
        if used > POPULATE_MAX_BYTES or used > self._map_size:
            return
        start = C_HEADER + b * C_SLOT
        start -= start % 4096
        # one call for the whole range (Linux >= 5.14), else a read of a byte a page
        if madvise(self._map + start, used - start, MADV_POPULATE_READ) == 0:
            return
        for off in range(start, used, 4096):
            acc += <uint8_t>self._map[off]
        self._sink = acc

    cdef _unmap(self):
        if self._map != NULL:
            munmap(self._map, self._map_size)
            self._map = NULL
        if self._ring != NULL:
            munmap(self._ring, self._ring_size)
            self._ring = NULL
        if self._fd >= 0:
            c_close_fd(self._fd)
            self._fd = -1

    def close(self):
        """Release the pool view and unmap. Idempotent. BufferError while a copy runs in
        another thread."""
        if self._busy:
            raise BufferError(f"{self._busy} lock-free read(s) are running in other threads")
        self._free_scratch()
        if self._has_buf:
            PyBuffer_Release(&self._pool_buf)
            self._has_buf = False
            self._base = NULL
        self._pool = None
        self._unmap()

    def __dealloc__(self):
        self._free_scratch()
        if self._has_buf:
            PyBuffer_Release(&self._pool_buf)
        if self._map != NULL:
            munmap(self._map, self._map_size)
        if self._ring != NULL:
            munmap(self._ring, self._ring_size)
        if self._fd >= 0:
            c_close_fd(self._fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def closed(self):
        return self._map == NULL

    @property
    def address(self):
        """Address of the read-only mapping of the table in this process."""
        self._check()
        return <uintptr_t>self._map

    @property
    def usable(self):
        """False once the server stopped or died (every read is then FALLBACK)."""
        return self._usable()

    @property
    def header(self):
        """The table's header fields (for tests and stats)."""
        self._check()
        h = self._h
        return {"epoch": h.epoch, "nslots": kvx_load_acq(&h.nslots),
                "capacity": h.capacity, "state": kvx_load_acq(&h.state),
                "base": kvx_load_acq(&h.base), "old_nslots": kvx_load_acq(&h.old_nslots),
                "old_base": kvx_load_acq(&h.old_base),
                "table_seq": kvx_load_acq(&h.table_seq),
                "unpublished": kvx_load_acq(&h.unpublished), "flags": h.flags,
                "live": h.live, "tombs": h.tombs, "block_size": h.block_size,
                "token": bytes(h.token[:16])}

    cdef inline int _check(self) except -1:
        if self._map == NULL:
            raise ValueError("index reader is closed")
        return 0

    cdef bint _usable(self) noexcept:
        cdef double now
        if self._map == NULL or self._dead:
            return False
        if self._forkgen != kvx_forks():
            return False        # a forked child: its client raises on the server path
        if kvx_load_acq(&self._h.state) != H_OPEN:
            self._dead = True
            return False
        now = kvx_now()
        if now >= self._next_check:
            # The server holds an exclusive flock on the segment while it lives; a
            # shared lock we can take means it is gone (SIGKILL) without closing.
            self._next_check = now + 0.1
            if flock(self._fd, LOCK_SH | LOCK_NB) == 0:
                flock(self._fd, LOCK_UN)
                self._dead = True
                return False
        return True

    # ------------------------------------------------------------ C core

    cdef inline const Slot* _slot(self, uint64_t i) noexcept nogil:
        return <const Slot*>(self._slots + i * C_SLOT)

    cdef int _find(self, const char* k, Py_ssize_t n, uint64_t h, Found* f,
                   bint full=True) noexcept nogil:
        """R_HIT (``f`` filled when ``full``, consistent at one instant), R_MISS (not in
        the table), or R_FALLBACK (the table kept changing under us). While a migration
        runs, the old table is looked in first, then the new one (the server moves an
        entry by writing its copy before its old slot becomes a tombstone)."""
        cdef uint64_t ts, nslots, base, onslots, obase
        cdef int attempt, r
        for attempt in range(TRIES):
            ts = kvx_load_acq(&self._h.table_seq)
            if ts & 1:
                kvx_pause()
                continue
            nslots = kvx_load_acq(&self._h.nslots)
            base = kvx_load_acq(&self._h.base)
            onslots = kvx_load_acq(&self._h.old_nslots)
            obase = kvx_load_acq(&self._h.old_base)
            if nslots == 0 or base + nslots > self._cap or nslots > self._cap or \
                    onslots > self._cap or obase + onslots > self._cap:
                return R_FALLBACK        # not what the server writes (or torn: retried)
            r = R_MISS
            if onslots:
                r = self._find_in(obase, onslots, k, n, h, f, full)
            if r == R_MISS:
                r = self._find_in(base, nslots, k, n, h, f, full)
            if r == R_HIT:
                return r
            if r == R_FALLBACK:
                self.retries += 1
                kvx_pause()
                continue
            kvx_fence_acq()
            if kvx_load_rlx(&self._h.table_seq) != ts:
                continue
            return R_MISS
        return R_FALLBACK

    cdef int _find_in(self, uint64_t base, uint64_t nslots, const char* k, Py_ssize_t n,
                      uint64_t h, Found* f, bint full) noexcept nogil:
        """One probe of the table of ``nslots`` slots from ``base``: R_HIT, R_MISS, or
        R_FALLBACK when a slot on the way changed (look again)."""
        cdef uint64_t i, probes, v1, hs, ne, m, want = _m_want(h, n)
        cdef const Slot* s
        cdef const char* tail
        cdef const char* kp
        cdef size_t room
        cdef uint32_t st
        i = kvx_home(h, nslots)
        for probes in range(nslots):
            s = self._slot(base + i)
            v1 = kvx_load_acq(&s.version)
            if v1 & 1:
                return R_FALLBACK
            m = s.meta
            st = _m_state(m)
            kp = NULL
            if _m_is(m, want):
                kp = _slot_key(s, self._wide, self._wide_cap, n, &room)
                if kp != NULL and memcmp(kp, k, n) != 0:
                    kp = NULL
            if kp != NULL:
                f.slot = base + i
                if full:
                    f.size = _m_size(m)
                    hs = _m_flags(m) & 1
                    ne = _m_next(m)
                    tail = kp + n
                    f.checksum = 0
                    if ne > C_MAX_EXT or n + 8 * hs + 8 * ne > room:
                        ne = hs = 0          # torn: the version check rejects it
                    f.has_sum = <int>hs
                    if hs:
                        memcpy(&f.checksum, tail, 8)
                        tail += 8
                    f.nextents = <int>ne
                    memcpy(f.ext, tail, ne * 8)
                kvx_fence_acq()
                if kvx_load_rlx(&s.version) != v1:
                    return R_FALLBACK
                f.version = v1
                return R_HIT
            kvx_fence_acq()
            if kvx_load_rlx(&s.version) != v1:
                return R_FALLBACK            # passed while it changed: look again
            if st == S_EMPTY:
                return R_MISS
            i += 1
            if i == nslots:
                i = 0
        return R_MISS

    cdef inline bint _valid(self, const Found* f) noexcept nogil:
        kvx_fence_acq()
        return kvx_load_rlx(&self._slot(f.slot).version) == f.version

    cdef bint _ranges_ok(self, const Found* f) noexcept nogil:
        """The runs cover ``size`` bytes and lie inside the pool (a torn read could say
        anything; this keeps the copy in bounds until the version check rejects it)."""
        cdef int j
        cdef uint64_t total = 0, a, b
        if f.nextents <= 0:
            return False
        for j in range(f.nextents):
            a = f.ext[j][0]
            b = f.ext[j][1]
            if (a + b) * self._bs > self._pool_size:
                return False
            total += b * self._bs
        return f.size <= total

    cdef void _copy_out(self, const Found* f, char* dst) noexcept nogil:
        cdef int j
        cdef uint64_t left = f.size, n
        for j in range(f.nextents):
            if left == 0:
                break
            n = f.ext[j][1] * self._bs
            if n > left:
                n = left
            memcpy(dst, self._base + f.ext[j][0] * self._bs, n)
            dst += n
            left -= n

    cdef int64_t _tickets(self, uint64_t n) noexcept nogil:
        """Take ``n`` consecutive tickets of the reads ring; -1 when it has not room."""
        cdef uint64_t* headp = <uint64_t*>(self._ring + 64)
        cdef const uint64_t* tailp = <uint64_t*>(self._ring + 128)
        cdef uint64_t hd, tl
        cdef int tries
        hd = kvx_load_rlx(headp)
        for tries in range(16):
            tl = kvx_load_acq(tailp)
            if hd + n - tl > self._nrec:
                return -1
            if kvx_cas(headp, &hd, hd + n):
                return <int64_t>hd
        return -1

    cdef inline void _record(self, uint64_t ticket, uint64_t slot, uint64_t version) noexcept nogil:
        cdef Rec* r = <Rec*>(self._ring + C_RING_HEADER) + (ticket & (self._nrec - 1))
        r.slot = <uint32_t>slot
        r.ver = <uint32_t>version
        kvx_store_rel(&r.seq, ticket + 1)

    cdef inline bint _record_one(self, const Found* f) noexcept nogil:
        """Record one validated read for the LRU. Tickets are taken after the copy, never
        before: a read still copying (a large value, a stopped reader) holds back no other
        read's record, and the order of tickets is the order of validations. False when
        the ring has no room (the read must then go to the server)."""
        cdef int64_t t = self._tickets(1)
        if t < 0:
            return False
        self._record(t, f.slot, f.version)
        return True

    cdef inline bint _misses_final(self) noexcept nogil:
        return (kvx_load_acq(&self._h.flags) & F_MISSES_FINAL) and \
            kvx_load_acq(&self._h.unpublished) == 0

    cdef int _get_into(self, const char* k, Py_ssize_t n, char* dst, uint64_t cap,
                       uint64_t* size) except -100:
        """One validated read into ``dst`` (``cap`` bytes). R_HIT / R_MISS / R_FALLBACK;
        ``size`` set on a hit, and to the value's size when ``cap`` is too small (-3)."""
        cdef Found f
        cdef int r, attempt
        cdef uint64_t h = kvx_hash(k, n)
        r = R_FALLBACK
        for attempt in range(TRIES):
            r = self._find(k, n, h, &f)
            if r != R_HIT:
                break
            if not self._ranges_ok(&f):
                r = R_FALLBACK
                continue
            if f.size > cap:
                if self._valid(&f):
                    size[0] = f.size
                    return -3
                continue
            self._busy += 1
            with nogil:                  # the caller's buffer may be slow (a file's pages)
                self._copy_out(&f, dst)
            self._busy -= 1
            if self._valid(&f):
                if not self._record_one(&f):
                    return R_FALLBACK
                size[0] = f.size
                return R_HIT
            self.retries += 1
            r = R_FALLBACK
        if r == R_MISS and not self._misses_final():
            r = R_FALLBACK
        return r

    cdef inline int _key_ok(self, object key, const char** k, Py_ssize_t* n) except -1:
        if not _key_ptr(key, k, n):
            return False
        return 0 < n[0] <= <Py_ssize_t>self.max_key

    # ------------------------------------------------------------ reads

    def get(self, key):
        """The value of ``key`` as new bytes, ``None`` for a (final) miss, or
        :data:`FALLBACK`."""
        cdef const char* k
        cdef Py_ssize_t n
        cdef Found f
        cdef int r, attempt
        cdef uint64_t h
        cdef bytes out
        cdef char* dst
        if not self._key_ok(key, &k, &n) or not self._usable():
            self.fallbacks += 1
            return FALLBACK
        h = kvx_hash(k, n)
        r = R_FALLBACK
        for attempt in range(TRIES):
            r = self._find(k, n, h, &f)
            if r != R_HIT:
                break
            if not self._ranges_ok(&f):
                r = R_FALLBACK
                continue
            out = PyBytes_FromStringAndSize(NULL, f.size)
            dst = PyBytes_AS_STRING(out)
            if f.size >= NOGIL_COPY:
                self._busy += 1
                with nogil:
                    self._copy_out(&f, dst)
                self._busy -= 1
            else:
                self._copy_out(&f, dst)
            if self._valid(&f):
                if not self._record_one(&f):
                    break                    # the ring is full: the server records it
                self.hits += 1
                return out
            self.retries += 1
            r = R_FALLBACK
        if r == R_MISS and self._misses_final():
            self.misses += 1
            return None
        self.fallbacks += 1
        return FALLBACK

    def get_into(self, key, dst):
        """Copy the value of ``key`` into the writable buffer ``dst``. Returns its size,
        :data:`MISS` or :data:`FALLBACK`. ValueError when ``dst`` is too small."""
        cdef const char* k
        cdef Py_ssize_t n
        cdef Py_buffer buf
        cdef uint64_t size = 0
        cdef int r
        if not self._key_ok(key, &k, &n) or not self._usable():
            self.fallbacks += 1
            return FALLBACK
        try:
            PyObject_GetBuffer(dst, &buf, PyBUF_ANY_CONTIGUOUS | PyBUF_WRITABLE)
        except (BufferError, TypeError, ValueError):
            self.fallbacks += 1
            return FALLBACK          # a tensor or odd buffer: the normal path handles it
        try:
            r = self._get_into(k, n, <char*>buf.buf, buf.len, &size)
        finally:
            PyBuffer_Release(&buf)
        return self._result(r, key, size, buf.len)

    cdef object _result(self, int r, object key, uint64_t size, Py_ssize_t cap):
        if r == R_HIT:
            self.hits += 1
            return size
        if r == R_MISS:
            self.misses += 1
            return MISS
        if r == -3:
            raise ValueError(f"output buffer for key {key!r} holds {cap} bytes; "
                             f"the value is {size} bytes")
        self.fallbacks += 1
        return FALLBACK

    def get_many_into(self, keys, dsts):
        """``[get_into(k, d) for k, d in zip(keys, dsts)]``: sizes, MISS or FALLBACK per key.
        Raises ValueError (a buffer too small) before any later key is read."""
        cdef Py_ssize_t i, nk = len(keys)
        if len(dsts) != nk:
            raise ValueError(f"{nk} keys but {len(dsts)} output buffers")
        return [self.get_into(keys[i], dsts[i]) for i in range(nk)]

    def get_many(self, keys):
        """``[get(k) for k in keys]``: bytes, None (final miss) or FALLBACK per key."""
        return [self.get(k) for k in keys]

    def lookup(self, key):
        """One key's entry: ``(token, size, extents, checksum)`` (``extents``: (first
        block, block count) runs; ``checksum`` None when stored without one), None for a
        final miss, or FALLBACK. Copy with the pool, then :meth:`validate` ``[token]``."""
        cdef const char* k
        cdef Py_ssize_t n
        cdef Found f
        cdef int r, j
        if not self._key_ok(key, &k, &n) or not self._usable():
            return FALLBACK
        r = self._find(k, n, kvx_hash(k, n), &f)
        if r == R_HIT and self._ranges_ok(&f):
            runs = tuple((f.ext[j][0], f.ext[j][1]) for j in range(f.nextents))
            return ((f.slot, f.version), f.size, runs, f.checksum if f.has_sum else None)
        if r == R_MISS and self._misses_final():
            return None
        return FALLBACK

    def locate(self, keys):
        """Single-run locations for a copy the caller makes itself (paged reads).

        Returns ``(offsets, sizes, tokens)``: byte offset and size per key (-1, -1 for a
        final miss), tokens to pass to :meth:`validate` after the copy; or None when any
        key must be asked of the server (or has several runs).
        """
        cdef const char* k
        cdef Py_ssize_t n, i, nk = len(keys)
        cdef Found f
        cdef int r
        cdef list offs = [], sizes = [], toks = []
        if not self._usable():
            return None
        for i in range(nk):
            key = keys[i]
            if not self._key_ok(key, &k, &n):
                return None
            r = self._find(k, n, kvx_hash(k, n), &f)
            if r == R_HIT:
                if f.nextents != 1 or not self._ranges_ok(&f):
                    return None
                offs.append(f.ext[0][0] * self._bs)
                sizes.append(f.size)
                toks.append((f.slot, f.version))
            elif r == R_MISS and self._misses_final():
                offs.append(-1)
                sizes.append(-1)
            else:
                return None
        return offs, sizes, toks

    def validate(self, tokens):
        """After a copy of :meth:`locate`'s ranges: True when every entry is still the
        one located (then the reads are recorded for the LRU); False: redo the read
        through the server."""
        cdef Py_ssize_t i, nt = len(tokens)
        cdef Found f
        cdef int64_t t
        cdef uint64_t ts, base, nslots, obase, onslots, sl
        if self._map == NULL:
            return False                # closed meanwhile (its table unmapped): redo it
        # a token of a slot outside the table(s) in use (moved by a growth since, its old
        # slots given back) is stale: not looked at, so that no page given back is faulted
        # in again (a fault there reserves it, or is a SIGBUS when /dev/shm is full)
        ts = kvx_load_acq(&self._h.table_seq)
        if ts & 1:
            return False
        nslots = kvx_load_acq(&self._h.nslots)
        base = kvx_load_acq(&self._h.base)
        onslots = kvx_load_acq(&self._h.old_nslots)
        obase = kvx_load_acq(&self._h.old_base)
        kvx_fence_acq()
        if kvx_load_rlx(&self._h.table_seq) != ts:
            return False
        for i in range(nt):
            slot, version = tokens[i]
            if slot < 0:
                return False
            sl = slot
            if sl >= self._cap or not ((base <= sl < base + nslots) or
                                       (onslots and obase <= sl < obase + onslots)):
                return False
            if kvx_load_rlx(&self._slot(sl).version) != <uint64_t>version:
                return False
        if nt == 0:
            return True
        t = self._tickets(nt)
        if t < 0:
            return False                # cannot record them: let the server see them
        for i in range(nt):
            slot, version = tokens[i]
            self._record(t + i, slot, version)
        self.hits += nt
        return True

    cdef inline bint _tables(self, uint64_t* ts, uint64_t* base, uint64_t* nslots,
                             uint64_t* obase, uint64_t* onslots) noexcept nogil:
        """The header's table sequence and tables now; False while they change (odd
        sequence) or when they are not what the server writes."""
        ts[0] = kvx_load_acq(&self._h.table_seq)
        nslots[0] = kvx_load_acq(&self._h.nslots)
        base[0] = kvx_load_acq(&self._h.base)
        onslots[0] = kvx_load_acq(&self._h.old_nslots)
        obase[0] = kvx_load_acq(&self._h.old_base)
        return not (ts[0] & 1) and nslots[0] != 0 and nslots[0] <= self._cap and \
            base[0] + nslots[0] <= self._cap and onslots[0] <= self._cap and \
            obase[0] + onslots[0] <= self._cap

    cdef Py_ssize_t _probe_all(self, const char* arena,
                               const uint32_t* offs, const uint64_t* hashes, Py_ssize_t nk,
                               char* out, bint prefix) noexcept nogil:
        """Look up ``nk`` keys (key ``i``: ``arena[offs[i]:offs[i + 1]]``, hash
        ``hashes[i]``) in one C loop: ``out[i]`` is R_HIT / R_MISS / R_FALLBACK per key.
        Stops after the first key that is not a hit with ``prefix``, after the first
        fallback without; returns the keys looked up (the rest of ``out`` unset).

        Fast (``fast_batch``): the two slots from the home of the key AHEAD places on
        are prefetched before each lookup (a cache line each); a key whose probe goes
        past them is put aside
        with the next MORE_SLOTS slots prefetched, and finished at the end of its chunk
        of C_CHUNK keys (so that its misses overlap the next keys' instead of stalling
        the loop). The tables are read from the header once per chunk. A hit stands
        (its slot's version was the same before and after); a miss stands only when the
        table sequence did not change over its chunk, otherwise it is looked up again
        alone (a key may have been moving). A slot written meanwhile sends its key to
        the full lookup (:meth:`_find`). Otherwise one :meth:`_find` per key."""
        cdef Py_ssize_t i, j, c0, lim, nd, d
        cdef Found f
        cdef int r
        cdef uint64_t ts, base, nslots, obase, onslots, pos, left, q
        cdef const char* k
        cdef Py_ssize_t n
        cdef bint quick
        cdef uint32_t dkey[C_CHUNK]          # keys put aside in this chunk
        cdef uint64_t dpos[C_CHUNK]          # (the slot their probe goes on from)
        cdef uint64_t dleft[C_CHUNK]         # (slots left to it)
        if not self.fast_batch:
            for i in range(nk):
                r = self._find(arena + offs[i], offs[i + 1] - offs[i], hashes[i], &f, False)
                out[i] = <char>r
                if r == R_FALLBACK or (prefix and r != R_HIT):
                    return i + 1
            return nk
        i = 0
        while i < nk:
            quick = self._tables(&ts, &base, &nslots, &obase, &onslots)
            c0 = i
            lim = min(nk, i + C_CHUNK)
            nd = 0
            if quick and i == 0:
                for j in range(min(nk, AHEAD)):
                    KVX_PREFETCH_KEY(self._slots, hashes[j], base, nslots, obase, onslots)
            while i < lim:
                k = arena + offs[i]
                n = offs[i + 1] - offs[i]
                if not quick:
                    r = self._find(k, n, hashes[i], &f, False)
                else:
                    j = i + AHEAD
                    if j < nk:
                        KVX_PREFETCH_KEY(self._slots, hashes[j], base, nslots, obase, onslots)
                    if onslots:             # a migration: the old table, then the new one
                        r = self._probe1(k, n, hashes[i], obase, onslots)
                        if r == R_MISS:
                            r = self._probe1(k, n, hashes[i], base, nslots)
                    else:
                        pos = kvx_home(hashes[i], nslots)
                        left = nslots
                        r = self._probe_part(k, n, hashes[i], base, nslots, &pos, &left,
                                             FIRST_SLOTS)
                        if r == R_MORE:
                            for q in range(MORE_SLOTS):
                                kvx_prefetch(self._slot(base + pos + q))   # (never faults)
                            dkey[nd] = <uint32_t>(i - c0)
                            dpos[nd] = pos
                            dleft[nd] = left
                            nd += 1
                            out[i] = <char>R_MORE
                            i += 1
                            continue
                    if r == R_FALLBACK:     # a slot in a write: the full lookup
                        r = self._find(k, n, hashes[i], &f, False)
                out[i] = <char>r
                i += 1
                if r == R_FALLBACK or (prefix and r != R_HIT):
                    break
            for d in range(nd):             # the keys put aside, their slots fetched by now
                j = c0 + dkey[d]
                k = arena + offs[j]
                n = offs[j + 1] - offs[j]
                r = self._probe_part(k, n, hashes[j], base, nslots, &dpos[d], &dleft[d],
                                     dleft[d])
                if r == R_FALLBACK or r == R_MORE:
                    r = self._find(k, n, hashes[j], &f, False)
                out[j] = <char>r
            if quick:
                kvx_fence_acq()
                if kvx_load_rlx(&self._h.table_seq) != ts:
                    # the tables changed during the chunk: its misses may have been keys
                    # moving; each is looked up again alone (rare)
                    for j in range(c0, i):
                        if out[j] == R_MISS:
                            out[j] = <char>self._find(arena + offs[j], offs[j + 1] - offs[j],
                                                      hashes[j], &f, False)
            for j in range(c0, i):
                if out[j] == R_FALLBACK or (prefix and out[j] != R_HIT):
                    return j + 1
        return nk

    cdef inline int _probe_part(self, const char* k, Py_ssize_t n, uint64_t h,
                                uint64_t base, uint64_t nslots, uint64_t* pos,
                                uint64_t* left, uint64_t most) noexcept nogil:
        """Part of one key's probe (as :meth:`_probe1`) of the table of ``nslots`` slots
        from ``base``: at most ``most`` slots from slot ``pos[0]`` of the table, with
        ``left[0]`` slots left to the whole probe. R_HIT, R_MISS, R_FALLBACK (a slot on
        the way was being written), or R_MORE with ``pos`` and ``left`` moved past the
        slots looked at."""
        cdef uint64_t i = pos[0], m, v1, mt, want = _m_want(h, n)
        cdef const Slot* s
        cdef const char* kp
        cdef size_t room
        cdef uint32_t st
        for m in range(most):
            if left[0] == 0:
                return R_MISS
            s = self._slot(base + i)
            v1 = kvx_load_acq(&s.version)
            if v1 & 1:
                return R_FALLBACK
            mt = s.meta
            st = _m_state(mt)
            if _m_is(mt, want):
                kp = _slot_key(s, self._wide, self._wide_cap, n, &room)
                if kp != NULL and kvx_keyeq_w(k, kp, n):
                    kvx_fence_acq()
                    return R_HIT if kvx_load_rlx(&s.version) == v1 else R_FALLBACK
            kvx_fence_acq()
            if kvx_load_rlx(&s.version) != v1:
                return R_FALLBACK
            if st == S_EMPTY:
                return R_MISS
            left[0] -= 1
            i += 1
            if i == nslots:
                i = 0
        pos[0] = i
        return R_MORE

    cdef inline int _probe1(self, const char* k, Py_ssize_t n, uint64_t h,
                            uint64_t base, uint64_t nslots) noexcept nogil:
        """One key's lookup in a table of ``nslots`` slots while no rebuild runs (the
        caller checks the table sequence once for the whole batch): R_HIT, R_MISS, or
        R_FALLBACK when a slot on the way was being written (the caller then runs the
        full :meth:`_find`)."""
        cdef uint64_t i = kvx_home(h, nslots), probes, v1, mt, want = _m_want(h, n)
        cdef const Slot* s
        cdef const char* kp
        cdef size_t room
        cdef uint32_t st
        for probes in range(nslots):
            s = self._slot(base + i)
            v1 = kvx_load_acq(&s.version)
            if v1 & 1:
                return R_FALLBACK
            mt = s.meta
            st = _m_state(mt)
            if _m_is(mt, want):
                kp = _slot_key(s, self._wide, self._wide_cap, n, &room)
                if kp != NULL and kvx_keyeq_w(k, kp, n):
                    kvx_fence_acq()
                    return R_HIT if kvx_load_rlx(&s.version) == v1 else R_FALLBACK
            kvx_fence_acq()
            if kvx_load_rlx(&s.version) != v1:
                return R_FALLBACK
            if st == S_EMPTY:
                return R_MISS
            i += 1
            if i == nslots:
                i = 0
        return R_MISS

    cdef object _batch(self, object keys, bint prefix):
        """The C lookup of every key of ``keys`` (a list or tuple): ``(flags, keys
        done)``, or None when a key is not one the table can hold (or the reader is not
        usable, or a list's length changed under a large batch). The keys go in
        segments of at most C_SEG keys (C_SEG_BYTES of key bytes): each segment's keys
        are copied into one small scratch buffer and hashed, then looked up (the GIL
        released for that when the batch has 2048 keys or more), so that the scratch
        stays in the cache and is faulted in once. Every key's type and length is
        checked before an answer, as the general path would (a lookup that stops early
        checks the keys after it). ``_busy`` keeps close() from unmapping under it."""
        cdef Py_ssize_t i, s0, nk, done, n, total, cap, sn
        cdef const char* k
        cdef char* arena
        cdef uint32_t* offs
        cdef uint64_t* hashes
        cdef char* out
        cdef bytes flags
        cdef bint own, nogil_ok, is_list, want_h
        cdef int nh = 0, cur = 0
        cdef Py_ssize_t nsn
        cdef SegWork ws[2]
        cdef SegWork* pending = NULL
        cdef char* arena2 = NULL
        cdef uint32_t* offs2 = NULL
        cdef uint64_t* hashes2 = NULL
        cdef size_t need
        cdef PyObject** items
        cdef Py_ssize_t maxk = <Py_ssize_t>self.max_key
        if not self._usable():
            return None
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)
        is_list = type(keys) is list
        nk = len(keys)
        if nk >= 2048 and (kvx_load_rlx(&self._h.nslots) != self._pf_n or
                           kvx_load_rlx(&self._h.base) != self._pf_base):
            self._prefault()            # the table moved since: map its pages here first
        flags = PyBytes_FromStringAndSize(NULL, nk)
        out = PyBytes_AS_STRING(flags)
        if nk == 0:
            return flags, 0
        nogil_ok = nk >= 2048
        want_h = nogil_ok and self.fast_batch and self._threads > 1 and nk >= self.threads_min
        # the reader's scratch buffers, kept between calls (twice the room when helpers
        # may look keys up: two segments at a time); a second thread's batch meanwhile
        # gets its own
        own = not self._scr_busy
        need = (C_SEG + 1) * (sizeof(uint64_t) + sizeof(uint32_t)) * (2 if want_h else 1)
        cap = C_SEG_BYTES
        if own:
            self._scr_busy = True
            if self._scr_cap[0] < need:
                c_free(self._scr[0])
                self._scr[0] = <char*>malloc(need)
                self._scr_cap[0] = need if self._scr[0] != NULL else 0
            if self._scr_cap[1] < <size_t>cap * (2 if want_h else 1):
                c_free(self._scr[1])
                self._scr[1] = <char*>malloc(cap * (2 if want_h else 1))
                self._scr_cap[1] = cap * (2 if want_h else 1) if self._scr[1] != NULL else 0
            hashes = <uint64_t*>self._scr[0]
            arena = self._scr[1]
        else:
            hashes = <uint64_t*>malloc(need)
            arena = <char*>malloc(cap * (2 if want_h else 1))
        if hashes == NULL or arena == NULL:
            if own:
                self._scr_busy = False
            else:
                c_free(hashes)
                c_free(arena)
            raise MemoryError()
        offs = <uint32_t*>(hashes + C_SEG + 1)
        if want_h:
            hashes2 = <uint64_t*>(offs + C_SEG + 1)
            offs2 = <uint32_t*>(hashes2 + C_SEG + 1)
            arena2 = arena + cap
            nh = kvx_pool_take(self._threads - 1)
        self._busy += 1
        try:
            s0 = 0
            if nh:
                # with helpers: segment k is looked up (its pieces claimed by the helpers
                # and, once it has copied and hashed segment k + 1 into the other
                # buffers, by this thread) while this thread copies segment k + 1
                if is_list and PyList_GET_SIZE(keys) != nk:
                    return None
                sn = _fill_seg(PySequence_Fast_ITEMS(keys), 0, nk, maxk, arena, offs,
                               hashes, cap)
                if sn < 0:
                    return None               # (a key the table cannot hold: see below)
                while True:
                    self._seg_publish(&ws[cur], arena, offs, hashes, sn, out + s0, prefix)
                    pending = &ws[cur]
                    nsn = 0
                    if s0 + sn < nk:
                        # (the list re-read: the GIL was released for the last segment)
                        if is_list and PyList_GET_SIZE(keys) != nk:
                            nsn = -1
                        else:
                            nsn = _fill_seg(PySequence_Fast_ITEMS(keys), s0 + sn, nk, maxk,
                                            arena2, offs2, hashes2, cap)
                    with nogil:
                        done = self._seg_finish(pending)
                    pending = NULL
                    s0 += done
                    if done < sn or s0 >= nk or _stopped(out + s0, done, prefix):
                        break                 # a fallback, (prefix) a key not found, or all
                    if nsn < 0:
                        return None           # a bad key next, or the list changed
                    arena, arena2 = arena2, arena
                    offs, offs2 = offs2, offs
                    hashes, hashes2 = hashes2, hashes
                    cur ^= 1
                    sn = nsn
            while s0 < nk and not nh:
                # (re-read each segment: with the GIL released, another thread may
                # have changed the list; its length changed, the general path answers)
                if is_list and PyList_GET_SIZE(keys) != nk:
                    return None
                items = PySequence_Fast_ITEMS(keys)  # borrowed: no Python code runs
                sn = _fill_seg(items, s0, nk, maxk, arena, offs, hashes, cap)
                if sn < 0:
                    # a key the table cannot hold: the whole batch goes to the client's
                    # general path, which raises for a key it refuses (wrong type,
                    # empty, over the server's limit) and asks the server otherwise
                    return None
                if nogil_ok:
                    with nogil:
                        done = self._probe_all(arena, offs, hashes, sn, out + s0, prefix)
                else:
                    done = self._probe_all(arena, offs, hashes, sn, out + s0, prefix)
                s0 += done
                if done < sn or _stopped(out + s0, done, prefix):
                    break                     # a fallback, or (prefix) a key not found
            if s0 < nk and prefix:
                # the answer is the key that stopped it: the keys after it must still be
                # ones the general path takes (an error of one is not to be hidden)
                if is_list and PyList_GET_SIZE(keys) != nk:
                    return None
                items = PySequence_Fast_ITEMS(keys)
                for i in range(s0, nk):
                    if not kvx_key_of(items[i], &k, &n):
                        n = 0
                    if not 0 < n <= maxk:
                        return None
            done = s0
        finally:
            if pending != NULL:             # (an exception while its pieces ran)
                with nogil:
                    self._seg_finish(pending)
            if nh:
                kvx_pool_give()
            self._busy -= 1
            if own:
                self._scr_busy = False
            else:
                c_free(hashes)
                c_free(arena)
        return flags, done

    @property
    def batch_threads(self):
        """Threads (this one included, 1 to 8) a fast batch lookup of at least
        :data:`BATCH_THREADS_MIN` keys looks its keys up with: each segment's keys are
        copied and hashed here, then looked up in pieces by this thread and helper
        threads of the process, whichever claims a piece first (the helpers are made
        at the first such batch; they spin ~0.1 ms for more, then sleep). One batch at a time has the helpers; another meanwhile runs alone.
        From :data:`ENV_BATCH_THREADS` (default :func:`default_batch_threads`)."""
        return self._threads

    @batch_threads.setter
    def batch_threads(self, int n):
        if not 1 <= n <= C_MAX_THREADS:
            raise ValueError(f"batch_threads must be in [1, {C_MAX_THREADS}]")
        self._threads = n

    cdef void _seg_publish(self, SegWork* w, const char* arena, const uint32_t* offs,
                           const uint64_t* hashes, Py_ssize_t nk, char* out,
                           bint prefix) noexcept nogil:
        """Offer a segment's :meth:`_probe_all` to the helpers (taken, kvx_pool_take), in
        pieces of C_PIECE keys (at most C_MAX_PIECES); :meth:`_seg_finish` ends it."""
        cdef uint32_t np
        w.arena = arena
        w.offs = offs
        w.hashes = hashes
        w.nk = nk
        w.out = out
        w.prefix = prefix
        w.piece = C_PIECE
        np = <uint32_t>((nk + C_PIECE - 1) // C_PIECE)
        if np > C_MAX_PIECES:
            w.piece = (nk + C_MAX_PIECES - 1) // C_MAX_PIECES
            np = <uint32_t>((nk + w.piece - 1) // w.piece)
        w.np = np
        kvx_work_publish(<void*>_probe_piece, <void*>self, w, np)

    cdef Py_ssize_t _seg_finish(self, SegWork* w) noexcept nogil:
        """Look up the pieces of ``w`` no helper claimed, wait for those they did, and
        return :meth:`_probe_all`'s of the whole segment (the first piece that stopped
        early decides)."""
        cdef uint32_t p
        cdef Py_ssize_t a
        while kvx_work_claim(&p):
            _probe_piece(self, w, p)
            kvx_work_finished()
        kvx_work_wait(w.np)             # (no piece left running: the buffers are free)
        for p in range(w.np):
            a = <Py_ssize_t>p * w.piece
            if w.done[p] < min(w.piece, w.nk - a) or _stopped(w.out + a + w.done[p],
                                                               w.done[p], w.prefix):
                return a + w.done[p]
        return w.nk

    cdef void _free_scratch(self) noexcept:
        c_free(self._scr[0])
        c_free(self._scr[1])
        self._scr[0] = self._scr[1] = NULL
        self._scr_cap[0] = self._scr_cap[1] = 0

    def exists_batch(self, keys):
        """Whether each key is present: a list of bool, or None when a key must be
        asked of the server. Keys are hashed and looked up in C (the GIL released for
        large batches), slots prefetched ahead."""
        cdef Py_ssize_t i, nk, done
        cdef const char* out
        cdef list res
        got = self._batch(keys, False)
        if got is None:
            return None
        flags, done = got
        nk = len(flags)
        out = PyBytes_AS_STRING(flags)
        if done < nk or (nk and out[nk - 1] == R_FALLBACK):
            return None
        if memchr(out, <char>R_MISS, nk) != NULL and not self._misses_final():
            return None
        res = PyList_New(nk)
        kvx_fill_bools(PySequence_Fast_ITEMS(res), out, nk, <char>R_HIT)
        return res

    def match_prefix(self, keys):
        """How many leading keys are present, or -2 (FALLBACK) when the answer needs
        the server."""
        cdef Py_ssize_t i, done
        cdef const char* out
        got = self._batch(keys, True)
        if got is None:
            return FALLBACK
        flags, done = got
        out = PyBytes_AS_STRING(flags)
        for i in range(done):               # the first key not found decides
            if out[i] != R_HIT:
                if out[i] == R_MISS and self._misses_final():
                    return i
                return FALLBACK
        return done


cdef Slot _layout_slot     # (the offsets of layout 5, which readers of other builds rely on)
cdef Header _layout_header
if (sizeof(Slot) != C_SLOT or C_KEY_MAX + 8 + 8 * C_MAX_EXT > C_WIDE or sizeof(Rec) != 16
        or (32 << C_REC_CLASSES) != C_WIDE or 64 + 128 + C_WIDE != C_RECS_BYTES
        or sizeof(Header) > C_HEADER or C_KEY_MAX > 255 or C_MAX_EXT > 8
        or <char*>&_layout_slot.key[0] - <char*>&_layout_slot != SLOT_KEY_OFFSET
        or <char*>&_layout_slot.meta - <char*>&_layout_slot != SLOT_META_OFFSET
        or SLOT_KEY_OFFSET + C_DATA != C_SLOT or C_LINE_KEY + 8 != C_DATA
        or (1 << C_SIZE_BITS) - 1 != SLOT_SIZE_MAX
        or <char*>&_layout_header.layout - <char*>&_layout_header != LAYOUT_OFFSET):
    raise ImportError("kvshm._shmindex was built with an unexpected struct layout")
