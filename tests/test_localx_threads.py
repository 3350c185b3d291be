"""Batch lookups split over helper threads (kvshm/_shmindex.pyx, ``IndexReader.batch_threads``,
``KVSHM_BATCH_READ_THREADS``): each segment's keys looked up in pieces by the batch's thread
and the helpers, against one thread (``batch_threads = 1``) and the one-key-at-a-time path
(``fast_batch = False``) on the same tables: misses at the pieces' and the segments' edges,
tables in the middle of a migration, two batches at once (one has the helpers), a writer
process overwriting, deleting, growing and rebuilding meanwhile, and a forked child. A
fallback (None / FALLBACK) is always allowed; a wrong answer never is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvshm import Pool, _shmindex
from kvshm._shmindex import (BATCH_SEGMENT, BATCH_THREADS_MIN, ENV_BATCH_THREADS, FALLBACK,
                             IndexReader, IndexWriter, batch_helper_stats,
                             default_batch_threads, default_slots)

BS = 4096
EPOCH = 131
PIECE = 512                  # kvshm._shmindex's C_PIECE
SUBPROCESS_TIMEOUT = 60


class Tables:
    """A pool, a writer, and readers of the same table: one thread, 2 and 4 threads
    (split from the GIL-release size: ``threads_min`` lowered), one key at a time."""

    def __init__(self, name: str, blocks: int, slots: int = 0, initial: int = 4096,
                 **kw) -> None:
        self.pool = Pool.create(name, blocks * BS, BS)
        self.writer = IndexWriter.create(name + "-index", name + "-reads",
                                         slots or default_slots(blocks), epoch=EPOCH,
                                         block_size=BS, num_blocks=blocks,
                                         token=self.pool.token, initial_slots=initial, **kw)
        self.readers = {}
        for label, threads in (("one", 1), ("two", 2), ("four", 4), ("slow", 1)):
            r = IndexReader(self.writer.name, self.writer.reads_name, self.pool, EPOCH)
            r.batch_threads = threads
            r.threads_min = 1
            self.readers[label] = r
        self.readers["slow"].fast_batch = False

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.writer.unlink()
        self.pool.close()
        self.pool.unlink()


def _prefix(keys: list, present: set) -> int:
    for i, k in enumerate(keys):
        if k not in present:
            return i
    return len(keys)


def _agree(t: Tables, keys: list, present: set) -> None:
    want = [k in present for k in keys]
    m = _prefix(keys, present)
    for label, r in t.readers.items():
        assert r.exists_batch(keys) == want, label
        assert r.match_prefix(keys) == m, label


def test_the_thread_count_is_read_when_a_reader_is_made(shm_name):
    code = textwrap.dedent("""
        import sys
        from kvshm import Pool
        from kvshm._shmindex import IndexReader
        pool = Pool.attach(sys.argv[1])
        try:
            r = IndexReader(sys.argv[1] + "-index", sys.argv[1] + "-reads", pool, int(sys.argv[2]))
        except ValueError as exc:
            print("ValueError"); pool.close(); sys.exit(0)
        print(r.batch_threads); r.close(); pool.close()
    """)
    t = Tables(shm_name, blocks=64)
    try:
        got = {}
        for val in ("", "1", "3", "99", "0", "x"):
            env = dict(os.environ)
            env[ENV_BATCH_THREADS] = val
            out = subprocess.run([sys.executable, "-c", code, shm_name, str(EPOCH)], env=env,
                                 capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
            assert out.returncode == 0, out.stderr
            got[val] = out.stdout.strip()
        assert got == {"": str(default_batch_threads()), "1": "1", "3": "3", "99": "8",
                       "0": "1", "x": "ValueError"}
        r = t.readers["one"]
        for bad in (0, 9):
            with pytest.raises(ValueError):
                r.batch_threads = bad
        assert default_batch_threads() in (1, 2)
        assert BATCH_THREADS_MIN > BATCH_SEGMENT
    finally:
        t.close()


def test_misses_at_the_pieces_and_segments_edges(shm_name):
    """Batches of several segments with a miss at and around every piece's and
    segment's edge, and many misses: every reader agrees with the model."""
    t = Tables(shm_name, blocks=65536, initial=4096)
    try:
        w = t.writer
        keys = [b"thr-%08d" % i for i in range(3 * BATCH_SEGMENT + 700)]
        present = set()
        for i, k in enumerate(keys):
            assert w.publish(k, 10, [(i % 65000, 1)]) >= 0
            present.add(k)
        _agree(t, keys, present)
        before = batch_helper_stats()["pieces"]
        for _ in range(500):                 # (a busy machine may run no helper for a while)
            assert t.readers["two"].exists_batch(keys) == [True] * len(keys)
            if batch_helper_stats()["pieces"] > before:
                break
        assert batch_helper_stats()["pieces"] > before      # the helpers did look keys up
        assert 1 <= batch_helper_stats()["threads"] <= 7
        edges = sorted({e + d for e in range(0, len(keys), PIECE) for d in (-1, 0, 1)
                        if 0 <= e + d <= len(keys)})
        for at in edges[::3] + [BATCH_SEGMENT, BATCH_SEGMENT + 1, 2 * BATCH_SEGMENT - 1]:
            asked = keys[:at] + [b"missing-%d" % at] + keys[at:]
            _agree(t, asked, present)
        half = [k if i % 2 else b"no-" + k for i, k in enumerate(keys)]
        _agree(t, half, present)
        _agree(t, half[::-1], present)
    finally:
        t.close()


def test_every_step_of_a_migration(shm_name):
    """The table grows a step per publish; at steps while both tables are named,
    batches of many pieces agree, overwrites and deletions of keys still in the old
    table included."""
    import random
    t = Tables(shm_name, blocks=32768, slots=32768, initial=4096, migrate_step=16)
    w = t.writer
    try:
        keys = [b"mig-%06d-" % i + b"m" * (i % 60) for i in range(5200)]
        present: set = set()
        for i, k in enumerate(keys[:2816]):
            assert w.publish(k, 4, [(i, 1)]) >= 0
            present.add(k)
        rnd = random.Random(5)
        seen = 0
        for i in range(2816, len(keys)):
            assert w.publish(keys[i], 4, [(i % 30000, 1)]) >= 0
            present.add(keys[i])
            if not t.readers["one"].header["old_nslots"]:
                continue
            seen += 1
            if seen % 7 == 0:
                gone = rnd.choice(keys[:2816])
                if gone in present:
                    assert w.unpublish(gone)
                    present.discard(gone)
            if seen % 11 == 0:
                _agree(t, keys[:i + 1] + [b"nowhere"] + keys[:2048], present)
        assert seen > 30
    finally:
        t.close()


def test_two_batches_at_once(shm_name):
    """Two Python threads ask large batches at once (one has the helpers, the other
    looks its keys up alone; the GIL is released per segment): both always right."""
    t = Tables(shm_name, blocks=65536, initial=4096)
    try:
        keys = [b"two-%08d" % i for i in range(5 * BATCH_SEGMENT)]
        for i, k in enumerate(keys[::2]):
            assert t.writer.publish(k, 10, [(i % 65000, 1)]) >= 0
        want = [i % 2 == 0 for i in range(len(keys))]
        live = keys[::2]
        errors = []
        second = IndexReader(t.writer.name, t.writer.reads_name, t.pool, EPOCH)
        second.batch_threads = 2
        second.threads_min = 1

        def ask(r: IndexReader) -> None:
            for _ in range(30):
                if r.exists_batch(keys) != want:
                    errors.append("exists")
                if r.match_prefix(live) != len(live):
                    errors.append("match_prefix")

        ths = [threading.Thread(target=ask, args=(r,))
               for r in (t.readers["two"], second, t.readers["two"])]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        second.close()
        assert errors == []
    finally:
        t.close()


_READER = textwrap.dedent("""
    import sys, time
    from kvshm import Pool
    from kvshm._shmindex import IndexReader, FALLBACK
    pool = Pool.attach(sys.argv[1])
    r = IndexReader(sys.argv[1] + "-index", sys.argv[1] + "-reads", pool, int(sys.argv[2]))
    r.batch_threads = int(sys.argv[5])
    r.threads_min = 1
    nstable, seconds = int(sys.argv[3]), float(sys.argv[4])
    stable = [(b"stable-%d-" % i) + (b"w" * (i % 140)) for i in range(nstable)]
    gone = [(b"gone-%d-" % i) + (b"w" * (i % 140)) for i in range(nstable)]
    wrong = asked = falls = 0
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got = r.exists_batch(stable)
        asked += 1
        if got is None:
            falls += 1
        elif not all(got):
            wrong += 1
        got = r.exists_batch(gone + stable[:64])
        if got is not None and (any(got[:nstable]) or not all(got[nstable:])):
            wrong += 1
        m = r.match_prefix(stable)
        if m != FALLBACK and m != nstable:
            wrong += 1
        m = r.match_prefix(stable[:1000] + gone[:1] + stable)
        if m != FALLBACK and m != 1000:
            wrong += 1
    r.close(); pool.close()
    print(asked, wrong, falls, flush=True)
""")


def test_reader_processes_while_keys_are_overwritten_deleted_and_tables_move(shm_name):
    """Reader processes with 2 and 3 threads ask batches of keys that stay stored but
    are overwritten all the time and of keys deleted before they start, while other
    keys come and go and the table grows and is rebuilt: a stored key is never
    reported missing, a deleted one never present."""
    nstable, blocks = 5000, 65536
    t = Tables(shm_name, blocks=blocks, slots=1 << 17, initial=4096, migrate_step=8)
    w = t.writer

    def skey(i: int) -> bytes:
        return (b"stable-%d-" % i) + (b"w" * (i % 140))

    for i in range(nstable):
        assert w.publish(skey(i), 16, [(i, 1)]) >= 0
        k = (b"gone-%d-" % i) + (b"w" * (i % 140))
        assert w.publish(k, 16, [(i, 1)]) >= 0
        assert w.unpublish(k)
    procs = [subprocess.Popen([sys.executable, "-c", _READER, shm_name, str(EPOCH),
                               str(nstable), "3", n], stdout=subprocess.PIPE, text=True)
             for n in ("2", "3")]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 3
        i = 0
        live: list[bytes] = []
        while time.monotonic() < deadline:
            i += 1
            s = i % nstable
            assert w.publish(skey(s), 16, [((s + i) % (blocks - 1), 1)]) >= 0
            k = b"other-%d" % i
            assert w.publish(k, 1, [(i % (blocks - 1), 1)]) >= 0
            live.append(k)
            if len(live) > 30_000:
                for old in live[:8000]:
                    w.unpublish(old)
                del live[:8000]
            if i % 256 == 0:
                w.drain()
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=SUBPROCESS_TIMEOUT)
            results.append(tuple(map(int, out.split())))
        print(results, w.stats())
        assert all(wrong == 0 for _, wrong, _ in results), results
        assert all(asked > 0 for asked, *_ in results), results
        assert w.rebuilds >= 1 and w.nslots > 4096, w.stats()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        t.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_gets_helpers_of_its_own(shm_name):
    """The parent's helper threads are not in a child forked after they ran: a reader
    the child makes still splits its batches (new helpers) and answers right."""
    t = Tables(shm_name, blocks=32768, initial=4096)
    try:
        keys = [b"fork-%08d" % i for i in range(3 * BATCH_SEGMENT)]
        for i, k in enumerate(keys):
            assert t.writer.publish(k, 10, [(i, 1)]) >= 0
        assert t.readers["two"].exists_batch(keys) == [True] * len(keys)   # helpers made
        pid = os.fork()
        if pid == 0:                                      # the child
            ok = False
            try:
                r = IndexReader(t.writer.name, t.writer.reads_name, t.pool, EPOCH)
                r.batch_threads = 3
                r.threads_min = 1
                ok = all(r.exists_batch(keys) == [True] * len(keys) for _ in range(5)) and \
                    r.match_prefix(keys) == len(keys)
                r.close()
            finally:
                os._exit(0 if ok else 1)
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the child hung")
            time.sleep(0.01)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert t.readers["two"].exists_batch(keys) == [True] * len(keys)
    finally:
        t.close()


def test_a_slot_held_in_a_write_in_a_later_piece_sends_the_batch_to_the_server(shm_name):
    """A key whose slot stays in a write (odd version: the server stopped mid-write) in
    any piece of any segment: exists_batch gives None and match_prefix FALLBACK (from
    that key on the answer is not known), with 1, 2 and 4 threads; the slot written
    again, the answers are back."""
    import mmap
    import struct

    import posix_ipc

    t = Tables(shm_name, blocks=32768, initial=4096)
    try:
        keys = [b"held-%08d" % i for i in range(3 * BATCH_SEGMENT)]
        for i, k in enumerate(keys):
            assert t.writer.publish(k, 10, [(i, 1)]) >= 0
        shm = posix_ipc.SharedMemory(t.writer.name)
        m = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        try:
            for at in (3, 2 * PIECE + 7, BATCH_SEGMENT + 3 * PIECE + 1, len(keys) - 2):
                offs, sizes, toks = t.readers["one"].locate([keys[at]])
                slot, version = toks[0]
                where = _shmindex.HEADER_SIZE + slot * _shmindex.SLOT_SIZE
                assert struct.unpack_from("<Q", m, where)[0] == version
                struct.pack_into("<Q", m, where, version + 1)  # a write begun, never ended
                try:
                    for label in ("one", "two", "four"):
                        r = t.readers[label]
                        assert r.exists_batch(keys) is None, (label, at)
                        assert r.match_prefix(keys) == FALLBACK, (label, at)
                        assert r.match_prefix(keys[:at]) == at, (label, at)
                finally:
                    struct.pack_into("<Q", m, where, version)
                for label in ("one", "two", "four"):
                    assert t.readers[label].exists_batch(keys) == [True] * len(keys)
        finally:
            m.close()
    finally:
        t.close()
