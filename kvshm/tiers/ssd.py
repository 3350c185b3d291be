"""The SSD tier: entries evicted from the pool go to pre-allocated files, not away.

Layout of ``--ssd-path DIR``::

    DIR/kvshm-ssd.lock        flock'ed while a server uses DIR (one server per directory)
    DIR/kvshm-ssd-<i>.dat     data files, posix_fallocate'd at start-up, used in blocks of
                              the pool's block size (one BitmapAllocator per file)
    DIR/kvshm-ssd.manifest    with ``persist``: key, file, block, size, xxh64 per entry

Threads. Everything in :class:`SsdTier` runs on the server's loop thread (the one that
owns the :class:`~kvshm.store.Store`), except the I/O itself: a few worker threads move
bytes between the files and the pool memory with ``os.preadv`` / ``os.pwritev`` (the GIL
is released during the system call), ``O_DIRECT`` where the filesystem allows it, through
a private buffer per worker in huge pages (:func:`_io_buffer`), and check xxh64. A
worker never touches the tier's maps; a finished job goes through a queue, the worker
wakes the loop (``notify``, the loop's wake pipe), and :meth:`SsdTier.poll` applies it on
the loop thread.

Promotion reads (:meth:`SsdTier.prefetch`, :class:`_Prefetch`) start before room is made
for them in the pool, in pieces of READ_PIECE_BYTES read in queue order, READ_DEPTH at a
time (:class:`_ReadGate`): a worker checks and copies its piece while the next pieces are
read. The copy into the pool waits until the loop thread gave every entry of the piece
its (allocated, unpublished) pool blocks, or none.

Where an SSD entry lives (``SsdEntry.where``):

- ``ONLY``: the pool has no copy; a LOOKUP promotes it. Kept in LRU order (the order in
  which entries left the pool); the oldest is dropped when room is needed.
- ``MARGIN``: a copy of a pool entry written ahead of its eviction (the store's cleaner
  keeps the LRU end of the pool clean, so an eviction costs no I/O).
- ``HOT``: a copy of a pool entry that was read since (promoted from SSD, or touched).
  Dropped first, most recently used first, when room is needed: its pool entry will be
  the last to be evicted, and only becomes dirty again.

Pool memory is never reused while a worker reads or writes it: the store pins an entry
whose bytes are being written, and allocates (but does not publish) the blocks a read
fills. The SSD blocks of an entry are freed only when no job touches them (``io``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import mmap
import os
import queue
import struct
import threading
import time
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import xxhash

from kvshm._bitmap import BitmapAllocator

__all__ = ["SsdConfig", "SsdEntry", "SsdTier", "SPILL_STARTED", "SPILL_BUSY",
           "SPILL_REFUSED", "ALIGN"]

log = logging.getLogger(__name__)

GiB = 1024 ** 3
MiB = 1024 ** 2
#: I/O alignment (offsets, lengths, buffer addresses) for O_DIRECT.
ALIGN = 4096
#: A job moves at most this many bytes / entries: runs of entries adjacent on disk are
#: moved with one preadv/pwritev. Also the size of each worker's private buffer (a
#: promotion read of a larger value goes straight into the pool).
MAX_JOB_BYTES = 8 * MiB
MAX_JOB_ITEMS = 512
#: A promotion read is started in pieces of at most this many bytes, each on its own
#: worker: the checksum and the copy into the pool of one piece overlap the disk reads
#: of the next ones (see :class:`_Prefetch`). Of the sizes (1, 2, 4 MiB) and depths
#: (1 to 4) tried with 8 MiB requests, two 2 MiB pieces at a time did best.
READ_PIECE_BYTES = 2 * MiB
#: Promotion reads in flight at once, started in the order they were queued (so the
#: disk sees one sequential stream, as a plain sequential read does).
READ_DEPTH = 2
#: Seconds the loop thread waits (at most) for an idle worker to start a prefetch.
KICK_WAIT = 0.001
#: Seconds a prefetch waits for its destinations before giving them up (a safety net:
#: the loop places every entry within the call that started the read).
PLACE_TIMEOUT = 30.0

# SsdEntry.state
WRITING = 0
STORED = 1
DEAD = 2
# SsdEntry.where
NOWHERE = 0
ONLY = 1
MARGIN = 2
HOT = 3

# SsdTier.spill results
SPILL_STARTED = 0
SPILL_BUSY = 1       # the write queue is full: try again when a write completes
SPILL_REFUSED = 2    # cannot be stored (larger than a file, no room, tier failing)

LOCK_NAME = "kvshm-ssd.lock"
MANIFEST_NAME = "kvshm-ssd.manifest"
DATA_FMT = "kvshm-ssd-{}.dat"
_MAGIC = b"KVSHMSSD"
_MANIFEST_VERSION = 1
_HDR = struct.Struct("<8sIQQ")   # magic, version, body length, xxh64(body)

#: Consecutive write errors after which spills are refused for FAIL_BACKOFF seconds.
FAIL_AFTER = 8
FAIL_BACKOFF = 5.0
#: How often (at most) the files are checked for having been removed under the server.
CHECK_INTERVAL = 1.0


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass
class SsdConfig:
    """Options of an :class:`SsdTier` (the server fills them from ``--ssd-*``).

    Attributes
    ----------
    path : str
        Directory of the data files (created when missing).
    size : int
        Bytes of disk to use, all files together (rounded down to whole blocks).
    block_size : int
        Bytes per block: the pool's block size (a multiple of 4 KiB).
    files : int
        Number of data files; 0 picks one per GiB, 1 to 8.
    workers : int
        I/O threads.
    queue_bytes : int
        Most bytes of spill writes in flight; a spill beyond it is refused as busy.
    persist : bool
        Keep the files and write a manifest (on a clean stop and every
        ``manifest_interval`` seconds while entries change) so a restarted server serves
        the entries again. Without it the files are scratch and removed at exit.
    manifest_interval : float
        Seconds between manifest writes while entries change.
    direct : bool or None
        Use O_DIRECT: None (default) where the filesystem allows it; False never.
    """

    path: str
    size: int
    block_size: int
    files: int = 0
    workers: int = 4
    queue_bytes: int = 64 * MiB
    persist: bool = False
    manifest_interval: float = 5.0
    direct: bool | None = None


class SsdEntry:
    """One value on disk: ``nblocks`` blocks of file ``file`` from block ``start``."""

    __slots__ = ("key", "file", "start", "nblocks", "size", "checksum", "state", "where",
                 "io", "owner", "evict_after")

    def __init__(self, key: bytes, file: int, start: int, nblocks: int, size: int,
                 checksum: int = 0, state: int = WRITING) -> None:
        self.key = key
        self.file = file
        self.start = start
        self.nblocks = nblocks
        self.size = size
        self.checksum = checksum
        self.state = state
        self.where = NOWHERE
        self.io = 0                 # jobs in flight that touch these blocks
        self.owner: Any = None      # the pool Entry this is a copy of (MARGIN, HOT, writing)
        self.evict_after = False    # the store asked to evict the pool copy once written

    def __repr__(self) -> str:
        st = ("writing", "stored", "dead")[self.state]
        wh = ("-", "only", "margin", "hot")[self.where]
        return (f"<SsdEntry {self.key!r} file={self.file} blocks={self.start}+{self.nblocks} "
                f"size={self.size} {st} {wh} io={self.io}>")


class _File:
    __slots__ = ("index", "path", "fd", "nblocks", "alloc", "disabled", "entries")

    def __init__(self, index: int, path: str, fd: int, nblocks: int) -> None:
        self.index = index
        self.path = path
        self.fd = fd
        self.nblocks = nblocks
        self.alloc = BitmapAllocator(nblocks)
        self.disabled = False
        self.entries = 0    # blocks of this file held by entries (for the removed-file drop)


class _Job:
    """One preadv/pwritev over a run of entries adjacent in one file (or a manifest)."""

    __slots__ = ("kind", "fd", "path", "offset", "items", "views", "oks", "sums", "error",
                 "payload", "pool", "direct")

    def __init__(self, kind: str, fd: int = -1, path: str = "", offset: int = 0,
                 pool: Any = None, direct: bool = False) -> None:
        self.kind = kind            # "r", "w" or "m" (manifest)
        self.fd = fd
        self.path = path
        self.offset = offset
        self.pool = pool
        self.direct = direct
        self.items: list[tuple[SsdEntry, Any]] = []
        self.views: list[memoryview] = []   # pool memory of each entry (I/O length)
        self.oks: list[bool] = []
        self.sums: list[int] = []
        self.error: BaseException | None = None
        self.payload: Any = None

    def release(self) -> None:
        for v in self.views:
            v.release()
        self.views = []

    def run(self, bounce: memoryview | None) -> None:
        try:
            if self.kind == "m":
                self.payload()
                self.oks = [True]
                return
            total = sum(v.nbytes for v in self.views)
            if self.direct and bounce is not None and total <= bounce.nbytes:
                with bounce[:total] as buf:
                    self._run_bounced(buf)
            elif self.kind == "w":
                self.sums = [_xxh(v, se.size) for (se, _), v in
                             zip(self.items, self.views)]
                _pwritev_all(self.fd, self.views, self.offset)
                self.oks = [True] * len(self.items)
            else:
                _preadv_all(self.fd, self.views, self.offset)
                self.oks = [_xxh(v, se.size) == se.checksum for (se, _), v in
                            zip(self.items, self.views)]
        except BaseException as exc:   # OSError from the disk; anything else is a bug
            self.error = exc
            self.oks = [False] * max(1, len(self.items))
        finally:
            self.release()

    def _run_bounced(self, buf: memoryview) -> None:
        """O_DIRECT through the worker's private buffer, in huge pages (see
        :func:`_io_buffer`: the pool's pages are 4 KiB ones, and a direct read or write
        is cut into one segment per page run), and the copy to/from the pool (GIL
        released) costs a fraction of that. The checksum of a spill covers exactly the
        bytes written."""
        pool = self.pool
        bs = pool.block_size
        offsets = [e.start * bs for _, e in self.items]
        sizes = [v.nbytes for v in self.views]
        starts = []
        pos = 0
        for n in sizes:
            starts.append(pos)
            pos += n
        if self.kind == "w":
            pool.gather(offsets, sizes, buf)
            self.sums = [_xxh_at(buf, a, se.size) for (se, _), a in zip(self.items, starts)]
            _pwritev_all(self.fd, [buf], self.offset)
            self.oks = [True] * len(self.items)
            return
        _preadv_all(self.fd, [buf], self.offset)
        self.oks = [_xxh_at(buf, a, se.size) == se.checksum
                    for (se, _), a in zip(self.items, starts)]
        keep = [i for i, ok in enumerate(self.oks) if ok]
        if keep:
            pool.scatter(buf, [offsets[i] for i in keep], [sizes[i] for i in keep],
                         [starts[i] for i in keep])


class _Prefetch:
    """A promotion read started before its pool blocks exist: one ``preadv`` of a run of
    SSD-only entries adjacent in one file into the worker's private buffer, then the
    checksum of every entry. Meanwhile the loop thread makes room in the pool and gives
    each entry its destination (:meth:`place`: a pool Entry, or None when it could not
    be placed or is no longer wanted); the worker copies the entries that passed their
    checksum to their destinations only once every entry was given one, so pool blocks
    are written only while the promotion owns them (allocated, not published)."""

    __slots__ = ("kind", "fd", "path", "offset", "items", "dests", "oks", "error", "pool",
                 "nbytes", "_left", "_lock", "_ready", "abandoned", "gate", "ticket",
                 "started")

    def __init__(self, fd: int, path: str, offset: int, pool: Any) -> None:
        self.kind = "r"
        self.fd = fd
        self.path = path
        self.offset = offset
        self.pool = pool
        self.items: list[tuple[SsdEntry, Any]] = []     # (entry, pool Entry or None)
        self.dests: list[Any] = []
        self.oks: list[bool] = []
        self.error: BaseException | None = None
        self.nbytes = 0
        self._left = 0
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.abandoned = False
        self.gate: _ReadGate | None = None     # set when queued
        self.ticket = 0
        self.started = threading.Event()       # a worker took it

    def add(self, se: SsdEntry, io_len: int) -> None:
        self.items.append((se, None))
        self.dests.append(None)
        self.nbytes += io_len
        self._left += 1

    def place(self, i: int, e: Any) -> bool:
        """Item ``i`` goes to pool entry ``e`` (None: nowhere). False when the worker gave
        up waiting (never in practice: the loop places every item within the call that
        started the read); the caller then reads the entry again the ordinary way."""
        with self._lock:
            if self.abandoned:
                return False
            self.dests[i] = e
            self.items[i] = (self.items[i][0], e)
            self._left -= 1
            if self._left == 0:
                self._ready.set()
            return True

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            self._ready.set()

    def release(self) -> None:
        pass

    def run(self, bounce: memoryview | None) -> None:
        items = self.items
        try:
            if bounce is None or self.nbytes > bounce.nbytes:
                raise AssertionError("a prefetch larger than the I/O buffer")
            self.started.set()
            with bounce[:self.nbytes] as buf:
                gate = self.gate
                if gate is not None:
                    gate.enter(self.ticket)
                try:
                    _preadv_all(self.fd, [buf], self.offset)
                finally:
                    if gate is not None:
                        gate.leave()
                bs = self.pool.block_size
                sums = []
                pos = 0
                for se, _ in items:
                    sums.append(_xxh_at(buf, pos, se.size) == se.checksum)
                    pos += se.nblocks * bs
                # Wait for the destinations (set by the loop thread while the disk read
                # ran, so almost never a wait); bounded, in case the loop died.
                deadline = time.monotonic() + PLACE_TIMEOUT
                while not self._ready.wait(0.5):
                    if time.monotonic() > deadline:
                        self.abandon()
                with self._lock:
                    self.abandoned = True    # a late place() is refused from now on
                    dests = list(self.dests)
                self.oks = sums
                offs, sizes, srcs = [], [], []
                pos = 0
                for (se, _), e, ok in zip(items, dests, sums):
                    if e is not None and ok:
                        offs.append(e.start * bs)
                        sizes.append(se.size)
                        srcs.append(pos)
                    pos += se.nblocks * bs
                if offs:
                    self.pool.scatter(buf, offs, sizes, srcs)
        except BaseException as exc:   # OSError from the disk; anything else is a bug
            self.error = exc
            with self._lock:
                self.abandoned = True
            self.oks = [False] * len(items)


def _xxh_at(buf: memoryview, start: int, size: int) -> int:
    with buf[start:start + size] as part:
        return xxhash.xxh64_intdigest(part)


def _xxh(view: memoryview, size: int) -> int:
    with view[:size] as part:
        return xxhash.xxh64_intdigest(part)


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    total = sum(v.nbytes for v in views)
    done = os.pwritev(fd, views, offset)
    if done == total:
        return
    pos = 0          # a short write (rare): finish view by view
    for v in views:
        n = v.nbytes
        k = min(max(0, done - pos), n)
        while k < n:
            with v[k:] as part:
                w = os.pwrite(fd, part, offset + pos + k)
            if w <= 0:
                raise OSError(errno.EIO, "short write")
            k += w
        pos += n


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
    total = sum(v.nbytes for v in views)
    done = os.preadv(fd, views, offset)
    if done == total:
        return
    pos = 0
    for v in views:
        n = v.nbytes
        k = min(max(0, done - pos), n)
        while k < n:
            with v[k:] as part:
                r = os.preadv(fd, [part], offset + pos + k)
            if r <= 0:
                raise OSError(errno.EIO, "short read: the file ends before the entry "
                                         "(truncated under the server?)")
            k += r
        pos += n


class _ReadGate:
    """Prefetch reads start in the order they were queued, at most READ_DEPTH at once:
    the disk sees one sequential stream (as a plain sequential read), while the workers
    that finished their read check and copy it. A read never waits for anything but
    the reads queued before it."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._issued = 0        # tickets handed out (under the pool's lock, in queue order)
        self._next = 0          # the ticket allowed to start next
        self._busy = 0
        self._stop = False

    def ticket(self) -> int:
        t = self._issued
        self._issued += 1
        return t

    def enter(self, t: int) -> None:
        with self._cv:
            while (t != self._next or self._busy >= READ_DEPTH) and not self._stop:
                self._cv.wait()
            if t == self._next:
                self._next += 1
            self._busy += 1

    def leave(self) -> None:
        with self._cv:
            self._busy -= 1
            self._cv.notify_all()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()


def _io_buffer(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """A private buffer of ``nbytes`` for direct I/O, in transparent huge pages where the
    kernel gives them (``MADV_HUGEPAGE``: THP "madvise" or "always").

    A direct read is cut into one segment per physically contiguous piece of the buffer,
    and a virtio disk takes at most ``max_segments`` (254 here) per request: into 4 KiB
    pages a 2 MiB read is 512 segments, three requests; into a huge page it is one.
    Measured here, sequential 2 MiB O_DIRECT reads: 3.3-3.7 GB/s into huge pages, 1.2-1.3
    GB/s into 4 KiB pages (private or shared alike). The mapping must be private:
    ``mmap.mmap(-1, n)`` is a shared (shmem) mapping, which THP leaves alone unless
    ``shmem_enabled`` says otherwise."""
    huge = 2 * MiB
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
    mem = mmap.mmap(-1, nbytes + huge, flags=flags)
    off = 0
    try:
        import ctypes

        c = ctypes.c_char.from_buffer(mem)
        off = -ctypes.addressof(c) % huge
        del c                   # no export left: the mapping can be closed later
        mem.madvise(mmap.MADV_HUGEPAGE, off, nbytes)
    except (ImportError, AttributeError, OSError, ValueError):
        pass                    # no THP: 4 KiB pages, still page-aligned
    view = memoryview(mem)[off:off + nbytes]
    view[:] = bytes(nbytes)     # fault the pages in now (huge ones where given)
    return mem, view


class _IoPool:
    """Worker threads running jobs; reads (a client waits) go before writes, but a write
    gets every fourth turn so spills are never starved."""

    def __init__(self, n: int, done: "queue.SimpleQueue[_Job]",
                 wake: Callable[[], None]) -> None:
        self._cv = threading.Condition()
        self._reads: deque[_Job] = deque()
        self._writes: deque[_Job] = deque()
        self._turn = 0
        self._stop = False
        self._gate = _ReadGate()
        self.idle = 0               # workers waiting for a job
        self._done = done
        self._wake = wake
        self._threads = [threading.Thread(target=self._run, name=f"kvshm-ssd-io-{i}",
                                          daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def put(self, job: Any) -> None:
        with self._cv:
            if type(job) is _Prefetch:
                job.gate = self._gate
                job.ticket = self._gate.ticket()
            (self._reads if job.kind == "r" else self._writes).append(job)
            self._cv.notify()

    def _take(self) -> _Job | None:
        with self._cv:
            while not self._reads and not self._writes:
                if self._stop:
                    return None
                self.idle += 1
                try:
                    self._cv.wait()
                finally:
                    self.idle -= 1
            self._turn += 1
            if self._reads and (not self._writes or self._turn % 4):
                return self._reads.popleft()
            return self._writes.popleft()

    def _run(self) -> None:
        # A private buffer for O_DIRECT jobs (see _Job._run_bounced, _Prefetch).
        mem, bounce = _io_buffer(MAX_JOB_BYTES)
        try:
            while True:
                job = self._take()
                if job is None:
                    return
                job.run(bounce)
                self._done.put(job)
                self._wake()
        finally:
            bounce.release()
            mem.close()

    def close(self, timeout: float) -> list[_Job]:
        """Stop: queued jobs are returned unrun (their views released); running ones
        finish (waited for up to ``timeout`` seconds)."""
        with self._cv:
            self._stop = True
            left = list(self._reads) + list(self._writes)
            self._reads.clear()
            self._writes.clear()
            self._cv.notify_all()
        self._gate.stop()       # reads queued behind dropped ones must not wait for them
        for j in left:
            if type(j) is _Prefetch:
                j.abandon()
        for j in left:
            j.release()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.error("an SSD I/O thread is still blocked in a system call after %.0f s "
                          "(a hung disk?)", timeout)
        return left


class SsdTier:
    """Spill files on a local disk, used in blocks, with their own LRU.

    Parameters
    ----------
    pool : kvshm.Pool
        The server's pool: I/O goes straight from/to its memory.
    config : SsdConfig

    Raises
    ------
    OSError
        The directory cannot be used (not writable, held by another server, not enough
        space for the files); the message names the directory.
    ValueError
        A size that holds no block.
    """

    def __init__(self, pool: Any, config: SsdConfig) -> None:
        cfg = config
        if cfg.block_size % ALIGN:
            raise ValueError(f"block size {cfg.block_size} is not a multiple of {ALIGN}")
        self.pool = pool
        self.config = cfg
        self.bs = cfg.block_size
        self.path = os.path.abspath(cfg.path)
        self.persist = cfg.persist
        total_blocks = cfg.size // self.bs
        nfiles = cfg.files or max(1, min(8, math.ceil(cfg.size / GiB)))
        per_file = total_blocks // nfiles
        if per_file < 1:
            raise ValueError(f"an SSD tier of {cfg.size} bytes in {nfiles} file(s) holds no "
                             f"block of {self.bs} bytes")
        self.queue_bytes = max(self.bs, cfg.queue_bytes)
        self.notify: Callable[[], None] | None = None
        #: Called with a pool Entry whose SSD copy was dropped (it is dirty again).
        self.unshadow: Callable[[Any], None] | None = None
        self.files: list[_File] = []
        self.direct = False
        self._lock_fd = -1
        self._locked = False
        self._created_dir = False
        self._only: OrderedDict[bytes, SsdEntry] = OrderedDict()
        self._margin: OrderedDict[bytes, SsdEntry] = OrderedDict()
        self._hot: OrderedDict[bytes, SsdEntry] = OrderedDict()
        self._held: set[SsdEntry] = set()      # every entry whose blocks are allocated
        self._writing: set[SsdEntry] = set()   # entries with a write in flight
        self.stored_bytes = 0                  # value bytes of STORED entries
        self.write_bytes = 0                   # bytes of spill writes queued or in flight
        self.margin_bytes = 0                  # value bytes in MARGIN
        self.reads_in_flight = 0
        self._wbatch: list[tuple[SsdEntry, Any, memoryview]] = []
        self._rbatch: list[tuple[SsdEntry, Any, memoryview]] = []
        #: Entries whose read was started by :meth:`prefetch` and that were not yet
        #: placed (:meth:`read`) or given up (:meth:`unreserve`): their job and index.
        self._pending: dict[SsdEntry, tuple[_Prefetch, int]] = {}
        self._done: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._woken = False
        self._next_file = 0
        self._write_errors = 0
        self._fail_until = 0.0
        self._logged: dict[tuple[Any, ...], float] = {}
        self._manifest_dirty = False
        self._manifest_busy = False
        self._next_manifest = 0.0
        self._next_check = 0.0
        self._closed = False
        self._pid = os.getpid()
        self.counters: dict[str, int] = dict.fromkeys(
            ("spills", "spill_bytes", "promotions", "promoted_bytes", "drops",
             "dropped_bytes", "shadow_drops", "checksum_failures", "io_errors", "stale",
             "refused", "manifest_writes", "manifest_errors", "loaded", "load_skipped"), 0)
        self._io: _IoPool | None = None
        try:
            self._open_files(nfiles, per_file)
            if self.persist:
                self._load_manifest()
            else:
                self._remove(os.path.join(self.path, MANIFEST_NAME))
            self._io = _IoPool(max(1, cfg.workers), self._done, self._wake)
        except BaseException:
            self._closed = True
            self._close_files(remove=not self.persist)
            raise

    # ------------------------------------------------------------------ set-up

    def _open_files(self, nfiles: int, per_file: int) -> None:
        path = self.path
        try:
            if not os.path.isdir(path):
                if os.path.exists(path):
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory")
                os.makedirs(path, mode=0o700)
                self._created_dir = True
            self._lock_fd = os.open(os.path.join(path, LOCK_NAME),
                                    os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot use SSD directory {path}: "
                                       f"{exc.strerror or exc}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise BlockingIOError(errno.EWOULDBLOCK, f"SSD directory {path} is in use by "
                                                     "another kvshm server") from None
        self._locked = True
        want_direct = self.config.direct is not False and hasattr(os, "O_DIRECT")
        self.direct = want_direct
        nbytes = per_file * self.bs
        for i in range(nfiles):
            fpath = os.path.join(path, DATA_FMT.format(i))
            fd = self._open_one(fpath)
            f = _File(i, fpath, fd, per_file)
            self.files.append(f)     # closed by _close_files on a failure below
            try:
                if os.fstat(fd).st_size > nbytes:
                    os.ftruncate(fd, nbytes)
                os.posix_fallocate(fd, 0, nbytes)   # keeps what is there; a no-op if done
            except OSError as exc:
                why = ("not enough free space" if exc.errno == errno.ENOSPC
                       else exc.strerror or str(exc))
                raise OSError(exc.errno, f"cannot allocate {nbytes / GiB:.3g} GiB for SSD "
                                         f"file {fpath}: {why}") from None
        if self.direct:
            log.info("SSD tier: %d file(s) of %.3g GiB in %s, O_DIRECT", nfiles,
                     nbytes / GiB, path)

    def _open_one(self, fpath: str) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        if self.direct:
            try:
                fd = os.open(fpath, flags | os.O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise OSError(exc.errno, f"cannot open SSD file {fpath}: "
                                             f"{exc.strerror}") from None
                self._no_direct(fpath, exc)
            else:
                if self._probe_direct(fd):
                    return fd
                os.close(fd)
                self._no_direct(fpath, None)
        try:
            return os.open(fpath, flags, 0o600)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open SSD file {fpath}: {exc.strerror}") from None

    def _probe_direct(self, fd: int) -> bool:
        """Some filesystems accept O_DIRECT at open and refuse the I/O."""
        buf = mmap.mmap(-1, ALIGN)
        try:
            with memoryview(buf) as v:
                if os.fstat(fd).st_size < ALIGN:
                    os.posix_fallocate(fd, 0, ALIGN)
                os.preadv(fd, [v], 0)
            return True
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise
        finally:
            buf.close()

    def _no_direct(self, fpath: str, exc: OSError | None) -> None:
        if self.direct:
            log.warning("SSD tier: the filesystem of %s does not allow O_DIRECT%s; using "
                        "buffered I/O (the page cache holds copies of spilled entries)",
                        os.path.dirname(fpath), f" ({exc.strerror})" if exc else "")
        self.direct = False

    # ------------------------------------------------------------------ manifest

    def _load_manifest(self) -> None:
        mpath = os.path.join(self.path, MANIFEST_NAME)
        try:
            with open(mpath, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("SSD tier: cannot read manifest %s (%s); starting empty", mpath, exc)
            return
        try:
            magic, version, n, csum = _HDR.unpack_from(data)
            body = data[_HDR.size:_HDR.size + n]
            if magic != _MAGIC or version != _MANIFEST_VERSION:
                raise ValueError("not a kvshm SSD manifest of this version")
            if len(body) != n or xxhash.xxh64_intdigest(body) != csum:
                raise ValueError("torn or corrupt (checksum mismatch)")
            m = msgpack.unpackb(body, raw=False, strict_map_key=False)
            geometry = [[DATA_FMT.format(f.index), f.nblocks] for f in self.files]
            if m["block_size"] != self.bs or m["files"] != geometry:
                raise ValueError(f"written for other files (block size {m['block_size']}, "
                                 f"files {m['files']}; now {self.bs}, {geometry})")
            entries = m["entries"]
        except (ValueError, KeyError, TypeError, struct.error,
                msgpack.UnpackException) as exc:
            log.warning("SSD tier: ignoring manifest %s: %s; starting empty", mpath, exc)
            self._remove(mpath)         # the files were resized / will be overwritten
            return
        bs = self.bs
        for rec in entries:
            try:
                key, fi, start, size, csum = rec
                f = self.files[fi]
                nblocks = max(1, -(-size // bs))
                if type(key) is not bytes or start < 0 or start + nblocks > f.nblocks:
                    raise ValueError("out of range")
                f.alloc.alloc_at(start, nblocks)
            except (ValueError, TypeError, IndexError):
                self.counters["load_skipped"] += 1
                continue
            if key in self._only:     # a duplicate key: keep the later (newer) record
                self._drop_only(self._only[key], count=False)
            se = SsdEntry(key, fi, start, nblocks, size, csum, STORED)
            f.entries += nblocks
            self._held.add(se)
            self._put(se, ONLY)
            self.counters["loaded"] += 1
        self._manifest_dirty = False
        log.info("SSD tier: %d entries (%.3g GiB) from manifest %s; checksums are checked "
                 "on each read", self.counters["loaded"], self.stored_bytes / GiB, mpath)

    def _snapshot(self) -> list[tuple[bytes, int, int, int, int]]:
        """The STORED entries, least recently used first (on the loop thread)."""
        return [(se.key, se.file, se.start, se.size, se.checksum)
                for d in (self._only, self._margin, self._hot) for se in d.values()]

    def _pack(self, recs: list[tuple[bytes, int, int, int, int]]) -> bytes:
        body = msgpack.packb({
            "block_size": self.bs,
            "files": [[DATA_FMT.format(f.index), f.nblocks] for f in self.files],
            "written": time.time(),
            "entries": recs}, use_bin_type=True)
        return _HDR.pack(_MAGIC, _MANIFEST_VERSION, len(body),
                         xxhash.xxh64_intdigest(body)) + body

    def _write_manifest(self, recs: list[tuple[bytes, int, int, int, int]]) -> None:
        """Data files durable first, then the manifest (atomically replaced)."""
        data = self._pack(recs)
        for f in self.files:
            if not f.disabled:
                os.fdatasync(f.fd)
        mpath = os.path.join(self.path, MANIFEST_NAME)
        tmp = mpath + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, mpath)
        dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _start_manifest(self, now: float) -> None:
        job = _Job("m")
        recs = self._snapshot()
        job.payload = lambda: self._write_manifest(recs)
        self._manifest_dirty = False
        self._manifest_busy = True
        self._next_manifest = now + self.config.manifest_interval
        assert self._io is not None
        self._io.put(job)

    # ------------------------------------------------------------------ maps

    def _put(self, se: SsdEntry, where: int) -> None:
        se.where = where
        if where == ONLY:
            self._only[se.key] = se
        elif where == MARGIN:
            self._margin[se.key] = se
            self.margin_bytes += se.size
        else:
            self._hot[se.key] = se
        if se.state == STORED:
            self.stored_bytes += se.size
        self._manifest_dirty = True

    def _take(self, se: SsdEntry) -> None:
        """Remove a STORED entry from its map (the caller re-files or kills it)."""
        w = se.where
        if w == ONLY:
            del self._only[se.key]
        elif w == MARGIN:
            del self._margin[se.key]
            self.margin_bytes -= se.size
        elif w == HOT:
            del self._hot[se.key]
        else:
            return
        se.where = NOWHERE
        self.stored_bytes -= se.size
        self._manifest_dirty = True

    def _kill(self, se: SsdEntry) -> None:
        """Mark dead; free the blocks now, or when the last job on them finishes."""
        self._take(se)
        se.state = DEAD
        se.owner = None
        if se.io == 0:
            self._free(se)

    def _free(self, se: SsdEntry) -> None:
        if se in self._held:
            self._held.discard(se)
            f = self.files[se.file]
            f.alloc.free(se.start, se.nblocks)
            f.entries -= se.nblocks

    def _unshadow(self, se: SsdEntry) -> None:
        owner = se.owner
        self._kill(se)
        if owner is not None and owner.meta is se:
            owner.meta = None
            if self.unshadow is not None:
                self.unshadow(owner)

    def _drop_only(self, se: SsdEntry, count: bool = True) -> None:
        if count:
            self.counters["drops"] += 1
            self.counters["dropped_bytes"] += se.size
        self._kill(se)

    def _make_room(self) -> bool | None:
        """Drop one entry to free blocks: a HOT copy (most recently used first), else the
        least recently used SSD-only entry not being read. None: not now (entries being
        promoted become HOT copies, droppable, when their reads complete: dropping an
        SSD-only entry instead would lose data an exact LRU keeps). False: nothing."""
        if self._hot:
            se = next(reversed(self._hot.values()))
            self.counters["shadow_drops"] += 1
            self._unshadow(se)
            return True
        if self.reads_in_flight:
            return None
        for se in self._only.values():
            if se.io == 0:
                self._drop_only(se)
                return True
        return False

    def _alloc(self, nblocks: int) -> tuple[int, int] | None | bool:
        """(file, start) of a new run; None: not now (see _make_room); False: never."""
        files = [f for f in self.files if not f.disabled]
        if not files or nblocks > max(f.nblocks for f in files):
            return False
        k = len(files)
        while True:
            for j in range(k):
                f = files[(self._next_file + j) % k]
                s = f.alloc.alloc(nblocks)
                if s >= 0:
                    self._next_file = (self._next_file + j) % k
                    f.entries += nblocks
                    return f.index, s
            r = self._make_room()
            if not r:
                return r

    # ------------------------------------------------------------------ store interface

    def has(self, key: Any) -> bool:
        """True when ``key`` lives on SSD only (exists / match_prefix count it)."""
        return key in self._only

    def keys(self) -> list[bytes]:
        """Keys that live on SSD only, oldest first."""
        return list(self._only)

    def lookup(self, key: bytes) -> SsdEntry | None:
        """The SSD-only entry of ``key`` (to promote), or None."""
        return self._only.get(key)

    @property
    def io_in_flight(self) -> bool:
        """Writes or promotion reads in flight: their completion may make room."""
        return bool(self._writing) or self.reads_in_flight > 0

    def can_spill(self) -> bool:
        return self.write_bytes < self.queue_bytes and time.monotonic() >= self._fail_until

    def spill(self, e: Any) -> int:
        """Start writing pool entry ``e`` (pinned by the caller until the completion).

        Returns SPILL_STARTED (``e.meta`` is then the new SsdEntry), SPILL_BUSY (the queue
        is full) or SPILL_REFUSED (too large, no room, or the disk is failing).
        """
        io_bytes = e.nblocks * self.bs
        if self.write_bytes and self.write_bytes + io_bytes > self.queue_bytes:
            return SPILL_BUSY
        if self._fail_until and time.monotonic() < self._fail_until:
            self.counters["refused"] += 1
            return SPILL_REFUSED
        loc = self._alloc(e.nblocks)
        if loc is None:
            return SPILL_BUSY
        if loc is False:
            self.counters["refused"] += 1
            return SPILL_REFUSED
        assert isinstance(loc, tuple)
        se = SsdEntry(e.key, loc[0], loc[1], e.nblocks, e.size)
        se.owner = e
        se.io = 1
        self._held.add(se)
        self._writing.add(se)
        self.write_bytes += io_bytes
        e.meta = se
        view = self.pool.view(e.start * self.bs, io_bytes, readonly=True)
        self._wbatch.append((se, e, view))
        return SPILL_STARTED

    def reserve(self, se: SsdEntry) -> None:
        """Keep SSD-only ``se`` from being dropped: a read of it is about to start
        (:meth:`read`) or was given up (:meth:`unreserve`)."""
        se.io += 1

    def unreserve(self, se: SsdEntry) -> None:
        p = self._pending.pop(se, None)
        if p is not None:
            p[0].place(p[1], None)      # its prefetch reads it for nothing
        se.io -= 1
        if se.state == DEAD and se.io == 0:
            self._free(se)

    def prefetch(self, ses: list[SsdEntry]) -> None:
        """Start reading reserved SSD-only entries now, before room is made for them in
        the pool: into the workers' private buffers, checksums checked there. Each entry
        must then be placed (:meth:`read`) or given up (:meth:`unreserve`) before the
        loop thread turns to anything else; the copy into the pool waits for that.
        Runs of entries adjacent on disk are read together, in pieces of at most
        READ_PIECE_BYTES (a value larger than the buffer is read by :meth:`read`)."""
        io = self._io
        if io is None or not ses:
            return
        pending = self._pending
        todo = []
        for se in ses:
            if se.state == STORED and se not in pending and se.nblocks * self.bs <= MAX_JOB_BYTES:
                todo.append(se)
        if not todo:
            return
        todo.sort(key=lambda x: (x.file, x.start))
        bs = self.bs
        files = self.files
        pool = self.pool
        job: _Prefetch | None = None
        job_file = end = -1
        last_whole = last_io = 0
        jobs = []
        for se in todo:
            if se in pending:           # the same entry twice in the list
                continue
            whole = se.nblocks * bs
            io_len = max(ALIGN, _round_up(se.size, ALIGN))
            if (job is None or se.file != job_file or se.start != end
                    or len(job.items) >= MAX_JOB_ITEMS
                    or job.nbytes + (last_whole - last_io) + io_len > READ_PIECE_BYTES):
                if job is not None:
                    jobs.append(job)
                f = files[se.file]
                job = _Prefetch(f.fd, f.path, se.start * bs, pool)
                job_file = se.file
            else:
                # the previous entry is no longer the last of the run: all its blocks
                job.nbytes += last_whole - last_io
            pending[se] = (job, len(job.items))
            se.io += 1                  # the prefetch's own hold on the blocks
            job.add(se, io_len)
            last_whole, last_io = whole, io_len
            end = se.start + se.nblocks
        if job is not None:
            jobs.append(job)
        kick = io.idle > 0
        for j in jobs:
            io.put(j)
        if kick:
            # Let an idle worker take the GIL and start the first read now, rather than
            # when this thread next blocks (after making room: a few hundred us later).
            jobs[0].started.wait(KICK_WAIT)

    def read(self, se: SsdEntry, e: Any) -> None:
        """Read reserved ``se`` into the blocks of ``e`` (allocated, unpublished)."""
        self.reads_in_flight += 1
        p = self._pending.pop(se, None)
        if p is not None and p[0].place(p[1], e):
            return                      # its prefetch copies it there
        view = self.pool.view(e.start * self.bs, e.nblocks * self.bs)
        self._rbatch.append((se, e, view))

    def submit(self) -> None:
        """Queue the spills and reads asked for since the last call, entries adjacent on
        disk merged into one job."""
        if self._wbatch:
            batch, self._wbatch = self._wbatch, []
            self._queue_jobs("w", batch)
        if self._rbatch:
            batch, self._rbatch = self._rbatch, []
            self._queue_jobs("r", batch)

    def _queue_jobs(self, kind: str, batch: list[tuple[SsdEntry, Any, memoryview]]) -> None:
        assert self._io is not None
        batch.sort(key=lambda t: (t[0].file, t[0].start))
        bs = self.bs
        job: _Job | None = None
        end = -1
        nbytes = 0
        for se, e, view in batch:
            f = self.files[se.file]
            if (job is None or job.fd != f.fd or se.start != end
                    or len(job.items) >= MAX_JOB_ITEMS
                    or nbytes + view.nbytes > MAX_JOB_BYTES):
                if job is not None:
                    self._finish_job(job)
                    self._io.put(job)
                job = _Job(kind, f.fd, f.path, se.start * bs, self.pool, self.direct)
                nbytes = 0
            job.items.append((se, e))
            job.views.append(view)
            nbytes += view.nbytes
            end = se.start + se.nblocks
        if job is not None:
            self._finish_job(job)
            self._io.put(job)

    @staticmethod
    def _finish_job(job: _Job) -> None:
        # The last entry of a run moves only its value rounded up to 4 KiB (the blocks
        # after it in the file need not be touched); the others move whole blocks so the
        # run stays contiguous on disk.
        se = job.items[-1][0]
        n = max(ALIGN, _round_up(se.size, ALIGN))
        v = job.views[-1]
        if n < v.nbytes:
            job.views[-1] = v[:n]
            v.release()

    def installed(self, se: SsdEntry, e: Any) -> None:
        """A promotion of ``se`` was published as pool entry ``e``: keep the copy (HOT)."""
        self._take(se)
        se.owner = e
        self._put(se, HOT)
        self.counters["promotions"] += 1
        self.counters["promoted_bytes"] += se.size

    def demote(self, se: SsdEntry) -> None:
        """The pool copy was evicted: ``se`` is now the only copy, most recently used."""
        self._take(se)
        se.owner = None
        self._put(se, ONLY)

    def touch(self, se: SsdEntry) -> None:
        """The pool copy was read."""
        w = se.where
        if w == MARGIN:
            self._take(se)
            self._put(se, HOT)
        elif w == HOT:
            self._hot.move_to_end(se.key)

    def discard(self, se: SsdEntry) -> None:
        """The copy is stale (its pool entry was overwritten, deleted or purged)."""
        if se.state == STORED:
            self.counters["stale"] += 1
        self._kill(se)

    def discard_key(self, key: bytes) -> bool:
        """Drop the SSD-only entry of ``key`` (delete, or a newer value was put)."""
        se = self._only.get(key)
        if se is None:
            return False
        self.discard(se)
        return True

    def purge(self) -> int:
        """Drop every SSD-only entry (the pool's own are dropped by the store). Returns
        how many."""
        n = len(self._only)
        for se in list(self._only.values()):
            self._kill(se)
        for d in (self._margin, self._hot):
            for se in list(d.values()):
                self._unshadow(se)
        return n

    def poll(self) -> list[tuple[str, SsdEntry, Any, bool]]:
        """Apply finished jobs; returns ``(kind, ssd_entry, pool_entry, ok)`` per entry
        ("w": a spill, "r": a read) for the store."""
        self._woken = False
        out: list[tuple[str, SsdEntry, Any, bool]] = []
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                return out
            if job.kind == "m":
                self._manifest_done(job)
                continue
            if type(job) is _Prefetch:
                self._prefetch_done(job, out)
                continue
            if job.error is not None:
                self._io_error(job)
            for i, (se, e) in enumerate(job.items):
                if job.kind == "w":
                    ok = self._write_done(se, job.oks[i], job.sums[i] if job.sums else 0)
                else:
                    ok = self._read_done(se, job.oks[i], job.error is not None)
                out.append((job.kind, se, e, ok))

    def _prefetch_done(self, job: _Prefetch,
                       out: list[tuple[str, SsdEntry, Any, bool]]) -> None:
        placed = [(i, se, e) for i, (se, e) in enumerate(job.items) if e is not None]
        if job.error is not None and placed:
            self._io_error(job)
        io_error = job.error is not None
        for se, _ in job.items:         # the prefetch's own hold
            se.io -= 1
            if se.state == DEAD and se.io == 0:
                self._free(se)
        for i, se, e in placed:
            out.append(("r", se, e, self._read_done(se, job.oks[i], io_error)))

    def _write_done(self, se: SsdEntry, ok: bool, csum: int) -> bool:
        se.io -= 1
        self._writing.discard(se)
        self.write_bytes -= se.nblocks * self.bs
        if se.state == DEAD:
            if se.io == 0:
                self._free(se)
            return False
        if not ok:
            se.state = DEAD
            se.owner = None
            if se.io == 0:
                self._free(se)
            return False
        self._write_errors = 0
        se.checksum = csum
        se.state = STORED
        self._put(se, MARGIN)
        self.counters["spills"] += 1
        self.counters["spill_bytes"] += se.size
        return True

    def _read_done(self, se: SsdEntry, ok: bool, io_error: bool) -> bool:
        se.io -= 1
        self.reads_in_flight -= 1
        if se.state == DEAD:
            if se.io == 0:
                self._free(se)
            return False
        if ok:
            return True
        if not io_error:
            self.counters["checksum_failures"] += 1
            self._log_once(("csum",), logging.WARNING,
                           "SSD tier: entry %r in %s failed its checksum on read; dropped "
                           "(never served)", se.key[:64], self.files[se.file].path)
        self._drop_only(se) if se.where == ONLY else self._kill(se)
        return False

    def _io_error(self, job: _Job | _Prefetch) -> None:
        exc = job.error
        self.counters["io_errors"] += 1
        what = "write to" if job.kind == "w" else "read from"
        if not isinstance(exc, OSError):
            log.error("SSD tier: %s %s failed: %r", what, job.path, exc)
            return
        self._log_once((job.path, job.kind, exc.errno), logging.ERROR,
                       "SSD tier: %s %s failed: %s (%d entries%s)", what, job.path,
                       exc.strerror or exc, len(job.items),
                       "; they stay in the pool" if job.kind == "w" else
                       "; served as misses")
        if job.kind == "w":
            self._write_errors += 1
            if self._write_errors >= FAIL_AFTER:
                self._fail_until = time.monotonic() + FAIL_BACKOFF
                self._write_errors = 0
                log.error("SSD tier: %d writes failed in a row; no spills for %.0f s "
                          "(evicted entries are dropped meanwhile)", FAIL_AFTER, FAIL_BACKOFF)

    def _manifest_done(self, job: _Job) -> None:
        self._manifest_busy = False
        if job.error is None:
            self.counters["manifest_writes"] += 1
            return
        self.counters["manifest_errors"] += 1
        self._manifest_dirty = True
        exc = job.error
        self._log_once(("manifest", getattr(exc, "errno", None)), logging.ERROR,
                       "SSD tier: cannot write the manifest in %s: %s; a restart will not "
                       "find the entries spilled since the last manifest", self.path,
                       getattr(exc, "strerror", None) or exc)

    def _log_once(self, what: tuple[Any, ...], level: int, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._logged.get(what, -1e9) >= 10.0:
            self._logged[what] = now
            log.log(level, msg, *args)

    def _wake(self) -> None:
        if not self._woken:
            self._woken = True
            fn = self.notify
            if fn is not None:
                fn()

    def service(self, now: float) -> float | None:
        """Periodic work (the loop calls it each turn): manifest, removed files.

        Returns the next time it needs a call (a manifest due), or None.
        """
        if now >= self._next_check:
            self._next_check = now + CHECK_INTERVAL
            self._check_files()
        if not self.persist or not self._manifest_dirty:
            return None
        if self._manifest_busy:
            return None             # its completion wakes the loop
        if now >= self._next_manifest:
            self._start_manifest(now)
            return None
        return self._next_manifest

    def _check_files(self) -> None:
        for f in self.files:
            if f.disabled:
                continue
            try:
                gone = os.fstat(f.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                self._disable(f, "was removed")

    def _disable(self, f: _File, why: str) -> None:
        f.disabled = True
        lost = 0
        for d in (self._only, self._margin, self._hot):
            for se in [s for s in d.values() if s.file == f.index]:
                lost += 1
                if se.where == ONLY:
                    self._drop_only(se)
                else:
                    self._unshadow(se)
        for se in [s for s in self._writing if s.file == f.index]:
            se.state = DEAD
        log.error("SSD tier: file %s %s while in use: its %d entries are dropped and it is "
                  "no longer used (%d file(s) left)", f.path, why, lost,
                  sum(1 for x in self.files if not x.disabled))

    # ------------------------------------------------------------------ stats

    def stats(self, verify: bool = False) -> dict[str, Any]:
        used = sum(f.alloc.num_used for f in self.files)
        total = sum(f.nblocks for f in self.files)
        s: dict[str, Any] = {
            "entries": len(self._only) + len(self._margin) + len(self._hot),
            "bytes": self.stored_bytes,
            "only_entries": len(self._only),
            "copies": len(self._margin) + len(self._hot),
            "capacity_bytes": total * self.bs,
            "used_bytes": used * self.bs,
            "writes_in_flight": len(self._writing),
            "reads_in_flight": self.reads_in_flight,
            "files": len(self.files),
            "files_disabled": sum(1 for f in self.files if f.disabled),
            "direct": self.direct,
            "persist": self.persist,
            "path": self.path,
        }
        s.update(self.counters)
        if verify:
            blocks = sum(se.nblocks for se in self._held)
            maps = all(se in self._held and se.state == STORED
                       for d in (self._only, self._margin, self._hot) for se in d.values())
            s["entry_blocks"] = blocks
            s["accounting_ok"] = (blocks == used and maps
                                  and self.stored_bytes == sum(
                                      se.size for d in (self._only, self._margin, self._hot)
                                      for se in d.values()))
        return s

    # ------------------------------------------------------------------ shutdown

    def __enter__(self) -> "SsdTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_pid", -1) == os.getpid():
            warnings.warn(f"SsdTier of {self.path} was not closed", ResourceWarning,
                          stacklevel=2)
            try:
                self.close(timeout=1.0)
            except Exception:
                pass

    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers (queued jobs are dropped, running ones finish), write the
        manifest (``persist``), close the files; without ``persist`` remove them.
        Idempotent; in a forked child it only closes its copies of the descriptors."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            for f in self.files:
                try:
                    os.close(f.fd)
                except OSError:
                    pass
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
            return
        for job, _ in list(self._pending.values()):
            job.abandon()
        self._pending.clear()
        for _, _, v in self._wbatch + self._rbatch:
            v.release()
        self._wbatch.clear()
        self._rbatch.clear()
        if self._io is not None:
            self._io.close(timeout)
        while True:     # views of finished jobs are released already; drop the results
            try:
                self._done.get_nowait()
            except queue.Empty:
                break
        if self.persist:
            try:
                self._write_manifest(self._snapshot())
                log.info("SSD tier: manifest of %d entries written to %s",
                         len(self._only) + len(self._margin) + len(self._hot), self.path)
            except OSError as exc:
                log.error("SSD tier: cannot write the manifest in %s at exit: %s",
                          self.path, exc.strerror or exc)
        self._close_files(remove=not self.persist)

    def _close_files(self, remove: bool) -> None:
        remove = remove and self._locked     # never another server's files
        for f in self.files:
            try:
                os.close(f.fd)
            except OSError:
                pass
            if remove:
                self._remove(f.path)
        if remove:
            self._remove(os.path.join(self.path, MANIFEST_NAME))
            self._remove(os.path.join(self.path, LOCK_NAME))
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if remove and self._created_dir:
            try:
                os.rmdir(self.path)
            except OSError:
                pass

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("SSD tier: cannot remove %s: %s", path, exc)
