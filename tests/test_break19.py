"""break19: attacks on the batch lookups split over helper threads (kvshm/_shmindex.pyx,
``IndexReader.batch_threads``) and on TCP ``get_batch_into``'s receive straight into the
caller's buffers (kvshm/zmq_ctrl/_zmtp.pyx ``Conn.recv(into=)``). Findings first (each
failed before its fix), then attacks that held."""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import textwrap
import threading

import pytest

from kvshm._shmindex import BATCH_SEGMENT, FALLBACK, IndexReader, batch_helper_stats

sys.path.insert(0, os.path.dirname(__file__))
from test_localx_threads import EPOCH, PIECE, Tables  # noqa: E402

SUBPROCESS_TIMEOUT = 60


def _hold(m: mmap.mmap, reader: IndexReader, key: bytes):
    """Put ``key``'s slot in a write that never ends (odd version): (where, version)."""
    offs, sizes, toks = reader.locate([key])
    slot, version = toks[0]
    where = 4096 + slot * 128                      # HEADER_SIZE, SLOT_SIZE
    assert struct.unpack_from("<Q", m, where)[0] == version
    struct.pack_into("<Q", m, where, version + 1)
    return where, version


def test_a_slot_held_in_a_write_at_a_pieces_or_segments_last_key_is_no_miss(shm_name):
    """Finding: a key whose slot is held in a write (odd version) that is the LAST key of
    a piece (threads) or of a segment (any reader, one key at a time included) was
    answered False by exists_batch (all keys present): _probe_all returns the keys it
    looked up, the fallback key included, so a stop at a piece's/segment's last key read
    as no stop and the keys after it were looked up as if nothing had happened; only the
    batch's very last key was checked for a fallback. Must be None (ask the server)."""
    import posix_ipc

    t = Tables(shm_name, blocks=32768, initial=4096)
    try:
        keys = [b"held-%08d" % i for i in range(3 * BATCH_SEGMENT)]
        for i, k in enumerate(keys):
            assert t.writer.publish(k, 10, [(i, 1)]) >= 0
        shm = posix_ipc.SharedMemory(t.writer.name)
        m = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        wrong = []
        try:
            for at in range(PIECE - 1, len(keys), PIECE):   # every piece's last key
                where, version = _hold(m, t.readers["one"], keys[at])
                try:
                    for label, r in t.readers.items():
                        got = r.exists_batch(keys)
                        if got is not None and not all(got):
                            wrong.append((label, at, got.index(False)))
                        mp = r.match_prefix(keys)
                        if mp != FALLBACK:
                            wrong.append((label, at, "match_prefix", mp))
                finally:
                    struct.pack_into("<Q", m, where, version)
            for r in t.readers.values():
                assert r.exists_batch(keys) == [True] * len(keys)
        finally:
            m.close()
        assert wrong == []
    finally:
        t.close()


def test_close_from_another_thread_while_helpers_run_pieces(shm_name):
    """Held: another Python thread closing the reader while batches with 2, 3 and 8
    threads run gets BufferError until no batch runs; then the batches answer None
    (reader not usable) and nothing reads the unmapped table."""
    t = Tables(shm_name, blocks=32768, initial=4096)
    try:
        keys = [b"cl-%08d" % i for i in range(3 * BATCH_SEGMENT)]
        for i, k in enumerate(keys):
            assert t.writer.publish(k, 10, [(i, 1)]) >= 0
        for threads in (2, 3, 8):
            r = IndexReader(t.writer.name, t.writer.reads_name, t.pool, EPOCH)
            r.batch_threads = threads
            r.threads_min = 1
            bad = []
            go = threading.Event()

            def ask() -> None:
                go.set()
                for _ in range(200):
                    got = r.exists_batch(keys)
                    if got is not None and got != [True] * len(keys):
                        bad.append(threads)
                    mp = r.match_prefix(keys)
                    if mp not in (FALLBACK, len(keys)):
                        bad.append(threads)

            th = threading.Thread(target=ask)
            th.start()
            go.wait()
            refused = 0
            while True:
                try:
                    r.close()
                    break
                except BufferError:
                    refused += 1
            th.join()
            assert r.closed and bad == []
            assert r.exists_batch(keys) is None and r.match_prefix(keys) == FALLBACK
    finally:
        t.close()


def test_the_default_starts_no_thread_and_exit_with_helpers_alive_does_not_hang(shm_name):
    """Held: with KVSHM_BATCH_READ_THREADS unset a large batch starts no helper (the
    process has the threads it had); with 4 a daemon thread mid-batch at interpreter
    exit (helpers alive, spinning or asleep) does not hang the exit."""
    code = textwrap.dedent("""
        import os, sys, threading
        from kvshm import Pool
        from kvshm._shmindex import IndexReader, batch_helper_stats
        pool = Pool.attach(sys.argv[1])
        r = IndexReader(sys.argv[1] + "-index", sys.argv[1] + "-reads", pool, int(sys.argv[2]))
        keys = [b"dt-%08d" % i for i in range(40000)]
        before = len(os.listdir("/proc/self/task"))
        assert r.exists_batch(keys) == [True] * len(keys)
        print(r.batch_threads, batch_helper_stats()["threads"],
              len(os.listdir("/proc/self/task")) - before, flush=True)
        if r.batch_threads > 1:
            def spin():
                while True:
                    r.exists_batch(keys)
            threading.Thread(target=spin, daemon=True).start()
            while batch_helper_stats()["pieces"] == 0:
                pass
        os._exit(0) if sys.argv[3] == "hard" else sys.exit(0)
    """)
    t = Tables(shm_name, blocks=65536, initial=4096)
    try:
        for i in range(40000):
            assert t.writer.publish(b"dt-%08d" % i, 10, [(i % 65000, 1)]) >= 0
        for val, want in (("", "1 0 0"), ("4", "4 3 3")):
            env = dict(os.environ)
            env.pop("KVSHM_BATCH_READ_THREADS", None)
            if val:
                env["KVSHM_BATCH_READ_THREADS"] = val
            out = subprocess.run([sys.executable, "-c", code, shm_name, str(EPOCH), "soft"],
                                 env=env, capture_output=True, text=True,
                                 timeout=SUBPROCESS_TIMEOUT)
            assert out.returncode == 0, out.stderr
            assert out.stdout.split("\n")[0] == want
    finally:
        t.close()
