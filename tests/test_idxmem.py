"""Index memory (issue 13): the shared table's slots are 64 bytes (layout 5), it takes memory for the
keys stored (it starts small and grows (``GROWTH``: from 13/16 full by half) up to its capacity, a bounded step per
publish or unpublish: no call rebuilds the whole table) rather than for the pool's blocks, and entries a slot cannot hold (long keys, many runs, checksums) use wide records
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
from kvshm._shmindex import (ENV_GROWTH, FALLBACK, GROWTH, HEADER_SIZE, INITIAL_SLOTS,
                             KEY_MAX, MIGRATE_STEP,
                             RESERVE_STEP, SLOT_SIZE, WIDE_SIZE, IndexReader, IndexWriter,
                             default_slots)
from servers import ServerProcess

BS = 4096
EPOCH = 91
SUBPROCESS_TIMEOUT = 60


def _allocated(name: str) -> int:
    """Bytes /dev/shm holds for segment ``name`` (what it costs the host)."""
    return os.stat("/dev/shm/" + name.lstrip("/")).st_blocks * 512


class Table:
    def __init__(self, name: str, blocks: int, slots: int = 0, initial: int = 64,
                 **kw) -> None:
        self.pool = Pool.create(name, blocks * BS, BS)
        self.writer = IndexWriter.create(name + "-index", name + "-reads",
                                         slots or default_slots(blocks), epoch=EPOCH,
                                         block_size=BS, num_blocks=blocks,
                                         token=self.pool.token, initial_slots=initial,
                                         **kw)
        self.reader = IndexReader(self.writer.name, self.writer.reads_name, self.pool, EPOCH)

    def close(self) -> None:
        self.reader.close()
        self.writer.unlink()
        self.pool.close()
        self.pool.unlink()


def test_slot_layout_is_small():
    assert SLOT_SIZE == 64 and WIDE_SIZE == 256 and KEY_MAX == 152


def test_40_byte_keys_take_at_most_about_120_bytes_of_table_each(shm_name):
    """Issue 13's bench case (40-byte keys, one run each, no checksum): each key lies in
    its 64-byte slot (no wide record), so the segment's allocated bytes per key are the
    slots per key (1.23 to 1.85 with GROWTH (13, 8)) x 64: at most ~118. Layout 4's
    128-byte slots took 158 to 236."""
    t = Table(shm_name, blocks=40_000, initial=64)
    w = t.writer
    try:
        keys = [b"%040x" % (i * 0x9E3779B97F4A7C15 % (1 << 160)) for i in range(30_000)]
        for i, k in enumerate(keys):
            assert w.publish(k, 8, [(i, 1)]) >= 0
        for _ in range(64):                        # the last steps give the old table back
            if w.stats()["phase"] == 0:
                break
            w.publish(keys[0], 8, [(0, 1)])
        assert w.stats()["phase"] == 0 and w.live == len(keys)
        per_key = (_allocated(w.name) - HEADER_SIZE) / len(keys)
        assert per_key <= 120, per_key
        assert per_key <= SLOT_SIZE * w.nslots / len(keys) + 1
        assert w.stats()["wide_used"] == 0
        assert t.reader.exists_batch(keys) == [True] * len(keys)
    finally:
        t.close()


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
        # grown by half (64 at least) from 64 (GROWTH): 11,070 slots hold 9,686 keys at
        # 14/16, 16,605 hold 10 k
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
        limit = 256 * (GROWTH[0] + 1) // 16        # keys a full table takes (224)
        assert w.nslots == 256 and slots.count(-1) == 256 - limit
        assert w.unpublished == 256 - limit and r.get(b"k255") == FALLBACK
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
    """A server with a pool of 32 k blocks and 2,500 keys: its table reserves the slots in
    use (4,096 to start: 512 KiB), where it used to reserve 64 k slots of 256 bytes
    (16 MiB) whatever it held."""
    with ServerProcess("--block-size", "4", shm_name=shm_name, prealloc_size=0.125) as srv:
        index = srv.shm_name + "-index"
        with Client(srv.address, transport="shm") as c:
            keys = [b"%040x" % i for i in range(2500)]     # (a growth starts at 3,328)
            c.put_batch(keys, [b"v"] * len(keys))
            assert all(c.exists_batch(keys))
            assert c.get(keys[7]) == b"v"
        assert _allocated(index) <= HEADER_SIZE + INITIAL_SLOTS * SLOT_SIZE + 8192


# Largest table upkeep one publish or unpublish may do, in slots: one step (reserve or
# give back RESERVE_STEP slots, or look at MIGRATE_STEP old slots and move their live
# entries) and the move of the key published itself.
STEP_BOUND = max(RESERVE_STEP, 2 * MIGRATE_STEP) + 1


def test_growing_to_a_million_keys_takes_bounded_steps(shm_name):
    """From 4,096 slots to a million keys (15 growths), then half the keys gone (rebuilds
    for the tombstones): no publish or unpublish does more than one bounded step of upkeep
    (counted in slots, not timed: the old growth rebuilt the whole table in one call, a
    million slots near the end), none had to finish a growth at once, and a reader made
    at the start sees every key."""
    n = 1_000_000
    blocks = 1 << 16
    w = IndexWriter.create(shm_name + "-index", shm_name + "-reads", 1 << 21, epoch=EPOCH,
                           block_size=BS, num_blocks=blocks)
    pool = Pool.create(shm_name, blocks * BS, BS)
    r = IndexReader(w.name, w.reads_name, pool, EPOCH)
    try:
        assert w.nslots == INITIAL_SLOTS
        keys = [b"%040x" % (i * 0x9E3779B97F4A7C15 % (1 << 160)) for i in range(n)]
        ext = [[(i % blocks, 1)] for i in range(10_000)]
        sizes = [1] * 10_000
        for lo in range(0, n, 10_000):
            assert w.publish_many(keys[lo:lo + 10_000], sizes, ext) == 0
        assert w.live == n and w.unpublished == 0
        assert w.rebuilds >= 15 and w.nslots * (GROWTH[0] + 1) >= n * 16
        assert w.max_step <= STEP_BOUND, w.max_step
        assert w.sync_finishes == 0
        print(f"\nlongest step: {w.max_step} slots, {w.max_step_cpu_s * 1e3:.3f} ms CPU")
        sample = keys[::97]
        assert r.exists_batch(sample) == [True] * len(sample)
        for k in keys[: n // 2]:
            w.unpublish(k)
        assert w.live == n - n // 2 and w.rebuilds >= 16
        assert w.max_step <= STEP_BOUND, w.max_step
        assert w.sync_finishes == 0
        assert r.exists_batch(keys[n // 2::97]) == [True] * len(keys[n // 2::97])
        assert r.exists_batch(keys[:n // 2:97]) == [False] * len(keys[:n // 2:97])
    finally:
        r.close()
        w.unlink()
        pool.close()
        pool.unlink()


def test_a_migration_moves_keys_a_step_at_a_time_and_readers_see_every_one(shm_name):
    """While the table moves (both named in the header), a reader made before finds every
    key wherever it is, sees overwrites and deletions at once, and a token of a moved
    entry goes stale; the old table's memory is given back at the end."""
    # (the growth policy before GROWTH's: this test's steps are counted for it; a
    # migration's mechanics do not depend on when it starts or how much it adds)
    t = Table(shm_name, blocks=4096, slots=8192, initial=1024, migrate_step=8,
              growth=(11, 8))
    w, r, p = t.writer, t.reader, t.pool
    try:
        keys = [b"m-%05d" % i + (b"w" * 100 if i % 5 == 0 else b"") for i in range(1000)]
        for i, k in enumerate(keys[:704]):                # 11/16 of 1024: growth starts
            p.write(i * BS, struct.pack("<I", i))
            assert w.publish(k, 4, [(i, 1)]) >= 0
        tok = r.lookup(keys[3])[0]
        seen_migration = 0
        assert r.header["old_nslots"] == 0          # still reserving the new table
        for i in range(704, 1000):
            p.write(i * BS, struct.pack("<I", i))
            assert w.publish(keys[i], 4, [(i, 1)]) >= 0
            hd = r.header
            if hd["old_nslots"]:
                seen_migration += 1
                if i == 760:
                    # an overwrite and a deletion of keys perhaps still in the old table
                    p.write(2000 * BS, b"NEW!")
                    assert w.publish(keys[1], 4, [(2000, 1)]) >= 0
                    assert r.get(keys[1]) == b"NEW!"
                    assert w.unpublish(keys[2]) and r.get(keys[2]) is None
                got = r.exists_batch(keys[:i + 1])
                assert got is not None and sum(got) == i + 1 - (i >= 760), i
                assert w.contains_many(keys[:i + 1]) == got        # the server's EXISTS
                assert r.match_prefix(keys[:1]) == 1
                for j in range(0, i + 1, 37):
                    v = r.get(keys[j])
                    assert v in (None, FALLBACK) or v == (b"NEW!" if j == 1 else
                                                           struct.pack("<I", j))
                    if j not in (1, 2):
                        assert v == struct.pack("<I", j)
        assert seen_migration > 20 and w.sync_finishes == 0 and w.rebuilds == 1
        assert w.nslots == 1536 and r.header["old_nslots"] == 0
        assert not r.validate([tok])
        for _ in range(4):                                # the last steps give back
            w.publish(b"extra", 1, [(0, 1)])
        assert w.stats()["phase"] == 0
        assert _allocated(w.name) <= HEADER_SIZE + 1536 * SLOT_SIZE + 4096 * WIDE_SIZE + 8192
    finally:
        t.close()


_STABLE_READER = textwrap.dedent("""
    import struct, sys, time
    from kvshm import Pool
    from kvshm._shmindex import IndexReader, FALLBACK
    pool = Pool.attach(sys.argv[1])
    r = IndexReader(sys.argv[1] + "-index", sys.argv[1] + "-reads", pool, int(sys.argv[2]))
    nstable, seconds = int(sys.argv[3]), float(sys.argv[4])
    keys = [(b"stable-%d-" % i) + (b"w" * 100 if i % 4 == 0 else b"") for i in range(nstable)]
    bad = reads = missed = falls = migr = 0
    print("ready", flush=True)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        kid = (i * 7919) % nstable
        if r.header["old_nslots"]:
            migr += 1
        v = r.get(keys[kid])
        if v is None:
            missed += 1
        elif v == FALLBACK:
            falls += 1
        elif v != struct.pack("<I", kid) * 4:
            bad += 1
        reads += 1
        if i % 20 == 0:
            got = r.exists_batch(keys)
            if got is not None and not all(got):
                missed += 1
            m = r.match_prefix(keys)
            if m != FALLBACK and m != nstable:
                missed += 1
    r.close(); pool.close()
    print(reads, bad, missed, falls, migr, flush=True)
""")


def test_reader_processes_never_miss_a_stored_key_or_read_wrong_bytes_across_migrations(
        shm_name):
    """Keys that stay stored while the table grows several times and is rebuilt for its
    tombstones (others come and go), read by reader processes lock-free in small steps of
    migration (migrate_step=6: migrations last thousands of publishes): every read is a
    hit with the right bytes or a fallback, never a miss."""
    nstable, blocks = 300, 16384
    t = Table(shm_name, blocks=blocks, slots=1 << 15, initial=512, migrate_step=6)
    w, pool = t.writer, t.pool

    def skey(i: int) -> bytes:
        return (b"stable-%d-" % i) + (b"w" * 100 if i % 4 == 0 else b"")

    for i in range(nstable):
        pool.write(i * BS, struct.pack("<I", i) * 4)
        assert w.publish(skey(i), 16, [(i, 1)], i if i % 2 else None) >= 0
    procs = [subprocess.Popen([sys.executable, "-c", _STABLE_READER, shm_name, str(EPOCH),
                               str(nstable), "3"], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 3
        i = 0
        live: list[bytes] = []
        while time.monotonic() < deadline:
            i += 1
            k = b"other-%d" % i
            assert w.publish(k, 1, [(nstable + i % (blocks - nstable), 1)]) >= 0
            live.append(k)
            if len(live) > 12_000:                 # tombstones pile up: rebuilds
                for old in live[:3000]:
                    w.unpublish(old)
                del live[:3000]
            if i % 256 == 0:
                w.drain()
        assert w.rebuilds >= 3
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=SUBPROCESS_TIMEOUT)
            results.append(tuple(map(int, out.split())))
        print(results, w.stats())
        assert all(bad == 0 and missed == 0 for _, bad, missed, _, _ in results), results
        assert all(reads > 0 for reads, *_ in results), results
        assert any(migr > 0 for *_, migr in results), results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        t.close()


def test_the_table_grows_from_13_16_full_by_half(shm_name, monkeypatch):
    """GROWTH (13/16, by 1/2): a table of 1,024 slots takes 832 keys before a growth starts
    (the 833rd starts it) and grows to 1,536 slots, so it stays 0.54 to 0.81 full as keys
    come (it was 11/16 by half: 0.46 to 0.69, ~20-40 % more bytes per key)."""
    monkeypatch.delenv(ENV_GROWTH, raising=False)
    assert GROWTH == (13, 8)
    t = Table(shm_name, blocks=4096, slots=8192, initial=1024)
    w, r = t.writer, t.reader
    try:
        assert w.growth == GROWTH and w.stats()["growth"] == GROWTH
        keys = [b"g-%05d" % i for i in range(1200)]
        for i in range(832):
            assert w.publish(keys[i], 4, [(i, 1)]) >= 0
        assert w.stats()["phase"] == 0 and w.nslots == 1024 and w.rebuilds == 0
        assert w.publish(keys[832], 4, [(832, 1)]) >= 0      # the growth starts
        assert w.stats()["phase"] != 0
        for i in range(833, 1000):
            assert w.publish(keys[i], 4, [(i, 1)]) >= 0
        assert w.nslots == 1536 and w.rebuilds == 1 and w.sync_finishes == 0
        assert r.exists_batch(keys[:1000]) == [True] * 1000
        assert r.exists_batch(keys[1000:]) == [False] * 200
    finally:
        t.close()


def test_the_growth_policy_is_an_argument_or_the_environment(shm_name, monkeypatch):
    """``growth=`` or KVSHM_INDEX_GROWTH ("AT,BY"; the argument wins): (11, 8) is the old
    policy (704 keys of 1,024 slots start a growth to 1,536); bad values are refused with
    the variable or argument named."""
    monkeypatch.setenv(ENV_GROWTH, "11,8")
    t = Table(shm_name, blocks=4096, slots=8192, initial=1024)
    try:
        assert t.writer.growth == (11, 8)
        for i in range(800):
            assert t.writer.publish(b"e-%05d" % i, 4, [(i, 1)]) >= 0
        assert t.writer.nslots == 1536
    finally:
        t.close()
    t = Table(shm_name + "-b", blocks=4096, slots=8192, initial=1024, growth=(12, 2))
    try:
        assert t.writer.growth == (12, 2)
    finally:
        t.close()
    # the lowest start (8/16: a growth needs half the slots live) still grows
    t = Table(shm_name + "-e", blocks=4096, slots=8192, initial=1024, growth=(8, 8))
    try:
        for i in range(700):
            assert t.writer.publish(b"e-%05d" % i, 4, [(i, 1)]) >= 0
        assert t.writer.nslots == 1536 and t.writer.unpublished == 0
    finally:
        t.close()
    def make(name, **kw):
        return IndexWriter.create(name + "-index", name + "-reads", 64, epoch=EPOCH,
                                  block_size=BS, num_blocks=64, **kw)

    for bad in ("13", "13,4,1", "x,4", "3,4", "7,4", "15,4", "13,0", "13,17"):
        monkeypatch.setenv(ENV_GROWTH, bad)
        with pytest.raises(ValueError, match=ENV_GROWTH):
            make(shm_name + "-c")
    monkeypatch.delenv(ENV_GROWTH)
    for bad in ((13,), (2, 4), (13, 20), "ab", 7):
        with pytest.raises(ValueError, match="growth"):
            make(shm_name + "-d", growth=bad)
    # refused before any segment was made
    for suffix in ("-c", "-d"):
        for seg in ("-index", "-reads"):
            assert not os.path.exists("/dev/shm/" + (shm_name + suffix + seg).lstrip("/"))


def test_an_entry_takes_80_bytes_and_keeps_its_attributes():
    """Entry (the server's per-key object, 2 M of them at 2 M keys) is 80 bytes with its
    header (it was 96: checksum, meta and the runs were a field each; now what few entries
    have lies in one side object): every attribute still reads and writes as before, in
    any order, and a freed entry keeps its checksum and meta."""
    import sys as _sys

    from kvshm.index import Entry

    e = Entry(b"k" * 40, 5, 2, 7000)
    assert _sys.getsizeof(e) <= 80, _sys.getsizeof(e)
    assert (e.checksum, e.meta, e.extents, e.nruns) == (None, None, ((5, 2),), 1)
    e.checksum = 2**64 - 1
    assert e.checksum == 2**64 - 1 and e.meta is None and e.extents == ((5, 2),)
    rec = {"where": 1}
    e.meta = rec
    assert e.meta is rec and e.checksum == 2**64 - 1
    e.extents = ((5, 1), (9, 1))
    assert e.extents == ((5, 1), (9, 1)) and e.nruns == 2
    assert e.byte_extents(BS) == [[5 * BS, BS], [9 * BS, 7000 - BS]]
    e.meta = None
    assert e.meta is None and e.checksum == 2**64 - 1 and e.extents == ((5, 1), (9, 1))
    e.checksum = None
    assert e.checksum is None and e.extents == ((5, 1), (9, 1))
    e.extents = ((7, 2),)                # one run of the whole value again
    assert e.extents == ((7, 2),) and e.start == 7 and e.nruns == 1
    assert (e.checksum, e.meta) == (None, None)
    e.checksum, e.meta = 12, "m"
    e.start = -1
    e.extents = ()                       # freed
    assert e.extents == () and e.nruns == 0 and e.byte_extents(BS) == []
    assert (e.checksum, e.meta) == (12, "m")
    e.extents = ((3, 1), (4, 1))
    assert e.extents == ((3, 1), (4, 1)) and (e.checksum, e.meta) == (12, "m")
    # any object as a checksum or meta, as before (the store checks what it keeps)
    f = Entry(b"f", 0, 1, 1, checksum="odd", extents=[(0, 1)])
    assert f.checksum == "odd" and f.extents == ((0, 1),) and f.meta is None
    f.meta = f                           # a cycle (a tier's record): kept, as before
    assert f.meta is f and f.checksum == "odd"
    f.meta = None
    assert f.meta is None and f.checksum == "odd"


def test_an_entry_keeps_a_checksum_or_a_meta_alone_without_a_side_object():
    """The common cases make no object beside the entry: a checksum alone (an int), or a
    tier's meta alone (an SSD tier sets one on every entry with a copy below); both, or
    runs other than one, take one side object, given back when they go."""
    import tracemalloc

    from kvshm.index import Entry

    es = [Entry(b"k%d" % i, i, 1, 10) for i in range(2000)]
    rec, csum = object(), 2**63 + 5
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for e in es:
            e.meta = rec
        assert tracemalloc.get_traced_memory()[0] - base < 2000 * 8
        assert all(e.meta is rec and e.checksum is None for e in es)
        for e in es:
            e.checksum = csum                    # both: a side object each
        assert tracemalloc.get_traced_memory()[0] - base >= 2000 * 32
        assert all(e.meta is rec and e.checksum == csum for e in es)
        for e in es:
            e.meta = None                        # the checksum alone again
        assert tracemalloc.get_traced_memory()[0] - base < 2000 * 8
        assert all(e.meta is None and e.checksum == csum for e in es)
        for e in es:
            e.checksum = None
            e.meta = 7                           # an int meta: kept apart from checksums
        assert all(e.meta == 7 and e.checksum is None for e in es)
        for e in es:
            e.meta = None
        assert tracemalloc.get_traced_memory()[0] - base < 2000 * 8
        assert all(e.meta is None and e.checksum is None and e.extents == ((e.start, 1),)
                   for e in es)
    finally:
        tracemalloc.stop()
