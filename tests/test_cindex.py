"""The index and the store's per-key loops in C (kvshm/_index.pyx), and the shared table's
batch publish: the same answers, counters, pins and publish order as the per-key paths,
and malformed input refused per key, never a crash."""

from __future__ import annotations

import random
import sys

import pytest

from kvshm import Pool, _index
from kvshm._shmindex import IndexReader, IndexWriter, default_slots
from kvshm.index import DEAD, LIVE, PENDING, Entry, Index
from kvshm.store import Store, StoreConfig
from kvshm.store.outcome import Outcome
from kvshm.zmq_ctrl.protocol import Limits

BS = 4096
EPOCH = 7


@pytest.fixture
def rig(shm_name):
    blocks = 256
    pool = Pool.create(shm_name, blocks * BS, BS)
    writer = IndexWriter.create(shm_name + "-index", shm_name + "-reads",
                                default_slots(blocks), epoch=EPOCH, block_size=BS,
                                num_blocks=blocks, token=pool.token)
    reader = IndexReader(writer.name, writer.reads_name, pool, EPOCH)
    store = Store(pool, StoreConfig(limits=Limits(max_key_bytes=64, max_batch=100_000)))
    store.index.attach_shared(writer)
    yield store, writer, reader
    reader.close()
    store.index.detach_shared()
    writer.unlink()
    pool.close()
    pool.unlink()


def test_entry_fields_and_extents():
    e = Entry(b"k", 5, 2, 7000)
    assert (e.key, e.start, e.nblocks, e.size, e.pins, e.state) == (b"k", 5, 2, 7000, 0,
                                                                   PENDING)
    assert e.checksum is None and e.meta is None
    assert e.extents == ((5, 2),)
    assert e.byte_extents(BS) == [[5 * BS, 7000]]
    m = Entry(b"m", 3, 3, 3 * BS - 1, 99, ((3, 1), (10, 2)))
    assert m.extents == ((3, 1), (10, 2)) and m.checksum == 99
    assert m.nruns == 2 and e.nruns == 1
    assert m.byte_extents(BS) == [[3 * BS, BS], [10 * BS, 2 * BS - 1]]
    m.extents = ((20, 3),)          # relocated into one run
    m.start = 20
    assert m.extents == ((20, 3),) and m.start == 20
    m.state = DEAD
    m.start = -1
    m.extents = ()
    assert m.extents == () and m.byte_extents(BS) == []
    assert "dead" in repr(m) and "-" in repr(m)
    e.meta = object()
    with pytest.raises(TypeError):
        e.size = "big"              # type: ignore[assignment]
    assert len({e, m}) == 2         # hashable by identity (the store's set of dead ones)


def test_index_keeps_lru_order_and_replaces():
    ix = Index()
    a, b, c = (Entry(k, i, 1, 1) for i, k in enumerate((b"a", b"b", b"c")))
    for e in (a, b, c):
        assert ix.insert(e) is None
    assert [e.key for e in ix.lru()] == [b"a", b"b", b"c"]
    a2 = Entry(b"a", 9, 1, 1)
    assert ix.insert(a2) is a       # replaced, and now the youngest
    assert [e.key for e in ix.lru()] == [b"b", b"c", b"a"]
    ix.touch(b"b")
    assert list(ix.keys()) == [b"c", b"a", b"b"]
    c.pins = 1
    assert ix.oldest_unpinned() is a2     # c, pinned, moved to the young end on the way
    assert list(ix.keys()) == [b"a", b"b", b"c"]
    assert ix.remove(b"b") is b and b"b" not in ix and len(ix) == 2
    assert ix.remove(b"b") is None and ix.get(b"zz") is None
    assert set(ix.clear()) == {a2, c} and len(ix) == 0


def test_insert_new_key_one_lookup_keeps_the_refusal_of_a_linked_entry():
    # Index.insert of a new bytes key takes one dict lookup (setdefault); an entry already
    # in an index is still refused before anything changes, under a new key as under an
    # old one, and a str key (not the bytes path) still goes in
    ix, other = Index(), Index()
    a, b = Entry(b"a", 0, 1, 1), Entry(b"b", 1, 1, 1)
    assert ix.insert(a) is None and other.insert(b) is None
    for key in (b"new", b"a"):
        linked = Entry(key, 2, 1, 1)
        other.insert(linked)
        with pytest.raises(ValueError, match="in an index already"):
            ix.insert(linked)
        assert ix.get(b"new") is None and ix.get(b"a") is a
        assert [e.key for e in ix.lru()] == [b"a"] and len(ix) == 1
    s = Entry("s", 3, 1, 1)
    assert ix.insert(s) is None and ix.get("s") is s
    n = Entry(b"n", 4, 1, 1)
    assert ix.insert(n) is None and ix.get(b"n") is n
    assert [e.key for e in ix.lru()] == [b"a", "s", b"n"]


def test_overwrite_keeps_one_key_object_per_key(rig):
    # an overwrite's entry takes the key object the dict already holds: the index keeps
    # one bytes object per key, and a request's (decoded, fresh) key objects go with it
    store, writer, reader = rig
    first = [b"k-%03d" % i for i in range(40)]
    assert store.put(first, [b"v1"] * 40) == [Outcome.OK] * 40
    again = [bytes(bytearray(k)) for k in first]      # equal, other objects
    assert all(a == b and a is not b for a, b in zip(first, again))
    refs = [sys.getrefcount(k) for k in again]
    assert store.put(again, _index_packed([b"v2"] * 40)) == [Outcome.OK] * 40   # C pass
    assert [sys.getrefcount(k) for k in again] == refs      # none kept by the index
    single = bytes(bytearray(first[0]))
    assert store.put([single], [b"v3"]) == [Outcome.OK]     # the general path
    assert sys.getrefcount(single) == 2
    for k in first:
        e = store.index.get(k)
        assert e.key is k and e.state == LIVE
    assert [e.key for e in store.index.lru()] == first[1:] + first[:1]
    assert reader.get(first[0]) == b"v3" and reader.get(first[1]) == b"v2"


def _index_packed(values):
    from kvshm._pool import PackedValues
    pv = PackedValues.of([b"".join(values)], [len(values)], [len(v) for v in values])
    assert pv is not None
    return pv


def test_publish_many_equals_publish(shm_name):
    blocks = 64
    pool = Pool.create(shm_name, blocks * BS, BS)
    w = IndexWriter.create(shm_name + "-index", shm_name + "-reads", default_slots(blocks),
                           epoch=EPOCH, block_size=BS, num_blocks=blocks, token=pool.token)
    r = IndexReader(w.name, w.reads_name, pool, EPOCH)
    try:
        keys = [b"k%d" % i for i in range(40)] + [b"x" * 300, b"k3"]
        runs = [((i, 1),) for i in range(40)] + [((50, 1),), ((60, 1),)]
        sizes = [100 + i for i in range(42)]
        sums = [None] * 41 + [1234]
        assert w.publish_many(keys, sizes, runs, sums) == 1     # the 300-byte key
        assert w.live == 40 and w.unpublished == 1
        assert r.exists_batch([b"k%d" % i for i in range(40)]) == [True] * 40
        with pytest.raises(ValueError):
            w.publish_many([b"a"], [1, 2], [((0, 1),)])
        with pytest.raises(ValueError):
            w.publish_many([b"a"], [1], [((-1, 1),)])
        with pytest.raises(ValueError):
            w.publish_many([b"a"], [1], [((1 << 70, 1),)])
        with pytest.raises(TypeError):
            w.publish_many([b"a"], [1], [(("x", 1),)])
    finally:
        r.close()
        w.unlink()
        pool.close()
        pool.unlink()


def test_put_overwrite_publishes_then_frees(rig):
    store, writer, reader = rig
    keys = [b"key-%d" % i for i in range(50)]
    vals = [bytes([i]) * (i * 100) for i in range(50)]
    assert store.put(keys, vals) == [Outcome.OK] * 50
    # a batch that names one key twice: the last value wins, both old copies freed
    st = store.put(keys + [keys[0]], [b"n" * 10] * 50 + [b"last"])
    assert st == [Outcome.OK] * 51
    assert store.alloc.num_used == 50       # one block each, every old copy freed
    assert writer.live == 50 and len(store.index) == 50
    out = bytearray(4)
    assert reader.get_into(keys[0], out) == 4 and bytes(out) == b"last"
    e = store.index.get(keys[1])
    assert e.state == LIVE and e.pins == 0 and bytes(store.view(e)) == b"n" * 10
    assert store.counters["puts"] == 101


def test_pins_and_counters_batch(rig):
    store, _, _ = rig
    keys = [b"p%d" % i for i in range(20)]
    store.put(keys, [b"v" * 5000] * 20)
    es, sums = store.pin_for_send(keys + [b"nope", 17, None])     # type: ignore[list-item]
    assert es[-3:] == [None, None, None] and sums == [None] * 23
    assert store._pins == 20 and store._pinned_entries == 20
    es2, _ = store.pin_for_send(keys[:5])
    assert store._pins == 25 and store._pinned_entries == 20
    # overwrite while pinned: old entries DEAD, freed only with their last pin
    store.put(keys[:5], [b"w"] * 5)
    assert all(e.state == DEAD for e in es[:5]) and len(store._dead) == 5
    store.unpin(es2)
    assert len(store._dead) == 5 and all(e.start >= 0 for e in es[:5])
    store.unpin([e for e in es if e is not None])
    assert store._dead == set() and all(e.start == -1 for e in es[:5])
    assert store._pins == 0 and store._pinned_entries == 0
    assert store.counters["hits"] == 25 and store.counters["misses"] == 3


def test_lookup_limits_and_extents(shm_name):
    pool = Pool.create(shm_name, 64 * BS, BS)
    try:
        store = Store(pool, StoreConfig(max_client_pinned_bytes=3 * BS))
        store.put([b"a", b"b", b"c"], [b"1" * BS, b"2" * (2 * BS), b"3"])
        offs, sizes, sums = store.lookup(b"s", 1, [b"b", b"a", b"c", b"x"])
        assert sizes[:2] == [2 * BS, BS] and sizes[2] == -2 and sizes[3] == -1
        assert offs[3] == -1 and offs[2] == -1 and isinstance(offs[0], int)
        assert store.counters["quota_refusals"] == 1
        store.release(b"s", [1])
        assert store._pins == 0
        # a value laid over several runs answers byte extents
        e = store.index.get(b"a")
        store.index.relocate(e, ((40, 1),))
        assert store.place(e) == 40 * BS
    finally:
        pool.close()
        pool.unlink()


@pytest.mark.parametrize("key,size,want", [
    (b"", 1, Outcome.INVALID_KEY), (b"x" * 65, 1, Outcome.INVALID_KEY),
    ("str", 1, Outcome.INVALID_KEY), (None, 1, Outcome.INVALID_KEY),
    (b"ok", -1, Outcome.INVALID_REQUEST), (b"ok", True, Outcome.INVALID_REQUEST),
    (b"ok", 1.0, Outcome.INVALID_REQUEST), (b"ok", 1 << 80, Outcome.TOO_LARGE),
    (b"ok", 10 ** 30 * -1, Outcome.INVALID_REQUEST), (b"ok", 0, Outcome.OK),
])
def test_alloc_validation_per_key(rig, key, size, want):
    store, _, _ = rig
    offs, st = store.alloc_entries(b"c", 1, [key, b"fine"], [size, 10])
    assert st == [want, Outcome.OK]
    assert (offs[0] == -1) == (want != Outcome.OK)


def test_pending_quota_and_pool_full(shm_name):
    pool = Pool.create(shm_name, 8 * BS, BS)
    try:
        store = Store(pool, StoreConfig(max_client_pending_bytes=3 * BS))
        offs, st = store.alloc_entries(b"c", 1, [b"a", b"b", b"c", b"d"], [BS, 2 * BS, 1, 1])
        assert st == [Outcome.OK, Outcome.OK, Outcome.QUOTA_EXCEEDED,
                      Outcome.QUOTA_EXCEEDED]
        assert store.counters["quota_refusals"] == 2
        store.abort(b"c", [1])
        assert store.alloc.num_free == 8 and store._pending == 0
        big = Store(pool, StoreConfig())
        for i in range(3):
            assert big.put([b"x%d" % i], [b"z" * (3 * BS)]) == [Outcome.OK]
        assert b"x0" not in big.index and big.counters["evictions"] == 1
        # in one batch: the first two are pending, nothing to evict for the third
        st2 = big.put([b"y%d" % i for i in range(3)], [b"z" * (3 * BS)] * 3)
        assert st2 == [Outcome.OK, Outcome.OK, Outcome.POOL_FULL]
        st3 = big.put([b"huge"], [b"z" * (9 * BS)])
        assert st3 == [Outcome.TOO_LARGE]
    finally:
        pool.close()
        pool.unlink()


def test_random_ops_match_a_python_model(rig):
    """Random puts, gets, deletes and pins against a plain ordered model of the LRU."""
    store, writer, reader = rig
    rnd = random.Random(5)
    model: dict[bytes, bytes] = {}
    pins: list[object] = []
    for step in range(400):
        op = rnd.random()
        ks = [b"r%d" % rnd.randrange(30) for _ in range(rnd.randrange(1, 6))]
        if op < 0.45:
            vs = [bytes([step % 251]) * rnd.randrange(0, 3 * BS) for _ in ks]
            st = store.put(ks, vs)
            for k, v, s in zip(ks, vs, st):
                if s == Outcome.OK:
                    model[k] = v
            # evictions: whatever the store dropped, it dropped least recently used keys
            for k in list(model):
                if k not in store.index:
                    del model[k]
        elif op < 0.75:
            es, _ = store.pin_for_send(ks)
            for k, e in zip(ks, es):
                assert (e is not None) == (k in model)
                if e is not None:
                    assert b"".join(bytes(v) for v in store.views(e)) == model[k]
            hit = [e for e in es if e is not None]
            if rnd.random() < 0.3:
                pins.extend(hit)
            else:
                store.unpin(hit)
        elif op < 0.85:
            store.delete(ks)
            for k in ks:
                model.pop(k, None)
        else:
            store.unpin(pins)       # type: ignore[arg-type]
            pins = []
        assert store._pins == len(pins)
        assert writer.live == len(store.index) == len(model)
    store.unpin(pins)               # type: ignore[arg-type]
    assert store._pins == 0 and store._pinned_entries == 0 and not store._dead
    used = sum(e.nblocks for e in store.index.lru())
    assert store.alloc.num_used == used


def test_helpers_reject_wrong_types(rig):
    store, _, _ = rig
    with pytest.raises(TypeError):
        _index.install_entries(store, [object()])
    for f in (_index.unpin_entries, _index.pin_entries, _index.free_entries,
              _index.install_entries):
        with pytest.raises(TypeError):
            f(store, [None])
        with pytest.raises(TypeError):
            f(store, [None, None])
    with pytest.raises(TypeError):
        store.index.insert(None)
    with pytest.raises(TypeError):
        _index.write_layout([object()], [b"x"], BS)
    assert store._pins == 0


def test_lru_list_iteration_and_view():
    ix = Index()
    es = [Entry(b"k%d" % i, i, 1, 1) for i in range(5)]
    for e in es:
        ix.insert(e)
    it = ix.lru()
    assert next(it) is es[0]
    ix.touch(b"k0")
    with pytest.raises(RuntimeError):
        next(it)
    with pytest.raises(KeyError):
        ix.touch(b"nope")
    it = ix.keys()
    ix.remove(b"k3")
    with pytest.raises(RuntimeError):
        next(it)
    assert list(ix.keys()) == [b"k1", b"k2", b"k4", b"k0"]
    m = ix.mapping
    assert m[b"k1"] is es[1] and b"k3" not in m and len(m) == 4
    assert dict(m) == {e.key: e for e in ix.lru()}
    with pytest.raises(TypeError):
        m[b"x"] = es[3]             # type: ignore[index]
    with pytest.raises(TypeError):
        ix.insert(Entry([1], 0, 1, 1))       # type: ignore[arg-type]   unhashable key
    assert len(ix) == 4 and list(ix.keys()) == [b"k1", b"k2", b"k4", b"k0"]
    # the same entry again: it is the one replaced (as the ordered dict's pop returned)
    assert ix.insert(es[1]) is es[1]
    assert list(ix.keys()) == [b"k2", b"k4", b"k0", b"k1"]
    assert ix.clear() == [es[2], es[4], es[0], es[1]]
    assert list(ix.lru()) == [] and ix.oldest_unpinned() is None
    for e in es:                    # re-used after a clear: links start afresh
        ix.insert(e)
    assert [e.key for e in ix.lru()] == [b"k%d" % i for i in range(5)]
    del ix                          # entries outlive their index
    assert es[2].key == b"k2"
