"""The SSD tier (issue 8): spill on eviction, promotion on lookup, persistence, disk faults.

Store-level tests drive a Store + SsdTier directly (no sockets): the loop's part is
``store.service()``, woken by the tier's ``notify``. Server-level tests use an in-process
:class:`kvshm.Server` (to inject disk faults) or real ``kvshm serve`` processes (kill -9,
restarts, exit codes). Data files go to pytest's tmp_path (the normal filesystem, where
O_DIRECT is usually allowed); one test uses a tmpfs directory for the buffered fallback.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from kvshm import Client, Pool
from kvshm.server import ConfigError, Server
from kvshm.store import Store, StoreConfig
from kvshm.tiers import ssd as ssd_mod
from kvshm.tiers.ssd import workers as ssd_io
from kvshm.tiers import SsdConfig, SsdTier
from kvshm.zmq_ctrl.protocol import Limits, Status
from servers import ServerProcess

BS = 4096
MiB = 1 << 20


def value(i: int, size: int) -> np.ndarray:
    """Bytes of value ``i``: cheap to make again, different for every i and offset."""
    a = np.arange(size, dtype=np.uint32)
    return ((a * (2 * i + 1) + i * 7919 + (a >> 8)) & 0xFF).astype(np.uint8)


def put_many(c: Client, prefix: str, n: int, size: int = MiB, batch: int = 8) -> None:
    """Put values ``value(i, size)`` under ``prefix + str(i)``, a pool-friendly batch at
    a time (one client may hold at most 3/4 of the pool pending)."""
    for b in range(0, n, batch):
        r = range(b, min(n, b + batch))
        c.put_batch([f"{prefix}{i}" for i in r], [value(i, size) for i in r])


def get_many(c: Client, keys: list[str], batch: int = 8) -> list[bytes | None]:
    out: list[bytes | None] = []
    for b in range(0, len(keys), batch):
        out += c.get_batch(keys[b:b + batch])
    return out


def runs_of(place, size: int) -> list:
    """Byte ranges of a value as ALLOC/LOOKUP place it: an offset, or its byte extents."""
    return [(place, size)] if type(place) is int else [tuple(r) for r in place]


# ---------------------------------------------------------------------- store level


class Tiered:
    """A Store over a small pool with an SSD tier in ``path``."""

    def __init__(self, name: str, path: str, pool_blocks: int = 64, ssd_blocks: int = 256,
                 queue_blocks: int = 8, clean_blocks: int = 4, persist: bool = False,
                 workers: int = 2) -> None:
        self.pool = Pool.create(name, pool_blocks * BS, BS)
        self.store = Store(self.pool, StoreConfig(lease_timeout=5.0,
                                                  limits=Limits(max_key_bytes=64,
                                                                max_batch=10_000)))
        self.tier = SsdTier(self.pool, SsdConfig(path=path, size=ssd_blocks * BS,
                                                 block_size=BS, files=1, workers=workers,
                                                 queue_bytes=queue_blocks * BS,
                                                 persist=persist))
        self.woke = threading.Event()
        self.tier.notify = self.woke.set
        self.store.attach_tier(self.tier, clean_target=clean_blocks * BS)
        self.rid = 0

    def idle(self) -> bool:
        t = self.tier
        return not (t._writing or t.reads_in_flight or t._wbatch or t._rbatch
                    or self.store._promoting)

    def drain(self, timeout: float = 10.0) -> None:
        """Run the loop's part until no I/O is in flight."""
        deadline = time.monotonic() + timeout
        while True:
            self.woke.clear()
            self.store.service()
            if self.idle():
                return
            if time.monotonic() > deadline:
                raise AssertionError("SSD I/O did not complete")
            self.woke.wait(0.5)

    def put(self, key: bytes, data: bytes) -> None:
        self.rid += 1
        r = None
        deadline = time.monotonic() + 10
        while r is None:          # deferred while spills make room: as the loop would
            r = self.store.alloc_entries(b"w", self.rid, [key], [len(data)], defer=True)
            if r is None:
                assert time.monotonic() < deadline
                self.woke.wait(0.5)
                self.woke.clear()
                self.store.service()
        offsets, st = r
        assert st == [Status.OK], st
        pos = 0
        for o, n in runs_of(offsets[0], len(data)):      # one run, or several
            self.pool.write(o, data[pos:pos + n])
            pos += n
        assert self.store.commit(b"w", [self.rid]) == []
        self.store.service()

    def get(self, key: bytes) -> bytes | None:
        self.rid += 1
        hold = self.store.read_hold()
        deadline = time.monotonic() + 10
        while not self.store.prepare_read([key], hold):
            assert time.monotonic() < deadline, "promotion did not complete"
            self.woke.wait(0.5)
            self.woke.clear()
            self.store.service()
        offsets, sizes, _ = self.store.lookup(b"r", self.rid, [key], hold)
        self.store.release_hold(hold)
        if sizes[0] < 0:
            return None
        data = b"".join(self.pool.read_bytes(o, n) for o, n in runs_of(offsets[0], sizes[0]))
        self.store.release(b"r", [self.rid])
        return data

    def check(self) -> dict:
        self.drain()
        s = self.store.stats(verify=True)
        assert s["accounting_ok"], s
        assert s["tiers"]["ssd"]["accounting_ok"], s["tiers"]["ssd"]
        return s

    def close(self) -> None:
        self.tier.close()
        self.pool.close()
        self.pool.unlink()


@pytest.fixture
def tiered(shm_name, tmp_path):
    made: list[Tiered] = []

    def make(**kw) -> Tiered:
        t = Tiered(shm_name + f"-{len(made)}", str(tmp_path / f"ssd{len(made)}"), **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        if not t.tier._closed:
            t.close()


def test_spill_and_promote_roundtrip(tiered):
    t = tiered()
    vals = {b"k%d" % i: bytes(value(i, BS * (1 + i % 3) - i)) for i in range(120)}
    for k, v in vals.items():
        t.put(k, v)
    s = t.check()
    assert s["evictions"] > 0 and s["tiers"]["pool"]["drops"] == 0
    assert s["tiers"]["ssd"]["spills"] >= s["evictions"]
    assert all(t.store.exists(list(vals)))
    assert t.store.match_prefix(list(vals)) == len(vals)
    for k, v in vals.items():
        assert t.get(k) == v, k
    s = t.check()
    assert s["tiers"]["ssd"]["hits"] > 0 and s["tiers"]["pool"]["promotions"] > 0
    assert s["pins"] == 0 and s["pending"] == 0


def test_entry_readable_while_its_spill_is_in_flight(tiered, monkeypatch):
    """The blocks of an entry being written are never reused, and it stays readable;
    an ALLOC that needs them is deferred (not refused, not spinning)."""
    gate = threading.Event()
    real = ssd_io.pwritev_all

    def slow(fd, views, offset):
        gate.wait(10)
        real(fd, views, offset)

    monkeypatch.setattr(ssd_io, "pwritev_all", slow)
    t = tiered(pool_blocks=16, clean_blocks=0)
    for i in range(16):
        t.put(b"k%d" % i, bytes(value(i, BS)))
    # pool full: this ALLOC must spill k0 first; the write is held at the gate
    r = t.store.alloc_entries(b"w", 999, [b"new"], [BS], defer=True)
    assert r is None
    assert t.tier._writing
    first = next(iter(t.tier._writing)).key
    assert t.get(first) == bytes(value(int(first[1:]), BS))     # readable from the pool
    assert t.store.alloc_entries(b"w", 999, [b"new"], [BS], defer=True) is None
    gate.set()
    t.drain()
    offsets, st = t.store.alloc_entries(b"w", 999, [b"new"], [BS], defer=True)
    assert st == [Status.OK]
    t.store.abort(b"w", [999])
    for i in range(16):
        assert t.get(b"k%d" % i) == bytes(value(i, BS))
    t.check()


def test_forced_alloc_drops_when_spills_hang(tiered, monkeypatch):
    gate = threading.Event()
    real = ssd_io.pwritev_all
    monkeypatch.setattr(ssd_io, "pwritev_all",
                        lambda fd, views, off: (gate.wait(10), real(fd, views, off)))
    t = tiered(pool_blocks=16, clean_blocks=0, queue_blocks=2)
    for i in range(16):
        t.put(b"k%d" % i, bytes(value(i, BS)))
    assert t.store.alloc_entries(b"w", 1, [b"a"], [4 * BS], defer=True) is None
    offsets, st = t.store.alloc_entries(b"w", 1, [b"a"], [4 * BS], drop=True)
    assert st == [Status.OK]
    s = t.store.stats()
    assert s["tiers"]["pool"]["drops"] >= 1
    gate.set()
    t.store.commit(b"w", [1])
    s = t.check()
    present = sum(t.store.exists([b"k%d" % i for i in range(16)]))
    assert present == 16 - s["tiers"]["pool"]["drops"]


def test_concurrent_lookups_read_once(tiered):
    t = tiered(pool_blocks=16)
    for i in range(40):
        t.put(b"k%d" % i, bytes(value(i, BS)))
    t.drain()
    assert t.tier.has(b"k0")
    h1, h2 = t.store.read_hold(), t.store.read_hold()
    assert not t.store.prepare_read([b"k0", b"k1"], h1)
    assert not t.store.prepare_read([b"k1", b"k0"], h2)
    assert t.tier.reads_in_flight == 2          # one read per key, not per request
    t.drain()
    assert t.store.prepare_read([b"k0", b"k1"], h1)
    assert t.store.prepare_read([b"k1", b"k0"], h2)
    for rid, h in ((1, h1), (2, h2)):
        offsets, sizes, _ = t.store.lookup(b"r", rid, [b"k0", b"k1"], h)
        t.store.release_hold(h)
        assert t.pool.read_bytes(offsets[0], sizes[0]) == bytes(value(0, BS))
        assert t.pool.read_bytes(offsets[1], sizes[1]) == bytes(value(1, BS))
        t.store.release(b"r", [rid])
    s = t.check()
    assert s["tiers"]["pool"]["promotions"] == 2
    assert s["tiers"]["ssd"]["hits"] == 4


def _wait_io_idle(t: Tiered, keys: list[bytes], timeout: float = 10.0) -> None:
    """Run the loop's part until no job holds the SSD blocks of ``keys`` (prefetches
    whose entries were not placed count too)."""
    deadline = time.monotonic() + timeout
    while True:
        t.woke.clear()
        t.store.service()
        ses = [t.tier._only.get(k) for k in keys]
        if t.idle() and all(se is None or se.io == 0 for se in ses):
            return
        assert time.monotonic() < deadline, "SSD I/O did not complete"
        t.woke.wait(0.2)


def test_promotion_read_starts_before_room_and_never_writes_unplaced_blocks(tiered):
    """The disk read of a promotion starts before room is made in the pool; an entry
    that then finds no room is a miss, and its bytes never reach the pool."""
    t = tiered(pool_blocks=16)
    for i in range(40):
        t.put(b"k%d" % i, bytes(value(i, BS)))
    t.drain()
    in_pool = [k for k in (b"k%d" % i for i in range(40)) if k in t.store.index]
    assert len(in_pool) == 16 and t.tier.has(b"k0")
    t.store.lookup(b"pin", 1, in_pool)                  # the whole pool pinned
    before = t.pool.read_bytes(0, 16 * BS)
    hold = t.store.read_hold()
    assert t.store.prepare_read([b"k0"], hold)     # no room: answered now, as a miss
    _wait_io_idle(t, [b"k0"])
    assert t.pool.read_bytes(0, 16 * BS) == before
    assert t.store.lookup(b"r", 2, [b"k0"], hold)[0] == [-1]
    t.store.release_hold(hold)
    s = t.check()
    assert s["tiers"]["ssd"]["checksum_failures"] == 0
    assert s["tiers"]["pool"]["promotions"] == 0 and t.tier.has(b"k0")
    t.store.release(b"pin", [1])
    assert t.get(b"k0") == bytes(value(0, BS))
    t.check()


@pytest.mark.parametrize("depth", [1, 2])
def test_promotion_in_pieces(tiered, monkeypatch, depth):
    """One request promotes many values of mixed sizes, read in small pieces in order
    (the read gate), the same key twice, a key that is nowhere: all bytes right."""
    monkeypatch.setattr(ssd_io, "READ_PIECE_BYTES", 3 * BS)
    monkeypatch.setattr(ssd_io, "READ_DEPTH", depth)
    t = tiered(pool_blocks=128, ssd_blocks=256, workers=3)
    vals = {b"k%d" % i: bytes(value(i, BS * (1 + i % 3) - 7 * i)) for i in range(40)}
    for k, v in vals.items():
        t.put(k, v)
    deadline = time.monotonic() + 10
    while t.store.stats()["num_keys"]:    # EVICT 0: everything written down, then out
        assert time.monotonic() < deadline
        t.store.evict(0.0)
        t.drain()
    keys = list(vals) + [b"k3", b"nowhere"]
    hold = t.store.read_hold()
    deadline = time.monotonic() + 10
    while not t.store.prepare_read(keys, hold):
        assert time.monotonic() < deadline
        t.woke.wait(0.2)
        t.woke.clear()
        t.store.service()
    offsets, sizes, _ = t.store.lookup(b"r", 1, keys, hold)
    t.store.release_hold(hold)
    for k, off, size in zip(keys, offsets, sizes):
        if k == b"nowhere":
            assert off == -1
        else:
            assert t.pool.read_bytes(off, size) == vals[k], k
    t.store.release(b"r", [1])
    s = t.check()
    assert s["tiers"]["pool"]["promotions"] == 40
    assert s["tiers"]["ssd"]["checksum_failures"] == 0


def test_prefetch_not_placed_in_time_falls_back(tiered, monkeypatch):
    """A prefetch whose entries are not placed in time gives up (a safety net); the
    entry is then read the ordinary way, with the right bytes."""
    monkeypatch.setattr(ssd_io, "PLACE_TIMEOUT", 0.2)
    t = tiered(pool_blocks=16)
    for i in range(40):
        t.put(b"k%d" % i, bytes(value(i, BS)))
    t.drain()
    se = t.tier.lookup(b"k1")
    t.tier.reserve(se)
    t.tier.prefetch([se])
    time.sleep(1.0)                       # the worker gave up waiting for a place
    assert t.get(b"k1") == bytes(value(1, BS))
    t.tier.unreserve(se)
    _wait_io_idle(t, [b"k1"])
    t.check()


def test_close_with_prefetches_waiting(tiered, monkeypatch):
    """Closing the tier while prefetches wait (for the disk, or for a place that will
    never come) does not hang."""
    gate = threading.Event()
    real = ssd_io.preadv_all
    monkeypatch.setattr(ssd_io, "preadv_all",
                        lambda fd, views, off: (gate.wait(10), real(fd, views, off)))
    monkeypatch.setattr(ssd_io, "READ_PIECE_BYTES", BS)
    t = tiered(pool_blocks=16)
    for i in range(40):
        t.put(b"k%d" % i, bytes(value(i, BS)))
    t.drain()
    ses = [t.tier.lookup(b"k%d" % i) for i in range(8)]
    for se in ses:
        t.tier.reserve(se)
    t.tier.prefetch(ses)                  # 8 pieces; the first reads wait at the gate
    threading.Timer(0.3, gate.set).start()
    t0 = time.monotonic()
    t.close()
    assert time.monotonic() - t0 < 5


def test_overwrite_delete_purge_drop_the_ssd_copy(tiered):
    t = tiered(pool_blocks=16)
    for i in range(40):
        t.put(b"k%d" % i, bytes(value(i, BS)))
    t.drain()
    assert t.tier.has(b"k0") and t.tier.has(b"k1")
    t.put(b"k0", b"new value")                   # newer put: the SSD copy is stale
    assert not t.tier.has(b"k0")
    assert t.get(b"k0") == b"new value"
    assert t.store.delete([b"k1"]) == 1          # an SSD-only key
    assert t.store.exists([b"k1"]) == [False] and t.get(b"k1") is None
    # a delete while its promotion is in flight: the read is thrown away
    h = t.store.read_hold()
    assert not t.store.prepare_read([b"k2"], h)
    assert t.store.delete([b"k2"]) == 1
    t.drain()
    assert t.store.prepare_read([b"k2"], h)
    offsets, _, _ = t.store.lookup(b"r", 5, [b"k2"], h)
    t.store.release_hold(h)
    assert offsets == [-1]
    s = t.check()
    assert s["tiers"]["ssd"]["stale"] >= 1
    n = t.store.purge()
    assert n == 40 - 2
    s = t.check()
    assert s["num_keys"] == 0 and s["tiers"]["ssd"]["entries"] == 0
    assert s["tiers"]["ssd"]["used_bytes"] == 0 and s["used_bytes"] == 0


def test_ssd_full_drops_oldest_with_exact_accounting(tiered):
    t = tiered(pool_blocks=16, ssd_blocks=48)
    n = 200
    for i in range(n):
        t.put(b"k%d" % i, bytes(value(i, BS)))
    s = t.check()
    present = [i for i in range(n) if t.store.exists([b"k%d" % i])[0]]
    # the newest keys are the ones kept, in LRU order; everything else was dropped
    assert present == list(range(n - len(present), n))
    ssd = s["tiers"]["ssd"]
    assert ssd["drops"] + s["tiers"]["pool"]["drops"] == n - len(present)
    assert s["tiers"]["pool"]["drops"] == 0
    assert ssd["only_entries"] + s["num_keys"] == len(present)
    assert ssd["used_bytes"] <= 48 * BS
    assert len(present) >= 16 + 48 - 8          # pool + SSD, less a small clean margin
    for i in present:
        assert t.get(b"k%d" % i) == bytes(value(i, BS))
    t.check()


def test_random_ops_keep_both_tiers_exact(tiered):
    rng = np.random.default_rng(7)
    t = tiered(pool_blocks=32, ssd_blocks=96, queue_blocks=4)
    truth: dict[bytes, bytes] = {}
    for step in range(1500):
        op = rng.integers(0, 10)
        k = b"k%d" % rng.integers(0, 150)
        if op < 5:
            v = bytes(value(step, int(rng.integers(1, 3 * BS))))
            t.put(k, v)
            truth[k] = v
        elif op < 8:
            got = t.get(k)
            if got is not None:
                assert got == truth[k], k
        elif op < 9:
            t.store.delete([k])
            truth.pop(k, None)
        elif step % 50 == 0:
            t.store.purge()
            truth.clear()
        if step % 100 == 0:
            t.check()
    s = t.check()
    for k in truth:
        got = t.get(k)
        assert got is None or got == truth[k]
    assert s["pins"] == 0


def test_persist_manifest_restart(tiered, tmp_path, shm_name):
    t = tiered(pool_blocks=16, persist=True)
    for i in range(60):
        t.put(b"k%d" % i, bytes(value(i, BS)))
    t.drain()
    on_ssd = [i for i in range(60) if t.tier.has(b"k%d" % i)]
    stored = t.tier.stats()["entries"]       # SSD-only, and copies of pool entries
    path = t.tier.path
    t.close()           # clean stop: writes the manifest
    assert os.path.exists(os.path.join(path, ssd_mod.MANIFEST_NAME))
    pool = Pool.create(shm_name + "-b", 16 * BS, BS)
    try:
        tier = SsdTier(pool, SsdConfig(path=path, size=256 * BS, block_size=BS, files=1,
                                       persist=True))
        try:
            assert tier.stats()["loaded"] == stored >= len(on_ssd) > 0
            assert all(tier.has(b"k%d" % i) for i in on_ssd)
        finally:
            tier.close()
    finally:
        pool.close()
        pool.unlink()
    shutil.rmtree(path)


# ---------------------------------------------------------------------- server level


@pytest.fixture
def server_factory(shm_name, tmp_path):
    made: list[Server] = []

    def make(**kw) -> Server:
        opts = dict(service_port=0, manage_port=None, ipc=False, prealloc_size=1 / 16,
                    shm_name=f"{shm_name}-{len(made)}", ssd_path=str(tmp_path / "ssd"),
                    ssd_size=0.5)
        opts.update(kw)
        srv = Server(**opts).start()
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.stop()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_pool_64mib_ssd_512mib_reads_back_400mib(server_factory, transport):
    srv = server_factory()
    sizes = [MiB, MiB - 12345, 300_000] if transport == "shm" else [MiB, 200_000]
    total = 400 * MiB if transport == "shm" else 120 * MiB
    with Client(srv.address, transport=transport, timeout=30) as c:
        keys, lens, written, i = [], [], 0, 0
        while written < total:
            batch = []
            for _ in range(8):
                n = sizes[i % len(sizes)]
                keys.append(f"v{i}")
                lens.append(n)
                batch.append(value(i, n))
                written += n
                i += 1
            c.put_batch(keys[-8:], batch)
        st = c.stats(verify=True)
        assert st["tiers"]["ssd"]["entries"] > 0 and st["evictions"] > 0
        assert c.match_prefix(keys) == len(keys)
        for j in range(0, len(keys), 16):
            got = c.get_batch(keys[j:j + 16])
            for k, (g, n) in enumerate(zip(got, lens[j:j + 16])):
                assert g is not None, keys[j + k]
                assert np.array_equal(np.frombuffer(g, np.uint8), value(j + k, n)), keys[j + k]
        st = c.stats(verify=True)
    assert st["accounting_ok"] and st["tiers"]["ssd"]["accounting_ok"]
    pool, ssd = st["tiers"]["pool"], st["tiers"]["ssd"]
    assert pool["drops"] == 0 and ssd["drops"] == 0 and ssd["checksum_failures"] == 0
    assert pool["promotions"] > 0 and ssd["hits"] == pool["promotions"]
    assert st["pins"] == 0


def test_async_client_out_of_order_replies(server_factory):
    """Deferred replies: a promoted GET answers after later requests; the AsyncClient
    matches them by request id and every grant is released."""
    import asyncio

    from kvshm.aio import AsyncClient

    srv = server_factory()
    with Client(srv.address, timeout=30) as c:
        for b in range(0, 160, 8):
            c.put_batch([f"a{i}" for i in range(b, b + 8)],
                        [value(i, MiB) for i in range(b, b + 8)])

    async def main() -> None:
        async with AsyncClient(srv.address, timeout=30) as ac:
            tasks = [ac.get_batch([f"a{i}", f"a{i + 1}"]) for i in range(0, 40, 2)]
            tasks += [ac.exists_batch([f"a{i}" for i in range(150, 160)])]
            res = await asyncio.gather(*tasks)
            for j, got in enumerate(res[:-1]):
                for k, g in enumerate(got):
                    assert np.array_equal(np.frombuffer(g, np.uint8), value(2 * j + k, MiB))
            assert all(res[-1])
            await ac.flush()

    asyncio.run(main())
    with Client(srv.address, timeout=30) as c:
        st = c.stats(verify=True)
    assert st["pins"] == 0 and st["grants"] == 0 and st["accounting_ok"]


def test_checksum_failure_is_a_miss_and_counted(server_factory, caplog):
    srv = server_factory(ssd_files=1)
    with Client(srv.address, timeout=30) as c:
        put_many(c, "c", 100)
        c.flush()
        tier = srv.tier
        se = tier._only[b"c0"]
        fd = os.open(tier.files[se.file].path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xff" * 4096, se.start * tier.bs + 8192)   # corrupt it on disk
        finally:
            os.close(fd)
        with caplog.at_level(logging.WARNING, logger="kvshm.tiers.ssd"):
            assert c.get_batch(["c0", "c1"])[0] is None
        assert np.array_equal(np.frombuffer(c.get("c1"), np.uint8), value(1, MiB))
        assert not c.exists("c0")
        st = c.stats(verify=True)
    assert st["tiers"]["ssd"]["checksum_failures"] == 1
    assert st["tiers"]["ssd"]["accounting_ok"]
    assert any("failed its checksum" in r.getMessage() for r in caplog.records)


def test_read_error_is_a_miss_with_a_log_line(server_factory, monkeypatch, caplog):
    srv = server_factory()
    with Client(srv.address, timeout=30) as c:
        put_many(c, "e", 100)

        def eio(fd, views, offset):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(ssd_io, "preadv_all", eio)
        with caplog.at_level(logging.ERROR, logger="kvshm.tiers.ssd"):
            assert c.get_batch(["e0", "e99"]) == [None, bytes(value(99, MiB))]
        monkeypatch.undo()
        assert np.array_equal(np.frombuffer(c.get("e5"), np.uint8), value(5, MiB))
        st = c.stats(verify=True)
    assert st["tiers"]["ssd"]["io_errors"] >= 1 and st["tiers"]["ssd"]["accounting_ok"]
    assert any("read from" in r.getMessage() and "Input/output error" in r.getMessage()
               for r in caplog.records)


def test_write_errors_keep_serving(server_factory, monkeypatch, caplog):
    srv = server_factory(ssd_wait=0.3)

    def eio(fd, views, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ssd_io, "pwritev_all", eio)
    with caplog.at_level(logging.ERROR, logger="kvshm.tiers.ssd"), \
            Client(srv.address, timeout=30) as c:
        for b in range(0, 160, 8):
            c.put_batch([f"w{i}" for i in range(b, b + 8)],
                        [value(i, MiB) for i in range(b, b + 8)])
        got = get_many(c, [f"w{i}" for i in range(160)])
        for i, g in enumerate(got):
            assert g is None or np.array_equal(np.frombuffer(g, np.uint8), value(i, MiB))
        assert got[-1] is not None
        st = c.stats(verify=True)
    assert st["tiers"]["ssd"]["io_errors"] >= 1 and st["tiers"]["pool"]["drops"] > 0
    assert st["accounting_ok"] and st["tiers"]["ssd"]["accounting_ok"]
    assert any("write to" in r.getMessage() for r in caplog.records)


def test_file_removed_under_the_server(server_factory, caplog):
    srv = server_factory(ssd_files=1)
    with Client(srv.address, timeout=30) as c:
        put_many(c, "r", 100)
        c.flush()
        os.unlink(srv.tier.files[0].path)
        with caplog.at_level(logging.ERROR, logger="kvshm.tiers.ssd"):
            srv.tier._next_check = 0           # the next turn checks the files
            got = get_many(c, [f"r{i}" for i in range(100)])
        for i, g in enumerate(got):
            assert g is None or np.array_equal(np.frombuffer(g, np.uint8), value(i, MiB))
        assert got[0] is None and got[-1] is not None
        # still serving: new values go to the pool; evictions now drop them
        put_many(c, "n", 100)
        assert np.array_equal(np.frombuffer(c.get("n99"), np.uint8), value(99, MiB))
        st = c.stats(verify=True)
    assert st["tiers"]["ssd"]["files_disabled"] == 1 and st["tiers"]["ssd"]["entries"] == 0
    assert st["tiers"]["ssd"]["accounting_ok"] and st["accounting_ok"]
    assert any("was removed while in use" in r.getMessage() for r in caplog.records)


def test_tmpfs_directory(server_factory, shm_name, caplog):
    """A tmpfs directory works: O_DIRECT where the kernel allows it there (Linux >= 6.6),
    else buffered I/O with a log line saying so."""
    path = f"/dev/shm/{shm_name}-ssd"
    with caplog.at_level(logging.WARNING, logger="kvshm.tiers.ssd"):
        srv = server_factory(ssd_path=path, ssd_size=0.125)
    said = any("does not allow O_DIRECT" in r.getMessage() for r in caplog.records)
    assert said == (not srv.tier.direct)
    with Client(srv.address, timeout=30) as c:
        put_many(c, "t", 100)
        for i in (0, 50, 99):
            assert np.array_equal(np.frombuffer(c.get(f"t{i}"), np.uint8), value(i, MiB))
    srv.stop()
    assert not os.path.exists(path)


def test_no_o_direct_falls_back_to_buffered_io(server_factory, monkeypatch, caplog):
    """A filesystem that refuses O_DIRECT (EINVAL at open, as tmpfs before Linux 6.6)."""
    real_open = os.open

    def open_no_direct(path, flags, *a, **kw):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", open_no_direct)
    with caplog.at_level(logging.WARNING, logger="kvshm.tiers.ssd"):
        srv = server_factory(ssd_size=0.125)
    monkeypatch.undo()
    assert not srv.tier.direct and "buffered" in srv.ready_line()
    assert any("does not allow O_DIRECT" in r.getMessage() and "buffered I/O" in r.getMessage()
               for r in caplog.records)
    with Client(srv.address, timeout=30) as c:
        put_many(c, "b", 100)
        for i in (0, 50, 99):
            assert np.array_equal(np.frombuffer(c.get(f"b{i}"), np.uint8), value(i, MiB))
        st = c.stats(verify=True)
    assert st["tiers"]["ssd"]["accounting_ok"] and st["tiers"]["ssd"]["direct"] is False


def test_config_errors_name_the_flag(tmp_path):
    with pytest.raises(ConfigError) as ei:
        Server(ssd_size=1.0)
    assert ei.value.option == "ssd_path"
    with pytest.raises(ConfigError) as ei:
        Server(ssd_path=str(tmp_path))
    assert ei.value.option == "ssd_size"
    with pytest.raises(ConfigError) as ei:
        Server(ssd_persist=True)
    assert ei.value.option == "ssd_persist"
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(ConfigError) as ei:
        Server(ssd_path=str(f), ssd_size=1.0)
    assert ei.value.option == "ssd_path"
    r = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--ssd-size", "1",
                        "--service-port", "0", "--no-manage"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--ssd-path" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--ssd-path", str(tmp_path),
                        "--ssd-size", "-1", "--service-port", "0", "--no-manage"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--ssd-size" in r.stderr


def _chattr(path: str, flag: str) -> bool:
    try:
        return subprocess.run(["chattr", flag, path], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def test_read_only_directory(tmp_path, shm_name):
    """At start-up: a clear message, exit 1. While running (persist): the manifest write
    fails with a log line and the server goes on serving."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if not _chattr(str(ro), "+i"):
        pytest.skip("chattr +i is not available here (needs root on ext4/xfs)")
    try:
        r = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--service-port", "0",
                            "--no-manage", "--prealloc-size", "0.0625", "--shm-name",
                            shm_name, "--ssd-path", str(ro), "--ssd-size", "0.125"],
                           capture_output=True, text=True, timeout=60)
    finally:
        _chattr(str(ro), "-i")
    assert r.returncode == 1, r.stderr
    assert f"cannot use SSD directory {ro}" in r.stderr
    assert "Traceback" not in r.stderr

    d = tmp_path / "d"
    with ServerProcess("--ssd-path", str(d), "--ssd-size", "0.25", "--ssd-persist",
                       "--ssd-manifest-interval", "0.2", "--log-level", "INFO",
                       prealloc_size=0.0625, shm_name=shm_name + "-b") as srv:
        assert _chattr(str(d), "+i")
        try:
            with Client(srv.address, timeout=30) as c:
                put_many(c, "m", 100)
                deadline = time.monotonic() + 20
                while c.stats()["tiers"]["ssd"]["manifest_errors"] == 0:
                    assert time.monotonic() < deadline, "no manifest write was tried"
                    c.exists("x")           # a turn of the loop
                    time.sleep(0.1)
                assert np.array_equal(np.frombuffer(c.get("m0"), np.uint8), value(0, MiB))
        finally:
            _chattr(str(d), "-i")
        srv.stop()
    assert "cannot write the manifest" in srv.stderr_text
    shutil.rmtree(d)


def test_second_server_on_the_same_directory_exits_1(tmp_path, shm_name):
    d = str(tmp_path / "d")
    with ServerProcess("--ssd-path", d, "--ssd-size", "0.125", prealloc_size=0.0625,
                       shm_name=shm_name + "-a"):
        r = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--service-port", "0",
                            "--no-manage", "--prealloc-size", "0.0625", "--shm-name",
                            shm_name + "-b", "--ssd-path", d, "--ssd-size", "0.125"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "in use by another kvshm server" in r.stderr
        assert os.path.exists(os.path.join(d, "kvshm-ssd-0.dat"))   # not removed by it
    assert not os.path.exists(d)            # scratch: removed at exit


WRITER = """
import sys, numpy as np, kvshm

def value(i, size):
    a = np.arange(size, dtype=np.uint32)
    return ((a * (2 * i + 1) + i * 7919 + (a >> 8)) & 0xFF).astype(np.uint8)

c = kvshm.Client(sys.argv[1], timeout=30)
i = 0
while True:
    keys = [f"p{j}" for j in range(i, i + 4)]
    c.put_batch(keys, [value(j, 1 << 20) for j in range(i, i + 4)])
    i += 4
    print(i, flush=True)
"""


def test_kill9_mid_spills_then_restart_with_persist(tmp_path, shm_name):
    d = str(tmp_path / "d")
    flags = ("--ssd-path", d, "--ssd-size", "0.25", "--ssd-persist",
             "--ssd-manifest-interval", "0.05", "--ssd-queue", "16")
    srv = ServerProcess(*flags, prealloc_size=0.0625, shm_name=shm_name + "-a")
    w = subprocess.Popen([sys.executable, "-c", WRITER, srv.address],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        written = 0
        while written < 400:          # 400 MiB through a 64 MiB pool: spills all along
            line = w.stdout.readline()
            assert line, w.stderr.read()
            written = int(line)
        with Client(srv.address, timeout=30) as c:
            s = c.stats()["tiers"]["ssd"]
        assert s["manifest_writes"] > 0
        srv.kill()                    # SIGKILL, writes in flight
    finally:
        w.kill()
        w.wait(10)
        w.stdout.close()
        w.stderr.close()
        srv.kill()
        srv.remove_segment()
    with ServerProcess(*flags, prealloc_size=0.0625, shm_name=shm_name + "-b") as srv2:
        with Client(srv2.address, timeout=60) as c:
            st = c.stats()["tiers"]["ssd"]
            assert st["loaded"] > 50
            keys = [f"p{j}" for j in range(written + 8)]
            served = 0
            for j in range(0, len(keys), 16):
                for k, g in enumerate(c.get_batch(keys[j:j + 16])):
                    if g is not None:
                        served += 1
                        assert np.array_equal(np.frombuffer(g, np.uint8),
                                              value(j + k, 1 << 20)), keys[j + k]
            st = c.stats(verify=True)
        assert served > 50
        assert served + st["tiers"]["ssd"]["checksum_failures"] <= st["tiers"]["ssd"]["loaded"]
        assert st["tiers"]["ssd"]["accounting_ok"]
    shutil.rmtree(d)        # persisted files: not left in pytest's temp directories


def test_metrics_per_tier(tmp_path, shm_name):
    with ServerProcess("--ssd-path", str(tmp_path / "d"), "--ssd-size", "0.125",
                       prealloc_size=0.0625, shm_name=shm_name) as srv:
        with Client(srv.address, timeout=30) as c:
            put_many(c, "x", 80)
            c.get("x0")
        body = urllib.request.urlopen(
            f"http://127.0.0.1:{srv.manage_port}/metrics", timeout=10).read().decode()
        stats = urllib.request.urlopen(
            f"http://127.0.0.1:{srv.manage_port}/stats?verify", timeout=10).read().decode()
    for name in ("kvshm_tier_entries", "kvshm_tier_bytes", "kvshm_tier_hits_total",
                 "kvshm_tier_spills_total", "kvshm_tier_promotions_total",
                 "kvshm_tier_drops_total", "kvshm_tier_checksum_failures_total"):
        assert f'{name}{{tier="ssd"}}' in body and f'{name}{{tier="pool"}}' in body, name
    assert '"tiers"' in stats


def test_replay_with_ssd_matches_lru_of_pool_plus_ssd(shm_name, tmp_path):
    from kvshm.replay import ReplayOptions, run_replay

    r = run_replay(ReplayOptions(requests=1500, block_bytes=16 * 1024, pool_gib=1 / 256,
                                 ssd_gib=1 / 32, ssd_path=str(tmp_path / "d"),
                                 progress=False, shm_name=shm_name))
    s = r.summary
    assert s["mismatches"] == 0 and s["errors"] == 0
    assert s["capacity_bytes"] == 4 * MiB + 32 * MiB
    assert abs(s["hit_rate"] - s["lru_hit_rate"]) < 0.01, s
    assert not os.path.exists(tmp_path / "d")


def test_clean_stop_with_persist_keeps_the_whole_cache(tmp_path, shm_name):
    """SIGTERM: the pool's entries are written down too, and a restart serves them all."""
    d = str(tmp_path / "d")
    flags = ("--ssd-path", d, "--ssd-size", "0.25", "--ssd-persist")
    with ServerProcess(*flags, prealloc_size=0.0625, shm_name=shm_name + "-a") as srv:
        with Client(srv.address, timeout=30) as c:
            put_many(c, "s", 120)       # 120 MiB through a 64 MiB pool
        assert srv.stop() == 0
    with ServerProcess(*flags, prealloc_size=0.0625, shm_name=shm_name + "-b") as srv:
        with Client(srv.address, timeout=30) as c:
            assert c.stats()["tiers"]["ssd"]["loaded"] >= 120
            got = get_many(c, [f"s{i}" for i in range(120)])
            for i, g in enumerate(got):
                assert g is not None and np.array_equal(np.frombuffer(g, np.uint8),
                                                        value(i, MiB)), i
            st = c.stats(verify=True)
        assert st["tiers"]["ssd"]["checksum_failures"] == 0
    shutil.rmtree(d)


def test_torn_manifest_is_ignored(tiered, shm_name, caplog):
    t = tiered(pool_blocks=16, persist=True)
    for i in range(40):
        t.put(b"k%d" % i, bytes(value(i, BS)))
    t.drain()
    path = t.tier.path
    t.close()
    mpath = os.path.join(path, ssd_mod.MANIFEST_NAME)
    with open(mpath, "r+b") as f:       # a torn write: the tail is missing
        f.truncate(os.path.getsize(mpath) - 10)
    pool = Pool.create(shm_name + "-b", 16 * BS, BS)
    try:
        with caplog.at_level(logging.WARNING, logger="kvshm.tiers.ssd"), \
                SsdTier(pool, SsdConfig(path=path, size=256 * BS, block_size=BS, files=1,
                                        persist=True)) as tier:
            assert tier.stats(verify=True)["entries"] == 0
            assert tier.stats(verify=True)["accounting_ok"]
        assert any("ignoring manifest" in r.getMessage() for r in caplog.records)
    finally:
        pool.close()
        pool.unlink()
    shutil.rmtree(path)
