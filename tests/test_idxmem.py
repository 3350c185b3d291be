"""Index memory (issue 13): the shared table's slots are 128 bytes, it takes memory for the
keys stored (it starts small and doubles up to its capacity) rather than for the pool's
blocks, and entries a slot cannot hold (long keys, many runs, checksums) use wide records
of the same segment. Readers see every size the table grows through, never a wrong value,
and refuse a table of another layout."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from kvshm import Client, Pool
from kvshm._shmindex import (FALLBACK, HEADER_SIZE, INITIAL_SLOTS, KEY_MAX, SLOT_SIZE,
                             WIDE_SIZE, IndexReader, IndexWriter, default_slots)
from servers import ServerProcess

BS = 4096
EPOCH = 91
SUBPROCESS_TIMEOUT = 60


def _allocated(name: str) -> int:
    """Bytes /dev/shm holds for segment ``name`` (what it costs the host)."""
    return os.stat("/dev/shm/" + name.lstrip("/")).st_blocks * 512


class Table:
    def __init__(self, name: str, blocks: int, slots: int = 0, initial: int = 64) -> None:
        self.pool = Pool.create(name, blocks * BS, BS)
        self.writer = IndexWriter.create(name + "-index", name + "-reads",
                                         slots or default_slots(blocks), epoch=EPOCH,
                                         block_size=BS, num_blocks=blocks,
                                         token=self.pool.token, initial_slots=initial)
        self.reader = IndexReader(self.writer.name, self.writer.reads_name, self.pool, EPOCH)

    def close(self) -> None:
        self.reader.close()
        self.writer.unlink()
        self.pool.close()
        self.pool.unlink()


def test_slot_layout_is_small():
    assert SLOT_SIZE == 128 and WIDE_SIZE == 256 and KEY_MAX == 152


def test_the_table_grows_with_the_keys_and_a_reader_made_before_sees_them_all(shm_name):
    t = Table(shm_name, blocks=20_000, initial=64)
    w, r = t.writer, t.reader
    try:
        assert w.nslots == 64 and w.capacity == default_slots(20_000) == 65536
        cap_bytes = HEADER_SIZE + 65536 * SLOT_SIZE
        assert os.stat("/dev/shm/" + w.name.lstrip("/")).st_size >= cap_bytes
        assert _allocated(w.name) <= HEADER_SIZE + 64 * SLOT_SIZE + 8192
        keys = [b"key-%06d" % i for i in range(10_000)]
        for i, k in enumerate(keys):
            t.pool.write(i * BS, struct.pack("<I", i))
            assert w.publish(k, 4, [(i, 1)]) >= 0
        assert w.unpublished == 0 and w.live == 10_000
        # grown by halves from 64: 11,070 slots hold 8,302 keys at 3/4, 16,605 hold 10 k
        assert w.nslots == 16605 and r.header["nslots"] == 16605
        assert w.rebuilds == 13
        # only the slots in use are reserved (with the header)
        assert _allocated(w.name) <= HEADER_SIZE + 16605 * SLOT_SIZE + 8192
        assert r.exists_batch(keys) == [True] * len(keys)
        assert r.match_prefix(keys) == len(keys)
        assert r.exists_batch([b"nope-%d" % i for i in range(100)]) == [False] * 100
        for i in range(0, 10_000, 97):
            assert r.get(keys[i]) == struct.pack("<I", i)
        offs, sizes, toks = r.locate(keys[:50])
        assert offs == [i * BS for i in range(50)] and r.validate(toks)
    finally:
        t.close()


def test_a_token_taken_before_the_table_grows_goes_stale(shm_name):
    t = Table(shm_name, blocks=1000, initial=64)
    w, r = t.writer, t.reader
    try:
        w.publish(b"first", 4, [(0, 1)])
        tok = r.lookup(b"first")[0]
        for i in range(1, 60):                     # past 3/4 of 64: it grows
            w.publish(b"k%d" % i, 4, [(i, 1)])
        assert w.nslots == 128
        assert not r.validate([tok])               # every slot moved in the rebuild
        assert r.lookup(b"first")[1:3] == (4, ((0, 1),))
    finally:
        t.close()


def test_the_table_stops_at_its_capacity(shm_name):
    t = Table(shm_name, blocks=1000, slots=256, initial=64)
    w, r = t.writer, t.reader
    try:
        slots = [w.publish(b"k%d" % i, 1, [(0, 1)]) for i in range(256)]
        assert w.nslots == 256 and slots.count(-1) == 256 - 192
        assert w.unpublished == 64 and r.get(b"k255") == FALLBACK
    finally:
        t.close()


def test_entries_a_slot_cannot_hold_use_wide_records(shm_name):
    t = Table(shm_name, blocks=64)
    w, r, p = t.writer, t.reader, t.pool
    try:
        long_key = b"L" * KEY_MAX
        runs = [(i, 1) for i in range(8)]
        for i in range(8):
            p.write(i * BS, bytes([65 + i]) * BS)
        assert w.publish(long_key, 8 * BS, runs, 12345) >= 0
        assert w.unpublished == 0
        assert r.get(long_key) == b"".join(bytes([65 + i]) * BS for i in range(8))
        assert r.lookup(long_key)[1:] == (8 * BS, tuple(runs), 12345)
        # a narrow entry that grows wide in place, and back to one run
        short = b"s" * 40
        assert w.publish(short, 10, [(0, 1)]) >= 0
        tok = r.lookup(short)[0]
        assert w.publish(short, 7 * BS, runs[:7], 7) >= 0          # 40 + 8 + 56 > 96
        assert not r.validate([tok])
        assert r.lookup(short)[1:] == (7 * BS, tuple(runs[:7]), 7)
        assert w.publish(short, 5, [(3, 1)]) >= 0
        assert r.get(short) == b"D" * 5
        assert r.exists_batch([long_key, short, b"x" * 100]) == [True, True, False]
        assert r.match_prefix([short, long_key, b"x"]) == 2
        # records go back and are reused: many long keys come and go
        for rnd in range(5):
            ks = [b"%d-%03d-" % (rnd, i) + b"w" * 100 for i in range(40)]
            for i, k in enumerate(ks):
                assert w.publish(k, 3, [(i, 1)]) >= 0
            assert r.exists_batch(ks) == [True] * 40
            for k in ks:
                assert w.unpublish(k)
            assert r.exists_batch(ks) == [False] * 40
        assert r.get(long_key)[:1] == b"A" and r.get(short) == b"D" * 5
        # the reads were recorded with the wide keys
        assert long_key in w.drain()
        # PURGE frees them all
        w.clear()
        assert r.get(long_key) is None
        assert w.publish(long_key, 1, [(1, 1)]) >= 0 and r.get(long_key) == b"B"
    finally:
        t.close()


def test_a_reader_refuses_a_table_of_another_layout(shm_name):
    t = Table(shm_name, blocks=64)
    try:
        fd = os.open("/dev/shm/" + t.writer.name.lstrip("/"), os.O_RDWR)
        try:
            os.pwrite(fd, struct.pack("<I", 1), 8)        # layout 1: 256-byte slots
        finally:
            os.close(fd)
        with pytest.raises(ValueError, match="layout"):
            IndexReader(t.writer.name, t.writer.reads_name, t.pool, EPOCH)
    finally:
        t.close()


_READER = textwrap.dedent("""
    import struct, sys, time
    from kvshm import Pool
    from kvshm._shmindex import IndexReader, FALLBACK
    pool = Pool.attach(sys.argv[1])
    r = IndexReader(sys.argv[1] + "-index", sys.argv[1] + "-reads", pool, int(sys.argv[2]))
    nkeys, seconds = int(sys.argv[3]), float(sys.argv[4])
    def key(i):
        return (b"k%d-" % i) + (b"w" * 110 if i % 3 == 0 else b"")
    bad = reads = 0
    end = time.monotonic() + seconds
    print("ready", flush=True)
    i = 0
    while time.monotonic() < end:
        i += 1
        kid = (i * 7919) % nkeys
        v = r.get(key(kid))
        if v is None or v == FALLBACK:
            continue
        if v[:4] != struct.pack("<I", kid) or v != v[:8] * (len(v) // 8):
            bad += 1
        reads += 1
        if i % 50 == 0:
            r.exists_batch([key(j) for j in range(kid, min(nkeys, kid + 64))])
    r.close(); pool.close()
    print(reads, bad, flush=True)
""")


def test_reader_processes_read_right_bytes_while_the_table_grows_and_wide_records_move(
        shm_name):
    """Keys come (the table doubles several times) and go (their wide records and blocks
    are reused by other keys) while reader processes read lock-free: every value read
    is its key's."""
    nkeys, blocks = 6000, 2048
    t = Table(shm_name, blocks=blocks, slots=16384, initial=64)
    w, pool = t.writer, t.pool

    def key(i: int) -> bytes:
        return (b"k%d-" % i) + (b"w" * 110 if i % 3 == 0 else b"")

    procs = [subprocess.Popen([sys.executable, "-c", _READER, shm_name, str(EPOCH),
                               str(nkeys), "2.5"], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        where: dict[int, int] = {}                 # key id -> block
        free = list(range(blocks))
        deadline = time.monotonic() + 2.5
        i = 0
        while time.monotonic() < deadline:
            kid = i % nkeys
            i += 1
            if kid in where:                       # gone first: its block is reused
                w.unpublish(key(kid))
                free.append(where.pop(kid))
            if not free:
                old = next(iter(where))
                w.unpublish(key(old))
                free.append(where.pop(old))
            b = free.pop(0)
            pool.write(b * BS, struct.pack("<II", kid, i) * 16)
            assert w.publish(key(kid), 128, [(b, 1)], i if kid % 2 else None) >= 0
            where[kid] = b
            if i % 256 == 0:
                w.drain()
            if i % 4000 == 0:
                w.clear()
                free = list(range(blocks))
                where.clear()
        assert w.rebuilds > 0
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=SUBPROCESS_TIMEOUT)
            results.append(tuple(map(int, out.split())))
        assert all(bad == 0 for _, bad in results), results
        assert all(reads > 0 for reads, _ in results), results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        t.close()


def test_a_servers_table_takes_memory_for_its_keys_not_its_blocks(shm_name):
    """A server with a pool of 32 k blocks and 3,000 keys: its table reserves the slots in
    use (4,096 to start: 512 KiB), where it used to reserve 64 k slots of 256 bytes
    (16 MiB) whatever it held."""
    with ServerProcess("--block-size", "4", shm_name=shm_name, prealloc_size=0.125) as srv:
        index = srv.shm_name + "-index"
        with Client(srv.address, transport="shm") as c:
            keys = [b"%040x" % i for i in range(3000)]
            c.put_batch(keys, [b"v"] * len(keys))
            assert all(c.exists_batch(keys))
            assert c.get(keys[7]) == b"v"
        assert _allocated(index) <= HEADER_SIZE + INITIAL_SLOTS * SLOT_SIZE + 8192
