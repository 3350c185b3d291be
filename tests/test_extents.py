"""Values laid over several block runs (issue 13, part 4): the store, then every mover.

The store places a value in one run when one fits, else in up to MAX_EXTENTS runs, and
evicts only when fewer blocks are free than the value needs; values of several runs must
round-trip byte-exact over shm, TCP and RDMA (the verbs double), and an overwrite that
fails must leave the old value readable.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvshm import Client, Pool, Server
from kvshm.index import MAX_EXTENTS
from kvshm.movers import VIRTUAL_BASE, Layout
from kvshm.store import Store, StoreConfig
from kvshm.zmq_ctrl.frames import FrameLayoutError
from kvshm.zmq_ctrl.frames import unpack as unpack_frames
from kvshm.zmq_ctrl.protocol import Limits, Status
from servers import unique_shm_name

KiB, MiB = 1024, 1 << 20
BS = 4 * KiB


def make_store(nblocks: int, **cfg) -> tuple[Pool, Store]:
    pool = Pool.create(unique_shm_name("extents-"), nblocks * BS, BS)
    return pool, Store(pool, StoreConfig(limits=Limits(max_batch=100_000), **cfg))


@pytest.fixture
def small():
    pool, store = make_store(64)
    yield store
    pool.close()
    pool.unlink()


def val(i: int, size: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def read(store: Store, key: bytes) -> bytes | None:
    """The value through LOOKUP's answer (an offset, or byte extents), pins released."""
    offsets, sizes, _ = store.lookup(b"reader", 1, [key])
    if sizes[0] < 0:
        return None
    place = offsets[0]
    runs = [[place, sizes[0]]] if type(place) is int else place
    assert sum(n for _, n in runs) == sizes[0]
    data = b"".join(store.pool.read_bytes(o, n) for o, n in runs)
    store.release(b"reader", [1])
    return data


def accounting_ok(store: Store) -> bool:
    return store.stats(verify=True)["accounting_ok"]


# --------------------------------------------------------------------- the measured case


def test_a_4mib_put_into_scattered_4kib_holes_evicts_nothing():
    """Half of a 64 MiB pool free in 4 KiB holes (4 KiB blocks): one 4 MiB put evicted
    512 live keys when a value had to be one run; now it evicts none and every key reads
    back byte-exact."""
    nblocks = (64 * MiB) // BS
    pool, store = make_store(nblocks)
    try:
        keys = [b"k%d" % i for i in range(nblocks)]
        assert store.put(keys, [val(i, BS) for i in range(nblocks)]) == [Status.OK] * nblocks
        assert store.alloc.num_free == 0
        assert store.delete(keys[::2]) == nblocks // 2
        assert store.alloc.num_free == nblocks // 2 and store.alloc.largest_free_run == 1
        big = val(10**6, 4 * MiB)
        assert store.put([b"big"], [big]) == [Status.OK]
        assert store.counters["evictions"] == 0
        assert store.exists(keys[1::2]) == [True] * (nblocks // 2)
        assert read(store, b"big") == big
        for i in range(1, nblocks, 2):
            assert read(store, keys[i]) == val(i, BS), i
        assert store.alloc.num_free == nblocks // 2 - (4 * MiB) // BS
        assert accounting_ok(store)
    finally:
        pool.close()
        pool.unlink()


def test_a_put_evicts_only_the_blocks_it_lacks(small):
    # 64 blocks of 1-block values, every 4th deleted: 16 free in holes of 1
    keys = [b"k%d" % i for i in range(64)]
    small.put(keys, [val(i, BS) for i in range(64)])
    small.delete(keys[::4])
    assert small.put([b"v"], [val(99, 20 * BS)]) == [Status.OK]
    # 4 blocks lacking: the 4 oldest live keys went, no more
    assert small.counters["evictions"] == 4
    gone = {k for k in keys if k not in small.index}
    assert gone == set(keys[::4]) | {keys[1], keys[2], keys[3], keys[5]}
    assert read(small, b"v") == val(99, 20 * BS)
    assert accounting_ok(small)


def test_few_runs_without_moving_anything(small):
    # holes of 8 blocks: a 20-block value takes 3 runs, nothing moved or evicted
    keys = [b"k%d" % i for i in range(8)]
    small.put(keys, [val(i, 8 * BS) for i in range(8)])
    small.delete([keys[1], keys[3], keys[5]])
    v = val(7, 20 * BS - 5)
    offsets, st = small.alloc_entries(b"w", 1, [b"v"], [len(v)])
    assert st == [Status.OK]
    runs = offsets[0]
    assert [o for o, _ in runs] == [8 * BS, 24 * BS, 40 * BS]
    assert [n for _, n in runs] == [8 * BS, 8 * BS, 4 * BS - 5]
    pos = 0
    for o, n in runs:
        small.pool.write(o, v[pos:pos + n])
        pos += n
    small.commit(b"w", [1])
    e = small.index.get(b"v")
    assert e.extents == ((8, 8), (24, 8), (40, 4)) and e.nblocks == 20
    assert small.counters["evictions"] == small.counters["relocations"] == 0
    assert small.counters["split_values"] == 1
    assert read(small, b"v") == v
    small.delete([b"v"])                    # frees every run
    assert small.alloc.num_free == 24 and accounting_ok(small)


def test_moves_keep_lru_order_and_skip_pinned_and_pending(small):
    keys = [b"k%d" % i for i in range(64)]
    small.put(keys, [val(i, BS) for i in range(64)])
    small.delete(keys[::2])                 # 32 holes of one block
    small.lookup(b"pinner", 5, [keys[1]])   # block 1 pinned: never moves
    order = list(small.index.keys())
    assert small.put([b"v"], [val(5, 16 * BS)]) == [Status.OK]
    assert small.counters["evictions"] == 0 and small.counters["relocations"] > 0
    assert list(small.index.keys()) == order + [b"v"]      # moved ones kept their place
    assert small.index.get(keys[1]).extents == ((1, 1),)
    assert all(read(small, keys[i]) == val(i, BS) for i in range(1, 64, 2))
    assert read(small, b"v") == val(5, 16 * BS)
    small.release(b"pinner", [5])
    assert accounting_ok(small)


def test_at_most_max_extents_runs(small):
    keys = [b"k%d" % i for i in range(64)]
    small.put(keys, [val(i, BS) for i in range(64)])
    small.delete(keys[::2])
    small.lookup(b"pinner", 1, keys[1::2])  # nothing can move: holes of one block stay
    assert small.put([b"v"], [val(1, (MAX_EXTENTS + 1) * BS)]) == [Status.POOL_FULL]
    assert small.put([b"w"], [val(2, MAX_EXTENTS * BS)]) == [Status.OK]
    assert len(small.index.get(b"w").extents) == MAX_EXTENTS
    assert read(small, b"w") == val(2, MAX_EXTENTS * BS)
    small.release(b"pinner", [1])
    assert accounting_ok(small)


# --------------------------------------------------------------------- failed overwrites


def test_an_overwrite_that_does_not_fit_leaves_the_old_value(small):
    old = val(1, 4 * BS)
    small.put([b"k"], [old])
    fill = [b"f%d" % i for i in range(60)]
    small.put(fill, [val(i, BS) for i in range(60)])
    small.lookup(b"pinner", 1, fill)        # the rest of the pool is pinned
    assert small.put([b"k"], [val(2, 5 * BS)]) == [Status.POOL_FULL]
    offsets, st = small.alloc_entries(b"w", 2, [b"k"], [5 * BS])
    assert st == [Status.POOL_FULL]
    assert read(small, b"k") == old and small.counters["replaced_early"] == 0
    # one that fits in the old value's blocks replaces it, evicting nothing
    new = val(3, 4 * BS)
    assert small.put([b"k"], [new]) == [Status.OK]
    assert read(small, b"k") == new and small.counters["evictions"] == 0
    small.release(b"pinner", [1])
    assert accounting_ok(small)


def test_an_overwrite_refused_by_the_quota_leaves_the_old_value():
    pool, store = make_store(64, max_client_pending_bytes=8 * BS)
    try:
        old = val(1, 4 * BS)
        store.put([b"k"], [old])
        store.put([b"f%d" % i for i in range(60)], [val(i, BS) for i in range(60)])
        offsets, st = store.alloc_entries(b"w", 1, [b"k"], [9 * BS])
        assert st == [Status.QUOTA_EXCEEDED]
        assert read(store, b"k") == old
        assert accounting_ok(store)
    finally:
        pool.close()
        pool.unlink()


def test_an_overwrite_in_a_batch_does_not_spend_another_keys_old_value(small):
    # a and b are both overwritten; the pool is full and pinned but for them. b's new
    # value cannot fit: b's old value must survive, a's replacement goes through.
    a_old, b_old = val(1, 2 * BS), val(2, 2 * BS)
    small.put([b"a", b"b"], [a_old, b_old])
    fill = [b"f%d" % i for i in range(60)]
    small.put(fill, [val(i, BS) for i in range(60)])
    small.lookup(b"pinner", 1, fill)
    a_new = val(3, 2 * BS)
    assert small.put([b"a", b"b"], [a_new, val(4, 3 * BS)]) == [Status.OK,
                                                                 Status.POOL_FULL]
    assert read(small, b"a") == a_new and read(small, b"b") == b_old
    small.release(b"pinner", [1])
    assert accounting_ok(small)


# --------------------------------------------------------------------- pieces


def test_layout_cuts_ranges_at_run_edges():
    lay = Layout()
    v = lay.add([[4096, 100], [0, 50], [9000, 10]])
    assert v >= VIRTUAL_BASE
    assert lay.pieces(v, 160) == [(4096, 100), (0, 50), (9000, 10)]
    assert lay.pieces(v + 90, 20) == [(4186, 10), (0, 10)]
    assert lay.pieces(v + 150, 10) == [(9000, 10)]
    assert lay.pieces(123, 7) == [(123, 7)]             # a pool offset passes unchanged
    w = lay.add([[0, 1], [2, 1]])
    assert w >= v + 160 and lay.pieces(w, 2) == [(0, 1), (2, 1)]
    with pytest.raises(IndexError):
        lay.pieces(v + 150, 11)


def test_frames_of_one_value_in_several_runs():
    got = unpack_frames([b"ab", b"cde", b"f", b"gh"], [1, 0, 0, 1], [6, 2])
    assert [bytes(g) for g in got] == [b"abcdef", b"gh"]
    with pytest.raises(FrameLayoutError):
        unpack_frames([b"ab", b"c"], [0, 1], [2, 1])          # nothing to continue
    with pytest.raises(FrameLayoutError):
        unpack_frames([b"ab", b"c"], [2, 0], [1, 2])          # continues two values
    with pytest.raises(FrameLayoutError):
        unpack_frames([b"ab", b"c"], [1, 0], [4])             # does not add up


# --------------------------------------------------------------------- every mover


def fragment(c: Client, n: int, size: int) -> list[str]:
    """Fill the pool with n values of ``size`` bytes in order, delete every other: holes
    of ``size`` bytes."""
    keys = [f"fill{i}" for i in range(n)]
    for j in range(0, n, 64):
        c.put_batch(keys[j:j + 64], [val(i, size) for i in range(j, min(n, j + 64))])
    c.delete(keys[::2])
    return keys


SIZES = [3 * 64 * KiB + 123, 8 * 64 * KiB, 1 * MiB + 5]   # 4 runs, 8 runs, moves


def check_split_round_trip(writer: Client, readers: list[Client], stats_client: Client
                           ) -> None:
    keys = fragment(writer, 1024, 64 * KiB)      # 64 MiB pool: full, then half in holes
    big = {f"big{n}": val(1000 + n, n) for n in SIZES}
    for k, v in big.items():
        writer.put(k, v, checksum=True)
    st = stats_client.stats()
    assert st["split_values"] >= 2 and st["relocations"] > 0, st
    assert st["evictions"] == 0, st
    for r in readers:
        for k, v in big.items():
            assert r.get(k, verify=True) == v, (r.transport, k)
        got = r.get_batch(list(big), verify=True)
        assert got == list(big.values())
        out = [bytearray(len(v) + 7) for v in big.values()]
        sizes = r.get_batch_into(list(big), out)
        assert [bytes(o[:s]) for o, s in zip(out, sizes)] == list(big.values())
        assert r.get_batch(keys[1:64:2]) == [val(i, 64 * KiB) for i in range(1, 64, 2)]
    assert stats_client.stats(verify=True)["accounting_ok"]


def test_values_of_several_runs_over_shm_and_tcp(shm_name):
    srv = Server(service_port=0, manage_port=None, prealloc_size=0.0625, shm_name=shm_name,
                 block_size=BS // KiB).start()
    try:
        with Client(srv.address, transport="shm") as s, \
                Client(srv.address, transport="tcp") as t:
            assert s.transport == "shm" and t.transport == "tcp"
            check_split_round_trip(s, [s, t], t)
        # the asyncio client shares the same paths
        async def via_aio() -> None:
            from kvshm import AsyncClient

            for transport in ("shm", "tcp"):
                async with AsyncClient(srv.address, transport=transport, timeout=10) as a:
                    v = val(5, 1 * MiB + 77)
                    await a.put(f"aio-{transport}", v)
                    assert await a.get(f"aio-{transport}") == v
                    for n in SIZES:
                        assert await a.get(f"big{n}") == val(1000 + n, n)

        asyncio.run(via_aio())
        # written over TCP, read over both
        with Client(srv.address, transport="tcp") as t, \
                Client(srv.address, transport="shm") as s:
            t.purge()
            check_split_round_trip(t, [t, s], s)
    finally:
        srv.stop()


def test_values_of_several_runs_over_rdma(tmp_path, shm_name):
    from kvshm.rdma import RdmaOptions
    from rdma_double import FakeVerbs

    fabric = tmp_path / "fabric"
    fabric.mkdir()
    sverbs = FakeVerbs(str(fabric))
    cverbs = FakeVerbs(str(fabric))
    srv = Server(rdma_backend=sverbs, service_port=0, manage_port=None,
                 prealloc_size=0.0625, shm_name=shm_name, ipc=False, dev_name="fake0",
                 block_size=BS // KiB).start()
    try:
        with Client(srv.address, transport="rdma", timeout=10,
                    rdma=RdmaOptions(backend=cverbs)) as r, \
                Client(srv.address, transport="tcp") as t:
            assert r.transport == "rdma"
            check_split_round_trip(r, [r, t], t)
    finally:
        srv.stop()
        sverbs.close()
        cverbs.close()
    assert not list(fabric.iterdir())


class Recorder:
    """A one-sided mover over a bytearray standing for the pool; records each call."""

    name = "fake"

    def __init__(self, size: int) -> None:
        self.mem = bytearray(size)
        self.calls: list[tuple[str, list[int], list[int]]] = []

    def write(self, offsets, values, keys):
        self.calls.append(("w", list(offsets), [memoryview(v).nbytes for v in values]))
        for o, v in zip(offsets, values):
            self.mem[o:o + memoryview(v).nbytes] = v

    def read_into(self, offsets, sizes, outs, keys):
        self.calls.append(("r", list(offsets), list(sizes)))
        for o, n, out in zip(offsets, sizes, outs):
            memoryview(out)[:n] = self.mem[o:o + n]

    def read_bytes(self, offsets, sizes, keys):
        return [bytes(self.mem[o:o + n]) for o, n in zip(offsets, sizes)]

    def close(self):
        pass


def test_extent_mover_cuts_at_runs_and_rdma_plans_one_segment_per_run():
    from kvshm.movers import ExtentMover, placed
    from kvshm.rdma.constants import WR_RDMA_WRITE
    from kvshm.rdma.wr import Segment, plan

    rec = Recorder(1000)
    places = [10, [[500, 30], [100, 20], [900, 5]]]     # one run, then three
    mover, offs = placed(rec, places, Layout())
    assert isinstance(mover, ExtentMover) and offs[0] == 10 and offs[1] >= VIRTUAL_BASE
    a, b = b"A" * 7, bytes(range(55))
    mover.write(offs, [a, b], [b"a", b"b"])
    assert rec.calls[-1] == ("w", [10, 500, 100, 900], [7, 30, 20, 5])
    assert bytes(rec.mem[500:530]) + bytes(rec.mem[100:120]) + bytes(rec.mem[900:905]) == b
    assert mover.read_bytes(offs, [7, 55], [b"a", b"b"]) == [a, b]
    out = bytearray(60)
    mover.read_into([offs[1] + 25], [10], [out], [b"b"])   # a range across two runs
    assert rec.calls[-1] == ("r", [525, 100], [5, 5]) and bytes(out[:10]) == b[25:35]
    # the same pieces as the RDMA mover plans them: one work request per run
    segs, pos = [], 0x1000
    for o, n in [(500, 30), (100, 20), (900, 5)]:
        segs.append(Segment(pos, 7, n, 0x9000 + o, 0))
        pos += n
    wrs = plan(segs, opcode=WR_RDMA_WRITE, rkey=1, max_sge=4, max_msg=1 << 20,
               signal_every=8)
    assert sorted((w.remote_addr, w.length) for w in wrs) == [
        (0x9000 + 100, 20), (0x9000 + 500, 30), (0x9000 + 900, 5)]
    # every value in one run: no wrapper, offsets unchanged
    assert placed(rec, [1, 2], Layout()) == (rec, [1, 2])


@pytest.mark.parametrize("layout", ["kv_first", "blocks_first"])
def test_pages_of_several_runs_round_trip(shm_name, layout):
    """Paged and layer-wise paths: pages of 16 KiB into holes of 4 KiB (4 runs each)."""
    from kvshm.layerwise import LayerWriter, prefetch_pages

    srv = Server(service_port=0, manage_port=None, prealloc_size=1 / 64, shm_name=shm_name,
                 block_size=BS // KiB).start()
    shape = (2, 6, 16, 4, 32) if layout == "kv_first" else (6, 2, 16, 4, 32)
    kv = np.random.default_rng(3).standard_normal(shape).astype(np.float32)  # 16 KiB pages
    ids = [4, 0, 5, 2]
    try:
        with Client(srv.address, transport="shm") as s, \
                Client(srv.address, transport="tcp") as t:
            fragment(s, (16 * MiB) // BS, BS)
            s.put_pages([f"p{i}" for i in ids], kv, ids)
            with LayerWriter(s, [[f"l{i}" for i in ids]]) as w:
                w.write(0, kv, ids)
            st = t.stats(verify=True)
            assert st["split_values"] >= 8 and st["evictions"] == 0 and st["accounting_ok"]
            for c in (s, t):
                for prefix in ("p", "l"):
                    out = np.zeros_like(kv)
                    keys = [f"{prefix}{i}" for i in ids]
                    assert c.get_pages_into(keys, out, ids) == [True] * 4
                    sel = (slice(None), ids) if layout == "kv_first" else (ids,)
                    assert np.array_equal(out[sel], kv[sel]), (c.transport, prefix)
            out = np.zeros_like(kv)
            assert prefetch_pages(s, [f"p{i}" for i in ids], out, ids).result(30) == [True] * 4
            sel = (slice(None), ids) if layout == "kv_first" else (ids,)
            assert np.array_equal(out[sel], kv[sel])
    finally:
        srv.stop()


@pytest.mark.parametrize("direct", [None, False])
def test_ssd_tier_spills_and_promotes_values_of_several_runs(shm_name, tmp_path, direct):
    """A value in 4 runs spills to disk (a read of each run) and is promoted back into
    4 other runs (a write into each), byte-exact, O_DIRECT or buffered."""
    import threading

    from kvshm.tiers import SsdConfig, SsdTier

    pool = Pool.create(shm_name, 64 * BS, BS)
    store = Store(pool, StoreConfig(limits=Limits(max_batch=10_000)))
    tier = SsdTier(pool, SsdConfig(path=str(tmp_path), size=512 * BS, block_size=BS,
                                   files=1, workers=2, queue_bytes=64 * BS, direct=direct))
    woke = threading.Event()
    tier.notify = woke.set
    store.attach_tier(tier)

    def drain() -> None:
        for _ in range(200):
            woke.clear()
            store.service()
            if not (tier._writing or tier.reads_in_flight or store._promoting):
                return
            woke.wait(0.5)
        raise AssertionError("SSD I/O did not complete")

    def holes(tag: str) -> list[bytes]:
        """Fill the pool with one-block values, drop every other, pin the rest."""
        keys = [b"%s%d" % (tag.encode(), i) for i in range(64)]
        assert store.put(keys, [val(i, BS) for i in range(64)], drop=True) \
            == [Status.OK] * 64
        store.delete(keys[::2])
        store.lookup(b"pin-" + tag.encode(), 1, keys[1::2])
        return keys

    try:
        holes("a")
        big = val(77, 4 * BS - 100)
        assert store.put([b"big"], [big]) == [Status.OK]
        assert len(store.index.get(b"big").extents) == 4
        store.release(b"pin-a", [1])
        for _ in range(10):                     # spill everything, then evict it
            store.evict(0.0)
            drain()
            if b"big" not in store.index:
                break
        assert b"big" not in store.index and tier.has(b"big")
        holes("b")
        hold = store.read_hold()
        for _ in range(100):
            if store.prepare_read([b"big"], hold):
                break
            drain()
        e = store.index.get(b"big")
        assert e is not None and len(e.extents) == 4, e
        assert read(store, b"big") == big
        store.release_hold(hold)
        store.release(b"pin-b", [1])
        drain()
        s = store.stats(verify=True)
        assert s["accounting_ok"] and s["tiers"]["ssd"]["accounting_ok"], s
        assert s["tiers"]["pool"]["promotions"] >= 1
    finally:
        store.close_tier()
        pool.close()
        pool.unlink()


# --------------------------------------------------------------------- stateful model

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402


class StoreMachine(RuleBasedStateMachine):
    """Puts, overwrites, deletes and pinned readers on a small fragmented pool: every
    live key reads back the bytes last put under it, and every pinned read (even of a
    replaced or deleted value) still reads the bytes it pinned, whatever was split,
    moved or evicted meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool.create(unique_shm_name("extents-sm-"), 64 * BS, BS)
        self.store = Store(self.pool, StoreConfig(limits=Limits(max_batch=100)))
        self.want: dict[bytes, bytes] = {}
        self.pins: dict[int, tuple[list, list, list[bytes]]] = {}  # rid -> what it read
        self.rid = 0
        self.seq = 0

    def teardown(self) -> None:
        self.pool.close()
        self.pool.unlink()

    def _value(self, blocks: int, cut: int) -> bytes:
        self.seq += 1
        return val(self.seq, max(0, blocks * BS - cut))

    @rule(keys=hst.lists(hst.integers(0, 23), min_size=1, max_size=4, unique=True),
          blocks=hst.lists(hst.integers(1, 20), min_size=4, max_size=4),
          cut=hst.integers(0, BS - 1))
    def put(self, keys, blocks, cut):
        ks = [b"k%d" % k for k in keys]
        vs = [self._value(b, cut) for b in blocks[:len(ks)]]
        evicted = self.store.counters["evictions"]
        before = set(self.want)
        st = self.store.put(ks, vs)
        for k, v, s in zip(ks, vs, st):
            if s == Status.OK:
                self.want[k] = v
            else:       # pool full (everything pinned): the old value, if any, stays
                assert s == Status.POOL_FULL
        # only an eviction removes a key here, and never one this put just wrote
        self._forget_evicted(evicted, before)

    @rule(first=hst.integers(24, 40))
    def holes(self, first):
        """16 one-block values, every other one deleted: small holes between live keys."""
        ks = [b"k%d" % k for k in range(first, first + 16)]
        vs = [self._value(1, 0) for _ in ks]
        evicted = self.store.counters["evictions"]
        st = self.store.put(ks, vs)
        for k, v, s in zip(ks, vs, st):
            if s == Status.OK:
                self.want[k] = v
        self.store.delete(ks[::2])
        for k in ks[::2]:
            self.want.pop(k, None)
        self._forget_evicted(evicted, set(self.want) - set(ks))

    @rule(key=hst.integers(0, 23), less=hst.integers(0, 2))
    def put_what_is_free(self, key, less):
        """A value of about the free blocks: split over the holes, or moves to join them."""
        n = self.store.alloc.num_free - less
        if n < 2:
            return
        k = b"k%d" % key
        v = self._value(n, 0)
        evicted = self.store.counters["evictions"]
        before = set(self.want) - {k}
        if self.store.put([k], [v]) == [Status.OK]:
            self.want[k] = v
        self._forget_evicted(evicted, before)

    def _forget_evicted(self, evicted, before):
        gone = [k for k in self.want if k not in self.store.index]
        assert len(gone) <= self.store.counters["evictions"] - evicted
        assert not set(gone) - before
        for k in gone:
            del self.want[k]

    @rule(keys=hst.lists(hst.integers(0, 23), min_size=1, max_size=3, unique=True))
    def delete(self, keys):
        ks = [b"k%d" % k for k in keys]
        self.store.delete(ks)
        for k in ks:
            self.want.pop(k, None)

    @rule(keys=hst.lists(hst.integers(0, 55), min_size=1, max_size=3, unique=True))
    def pin(self, keys):
        self.rid += 1
        ks = [b"k%d" % k for k in keys]
        offsets, sizes, _ = self.store.lookup(b"pinner", self.rid, ks)   # read() is "reader"
        got = [self.want.get(k) if s >= 0 else None for k, s in zip(ks, sizes)]
        assert [s >= 0 for s in sizes] == [k in self.want for k in ks]
        self.pins[self.rid] = (offsets, sizes, got)

    @rule(data=hst.data())
    def release(self, data):
        if self.pins:
            rid = data.draw(hst.sampled_from(sorted(self.pins)))
            self.store.release(b"pinner", [rid])
            del self.pins[rid]

    @invariant()
    def bytes_and_accounting(self):
        assert set(self.store.index.keys()) == set(self.want)
        for k, v in self.want.items():
            assert read(self.store, k) == v, k
        for offsets, sizes, got in self.pins.values():
            for place, size, v in zip(offsets, sizes, got):
                if size < 0:
                    continue
                runs = [[place, size]] if type(place) is int else place
                assert b"".join(self.pool.read_bytes(o, n) for o, n in runs) == v
        assert accounting_ok(self.store)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------- moves and the shared index


def test_moved_entries_are_republished_for_lock_free_readers():
    """A compaction moves live entries and frees their old blocks: a same-host reader of
    the shared index must then find each moved key at its new runs (never the freed
    blocks, which the new value overwrites)."""
    from kvshm._shmindex import IndexReader, IndexWriter, default_slots

    name = unique_shm_name("extents-idx-")
    pool, store = make_store(64)
    writer = IndexWriter.create(name + "-index", name + "-reads", default_slots(64), epoch=5,
                                block_size=BS, num_blocks=64, token=pool.token,
                                misses_final=True)
    store.index.attach_shared(writer)
    reader = IndexReader(writer.name, writer.reads_name, pool, 5)
    try:
        keys = [b"k%d" % i for i in range(64)]
        store.put(keys, [val(i, BS) for i in range(64)])
        store.delete(keys[::2])                       # 32 one-block holes
        assert store.put([b"v"], [val(99, 16 * BS)]) == [Status.OK]
        assert store.counters["relocations"] > 0      # live entries were moved
        for i in range(1, 64, 2):
            assert reader.get(keys[i]) == val(i, BS), keys[i]
        assert reader.get(b"v") == val(99, 16 * BS)
        assert accounting_ok(store)
    finally:
        reader.close()
        store.index.detach_shared()
        writer.unlink()
        pool.close()
        pool.unlink()
