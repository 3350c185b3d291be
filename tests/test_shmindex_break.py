"""Attacks on the shared index and its reads ring (kvshm/_shmindex.pyx, kvshm/localread.py).

The reads ring is writable by every same-user client: whatever a client scribbles into it
(head, tail, the header) must cost it and others at most their lock-free reads for a
moment, never the server, never another client's bytes, and never the ring for good.
"""

from __future__ import annotations

import mmap
import signal
import struct

import posix_ipc
import pytest

import kvshm
from kvshm import Pool
from kvshm._shmindex import (FALLBACK, RING_RECORDS, IndexReader, IndexWriter,
                             default_slots)
from kvshm.client import Client
from servers import ServerProcess

BS = 4096
EPOCH = 91
HEAD, TAIL, NREC = 64, 128, 8      # byte offsets in the reads ring's header


class Table:
    def __init__(self, name: str, blocks: int = 16, ring_records: int = RING_RECORDS,
                 ) -> None:
        self.pool = Pool.create(name, blocks * BS, BS)
        self.writer = IndexWriter.create(name + "-index", name + "-reads",
                                         default_slots(blocks), epoch=EPOCH, block_size=BS,
                                         num_blocks=blocks, token=self.pool.token,
                                         ring_records=ring_records)
        self.readers: list[IndexReader] = []
        self.reader()

    def reader(self) -> IndexReader:
        r = IndexReader(self.writer.name, self.writer.reads_name, self.pool, EPOCH)
        self.readers.append(r)
        return r

    def ring(self) -> mmap.mmap:
        """The reads ring, mapped writable as any same-user client may."""
        shm = posix_ipc.SharedMemory(self.writer.reads_name)
        try:
            return mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()

    def close(self) -> None:
        for r in self.readers:
            r.close()
        self.writer.unlink()
        self.pool.close()
        self.pool.unlink()


def _poke(t: Table, offset: int, value: int) -> None:
    m = t.ring()
    struct.pack_into("<Q", m, offset, value)
    m.close()


def _peek(t: Table, offset: int) -> int:
    m = t.ring()
    try:
        return struct.unpack_from("<Q", m, offset)[0]
    finally:
        m.close()


def test_a_ring_full_of_tickets_nobody_writes_is_dropped_at_once(shm_name):
    # A client takes every ticket of the ring (head += nrec) and writes no record: the
    # server used to give up on one ticket per stuck period (65,536 x 50 ms = 55 min of
    # every reader falling back and no lock-free read counting for the LRU).
    t = Table(shm_name, ring_records=1024)
    try:
        t.writer.publish(b"k", 3, [(0, 1)])
        t.pool.write(0, b"abc")
        head = _peek(t, HEAD)
        _poke(t, HEAD, head + 1024)
        assert t.readers[0].get(b"k") == FALLBACK          # the ring is full
        for _ in range(3):
            t.writer.drain(stuck_after=0.0)
        assert t.writer.skipped_records == 1024
        assert t.readers[0].get(b"k") == b"abc"             # lock-free again
        assert t.writer.drain(stuck_after=0.0) == [b"k"]
    finally:
        t.close()


def test_an_honest_ticket_taken_after_a_stuck_one_is_not_skipped(shm_name):
    # Dropping a run of dead tickets must stop at those taken before the server first
    # saw the ring stuck: a later ticket still being written is waited for.
    t = Table(shm_name, ring_records=1024)
    try:
        t.writer.publish(b"k", 3, [(0, 1)])
        head = _peek(t, HEAD)
        _poke(t, HEAD, head + 2)                  # two dead tickets
        t.writer.drain(stuck_after=0.0)           # seen stuck (head = head + 2)
        _poke(t, HEAD, head + 3)                  # a reader took a ticket, still copying
        assert t.writer.drain(stuck_after=0.0) == []
        assert t.writer.skipped_records == 2      # the later one is waited for
        assert t.readers[0].get(b"k") is not FALLBACK
        # the in-flight one is its own stuck episode, seen stuck by the drain above
        assert t.writer.drain(stuck_after=3600) == []
        assert t.writer.skipped_records == 2
        assert t.writer.drain(stuck_after=0.0) == [b"k"]
        assert t.writer.skipped_records == 3
    finally:
        t.close()


def test_a_tail_scribbled_ahead_of_head_is_restored_by_the_server(shm_name):
    # tail > head makes every reader's room check wrap: the ring looks full forever, and
    # the server (nothing to drain) never wrote the tail back.
    t = Table(shm_name)
    try:
        t.writer.publish(b"k", 3, [(0, 1)])
        _poke(t, TAIL, 1 << 62)
        assert t.readers[0].get(b"k") == FALLBACK
        t.writer.drain()
        assert _peek(t, TAIL) == _peek(t, HEAD)
        assert t.readers[0].get(b"k") is not FALLBACK
        assert t.writer.drain() == [b"k"]
    finally:
        t.close()


def test_a_scribbled_ring_size_does_not_cost_new_readers_their_lock_free_reads(shm_name):
    # The ring's record count sits in its writable header; a reader attached after a
    # client changed it used it as is (1 record: every second read fell back, and its
    # records landed where the server does not look).
    t = Table(shm_name)
    try:
        t.writer.publish(b"a", 1, [(0, 1)])
        t.writer.publish(b"b", 1, [(1, 1)])
        _poke(t, NREC, 1)
        r = t.reader()
        assert [r.get(b"a"), r.get(b"b"), r.get(b"a")] == [b"\0"] * 3
        assert t.writer.drain() == [b"a", b"b", b"a"]
    finally:
        t.close()


def test_garbage_records_neither_crash_the_server_nor_touch_dead_entries(shm_name):
    # Records a client makes up: slots out of range, versions of entries that changed,
    # a head moved backwards. The server applies only records that name a live entry as
    # it is now, and the ring keeps working.
    t = Table(shm_name, ring_records=64)
    try:
        t.writer.publish(b"a", 1, [(0, 1)])
        t.writer.publish(b"b", 1, [(1, 1)])
        m = t.ring()
        recs = [(1, 0xFFFFFFF0, 0), (2, 12345, 2), (3, 0, 7)]   # (seq, slot, version)
        for seq, slot, ver in recs:
            struct.pack_into("<QII", m, 256 + 16 * (seq - 1), seq, slot, ver)
        struct.pack_into("<Q", m, HEAD, len(recs))
        m.close()
        assert t.writer.drain() == []
        _poke(t, HEAD, 0)                         # backwards
        t.writer.drain()
        for _ in range(3):
            assert t.readers[0].get(b"b") == b"\0"
        got = []
        for _ in range(3):
            got += t.writer.drain(stuck_after=0.0)
        assert got.count(b"b") == 3 and set(got) <= {b"b"}
    finally:
        t.close()


def test_a_client_of_a_killed_server_never_reads_the_restarted_servers_pool_as_old_keys(
        shm_name):
    # kill -9, then a new server on the same shm name and port: the old client's table
    # and pool mappings are of the dead server; nothing it reads may come from the new
    # pool under an old key's location.
    a = ServerProcess(shm_name=shm_name, prealloc_size=1 / 256)
    b = None
    try:
        c = Client(a.address, timeout=5)
        try:
            c.put_batch([b"old-%d" % i for i in range(8)], [b"A%d" % i * 500 for i in range(8)])
            assert c.get(b"old-3") == b"A3" * 500
            old = c._session.local
            assert old is not None and old.hits >= 1
            port = int(a.address.rsplit(":", 1)[1])
            a.proc.send_signal(signal.SIGKILL)
            a.proc.wait(timeout=30)
            b = ServerProcess(shm_name=shm_name, prealloc_size=1 / 256, service_port=port)
            with Client(b.address, timeout=5) as w:     # fills the new pool where old keys were
                w.put_batch([b"new-%d" % i for i in range(8)], [b"B%d" % i * 500 for i in range(8)])
                w.put(b"old-5", b"B-old-5")
            assert not old.usable                      # the new server closed the dead table
            for i in range(8):
                try:
                    v = c.get(b"old-%d" % i)
                except (kvshm.KeyNotFound, kvshm.ServerUnavailable):
                    continue
                assert i == 5 and v == b"B-old-5", (i, v[:8])
            assert c.get(b"old-5") == b"B-old-5"
            with pytest.raises(kvshm.KeyNotFound):
                c.get(b"old-3")
        finally:
            c.close()
    finally:
        a.kill()
        a.remove_segment()
        if b is not None:
            b.stop()


class _StalledBuffer:
    """A page whose first touch blocks until :meth:`release` (userfaultfd): a copy into
    it is caught mid-way, deterministically."""

    def __init__(self, size: int = 4096) -> None:
        import ctypes
        import os

        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        self.fd = libc.syscall(323, os.O_CLOEXEC)          # userfaultfd (x86_64)
        if self.fd < 0:
            pytest.skip(f"no userfaultfd here (errno {ctypes.get_errno()})")
        api = (ctypes.c_uint64 * 3)(0xAA, 0, 0)
        self.mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        c = ctypes.c_char.from_buffer(self.mem)
        reg = (ctypes.c_uint64 * 4)(ctypes.addressof(c), size, 1, 0)   # MISSING pages
        del c
        if libc.ioctl(self.fd, ctypes.c_ulong(0xc018aa3f), api) or \
                libc.ioctl(self.fd, ctypes.c_ulong(0xc020aa00), reg):
            err = ctypes.get_errno()
            self.release()
            self.mem.close()
            pytest.skip(f"userfaultfd refused (errno {err})")

    def wait_touched(self) -> None:
        import os

        os.read(self.fd, 32)                      # a fault message: the copy is blocked

    def release(self) -> None:
        import os

        if self.fd >= 0:
            os.close(self.fd)                     # the blocked copy goes on
            self.fd = -1


def test_a_read_still_copying_does_not_hold_back_the_reads_after_it(shm_name):
    # A get took its ticket before copying: while one reader copied (a large value, a
    # slow page, a reader stopped mid-copy) no later lock-free read reached the LRU, and
    # after `stuck_after` the copying read itself was dropped. Reads are recorded once
    # they are validated, so a copy in progress holds nothing.
    import threading

    t = Table(shm_name)
    buf = _StalledBuffer()
    try:
        t.writer.publish(b"big", 4096, [(0, 1)])
        t.writer.publish(b"a", 1, [(1, 1)])
        got: list[object] = []
        th = threading.Thread(target=lambda: got.append(t.readers[0].get_into(b"big",
                                                                              buf.mem)))
        th.start()
        buf.wait_touched()                        # that read is inside its copy now
        other = t.reader()
        assert other.get(b"a") == b"\0"
        assert t.writer.drain(stuck_after=3600) == [b"a"]
        buf.release()
        th.join(30)
        assert not th.is_alive() and got == [4096]
        assert t.writer.drain(stuck_after=3600) == [b"big"]
        assert t.writer.skipped_records == 0
    finally:
        buf.release()
        th.join(30)
        buf.mem.close()
        t.close()
