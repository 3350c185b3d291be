"""The SSD tier: entries evicted from the pool go to pre-allocated files, not away.

:class:`SsdTier` is what the :class:`~kvshm.store.Store` talks to (spill, has, lookup,
reserve / prefetch / read / unreserve, demote, touch, installed, discard, purge, submit,
poll, service, stats, close). It keeps the tier's maps and rules
(:class:`~kvshm.tiers.ssd.policy.SsdPolicy`), opens its files
(:class:`~kvshm.tiers.ssd.files.FileSet`), hands I/O to the workers
(:mod:`kvshm.tiers.ssd.workers`) and applies what they finished, and writes the manifest
(:mod:`kvshm.tiers.ssd.manifest`).

Threads. Everything here runs on the server's loop thread (the one that owns the
Store), except the I/O itself, which the workers do. A finished job goes through a
queue, the worker wakes the loop (``notify``, the loop's wake pipe), and :meth:`SsdTier.poll`
applies it on the loop thread.

Pool memory is never reused while a worker reads or writes it: the store pins an entry
whose bytes are being written, and allocates (but does not publish) the blocks a read
fills. The SSD blocks of an entry are freed only when no job touches them (``io``).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import time
import warnings
from typing import Any, Callable

from kvshm.index import MAX_EXTENTS
from kvshm.tiers.ssd import manifest
from kvshm.tiers.ssd.entry import (ALIGN, DEAD, HOT, MARGIN, ONLY, SPILL_BUSY, SPILL_REFUSED,
                                   SPILL_STARTED, STORED, GiB, SsdConfig, SsdEntry)
from kvshm.tiers.ssd.files import MANIFEST_NAME, FileSet, SsdFile, remove_file
from kvshm.tiers.ssd.policy import SsdPolicy
from kvshm.tiers.ssd.workers import (KICK_WAIT, MAX_JOB_BYTES, IoPool, Job, Prefetch,
                                     batch_jobs, pool_views, prefetch_jobs)

__all__ = ["SsdTier"]

log = logging.getLogger(__name__)

#: Consecutive write errors after which spills are refused for FAIL_BACKOFF seconds.
FAIL_AFTER = 8
FAIL_BACKOFF = 5.0
#: How often (at most) the files are checked for having been removed under the server.
CHECK_INTERVAL = 1.0


class SsdTier(SsdPolicy):
    """Spill files on a local disk, used in blocks, with their own LRU.

    Pool entries may lie in several block runs (up to ``max_extents``): a spill reads
    each run, a promotion writes into each run; on disk an entry is one run.

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

    #: Most pool runs of one entry this tier moves (the store places values in as many).
    max_extents = MAX_EXTENTS

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
        self._fs = FileSet(self.path, self.bs, cfg.direct, scratch=not cfg.persist)
        super().__init__(self._fs.files)
        self.queue_bytes = max(self.bs, cfg.queue_bytes)
        self.notify: Callable[[], None] | None = None
        self._writing: set[SsdEntry] = set()   # entries with a write in flight
        self.write_bytes = 0                   # bytes of spill writes queued or in flight
        # (entry, pool entry, views of its pool runs)
        self._wbatch: list[tuple[SsdEntry, Any, list[memoryview]]] = []
        self._rbatch: list[tuple[SsdEntry, Any, list[memoryview]]] = []
        #: Entries whose read was started by :meth:`prefetch` and that were not yet
        #: placed (:meth:`read`) or given up (:meth:`unreserve`): their job and index.
        self._pending: dict[SsdEntry, tuple[Prefetch, int]] = {}
        self._done: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._woken = False
        self._write_errors = 0
        self._fail_until = 0.0
        self._logged: dict[tuple[Any, ...], float] = {}
        self._manifest_busy = False
        self._next_manifest = 0.0
        self._next_check = 0.0
        self._closed = False
        self._pid = os.getpid()
        self._io: IoPool | None = None
        try:
            self._fs.open(nfiles, per_file)
            if self.persist:
                self._load_manifest()
            else:
                remove_file(os.path.join(self.path, MANIFEST_NAME))
            self._io = IoPool(max(1, cfg.workers), self._done, self._wake)
        except BaseException:
            self._closed = True
            self._fs.close(remove=not self.persist)
            raise

    @property
    def direct(self) -> bool:
        """True when the files were opened with O_DIRECT."""
        return self._fs.direct

    # ------------------------------------------------------------------ manifest

    def _load_manifest(self) -> None:
        records = manifest.load(self.path, self.bs, self.files)
        if records is None:
            return
        self._restore(records, self.bs)
        log.info("SSD tier: %d entries (%.3g GiB) from manifest %s; checksums are checked "
                 "on each read", self.counters["loaded"], self.stored_bytes / GiB,
                 os.path.join(self.path, MANIFEST_NAME))

    def _write_manifest(self, recs: list[manifest.Record]) -> None:
        manifest.write(self.path, self.bs, self.files, recs)

    def _start_manifest(self, now: float) -> None:
        job = Job("m")
        recs = self._snapshot()
        job.payload = lambda: self._write_manifest(recs)
        self._manifest_dirty = False
        self._manifest_busy = True
        self._next_manifest = now + self.config.manifest_interval
        assert self._io is not None
        self._io.put(job)
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
        self._wbatch.append((se, e, pool_views(self.pool, e, self.bs, True)))
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
        todo: dict[SsdEntry, None] = {}         # in order, each entry once
        for se in ses:
            if se.state == STORED and se not in pending and se.nblocks * self.bs <= MAX_JOB_BYTES:
                todo[se] = None
        if not todo:
            return
        jobs = prefetch_jobs(list(todo), self.files, self.bs, self.pool)
        for job in jobs:
            for i, (se, _) in enumerate(job.items):
                pending[se] = (job, i)
                se.io += 1              # the prefetch's own hold on the blocks
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
        self._rbatch.append((se, e, pool_views(self.pool, e, self.bs, False)))

    def submit(self) -> None:
        """Queue the spills and reads asked for since the last call, entries adjacent on
        disk merged into one job."""
        if self._wbatch:
            batch, self._wbatch = self._wbatch, []
            self._queue_jobs("w", batch)
        if self._rbatch:
            batch, self._rbatch = self._rbatch, []
            self._queue_jobs("r", batch)

    def _queue_jobs(self, kind: str, batch: list[tuple[SsdEntry, Any, list[memoryview]]]
                    ) -> None:
        assert self._io is not None
        for job in batch_jobs(kind, batch, self.files, self.bs, self.pool, self.direct):
            self._io.put(job)


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
            if type(job) is Prefetch:
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

    def _prefetch_done(self, job: Prefetch,
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

    def _io_error(self, job: Job | Prefetch) -> None:
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

    def _manifest_done(self, job: Job) -> None:
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
            for f in self._fs.removed():
                self._disable(f, "was removed")
        if not self.persist or not self._manifest_dirty:
            return None
        if self._manifest_busy:
            return None             # its completion wakes the loop
        if now >= self._next_manifest:
            self._start_manifest(now)
            return None
        return self._next_manifest

    def _disable(self, f: SsdFile, why: str) -> None:
        f.disabled = True
        lost = self._drop_file(f)
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
            self._fs.close_fds()
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
        self._fs.close(remove=not self.persist)

