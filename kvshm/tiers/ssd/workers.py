"""The SSD tier's I/O: jobs, the worker threads that run them, and how requests are cut
into jobs.

A few worker threads (:class:`IoPool`) move bytes between the data files and the pool
memory with ``os.preadv`` / ``os.pwritev`` (the GIL is released during the system call),
``O_DIRECT`` where the filesystem allows it, through a private buffer per worker in huge
pages (:func:`io_buffer`), and check xxh64. A worker never touches the tier's maps: a
finished job goes through a queue, the worker wakes the loop, and the tier applies it on
the loop thread (:meth:`kvshm.tiers.ssd.SsdTier.poll`).

Runs of entries adjacent on disk move with one system call (:func:`batch_jobs`).
Promotion reads (:class:`Prefetch`, :func:`prefetch_jobs`) start before room is made for
them in the pool, in pieces of READ_PIECE_BYTES read in queue order, READ_DEPTH at a time
(:class:`ReadGate`): a worker checks and copies its piece while the next pieces are read.
The copy into the pool waits until the loop thread gave every entry of the piece its
(allocated, unpublished) pool blocks, or none.

A pool entry may lie in several block runs (``Entry.extents``): it then moves as one
view of the pool per run (:func:`pool_views`), in order, and a promotion copies into
each run (:func:`run_pieces`); on disk an entry is always one run.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import xxhash

from kvshm.tiers.api import MAX_JOB_BYTES as _API_MAX_JOB_BYTES
from kvshm.tiers.ssd.entry import ALIGN, MiB, SsdEntry, round_up

__all__ = ["Job", "Prefetch", "ReadGate", "IoPool", "io_buffer", "pwritev_all",
           "preadv_all", "xxh", "xxh_at", "xxh_views", "batch_jobs", "prefetch_jobs",
           "pool_views", "run_pieces", "MAX_JOB_BYTES",
           "MAX_JOB_ITEMS", "READ_PIECE_BYTES", "READ_DEPTH", "KICK_WAIT", "PLACE_TIMEOUT"]

log = logging.getLogger(__name__)

#: A job moves at most this many bytes / entries: runs of entries adjacent on disk are
#: moved with one preadv/pwritev. Also the size of each worker's private buffer (a
#: promotion read of a larger value goes straight into the pool).
MAX_JOB_BYTES = _API_MAX_JOB_BYTES    # 8 MiB (kvshm.tiers.api: the store groups by it)
MAX_JOB_ITEMS = 512
#: A promotion read is started in pieces of at most this many bytes, each on its own
#: worker: the checksum and the copy into the pool of one piece overlap the disk reads
#: of the next ones (see :class:`Prefetch`). Of the sizes (1, 2, 4 MiB) and depths
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


def pool_views(pool: Any, e: Any, bs: int, readonly: bool) -> list[memoryview]:
    """Views of pool entry ``e``'s blocks, one per run, in the order of its bytes."""
    return [pool.view(s * bs, n * bs, readonly=readonly) for s, n in e.extents]


def run_pieces(e: Any, bs: int, size: int, src: int
               ) -> tuple[list[int], list[int], list[int]]:
    """``(pool offsets, lengths, source offsets)`` that copy ``size`` bytes found at
    ``src`` of a buffer into the runs of pool entry ``e``."""
    offs, lens, srcs = [], [], []
    for s, n in e.extents:
        k = min(size, n * bs)
        offs.append(s * bs)
        lens.append(k)
        srcs.append(src)
        src += k
        size -= k
        if size <= 0:
            break
    return offs, lens, srcs


class Job:
    """One preadv/pwritev over a run of entries adjacent in one file (or a manifest)."""

    __slots__ = ("kind", "fd", "path", "offset", "items", "views", "parts", "places",
                 "oks", "sums", "error", "payload", "pool", "direct")

    def __init__(self, kind: str, fd: int = -1, path: str = "", offset: int = 0,
                 pool: Any = None, direct: bool = False) -> None:
        self.kind = kind            # "r", "w" or "m" (manifest)
        self.fd = fd
        self.path = path
        self.offset = offset
        self.pool = pool
        self.direct = direct
        self.items: list[tuple[SsdEntry, Any]] = []
        self.views: list[memoryview] = []   # pool memory of the entries (I/O length)
        self.parts: list[int] = []          # views of each item (its runs), in order
        self.places: list[int] = []         # pool offset of each view
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
                self.sums = [xxh_views(vs, se.size) for se, vs in self._item_views()]
                pwritev_all(self.fd, self.views, self.offset)
                self.oks = [True] * len(self.items)
            else:
                preadv_all(self.fd, self.views, self.offset)
                self.oks = [xxh_views(vs, se.size) == se.checksum
                            for se, vs in self._item_views()]
        except BaseException as exc:   # OSError from the disk; anything else is a bug
            self.error = exc
            self.oks = [False] * max(1, len(self.items))
        finally:
            self.release()

    def _item_views(self) -> list[tuple[SsdEntry, list[memoryview]]]:
        out = []
        j = 0
        for (se, _), k in zip(self.items, self.parts):
            out.append((se, self.views[j:j + k]))
            j += k
        return out

    def _run_bounced(self, buf: memoryview) -> None:
        """O_DIRECT through the worker's private buffer, in huge pages (see
        :func:`io_buffer`: the pool's pages are 4 KiB ones, and a direct read or write
        is cut into one segment per page run), and the copy to/from the pool (GIL
        released) costs a fraction of that. The checksum of a spill covers exactly the
        bytes written."""
        pool = self.pool
        offsets = self.places
        sizes = [v.nbytes for v in self.views]
        starts = []                     # where each item begins in the buffer
        item_of = []                    # the item of each view
        pos = 0
        j = 0
        for i, k in enumerate(self.parts):
            starts.append(pos)
            for n in sizes[j:j + k]:
                pos += n
                item_of.append(i)
            j += k
        if self.kind == "w":
            pool.gather(offsets, sizes, buf)
            self.sums = [xxh_at(buf, a, se.size) for (se, _), a in zip(self.items, starts)]
            pwritev_all(self.fd, [buf], self.offset)
            self.oks = [True] * len(self.items)
            return
        preadv_all(self.fd, [buf], self.offset)
        self.oks = [xxh_at(buf, a, se.size) == se.checksum
                    for (se, _), a in zip(self.items, starts)]
        keep = [v for v, i in enumerate(item_of) if self.oks[i]]
        if keep:
            vstarts = [0] * len(sizes)
            p = 0
            for v, n in enumerate(sizes):
                vstarts[v] = p
                p += n
            pool.scatter(buf, [offsets[v] for v in keep], [sizes[v] for v in keep],
                         [vstarts[v] for v in keep])


class Prefetch:
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
        self.gate: ReadGate | None = None     # set when queued
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
                    preadv_all(self.fd, [buf], self.offset)
                finally:
                    if gate is not None:
                        gate.leave()
                bs = self.pool.block_size
                sums = []
                pos = 0
                for se, _ in items:
                    sums.append(xxh_at(buf, pos, se.size) == se.checksum)
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
                        o, n, src = run_pieces(e, bs, se.size, pos)
                        offs += o
                        sizes += n
                        srcs += src
                    pos += se.nblocks * bs
                if offs:
                    self.pool.scatter(buf, offs, sizes, srcs)
        except BaseException as exc:   # OSError from the disk; anything else is a bug
            self.error = exc
            with self._lock:
                self.abandoned = True
            self.oks = [False] * len(items)


def xxh_views(views: Sequence[memoryview], size: int) -> int:
    """xxh64 of the first ``size`` bytes of ``views`` taken one after the other."""
    if len(views) == 1:
        return xxh(views[0], size)
    h = xxhash.xxh64()
    for v in views:
        if size <= 0:
            break
        with v[:size] as part:
            h.update(part)
            size -= part.nbytes
    return h.intdigest()


def xxh_at(buf: memoryview, start: int, size: int) -> int:
    with buf[start:start + size] as part:
        return xxhash.xxh64_intdigest(part)


def xxh(view: memoryview, size: int) -> int:
    with view[:size] as part:
        return xxhash.xxh64_intdigest(part)


def pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
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


def preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
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


class ReadGate:
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


def io_buffer(nbytes: int) -> tuple[mmap.mmap, memoryview]:
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


class IoPool:
    """Worker threads running jobs; reads (a client waits) go before writes, but a write
    gets every fourth turn so spills are never starved."""

    def __init__(self, n: int, done: "queue.SimpleQueue[Job]",
                 wake: Callable[[], None]) -> None:
        self._cv = threading.Condition()
        self._reads: deque[Job] = deque()
        self._writes: deque[Job] = deque()
        self._turn = 0
        self._stop = False
        self._gate = ReadGate()
        self.idle = 0               # workers waiting for a job
        self._done = done
        self._wake = wake
        self._threads = [threading.Thread(target=self._run, name=f"kvshm-ssd-io-{i}",
                                          daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def put(self, job: Any) -> None:
        with self._cv:
            if type(job) is Prefetch:
                job.gate = self._gate
                job.ticket = self._gate.ticket()
            (self._reads if job.kind == "r" else self._writes).append(job)
            self._cv.notify()

    def _take(self) -> Job | None:
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
        # A private buffer for O_DIRECT jobs (see Job._run_bounced, Prefetch).
        mem, bounce = io_buffer(MAX_JOB_BYTES)
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

    def close(self, timeout: float) -> list[Job]:
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
            if type(j) is Prefetch:
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


# ---------------------------------------------------------------------- cutting into jobs


def batch_jobs(kind: str, batch: list[tuple[SsdEntry, Any, list[memoryview]]],
               files: Sequence[Any], bs: int, pool: Any, direct: bool) -> list[Job]:
    """Jobs for spills (``kind`` "w") or reads ("r") of ``(entry, pool entry, views of
    its pool memory, one per run)``: entries adjacent on disk merged into one job, at
    most MAX_JOB_ITEMS entries and MAX_JOB_BYTES bytes each. ``files[i]`` has ``fd`` and
    ``path``."""
    batch.sort(key=lambda t: (t[0].file, t[0].start))
    jobs: list[Job] = []
    job: Job | None = None
    end = -1
    nbytes = 0
    for se, e, views in batch:
        f = files[se.file]
        size = sum(v.nbytes for v in views)
        if (job is None or job.fd != f.fd or se.start != end
                or len(job.items) >= MAX_JOB_ITEMS
                or nbytes + size > MAX_JOB_BYTES):
            if job is not None:
                _finish_job(job)
                jobs.append(job)
            job = Job(kind, f.fd, f.path, se.start * bs, pool, direct)
            nbytes = 0
        job.items.append((se, e))
        job.views.extend(views)
        job.parts.append(len(views))
        job.places.extend(s * bs for s, _ in e.extents)
        nbytes += size
        end = se.start + se.nblocks
    if job is not None:
        _finish_job(job)
        jobs.append(job)
    return jobs


def _finish_job(job: Job) -> None:
    # The last entry of a run moves only its value rounded up to 4 KiB (the blocks
    # after it in the file need not be touched); the others move whole blocks so the
    # run stays contiguous on disk.
    se = job.items[-1][0]
    n = max(ALIGN, round_up(se.size, ALIGN))
    whole = sum(v.nbytes for v in job.views[len(job.views) - job.parts[-1]:])
    v = job.views[-1]
    if n < whole:               # the value ends in its last run: only that one is cut
        job.views[-1] = v[:v.nbytes - (whole - n)]
        v.release()


def prefetch_jobs(ses: list[SsdEntry], files: Sequence[Any], bs: int,
                  pool: Any) -> list[Prefetch]:
    """Promotion reads of ``ses`` (each at most MAX_JOB_BYTES on disk, no duplicates),
    runs of entries adjacent on disk read together in pieces of at most
    READ_PIECE_BYTES. Item ``i`` of a job is ``job.items[i]``; nothing is queued."""
    todo = sorted(ses, key=lambda x: (x.file, x.start))
    job: Prefetch | None = None
    job_file = end = -1
    last_whole = last_io = 0
    jobs: list[Prefetch] = []
    for se in todo:
        whole = se.nblocks * bs
        io_len = max(ALIGN, round_up(se.size, ALIGN))
        if (job is None or se.file != job_file or se.start != end
                or len(job.items) >= MAX_JOB_ITEMS
                or job.nbytes + (last_whole - last_io) + io_len > READ_PIECE_BYTES):
            if job is not None:
                jobs.append(job)
            f = files[se.file]
            job = Prefetch(f.fd, f.path, se.start * bs, pool)
            job_file = se.file
        else:
            # the previous entry is no longer the last of the run: all its blocks
            job.nbytes += last_whole - last_io
        job.add(se, io_len)
        last_whole, last_io = whole, io_len
        end = se.start + se.nblocks
    if job is not None:
        jobs.append(job)
    return jobs
