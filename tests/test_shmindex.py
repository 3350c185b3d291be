"""The shared index (kvshm/_shmindex.pyx) and same-host lock-free reads (kvshm/localread.py).

The server side (IndexWriter) and the reader (IndexReader) are tested on their own, with a
Store publishing into the table (no sockets), and through real servers and clients.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import posix_ipc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import kvshm
from kvshm import Pool, segments
from kvshm._shmindex import (FALLBACK, HEADER_SIZE, KEY_MAX, LAYOUT, LAYOUT_OFFSET, MISS,
                             SLOT_DATA, SLOT_KEY_OFFSET, SLOT_META_OFFSET, SLOT_SIZE,
                             SLOT_SIZE_MAX, SLOT_SIZE_OFFSET, IndexReader, IndexWriter,
                             default_slots, key_hash)
from kvshm.client import Client
from kvshm.server import Server
from kvshm.store import Store, StoreConfig
from kvshm.zmq_ctrl.protocol import Limits
from servers import ServerProcess, segment_exists, unique_shm_name

BS = 4096
EPOCH = 77
SUBPROCESS_TIMEOUT = 60


class Table:
    """A pool, a writer and a reader of one test, cleaned up at the end."""

    def __init__(self, name: str, blocks: int = 64, slots: int = 0,
                 misses_final: bool = True) -> None:
        self.pool = Pool.create(name, blocks * BS, BS)
        self.writer = IndexWriter.create(name + "-index", name + "-reads",
                                         slots or default_slots(blocks), epoch=EPOCH,
                                         block_size=BS, num_blocks=blocks,
                                         token=self.pool.token, misses_final=misses_final)
        self.reader = IndexReader(self.writer.name, self.writer.reads_name, self.pool, EPOCH)

    def close(self) -> None:
        self.reader.close()
        self.writer.unlink()
        self.pool.close()
        self.pool.unlink()


@pytest.fixture
def table(shm_name):
    t = Table(shm_name)
    yield t
    t.close()


def fill(pool: Pool, block: int, data: bytes) -> None:
    pool.write(block * BS, data)


# ----------------------------------------------------------------------------- unit


def test_publish_lookup_overwrite_unpublish(table):
    w, r, p = table.writer, table.reader, table.pool
    fill(p, 3, b"a" * 5000)
    assert w.publish(b"k", 5000, [(3, 2)]) >= 0
    assert r.get(b"k") == b"a" * 5000
    assert r.get("k") == b"a" * 5000                  # str keys: their UTF-8
    assert r.get(b"nope") is None                     # a final miss
    out = bytearray(6000)
    assert r.get_into(b"k", out) == 5000 and out[:5000] == b"a" * 5000
    with pytest.raises(ValueError, match="holds 10 bytes"):
        r.get_into(b"k", bytearray(10))
    assert r.get_into(b"nope", out) == MISS
    assert r.exists_batch([b"k", b"nope"]) == [True, False]
    assert r.match_prefix([b"k", b"nope", b"k"]) == 1
    fill(p, 7, b"b" * 10)
    w.publish(b"k", 10, [(7, 1)], 1234)               # overwrite in place
    assert r.get(b"k") == b"b" * 10
    assert w.live == 1
    assert w.unpublish(b"k") and not w.unpublish(b"k")
    assert r.get(b"k") is None and r.exists_batch([b"k"]) == [False]


def test_values_of_several_runs_are_read_in_order(table):
    w, r, p = table.writer, table.reader, table.pool
    fill(p, 10, b"1" * BS)
    fill(p, 2, b"2" * BS * 2)
    fill(p, 20, b"3" * 100)
    w.publish(b"multi", 3 * BS + 100, [(10, 1), (2, 2), (20, 1)])
    assert r.get(b"multi") == b"1" * BS + b"2" * 2 * BS + b"3" * 100
    assert r.locate([b"multi"]) is None               # callers' own copies: one run only
    tok, size, runs, csum = r.lookup(b"multi")
    assert (size, runs, csum) == (3 * BS + 100, ((10, 1), (2, 2), (20, 1)), None)
    assert r.validate([tok]) and r.lookup(b"none") is None
    w.publish(b"multi", 1, [(5, 1)], 99)
    assert not r.validate([tok]) and r.lookup(b"multi")[1:] == (1, ((5, 1),), 99)


def test_a_token_goes_stale_when_the_entry_changes(table):
    w, r, p = table.writer, table.reader, table.pool
    w.publish(b"k", 10, [(1, 1)])
    offs, sizes, toks = r.locate([b"k", b"miss"])
    assert offs == [BS, -1] and sizes == [10, -1]
    assert r.validate(toks)
    w.publish(b"k", 10, [(1, 1)])                     # same place, new version
    assert not r.validate(toks)
    offs, sizes, toks = r.locate([b"k"])
    w.unpublish(b"k")
    assert not r.validate(toks)


def test_keys_the_table_cannot_hold_make_readers_ask_the_server(table):
    w, r = table.writer, table.reader
    long_key = b"x" * (KEY_MAX + 1)
    assert w.publish(long_key, 10, [(0, 1)]) == -1
    assert w.unpublished == 1
    assert r.get(long_key) == FALLBACK                # too long for the table
    assert r.get_into(long_key, bytearray(10)) == FALLBACK
    # a live key is missing from the table, so no miss is final any more
    assert r.get(b"other") == FALLBACK
    assert r.exists_batch([b"other"]) is None
    assert r.match_prefix([b"other"]) == FALLBACK
    w.unpublish(long_key)
    assert w.unpublished == 0 and r.get(b"other") is None
    assert w.publish(b"k", 10, [(0, 1)] * 9) == -1    # more runs than a slot holds
    w.unpublish(b"k")


def test_misses_are_not_final_with_a_tier_below(shm_name):
    t = Table(shm_name, misses_final=False)
    try:
        t.writer.publish(b"k", 1, [(0, 1)])
        assert t.reader.get(b"k") is not None
        assert t.reader.get(b"miss") == FALLBACK
        assert t.reader.get_into(b"miss", bytearray(8)) == FALLBACK
        assert t.reader.get_many_into([b"k", b"miss"], [bytearray(8)] * 2) == [1, FALLBACK]
        assert t.reader.exists_batch([b"k", b"miss"]) is None
        assert t.reader.match_prefix([b"k", b"miss"]) == FALLBACK
        assert t.reader.match_prefix([b"k"]) == 1
    finally:
        t.close()


def test_tombstones_are_rebuilt_away_and_every_live_key_stays_found(shm_name):
    t = Table(shm_name, blocks=64, slots=64)
    w, r = t.writer, t.reader
    try:
        live: dict[bytes, int] = {}
        for i in range(2000):
            k = b"key%d" % i
            w.publish(k, i, [(i % 64, 1)])
            live[k] = i
            if i % 3 != 2:
                w.unpublish(b"key%d" % (i - i % 3))
                live.pop(b"key%d" % (i - i % 3), None)
            while len(live) > 40:
                old = next(iter(live))
                w.unpublish(old)
                del live[old]
        assert w.rebuilds > 0
        assert w.live == len(live)
        assert r.exists_batch(list(live)) == [True] * len(live)
        for k, size in live.items():
            assert r.locate([k])[1] == [size]
        assert r.exists_batch([b"key%d" % i for i in range(2000) if b"key%d" % i
                               not in live]) == [False] * (2000 - len(live))
    finally:
        t.close()


def test_full_table_leaves_keys_unpublished(shm_name):
    t = Table(shm_name, blocks=64, slots=64)
    try:
        slots = [t.writer.publish(b"k%d" % i, 1, [(0, 1)]) for i in range(64)]
        assert -1 in slots                  # load limit: (GROWTH[0] + 1)/16 of the slots
        assert t.writer.unpublished == slots.count(-1)
        assert t.reader.get(b"k63") == FALLBACK
    finally:
        t.close()


def test_closed_table_sends_every_read_to_the_server(table):
    table.writer.publish(b"k", 1, [(0, 1)])
    assert table.reader.get(b"k") is not None and table.reader.usable
    table.writer.close()
    assert not table.reader.usable
    assert table.reader.get(b"k") == FALLBACK
    assert table.reader.exists_batch([b"k"]) is None


def test_reader_refuses_another_epoch(table):
    with pytest.raises(ValueError, match="epoch"):
        IndexReader(table.writer.name, table.writer.reads_name, table.pool, EPOCH + 1)


def _index_map(name: str) -> mmap.mmap:
    """The index segment ``name`` mapped writable (the test plays a server of another
    build)."""
    shm = posix_ipc.SharedMemory(name)
    try:
        return mmap.mmap(shm.fd, HEADER_SIZE)
    finally:
        shm.close_fd()


def _slot_bytes(table, slot):
    shm = posix_ipc.SharedMemory(table.writer.name)
    m = mmap.mmap(shm.fd, shm.size, prot=mmap.PROT_READ)
    shm.close_fd()
    try:
        return m[HEADER_SIZE + slot * SLOT_SIZE:HEADER_SIZE + (slot + 1) * SLOT_SIZE]
    finally:
        m.close()


def _meta(s):
    """A layout-5 slot's meta word, split: (size, tag, keylen, state, has checksum,
    wide record bytes (0: none), runs)."""
    m = struct.unpack_from("<Q", s, SLOT_META_OFFSET)[0]
    rec = (m >> 59) & 3
    return (m & SLOT_SIZE_MAX, (m >> 40) & 0xFF, (m >> 48) & 0xFF, (m >> 56) & 3,
            (m >> 58) & 1, 32 << rec if rec else 0, ((m >> 61) & 7) + 1)


def test_a_slot_is_one_cache_line_holding_a_40_byte_key_and_its_run(table):
    # Layout 5: 64-byte slots (one cache line each: the table takes half the memory of
    # layout 4's 128-byte slots). @0 the version, @8 one u64 of size (40 bits), hash
    # tag, key length, state, flags (checksum, wide record class) and run count, @16
    # 48 bytes of key and runs: a 40-byte key (a hex chunk hash) in one run lies in the
    # slot, no wide record; what does not fit takes the smallest wide record (64, 128
    # or 256 bytes) that holds its key, checksum and runs.
    assert (LAYOUT, SLOT_SIZE, SLOT_META_OFFSET, SLOT_KEY_OFFSET, SLOT_DATA) == (5, 64, 8, 16, 48)
    assert SLOT_SIZE_OFFSET == SLOT_META_OFFSET and SLOT_SIZE_MAX == (1 << 40) - 1
    key = b"%040x" % 0x1234567890ABCDEF                  # 40 bytes
    assert table.writer.publish(key, 4000, [(3, 1)]) >= 0
    assert table.writer.stats()["wide_used"] == 0
    _offs, _sizes, toks = table.reader.locate([key])
    slot, version = toks[0]
    s = _slot_bytes(table, slot)
    assert struct.unpack_from("<Q", s, 0)[0] == version
    assert _meta(s) == (4000, key_hash(key) & 0xFF, 40, 1, 0, 0, 1)
    assert s[16:56] == key and struct.unpack_from("<II", s, 56) == (3, 1)
    assert table.reader.lookup(key)[1:] == (4000, ((3, 1),), None)
    # with a checksum it no longer fits: a 64-byte record holds key, checksum and run
    assert table.writer.publish(key, 4001, [(3, 1)], checksum=0x1122334455667788) == slot
    s = _slot_bytes(table, slot)
    assert _meta(s) == (4001, key_hash(key) & 0xFF, 40, 1, 1, 64, 1)
    assert table.writer.stats()["wide_by_class"] == {"64": 1, "128": 0, "256": 0}
    assert table.reader.lookup(key)[1:] == (4001, ((3, 1),), 0x1122334455667788)
    # in 8 runs (40 + 8 + 64 bytes): a 128-byte record, the 64-byte one given back
    runs = [(10 + 2 * j, 1) for j in range(8)]
    assert table.writer.publish(key, 4002, runs, checksum=5) == slot
    assert _meta(_slot_bytes(table, slot))[4:] == (1, 128, 8)
    assert table.writer.stats()["wide_by_class"] == {"64": 0, "128": 1, "256": 0}
    assert table.reader.lookup(key)[1:] == (4002, tuple(runs), 5)
    # back to one run: it keeps its record (once wide, an entry stays wide)
    assert table.writer.publish(key, 4003, [(3, 1)]) == slot
    assert _meta(_slot_bytes(table, slot))[4:] == (0, 128, 1)
    assert table.reader.lookup(key)[1:] == (4003, ((3, 1),), None)
    # keys past 40 bytes: 64 / 128 / 256-byte records by what they need
    for n, rec in ((56, 64), (57, 128), (120, 128), (121, 256), (KEY_MAX, 256)):
        k = bytes([65 + n % 26]) * n
        i = table.writer.publish(k, n, [(1, 1)])
        assert _meta(_slot_bytes(table, i))[5] == rec, n
        assert table.reader.lookup(k)[1:] == (n, ((1, 1),), None)
    assert table.writer.stats()["wide_by_class"] == {"64": 1, "128": 3, "256": 2}
    for n in (56, 57, 120, 121, KEY_MAX):
        assert table.writer.unpublish(bytes([65 + n % 26]) * n)
    assert table.writer.stats()["wide_by_class"] == {"64": 0, "128": 1, "256": 0}
    # a short key with a checksum and two runs fits: 8 + 8 + 16 <= 48
    assert table.writer.publish(b"k" * 8, 5, [(1, 1), (7, 2)], checksum=9) >= 0
    assert table.writer.stats()["wide_used"] == 1
    assert table.reader.lookup(b"k" * 8)[1:] == (5, ((1, 1), (7, 2)), 9)


def test_a_value_past_the_slots_size_field_is_not_published(table):
    # the size has 40 bits (1 TiB - 1): a larger value is left to the server (a reader
    # falls back), and an older smaller value of the key is no longer visible
    assert table.writer.publish(b"big", 10, [(0, 1)]) >= 0
    assert table.reader.lookup(b"big")[1] == 10
    assert table.writer.publish(b"big", SLOT_SIZE_MAX + 1, [(0, 1)]) == -1
    assert table.reader.lookup(b"big") == FALLBACK
    assert table.writer.unpublished == 1
    slot = table.writer.publish(b"big", SLOT_SIZE_MAX, [(0, 1)])
    assert slot >= 0 and table.writer.unpublished == 0
    assert _meta(_slot_bytes(table, slot))[0] == SLOT_SIZE_MAX     # the largest it holds
    assert table.reader.lookup(b"big") == FALLBACK    # (its one block cannot hold it)
    assert table.writer.publish(b"big", 11, [(0, 1)]) == slot
    assert table.reader.lookup(b"big")[1] == 11


def test_a_growth_drops_a_slot_scribbled_to_name_no_key_and_keeps_the_rest(shm_name):
    # layout 5 keeps one hash byte, so a growth hashes each moved key again from the
    # key's bytes; a slot whose wide record index a same-user process scribbled past
    # the records names no key: the growth drops it (no key compare could match it
    # anyway) instead of hashing memory it does not name, and moves every other key
    pool = Pool.create(shm_name, 64 * BS, BS)
    w = IndexWriter.create(shm_name + "-index", shm_name + "-reads", 4096, epoch=EPOCH,
                           block_size=BS, num_blocks=64, initial_slots=64, migrate_step=4)
    try:
        long_key = b"L" * 100                          # over 40 bytes: a wide record
        slot = w.publish(long_key, 7, [(1, 1)])
        assert slot >= 0 and w.stats()["wide_used"] == 1
        shm = posix_ipc.SharedMemory(w.name)
        m = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        try:
            struct.pack_into("<I", m, HEADER_SIZE + slot * SLOT_SIZE + SLOT_KEY_OFFSET,
                             0xFFFFFFF0)
        finally:
            m.close()
        keys = [b"%040x" % i for i in range(600)]      # several growths from 64 slots
        for i, k in enumerate(keys):
            assert w.publish(k, i + 1, [(i % 64, 1)]) >= 0
        assert w.rebuilds >= 2 and w.live == len(keys)
        r = IndexReader(w.name, w.reads_name, pool, EPOCH)
        try:
            assert r.exists_batch(keys) == [True] * len(keys)
            assert all(r.lookup(k)[1] == i + 1 for i, k in enumerate(keys))
            assert r.lookup(long_key) is None        # dropped: a miss (server's table)
        finally:
            r.close()
        assert w.publish(long_key, 8, [(2, 1)]) >= 0  # it takes the key again
    finally:
        w.unlink()
        pool.close()
        pool.unlink()


def test_reader_refuses_a_table_of_another_layout(table):
    table.writer.publish(b"k", 3, [(0, 1)])
    m = _index_map(table.writer.name)
    try:
        assert struct.unpack_from("<I", m, LAYOUT_OFFSET)[0] == LAYOUT
        for other in (LAYOUT - 1, LAYOUT + 1):
            struct.pack_into("<I", m, LAYOUT_OFFSET, other)
            with pytest.raises(ValueError, match="layout"):
                IndexReader(table.writer.name, table.writer.reads_name, table.pool, EPOCH)
        struct.pack_into("<I", m, LAYOUT_OFFSET, LAYOUT)
    finally:
        m.close()
    r = IndexReader(table.writer.name, table.writer.reads_name, table.pool, EPOCH)
    try:
        assert r.exists_batch([b"k"]) == [True]
    finally:
        r.close()


def test_a_client_whose_reader_refuses_the_table_asks_the_server(shm_name):
    """A server of another kvshm build (here: its table's layout word changed) announces
    a table this client's reader refuses: the client maps the pool and answers every
    read through the server, correctly, instead of failing."""
    srv = Server(service_port=0, manage_port=None, prealloc_size=1 / 256, block_size=4,
                 shm_name=shm_name).start()
    try:
        m = _index_map(shm_name + "-index")
        try:
            struct.pack_into("<I", m, LAYOUT_OFFSET, LAYOUT - 1)
            with Client(srv.address) as c:
                assert c.transport == "shm" and _local(c) is None
                keys = [b"%040x" % i for i in range(50)]
                c.put_batch(keys, [b"v%d" % i * 100 for i in range(50)])
                c.put("a", b"A" * 5000)
                before = c.stats()["gets"]
                assert c.get("a") == b"A" * 5000
                assert c.get_batch(keys[:3] + [b"zz"]) == [b"v0" * 100, b"v1" * 100,
                                                          b"v2" * 100, None]
                assert c.exists_batch(keys + [b"zz"]) == [True] * 50 + [False]
                assert c.match_prefix(keys + [b"zz"] + keys) == 50
                assert c.exists("a") and not c.exists("zz")
                with pytest.raises(kvshm.KeyNotFound):
                    c.get("zz")
                assert c.stats()["gets"] > before          # the server answered
        finally:
            struct.pack_into("<I", m, LAYOUT_OFFSET, LAYOUT)
            m.close()
        with Client(srv.address) as c:                      # the layout back: lock-free
            assert _local(c) is not None and c.get("a") == b"A" * 5000
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- LRU


def _store_with_table(name: str, blocks: int) -> tuple[Store, Table]:
    t = Table(name, blocks=blocks)
    store = Store(t.pool, StoreConfig(limits=Limits(max_key_bytes=200, max_batch=1000)))
    store.index.attach_shared(t.writer)
    return store, t


def test_lock_free_reads_count_for_the_lru(shm_name):
    store, t = _store_with_table(shm_name, blocks=4)
    try:
        for k in (b"a", b"b", b"c", b"d"):
            assert store.put([k], [k * 100]) == [0]
        assert t.reader.get(b"a") == b"a" * 100       # a is now the most recent
        store.put([b"e"], [b"e"])                     # full: evicts the LRU entry
        assert store.exists([b"a", b"b"]) == [True, False]
        assert t.reader.get(b"b") is None             # unpublished with its eviction
    finally:
        t.close()


def test_reads_are_applied_in_their_global_order_with_the_servers_own(shm_name):
    store, t = _store_with_table(shm_name, blocks=4)
    try:
        for k in (b"a", b"b", b"c", b"d"):
            store.put([k], [k])
        t.reader.get(b"b")                            # lock-free: b
        store.lookup(b"cl", 1, [b"a"])                # the server's own touch: a
        store.release(b"cl", [1])
        t.reader.get(b"c")                            # c
        assert [e.key for e in store.index.lru()] == [b"d", b"b", b"a", b"c"]
    finally:
        t.close()


def test_a_ticket_never_written_is_skipped_and_later_reads_still_count(shm_name):
    store, t = _store_with_table(shm_name, blocks=4)
    try:
        for k in (b"a", b"b", b"c", b"d"):
            store.put([k], [k])
        # a reader killed between taking its ticket and writing its record
        shm = posix_ipc.SharedMemory(t.writer.reads_name)
        m = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        head = struct.unpack_from("<Q", m, 64)[0]
        struct.pack_into("<Q", m, 64, head + 1)
        m.close()
        t.reader.get(b"a")
        assert t.writer.drain(stuck_after=3600) == []        # waits behind the ticket
        assert t.writer.drain(stuck_after=0.0) == [b"a"]     # gives up on it
        assert t.writer.skipped_records == 1
        # a head no reader could have written (the ring is writable by clients)
        fd = os.open("/dev/shm" + t.writer.reads_name, os.O_RDWR)
        m = mmap.mmap(fd, 0)
        os.close(fd)
        struct.pack_into("<Q", m, 64, head + (1 << 40))
        m.close()
        assert t.writer.drain() == [] and t.writer.skipped_records > 1 << 39
        t.reader.get(b"b")                             # the ring works again
        assert t.writer.drain() == [b"b"]
    finally:
        t.close()


def test_a_full_reads_ring_sends_reads_to_the_server(shm_name):
    name = shm_name
    pool = Pool.create(name, 8 * BS, BS)
    w = IndexWriter.create(name + "-index", name + "-reads", 64, epoch=EPOCH, block_size=BS,
                           num_blocks=8, ring_records=64)
    r = IndexReader(w.name, w.reads_name, pool, EPOCH)
    try:
        w.publish(b"k", 1, [(0, 1)])
        got = [r.get(b"k") for _ in range(70)]
        assert got[:64] == [b"\0"] * 64 and got[64:] == [FALLBACK] * 6
        assert len(w.drain()) == 64
        assert r.get(b"k") == b"\0"
    finally:
        r.close()
        w.unlink()
        pool.close()
        pool.unlink()


# ----------------------------------------------------------------------------- races


def _value(key_id: int, version: int, size: int) -> bytes:
    word = struct.pack("<II", key_id, version)
    return (word * (size // 8 + 1))[:size]


def _check_value(key_id: int, data: bytes, committed: dict[int, set[int]]) -> str | None:
    if len(data) < 8:
        return None if len(data) == 0 else _short_check(key_id, data, committed)
    kid, ver = struct.unpack_from("<II", data)
    if kid != key_id:
        return f"key {key_id} read bytes of key {kid}"
    if data != _value(kid, ver, len(data)):
        return f"key {key_id} read a mix of versions"
    if ver not in committed.get(key_id, ()):
        return f"key {key_id} read version {ver}, never committed"
    return None


def _short_check(key_id: int, data: bytes, committed: dict[int, set[int]]) -> str | None:
    for v in committed.get(key_id, ()):
        if _value(key_id, v, len(data)) == data:
            return None
    return f"key {key_id} read {data!r}, no committed version"


NKEYS = 12


class LockFreeReads(RuleBasedStateMachine):
    """The store (this thread) overwrites, deletes, evicts and refills while reader
    threads read lock-free; every read is a committed version of its key or a miss."""

    def __init__(self) -> None:
        super().__init__()
        name = unique_shm_name("lockfree-")
        self.store, self.t = _store_with_table(name, blocks=24)
        self.committed: dict[int, set[int]] = {}
        self.version = 0
        self.errors: list[str] = []
        self.reads = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._read_loop, args=(i,), daemon=True)
                        for i in range(3)]
        for th in self.threads:
            th.start()

    def _read_loop(self, seed: int) -> None:
        import random

        rnd = random.Random(seed)
        r = self.t.reader
        while not self.stop.is_set():
            kid = rnd.randrange(NKEYS)
            v = r.get(b"key-%d" % kid)
            if v is None or v == FALLBACK:
                continue
            err = _check_value(kid, v, self.committed)
            if err:
                self.errors.append(err)
            self.reads += 1

    @rule(kid=st.integers(0, NKEYS - 1), size=st.integers(0, 3 * BS + 17))
    def put(self, kid: int, size: int) -> None:
        self.version += 1
        # recorded as committed before it is: a reader may see it once installed
        self.committed.setdefault(kid, set()).add(self.version)
        self.store.put([b"key-%d" % kid], [_value(kid, self.version, size)])

    @rule(kid=st.integers(0, NKEYS - 1))
    def delete(self, kid: int) -> None:
        self.store.delete([b"key-%d" % kid])

    @rule(ratio=st.sampled_from([0.0, 0.3, 0.6]))
    def evict(self, ratio: float) -> None:
        self.store.evict(ratio)

    @rule()
    def purge(self) -> None:
        self.store.purge()

    @rule()
    def let_readers_run(self) -> None:
        time.sleep(0.002)

    @invariant()
    def reads_are_committed_versions(self) -> None:
        assert not self.errors, self.errors[:5]
        assert self.store.stats(verify=True)["accounting_ok"]

    def teardown(self) -> None:
        self.stop.set()
        for th in self.threads:
            th.join(10)
        self.t.close()
        assert not self.errors, self.errors[:5]


TestLockFreeReads = LockFreeReads.TestCase
TestLockFreeReads.settings = settings(max_examples=25, stateful_step_count=60,
                                      deadline=None,
                                      suppress_health_check=list(HealthCheck))


_READER_PROC = textwrap.dedent("""
    import struct, sys, time
    from kvshm import Pool
    from kvshm._shmindex import IndexReader, FALLBACK
    pool = Pool.attach(sys.argv[1])
    r = IndexReader(sys.argv[1] + "-index", sys.argv[1] + "-reads", pool, int(sys.argv[2]))
    nkeys, seconds = int(sys.argv[3]), float(sys.argv[4])
    bad = reads = 0
    end = time.monotonic() + seconds
    print("ready", flush=True)
    i = 0
    while time.monotonic() < end:
        i += 1
        kid = i % nkeys
        v = r.get(b"key-%d" % kid)
        if v is None or v == FALLBACK or len(v) < 8:
            continue
        k, ver = struct.unpack_from("<II", v)
        word = struct.pack("<II", k, ver)
        if k != kid or v != (word * (len(v) // 8 + 1))[:len(v)]:
            bad += 1
        reads += 1
    r.close(); pool.close()
    print(reads, bad, flush=True)
""")


def test_reader_processes_never_see_torn_or_foreign_bytes(shm_name):
    """Reader processes (no GIL shared with the writer) read while the store overwrites,
    deletes and evicts as fast as it can."""
    store, t = _store_with_table(shm_name, blocks=32)
    procs = [subprocess.Popen([sys.executable, "-c", _READER_PROC, shm_name, str(EPOCH),
                               str(NKEYS), "2.0"], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        v = 0
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            v += 1
            kid = v % NKEYS
            store.put([b"key-%d" % kid], [_value(kid, v, (v * 977) % (3 * BS) + 8)])
            if v % 7 == 0:
                store.delete([b"key-%d" % ((v * 5) % NKEYS)])
            if v % 29 == 0:
                store.evict(0.3)
            store.index.sync()
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


def test_a_killed_reader_leaves_the_index_working(shm_name):
    store, t = _store_with_table(shm_name, blocks=32)
    try:
        store.put([b"key-1"], [_value(1, 1, 100)])
        p = subprocess.Popen([sys.executable, "-c", _READER_PROC, shm_name, str(EPOCH),
                              "2", "30"], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait(SUBPROCESS_TIMEOUT)
        p.stdout.close()
        assert segment_exists(t.writer.name) and segment_exists(t.writer.reads_name)
        store.put([b"key-0"], [_value(0, 2, 50)])
        store.evict(0.0)                  # drains what it recorded, skips a half record
        time.sleep(0.06)
        store.index.sync()
        store.put([b"key-1"], [_value(1, 3, 100)])
        assert t.reader.get(b"key-1") == _value(1, 3, 100)
    finally:
        t.close()


_WRITE_INDEX = textwrap.dedent("""
    import ctypes, sys
    from kvshm import Pool
    from kvshm._shmindex import IndexReader
    pool = Pool.attach(sys.argv[1])
    r = IndexReader(sys.argv[1] + "-index", sys.argv[1] + "-reads", pool, int(sys.argv[2]))
    print("mapped", flush=True)
    ctypes.memset(r.address + 4096, 0xFF, 64)      # a slot: must fault
    print("wrote", flush=True)
""")


def test_a_reader_cannot_write_the_index(table):
    table.writer.publish(b"k", 3, [(0, 1)])
    p = subprocess.run([sys.executable, "-c", _WRITE_INDEX, table.pool.name.lstrip("/"),
                        str(EPOCH)], capture_output=True, text=True,
                       timeout=SUBPROCESS_TIMEOUT)
    assert p.stdout.split() == ["mapped"], p.stdout + p.stderr
    assert p.returncode == -signal.SIGSEGV
    assert table.reader.exists_batch([b"k"]) == [True]


# ----------------------------------------------------------------------------- clients


@pytest.fixture
def server(shm_name):
    srv = Server(service_port=0, manage_port=None, prealloc_size=1 / 256, block_size=4,
                 shm_name=shm_name).start()
    yield srv
    srv.stop()


def _local(c: Client):
    return c._session.local


def test_local_client_reads_without_the_server(server):
    with Client(server.address) as c:
        assert c.transport == "shm" and _local(c) is not None
        c.put_batch([b"a", b"b"], [b"A" * 5000, b"B"])
        before = c.stats()["gets"]
        assert c.get("a") == b"A" * 5000
        assert c.get_batch([b"a", b"b", b"zz"]) == [b"A" * 5000, b"B", None]
        out = [bytearray(5000), bytearray(1)]
        assert c.get_batch_into([b"a", b"b"], out) == [5000, 1] and out[1] == b"B"
        assert c.get_into("b", bytearray(4)) == 1
        assert c.exists_batch([b"a", b"zz"]) == [True, False] and c.exists("b")
        assert c.match_prefix([b"a", b"b", b"zz", b"a"]) == 2
        with pytest.raises(kvshm.KeyNotFound):
            c.get("zz")
        assert c.stats()["gets"] == before            # none of them asked the server
        r = _local(c)
        assert r.hits == 6 and r.misses >= 2 and r.fallbacks == 0
        assert c.get("a", verify=False) == b"A" * 5000
        c.delete("a")
        assert not c.exists("a") and c.get_batch([b"a"]) == [None]


def test_long_keys_and_tcp_clients_use_the_protocol(server):
    key = "k" * (KEY_MAX + 10)
    with Client(server.address) as c, Client(server.address, transport="tcp") as tcp:
        c.put(key, b"long")
        assert c.get(key) == b"long" and c.exists(key)
        assert _local(c).fallbacks >= 1
        assert _local(tcp) is None
        assert tcp.get(key) == b"long"


def test_lazy_commits_are_read_back_by_their_writer(server):
    with Client(server.address, lazy_commit=True) as c:
        c.put("lazy", b"1")
        assert c.get("lazy") == b"1"                  # through the server: COMMIT rides
        c.put("lazy", b"2")
        assert c.get("lazy") == b"2"


def test_paged_reads_are_lock_free(server):
    np = pytest.importorskip("numpy")
    with Client(server.address) as c:
        kv = np.arange(2 * 4 * 1024, dtype=np.float32).reshape(2, 4, 1024)
        c.put_pages(["p0", "p1"], kv, [0, 1])
        back = np.zeros_like(kv)
        hits = _local(c).hits
        assert c.get_pages_into(["p0", "p1", "p9"], back, [2, 3, 0]) == [True, True, False]
        assert (back[:, 2] == kv[:, 0]).all() and (back[:, 3] == kv[:, 1]).all()
        assert _local(c).hits == hits + 2


def test_a_restarted_server_is_noticed_by_its_readers(shm_name):
    # tcp only: the client's ipc endpoint would name the old server's directory
    srv = Server(service_port=0, manage_port=None, prealloc_size=1 / 256, block_size=4,
                 shm_name=shm_name, ipc=False).start()
    port = srv.service_port
    c = Client(srv.address, timeout=5)
    try:
        c.put("k", b"old")
        old = _local(c)
        assert c.get("k") == b"old"
        srv.stop()
        assert not old.usable and old.get(b"k") == FALLBACK
        srv = Server(service_port=port, manage_port=None, prealloc_size=1 / 256,
                     block_size=4, shm_name=shm_name + "-2", ipc=False).start()
        with pytest.raises(kvshm.KeyNotFound):
            c.get("k")                                # the new server has nothing
        c.put("k", b"new")
        assert c.get("k") == b"new"
        assert _local(c) is not old and _local(c).epoch == srv.epoch
        assert _local(c).hits >= 1
    finally:
        c.close()
        srv.stop()


def test_a_killed_servers_index_is_noticed_and_cleaned_up(shm_name):
    srv = ServerProcess(shm_name=shm_name, prealloc_size=1 / 256)
    try:
        with Client(srv.address, timeout=2) as c:
            c.put("k", b"v")
            r = _local(c)
            assert c.get("k") == b"v" and r.usable
            srv.kill()
            time.sleep(0.15)                          # the reader checks the lock each 0.1 s
            assert not r.usable
            with pytest.raises(kvshm.ServerUnavailable):
                c.get("k")
            names = [shm_name, shm_name + "-index", shm_name + "-reads"]
            # (a server of another test run on this host may have cleaned them already)
            removed = segments.cleanup(shm_name)
            assert set(removed) <= set(names)
            assert not any(segment_exists(n) for n in names)
    finally:
        srv.kill()
        srv.remove_segment()


def test_stop_removes_the_index_segments(shm_name):
    srv = Server(service_port=0, manage_port=None, prealloc_size=1 / 256, block_size=4,
                 shm_name=shm_name).start()
    names = [shm_name + "-index", shm_name + "-reads"]
    assert all(segment_exists(n) for n in names)
    srv.stop()
    assert not any(segment_exists(n) for n in names)


def test_no_shared_index_flag(shm_name):
    with ServerProcess("--no-shared-index", shm_name=shm_name, prealloc_size=1 / 256) as srv, \
            Client(srv.address) as c:
        assert c.transport == "shm" and _local(c) is None
        assert not segment_exists(shm_name + "-index")
        c.put("k", b"v")
        assert c.get("k") == b"v" and c.exists("k")


_CLIENT_READER = textwrap.dedent("""
    import struct, sys, time
    import kvshm
    c = kvshm.Client(sys.argv[1], transport="shm")
    nkeys, seconds = int(sys.argv[2]), float(sys.argv[3])
    bad = reads = 0
    print("ready", flush=True)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        got = c.get_batch([b"key-%d" % ((i + j) % nkeys) for j in range(3)])
        for j, v in enumerate(got):
            if v is None or len(v) < 8:
                continue
            kid, ver = struct.unpack_from("<II", v)
            word = struct.pack("<II", kid, ver)
            if kid != (i + j) % nkeys or v != (word * (len(v) // 8 + 1))[:len(v)]:
                bad += 1
            reads += 1
    local = c._session.local
    print(reads, bad, local.hits if local is not None else -1, flush=True)
    c.close()
""")


def test_clients_read_while_other_clients_overwrite_and_evict(shm_name):
    """Through real clients: writers reuse freed blocks (ALLOC/COMMIT into a pool kept
    full, so every put evicts or replaces) while local readers in this process and in
    another one read lock-free; no read returns a mix or another key's bytes."""
    srv = Server(service_port=0, manage_port=None, prealloc_size=1 / 1024, block_size=4,
                 shm_name=shm_name).start()               # 256 blocks of 4 KiB
    stop = threading.Event()
    errors: list[str] = []
    counts = [0, 0]

    def read_loop(slot: int) -> None:
        with Client(srv.address) as c:
            i = 0
            while not stop.is_set():
                i += 1
                kid = (i * 7 + slot) % NKEYS
                v = c.get_batch([b"key-%d" % kid])[0] if i % 2 else \
                    _get_or_none(c, b"key-%d" % kid)
                if v is None or len(v) < 8:
                    continue
                k, ver = struct.unpack_from("<II", v)
                if k != kid or v != _value(k, ver, len(v)):
                    errors.append(f"key {kid}: bytes of key {k} version {ver} or a mix")
                counts[slot] += 1

    proc = subprocess.Popen([sys.executable, "-c", _CLIENT_READER, srv.address, str(NKEYS),
                             "3.0"], stdout=subprocess.PIPE, text=True)
    threads = [threading.Thread(target=read_loop, args=(i,), daemon=True) for i in range(2)]
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for th in threads:
            th.start()
        with Client(srv.address) as w:
            v = 0
            # at least 3 s of writes, and on until the pool has evicted (12 keys of up to
            # 40 blocks in 256 fill it only when the sizes drawn add up: under load 3 s
            # can pass before they do); the bound only stops a broken store looping
            deadline = time.monotonic() + 3.0
            bound = deadline + 60.0
            evicted = False
            while time.monotonic() < deadline or (not evicted
                                                  and time.monotonic() < bound):
                v += 1
                if v % 20 == 0 and time.monotonic() >= deadline:
                    evicted = w.stats()["evictions"] > 0
                keys = [b"key-%d" % ((v + j) % NKEYS) for j in range(3)]
                try:
                    w.put_batch(keys, [_value((v + j) % NKEYS, v,
                                              (v * 4099 + j) % (40 * BS) + 8)
                                       for j in range(3)])
                except kvshm.PoolFull:
                    pass        # readers that fell back to LOOKUP pin what they read
                if v % 5 == 0:
                    w.delete(keys[:1])
            assert w.stats(verify=True)["accounting_ok"]
            assert w.stats()["evictions"] > 0
        out, _ = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
        reads, bad, hits = map(int, out.split())
        assert bad == 0 and reads > 0 and hits > 0, out
    finally:
        stop.set()
        for th in threads:
            th.join(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        srv.stop()
    assert not errors, errors[:5]
    assert all(n > 0 for n in counts), counts


def _get_or_none(c: Client, key: bytes) -> bytes | None:
    try:
        return c.get(key)
    except kvshm.KeyNotFound:
        return None
