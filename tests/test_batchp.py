"""A batch PUT of packed values in one C pass (:func:`kvshm._index.put_packed`, the
shared table's :meth:`IndexWriter.publish_runs`, :meth:`BitmapAllocator.alloc_runs` /
:meth:`free_runs`) against the general path (``KVSHM_FAST_PUT=0``): the same batches give
the same replies, counters, accounting, blocks, LRU order, eviction victims, values and
shared-table bytes; what the C pass does not take (evictions, fragmented free space,
hostile keys and sizes, checksums) it declines before anything changes."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
import zmq

from kvshm import Pool, _index
from kvshm._bitmap import BitmapAllocator
from kvshm._pool import PackedValues
from kvshm._shmindex import IndexWriter, default_slots
from kvshm.index import DEAD
from kvshm.limits import Limits
from kvshm.store import Store, StoreConfig
from kvshm.store import core as store_core
from kvshm.store.outcome import Outcome
from kvshm.zmq_ctrl import router as router_mod
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, decode_reply

BS = 4096
BLOCKS = 256


def _packed(values: list[bytes], per_frame: int) -> PackedValues:
    frames, counts = [], []
    for a in range(0, len(values), per_frame):
        frames.append(b"".join(values[a:a + per_frame]))
        counts.append(len(values[a:a + per_frame]))
    pv = PackedValues.of(frames, counts, [len(v) for v in values])
    assert pv is not None
    return pv


class Twin:
    """A store with a shared table; ``fast`` says which path its PUTs take."""

    def __init__(self, name: str, fast: bool, limits: Limits | None = None) -> None:
        self.fast = fast
        self.name = name
        self.pool = Pool.create(name, BLOCKS * BS, BS)
        self.writer = IndexWriter.create(name + "-index", name + "-reads",
                                         default_slots(BLOCKS), epoch=3, block_size=BS,
                                         num_blocks=BLOCKS, token=b"t" * 16)
        self.store = Store(self.pool, StoreConfig(limits=limits or Limits(
            max_key_bytes=200, max_batch=100_000)))
        self.store.index.attach_shared(self.writer)

    def put(self, keys: list[Any], values: list[bytes], per_frame: int = 7) -> Any:
        store_core.FAST_PUT = self.fast
        try:
            return self.store.put(keys, _packed(values, per_frame))
        finally:
            store_core.FAST_PUT = True

    def state(self) -> dict[str, Any]:
        s = self.store
        entries = [(e.key, e.extents, e.size, e.state, e.pins, e.checksum)
                   for e in s.index.lru()]
        values = {e.key: b"".join(s.pool.read_bytes(o, k) for o, k in e.byte_extents(BS))
                  for e in s.index.lru()}
        with open("/dev/shm/" + self.name + "-index", "rb") as f:
            table = f.read()[4096:]             # the slots and wide records
        ws = self.writer.stats()
        return {"counters": dict(s.counters), "progress": s.progress, "pins": s._pins,
                "pinned": s._pinned_entries, "dead": sorted(e.key for e in s._dead),
                "pending": s._pending, "free": bytes(s.alloc.free_map()),
                "entries": entries, "values": values, "table": table,
                "writer": {k: ws[k] for k in ("live", "tombstones", "slots",
                                               "unpublished", "rebuilds", "phase")}}

    def close(self) -> None:
        self.store.index.detach_shared()
        self.writer.unlink()
        self.pool.close()
        self.pool.unlink()


@pytest.fixture
def twins(shm_name):
    made: list[Twin] = []

    def make(limits: Limits | None = None) -> tuple[Twin, Twin]:
        a = Twin(shm_name + f"-f{len(made)}", True, limits)
        made.append(a)
        b = Twin(shm_name + f"-p{len(made)}", False, limits)
        made.append(b)
        return a, b

    yield make
    for t in made:
        t.close()


@pytest.fixture
def taken(monkeypatch):
    """How many PUTs the C pass answered (not declined)."""
    box = {"n": 0, "declined": 0}
    real = _index.put_packed

    def counting(*a: Any) -> Any:
        r = real(*a)
        box["n" if r is not None else "declined"] += 1
        return r

    monkeypatch.setattr(_index, "put_packed", counting)
    return box


def _both(fast: Twin, slow: Twin, op: str, *args: Any) -> None:
    if op == "put":
        ra = fast.put(*args)
        rb = slow.put(*args)
    else:
        ra = getattr(fast.store, op)(*args)
        rb = getattr(slow.store, op)(*args)
    if op == "pin_for_send":
        ra, rb = [e is not None for e in ra[0]], [e is not None for e in rb[0]]
    assert ra == rb, op
    assert fast.state() == slow.state(), op


@pytest.mark.parametrize("prefetch", [True, False])
def test_random_batches_same_as_the_general_path(twins, taken, monkeypatch, prefetch):
    # prefetch: put_packed's dict-slot prefetch (KVSHM_PUT_PREFETCH), on and off
    monkeypatch.setattr(_index, "PUT_PREFETCH", prefetch)
    fast, slow = twins()
    rnd = random.Random(13)
    for step in range(120):
        r = rnd.random()
        if r < 0.7:
            n = rnd.choice([1, 2, 5, 40, 120])
            keys = [b"k%03d" % rnd.randrange(150) for _ in range(n)]   # repeats
            sizes = [rnd.choice([0, 1, 64, BS - 1, BS, BS + 1, 3 * BS])
                     for _ in range(n)]
            values = [bytes([(step + i) % 256]) * s for i, s in enumerate(sizes)]
            _both(fast, slow, "put", keys, values, rnd.choice([1, 7, 1000]))
        elif r < 0.8:
            _both(fast, slow, "delete", [b"k%03d" % rnd.randrange(150) for _ in range(20)])
        elif r < 0.9:
            # pins on some keys: their overwrite keeps the old value until the unpin
            keys = [b"k%03d" % rnd.randrange(150) for _ in range(5)]
            ea, _ = fast.store.pin_for_send(keys)
            eb, _ = slow.store.pin_for_send(keys)
            assert [e is not None for e in ea] == [e is not None for e in eb]
            assert fast.state() == slow.state()
            fast.pinned = [e for e in ea if e is not None]      # type: ignore[attr-defined]
            slow.pinned = [e for e in eb if e is not None]      # type: ignore[attr-defined]
        else:
            for t in (fast, slow):
                t.store.unpin(getattr(t, "pinned", []))
                t.pinned = []                                   # type: ignore[attr-defined]
            assert fast.state() == slow.state()
    assert taken["n"] > 20 and taken["declined"] > 5     # both ways were exercised


def test_overwrite_keeps_a_pinned_old_value_readable(twins, taken):
    fast, slow = twins()
    keys = [b"a", b"b", b"c"]
    _both(fast, slow, "put", keys, [b"1" * 10, b"2" * 10, b"3" * 10])
    olds = []
    for t in (fast, slow):
        es, _ = t.store.pin_for_send([b"b"])
        olds.append(es[0])
    _both(fast, slow, "put", keys, [b"x", b"y", b"z"])
    for t, e in zip((fast, slow), olds):
        assert e.state == DEAD and t.store.view(e).tobytes() == b"2" * 10
        assert t.store.index.get(b"b") is not e
    assert fast.state() == slow.state()
    for t, e in zip((fast, slow), olds):
        t.store.unpin([e])
    assert fast.state() == slow.state()
    assert taken["n"] == 2


def test_duplicate_keys_in_one_batch(twins, taken):
    fast, slow = twins()
    _both(fast, slow, "put", [b"d", b"e", b"d", b"d"], [b"1", b"2", b"3", b"4" * 5000])
    assert fast.store.view(fast.store.index.get(b"d")).tobytes() == b"4" * 5000
    assert taken["n"] == 1


def test_a_full_pool_evicts_the_same_victims(twins, taken):
    fast, slow = twins()
    keys = [b"v%03d" % i for i in range(BLOCKS)]
    # fill the pool (fast: fits), then a batch that needs evictions (declined: general)
    _both(fast, slow, "put", keys[:200], [b"x" * 100] * 200)
    _both(fast, slow, "pin_for_send", keys[:3])       # the oldest pinned: skipped
    _both(fast, slow, "put", keys[200:], [b"y" * BS] * 56 + [b"z" * 2 * BS] * 0)
    _both(fast, slow, "put", [b"w%d" % i for i in range(30)], [b"w" * 2 * BS] * 30)
    assert fast.store.counters["evictions"] > 0
    assert taken["n"] >= 2 and taken["declined"] >= 1


def test_fragmented_free_space_declines_and_changes_nothing(twins, taken):
    fast, slow = twins()
    keys = [b"f%03d" % i for i in range(BLOCKS)]
    _both(fast, slow, "put", keys, [b"f"] * BLOCKS)
    _both(fast, slow, "delete", keys[::2])           # 128 free blocks, none adjacent
    before = fast.state()
    store_core.FAST_PUT = True
    r = _index.put_packed(fast.store, [b"big"], _packed([b"b" * 3 * BS], 1),
                          [3 * BS], Outcome.OK)
    assert r is None and fast.state() == before      # declined: nothing changed
    # the general path places it in several runs, and both stores agree
    _both(fast, slow, "put", [b"s", b"big", b"t"], [b"s", b"b" * 3 * BS, b"t"])
    assert fast.store.index.get(b"big").nruns > 1
    # an overwrite of a value in several runs by the C pass frees all its runs
    _both(fast, slow, "put", [b"big"], [b"c" * 10])
    assert taken["n"] >= 1


@pytest.mark.parametrize("keys", [
    [b"a", 12, b"b"], [b"a", "str", b"b"], [b"a", None], [b""], [b"a", b"x" * 201],
    [b"a", bytearray(b"b")],
])
def test_hostile_keys_same_statuses(twins, taken, keys):
    fast, slow = twins()
    _both(fast, slow, "put", [b"a", b"b"], [b"old-a", b"old-b"])
    n0 = taken["n"]
    _both(fast, slow, "put", keys, [b"v%d" % i for i in range(len(keys))])
    assert taken["n"] == n0                           # declined before any change


def test_too_large_and_limits_same_statuses(twins, taken):
    fast, slow = twins(Limits(max_key_bytes=8, max_batch=100, max_value_bytes=2 * BS))
    _both(fast, slow, "put", [b"a", b"b"], [b"1", b"2"])
    _both(fast, slow, "put", [b"a", b"toolongkey"], [b"1", b"2"])
    _both(fast, slow, "put", [b"a", b"b"], [b"1", b"2" * (2 * BS + 1)])
    _both(fast, slow, "put", [b"a", b"b"], [b"3", b"4" * (2 * BS)])
    assert taken["n"] == 2 and taken["declined"] == 2


def test_alloc_runs_and_free_runs_as_their_one_run_twins():
    import array

    a, b = BitmapAllocator(100), BitmapAllocator(100)
    counts = array.array("q", [3, 1, 40, 50, 20, 1])
    out = array.array("q", [0] * len(counts))
    assert a.alloc_runs(counts, out) == b.alloc_many(list(counts)).count(-1) == 1
    assert list(out) == b.alloc_many([]) + [0, 3, 4, 44, -1, 94]
    with pytest.raises(ValueError):
        a.alloc_runs(array.array("q", [1, 0]), array.array("q", [0, 0]))
    with pytest.raises(ValueError):
        a.alloc_runs(counts, array.array("q", [0]))
    st = array.array("q", [0, 4])
    ct = array.array("q", [3, 40])
    with pytest.raises(ValueError):                    # overlaps: nothing freed
        a.free_runs(array.array("q", [0, 1]), array.array("q", [3, 1]))
    with pytest.raises(ValueError):                    # not allocated: nothing freed
        a.free_runs(array.array("q", [0, 95]), array.array("q", [3, 1]))
    assert a.num_free == 100 - 95
    a.free_runs(st, ct)
    b.free(0, 3)
    b.free(4, 40)
    assert a.free_map() == b.free_map()


def test_install_entries_runs_write_what_lists_write(shm_name, monkeypatch):
    # install_entries (the general PUT, COMMIT) hands a plain batch to the shared table as
    # C arrays (publish_runs, INSTALL_RUNS) and any other (checksums, several runs) as
    # lists: the same entries, counters, freed blocks and table bytes as the lists always
    a = Twin(shm_name + "-ra", False)
    b = Twin(shm_name + "-rb", False)
    try:
        rnd = random.Random(11)
        for step in range(6):
            keys = [b"k%03d" % rnd.randrange(60) for _ in range(rnd.randrange(2, 40))]
            vals = [bytes([step]) * rnd.randrange(0, 3 * BS) for _ in keys]
            sums = None
            if step == 3:
                sums = [rnd.randrange(1 << 64) for _ in keys]   # checksums: the lists
            if step == 2:
                pin = keys[0]           # an old value pinned across the overwrite
                for t in (a, b):
                    t.store.lookup(b"s", 1, [pin])
            for t, runs in ((a, True), (b, False)):
                monkeypatch.setattr(_index, "INSTALL_RUNS", runs)
                st = t.store.put(keys, vals, sums)
                assert all(x == 0 for x in st)
            assert a.state() == b.state()
    finally:
        a.close()
        b.close()


def test_publish_runs_writes_what_publish_many_writes(shm_name):
    ws = [IndexWriter.create(shm_name + f"-{i}", shm_name + f"-r{i}", 1 << 12, epoch=1,
                             block_size=BS, num_blocks=1 << 12, token=b"t" * 16)
          for i in range(2)]
    import array
    try:
        rnd = random.Random(5)
        for _ in range(4):
            keys = [b"p%04d" % rnd.randrange(3000) for _ in range(2500)]
            keys[3] = b"x" * 200                        # too long: not published
            sizes = [rnd.randrange(10_000) for _ in keys]
            starts = [rnd.randrange(1 << 20) for _ in keys]
            counts = [rnd.randrange(1, 9) for _ in keys]
            r0 = ws[0].publish_many(keys, sizes, [((s, c),) for s, c in zip(starts, counts)])
            r1 = ws[1].publish_runs(keys, array.array("q", sizes), array.array("q", starts),
                                    array.array("q", counts))
            assert r0 == r1 == 1
            ws[0].unpublish(keys[0])
            ws[1].unpublish(keys[0])
            tabs = []
            for i in range(2):
                with open(f"/dev/shm/{shm_name}-{i}", "rb") as f:
                    tabs.append(f.read()[4096:])
            assert tabs[0] == tabs[1]
            assert ws[0].unpublished == ws[1].unpublished
        with pytest.raises(TypeError):
            ws[1].publish_runs([b"a", "b"], array.array("q", [1, 1]),
                               array.array("q", [1, 1]), array.array("q", [1, 1]))
        with pytest.raises(ValueError):
            ws[1].publish_runs([b"a"], array.array("q", [1]), array.array("q", [1 << 33]),
                               array.array("q", [1]))
        with pytest.raises(ValueError):
            ws[1].publish_runs([b"a"], array.array("q", [1, 2]), array.array("q", [1]),
                               array.array("q", [1]))
    finally:
        for w in ws:
            w.unlink()


# ------------------------------------------------------------------ through the router


def _loop_replies(name: str, fast: bool, script: list[tuple[dict[str, Any], list[bytes]]]
                  ) -> tuple[list[Any], dict[str, Any]]:
    ctx = zmq.Context()
    pool = Pool.create(name, 512 * BS, BS)
    store = Store(pool, StoreConfig(limits=Limits(max_batch=100_000, max_key_bytes=64)))
    loop = router_mod.ServiceLoop(store, ["tcp://127.0.0.1:0"],
                                  {"version": PROTOCOL_VERSION}, 7, context=ctx,
                                  slice_keys=64)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(loop.endpoints[0])
    out = []
    store_core.FAST_PUT = fast
    try:
        for rid, (body, frames) in enumerate(script, 1):
            head = msgpack.packb([PROTOCOL_VERSION, int(Op.PUT), rid, 7, body],
                                 use_bin_type=True)
            sock.send_multipart([head, *frames])
            for _ in range(4000):
                loop.turn(5)
                if sock.poll(0):
                    break
            else:
                raise AssertionError("no reply")
            parts = sock.recv_multipart()
            out.append((decode_reply(parts[0]), parts[1:]))
        stats = store.stats()
        got = [store.view(e).tobytes() if e.nruns == 1 else None for e in store.index.lru()]
        return out, {"stats": stats, "values": got, "counters": dict(store.counters)}
    finally:
        store_core.FAST_PUT = True
        sock.close(0)
        loop.close()
        ctx.term()
        pool.close()
        pool.unlink()


def test_hostile_frames_same_replies_through_the_router(shm_name, taken):
    keys = [b"r%04d" % i for i in range(300)]        # > slice_keys: served in slices
    vals = [bytes([i % 256]) * (i % 70) for i in range(300)]
    script: list[tuple[dict[str, Any], list[bytes]]] = [
        ({"keys": keys, "sizes": [len(v) for v in vals], "counts": [300]},
         [b"".join(vals)]),
        ({"keys": keys[:3], "sizes": [1, 2, 3], "counts": [3]}, [b"abcdef"]),
        ({"keys": [b"a", 12, b"b"], "sizes": [1, 1, 1], "counts": [3]}, [b"xyz"]),
        ({"keys": [b"a", b""], "sizes": [1, 1], "counts": [2]}, [b"xy"]),
        ({"keys": [b"a", b"k" * 65], "sizes": [1, 1], "counts": [2]}, [b"xy"]),
        ({"keys": [b"a", b"b"], "sizes": [1, 5], "counts": [2]}, [b"xy"]),
        ({"keys": [b"a", b"b"], "sizes": [1, -1], "counts": [2]}, [b"x"]),
        ({"keys": [b"a", b"b"], "sizes": [1, "1"], "counts": [2]}, [b"xy"]),
        ({"keys": [b"a", b"b"], "sizes": [1, 1], "counts": [1, 1]}, [b"x", b"y"]),
        ({"keys": [b"a", b"b"], "sizes": [1, 1], "counts": [3]}, [b"xy"]),
        ({"keys": [b"a", b"b"], "sizes": [1, 1], "counts": [2], "sums": [1]}, [b"xy"]),
        ({"keys": [b"a", b"b"], "sizes": [1, 1], "counts": [2], "sums": [1, 2]}, [b"xy"]),
        ({"keys": [b"a", b"b"], "sizes": [1], "counts": [2]}, [b"xy"]),
        ({"keys": keys[::-1], "sizes": [len(v) for v in vals][::-1], "counts": [150, 150]},
         [b"".join(vals[::-1][:150]), b"".join(vals[::-1][150:])]),
        ({"keys": [b"big"] + keys[:2], "sizes": [600 * BS, 1, 1], "counts": [3]},
         [b"b" * (600 * BS) + b"xy"]),
    ]
    fast = _loop_replies(shm_name + "-a", True, script)
    n = taken["n"]
    slow = _loop_replies(shm_name + "-b", False, script)
    assert fast == slow
    assert n >= 8 and taken["n"] == n              # the C pass served the plain ones


# ------------------------------------------------------------------ the client's header


_EDGE_INTS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
              2**64 - 1, -1, -32, -33, -128, -129, -32768, -32769, -2**31, -2**31 - 1,
              -2**63]


def _scalar(rnd: random.Random) -> Any:
    r = rnd.random()
    if r < 0.3:
        return rnd.choice(_EDGE_INTS)
    if r < 0.5:
        return bytes(rnd.randrange(256) for _ in range(rnd.choice([0, 1, 31, 32, 255])))
    if r < 0.55:
        return rnd.choice([b"x" * 256, b"y" * 65535, b"z" * 65536])
    if r < 0.7:
        return "".join(rnd.choice("ab\u00e9\u4e2d") for _ in range(rnd.choice([0, 5, 31, 32, 300])))
    if r < 0.8:
        return rnd.choice([None, True, False])
    return rnd.randrange(-10**6, 10**6)


def test_pack_request_is_msgpack_byte_for_byte():
    from kvshm import _batch

    rnd = random.Random(21)
    for _ in range(300):
        body: dict[Any, Any] = {}
        for j in range(rnd.choice([0, 1, 3, 15, 16, 17])):
            body[f"f{j}"] = ([_scalar(rnd) for _ in range(rnd.choice([0, 1, 15, 16, 70]))]
                             if rnd.random() < 0.5 else _scalar(rnd))
        head = (1, rnd.choice([1, 200, 70000]), rnd.choice(_EDGE_INTS[:10]), 2**40)
        want = msgpack.packb([*head, body], use_bin_type=True)
        got = _batch.pack_request(*head, body)
        assert got is None or got == want
        if all(not (type(v) is int and v >= 2**63) and
               not (type(v) is list and any(type(x) is int and x >= 2**63 for x in v))
               for v in body.values()):
            assert got == want
    big = {"keys": [b"k%06d" % i for i in range(70000)], "sizes": [64] * 70000,
           "counts": [70000]}
    assert _batch.pack_request(1, 4, 9, 3, big) == msgpack.packb([1, 4, 9, 3, big],
                                                                  use_bin_type=True)


@pytest.mark.parametrize("body", [
    {1: b"a"}, {"a": 1.5}, {"a": (1, 2)}, {"a": [[1]]}, {"a": {"b": 1}}, {"a": [1.0]},
    {"a": bytearray(b"x")}, {"a": [memoryview(b"x")]}, {"a": "\ud800"}, {"a": [2**64]},
    [b"a"], {"a": Op.PUT},
])
def test_pack_request_declines_what_msgpack_must_pack(body):
    from kvshm import _batch
    from kvshm.zmq_ctrl.protocol import encode_request

    assert _batch.pack_request(1, 4, 9, 3, body) is None
    try:
        want = msgpack.packb([PROTOCOL_VERSION, int(Op.PUT), 9, 3, body], use_bin_type=True)
    except Exception as exc:                             # the same error either way
        with pytest.raises(type(exc)):
            encode_request(Op.PUT, 9, 3, body)
    else:
        assert encode_request(Op.PUT, 9, 3, body) == want


# ------------------------------------------------------------------ the server's decode


def _decode_all(head: bytes, budget: int, fast: bool, monkeypatch) -> Any:
    from kvshm import _batch
    from kvshm.zmq_ctrl import protocol

    monkeypatch.setattr(protocol, "_scan_plain", _batch.scan_plain if fast else None)
    try:
        d = protocol.RequestDecoder(head)
        for _ in range(100_000):
            r = d.step(budget)
            if r is not None:
                return ("ok", r)
        raise AssertionError("never done")
    except protocol.DecodeError as exc:
        return ("error", str(exc))


def test_decode_of_plain_runs_same_as_item_by_item(monkeypatch):
    rnd = random.Random(8)
    items = [lambda: b"k" * rnd.choice([0, 1, 255, 256, 70000]), lambda: rnd.choice(_EDGE_INTS),
             lambda: None, lambda: True, lambda: "s\u00e9", lambda: 1.5, lambda: [1, b"x"],
             lambda: {"a": 1}]
    for case in range(150):
        n = rnd.choice([0, 15, 16, 17, 100, 3000])
        plain = rnd.random() < 0.5
        arr = [rnd.choice(items[:4] if plain else items)() for _ in range(n)]
        body = {"keys": arr, "sizes": list(range(n)), "x": 3}
        head = msgpack.packb([PROTOCOL_VERSION, 4, 1, 7, body], use_bin_type=True)
        cut = rnd.random()
        if cut < 0.3:
            head = head[:rnd.randrange(len(head))]          # truncated somewhere
        elif cut < 0.4:
            head = head + b"\x01"                           # extra data
        elif cut < 0.5 and len(head) > 40:
            i = rnd.randrange(20, len(head))                # a byte changed
            head = head[:i] + bytes([rnd.randrange(256)]) + head[i + 1:]
        budget = rnd.choice([16, 17, 64, 4096])
        assert _decode_all(head, budget, True, monkeypatch) == \
            _decode_all(head, budget, False, monkeypatch), case


def test_scan_plain_bounds():
    from kvshm import _batch

    b = msgpack.packb([b"ab", 300, None, True, -5, b"x" * 300], use_bin_type=True)
    assert _batch.scan_plain(b, 1, 6) == len(b)
    assert _batch.scan_plain(b, 1, 7) == -1                  # past the end
    assert _batch.scan_plain(b[:-1], 1, 6) == -1             # truncated bin
    assert _batch.scan_plain(b, 1, 0) == 1
    assert _batch.scan_plain(b, -1, 1) == -1
    assert _batch.scan_plain(b, len(b) + 1, 1) == -1
    assert _batch.scan_plain(msgpack.packb(["s"]), 1, 1) == -1   # a str: item by item
    assert _batch.scan_plain(b"\xc6\xff\xff\xff\xff", 0, 1) == -1


def test_packed_values_of_declines_sizes_it_cannot_hold():
    # PackedValues.of checks sizes with C compares: past 64 bits, negative, not an exact
    # int: declined (None) as before, never raised
    assert PackedValues.of([b"ab"], [2], [1, 1]) is not None
    for bad in (2**63, 2**70, -1, -2**70, True, 1.0, None):
        assert PackedValues.of([b"ab"], [2], [1, bad]) is None, bad


@pytest.mark.parametrize("items", [
    [0] * 70000,                                    # over one 0xFFFF chunk
    [0, 1, 127] * 3000,
    [0] * 5000 + [128] + [0] * 5000,                # not a fixint: msgpack packs it
    [0] * 5000 + [-1] + [0] * 5000,
    [0] * 5000 + [True] + [0] * 5000,               # a bool is not an int to msgpack
    [0] * 5000 + [2**40] + [0] * 5000,
    [0] * 5000 + [None, b"x", 1.5] + [0] * 5000,
    [5] * 20000 + [[1, 2]] + [6] * 3,
])
def test_reply_encoder_fixints_same_bytes_as_msgpack(monkeypatch, items):
    # ReplyEncoder's C packing of small-int chunks (KVSHM_FAST_REPLY) against msgpack's:
    # the same header bytes, for every budget, with the switch on and off
    from kvshm._batch import pack_fixints
    from kvshm.zmq_ctrl import protocol

    body = {"st": items, "n": 3}
    want = msgpack.packb([PROTOCOL_VERSION, 0, 77, body], use_bin_type=True)
    for fn in (pack_fixints, None):
        monkeypatch.setattr(protocol, "_pack_fixints", fn)
        for budget in (1, 7, 8192, 10**6):
            enc = protocol.ReplyEncoder(0, 77, body)
            h = None
            while h is None:
                h = enc.step(budget)
            assert h == want, (fn, budget)


def test_pack_fixints_bounds_and_declines():
    from kvshm._batch import pack_fixints

    v = [1, 2, 3]
    assert pack_fixints(v, 0, 3) == b"\x01\x02\x03"
    assert pack_fixints(v, 1, 2) == b"\x02" and pack_fixints(v, 3, 3) == b""
    for a, b in ((-1, 2), (2, 1), (0, 4), (4, 4)):
        assert pack_fixints(v, a, b) is None
    assert pack_fixints([1, False], 0, 2) is None


def test_pack_fixints_takes_the_stores_outcomes():
    # a PUT's reply statuses are Outcome members (an IntEnum): packed in C by value, the
    # bytes msgpack writes for them (they went the msgpack way before: ~4% of a batch
    # PUT's server CPU); an int subclass out of range still declines
    import enum

    from kvshm._batch import pack_fixints
    from kvshm.store import Outcome

    v = [Outcome.OK] * 3 + [Outcome.POOL_FULL, Outcome.INVALID_KEY, 7]
    assert pack_fixints(v, 0, len(v)) == msgpack.packb(v)[1:]

    class Big(enum.IntEnum):
        X = 300

    assert pack_fixints([Outcome.OK, Big.X], 0, 2) is None
    assert pack_fixints([Outcome.OK, True], 0, 2) is None


def test_unpack_hands_odd_sizes_to_the_slow_path():
    # _batch.unpack checks sizes with C compares: past 64 bits, negative, a bool: slow
    from kvshm import _batch

    def slow(f: Any, c: Any, s: Any) -> str:
        return "slow"

    assert _batch.unpack([b"abc"], [2], [1, 2], slow) == [b"a", b"bc"]
    for bad in (2**64, 2**70, -1, True):
        assert _batch.unpack([b"abc"], [2], [1, bad], slow) == "slow", bad


class _CountingList(list):
    """A grant's entries list that counts the items its slicing copies and its slice
    deletions shift (the work :meth:`Store.settle_some` does on it)."""

    work = 0

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            _CountingList.work += len(range(*i.indices(len(self))))
        return super().__getitem__(i)

    def __delitem__(self, i: Any) -> None:
        if isinstance(i, slice):
            a, b, _ = i.indices(len(self))
            _CountingList.work += len(self) - max(a, b)     # the items after it shift
        super().__delitem__(i)


@pytest.mark.parametrize("how", ["commit", "abort", "release"])
def test_settle_some_of_a_large_grant_in_small_parts_is_linear(shm_name, how):
    # a grant of N entries settled one entry at a time (the router's slices of a COMMIT
    # or RELEASE of a large grant): each entry is copied or moved a bounded number of
    # times in all (``del entries[:n]`` moved the rest each time: N**2 / 2), and the
    # grant ends as one commit / abort / release of it would leave it
    n = 3000
    pool = Pool.create(shm_name, n * BS, BS)
    try:
        store = Store(pool, StoreConfig(limits=Limits(max_key_bytes=200,
                                                      max_batch=100_000)))
        keys = [b"L%05d" % i for i in range(n)]
        sess = store.session_for(b"client")
        if how == "release":
            assert store.put(keys, [b"v%05d" % i for i in range(n)]) == [0] * n
            offsets, sizes, _ = store.lookup(sess, 5, keys)
            assert all(s == 6 for s in sizes)
        else:
            offsets, st = store.alloc_entries(sess, 5, keys, [6] * n)
            assert st == [0] * n
            for i, o in enumerate(offsets):
                pool.write(o, b"v%05d" % i)
        g = sess.grants[5]
        g.entries = _CountingList(g.entries)
        _CountingList.work = 0
        for k in range(n):
            assert store.grant_entries(sess, [5]) == n - k
            assert store.settle_some(sess, 5, how, 1) == 1
        assert 5 not in sess.grants
        # no grant left: -1, but a commit of one committed already is done (0)
        assert store.settle_some(sess, 5, how, 1) == (0 if how == "commit" else -1)
        assert _CountingList.work <= 3 * n, _CountingList.work
        st = store.stats(verify=True)
        assert st["accounting_ok"], st
        assert st["grants"] == 0 and sess.quota.pending == sess.quota.pinned == 0
        assert store._pending == 0
        if how == "abort":
            assert st["num_keys"] == 0 and st["free_blocks"] == n, st
        else:
            assert st["num_keys"] == n, st
            assert all(e.pins == 0 for e in store.index.lru())
            for i in (0, 1, n // 2, n - 1):
                e = store.index.get(keys[i])
                assert pool.read_bytes(e.start * BS, 6) == b"v%05d" % i
            if how == "commit":
                assert store.counters["puts"] == n
                assert store.counters["bytes_in"] == 6 * n
    finally:
        pool.close()
        pool.unlink()


def test_settle_some_in_parts_counts_what_one_commit_counts(shm_name):
    # a large ALLOC grant committed in parts (settle_some, the router's slices; its
    # blocks and bytes summed in C) leaves the same counters, quota and pending counts,
    # entries and table bytes as one COMMIT of it
    a = Twin(shm_name + "-sa", False)
    b = Twin(shm_name + "-sb", False)
    try:
        rnd = random.Random(3)
        keys = [b"g%03d" % i for i in range(30)]
        sizes = [rnd.randrange(0, 3 * BS) for _ in keys]
        for t in (a, b):
            sess = t.store.session_for(b"client")
            offsets, st = t.store.alloc_entries(sess, 9, keys, sizes)
            assert st == [0] * len(keys)
        sa = a.store.session_for(b"client")
        for part in (4, 11, 1, 100):
            assert a.store.settle_some(sa, 9, "commit", part) == min(part, 30 - sum(
                (4, 11, 1, 100)[:(4, 11, 1, 100).index(part)]))
        sb = b.store.session_for(b"client")
        assert b.store.commit(sb, [9]) == []
        assert a.state() == b.state()
        assert sa.quota.pending == sb.quota.pending == 0
        assert a.store._pending == b.store._pending == 0
        assert a.store.counters["bytes_in"] == sum(sizes)
        assert _index.sum_blocks_bytes([]) == (0, 0)
        with pytest.raises(TypeError):
            _index.sum_blocks_bytes([object()])
    finally:
        a.close()
        b.close()
