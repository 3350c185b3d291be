"""The server's batch paths in C: a PUT's packed values read in place
(:class:`kvshm._pool.PackedValues`, :meth:`Pool.write_values`), a GET of small values
planned and copied in C (:func:`kvshm._index.small_frames`, :meth:`Pool.read_groups`),
EXISTS answered from the shared table (:meth:`IndexWriter.contains_many`). Each gives
what the general path gives: the same values, statuses, frames, LRU order and errors."""

from __future__ import annotations

import random

import pytest

import kvshm
from kvshm import Pool, _index
from kvshm._pool import PackedValues
from kvshm._shmindex import IndexWriter, default_slots
from kvshm.store import Store, StoreConfig
from kvshm.store.outcome import Outcome
from kvshm.zmq_ctrl.frames import PACK_BELOW, PACK_FRAME_BYTES
from kvshm.zmq_ctrl.frames import plan as plan_frames
from kvshm.zmq_ctrl.frames import unpack as unpack_frames
from kvshm.zmq_ctrl.protocol import Limits
from servers import ServerProcess

BS = 4096


@pytest.fixture
def rig(shm_name):
    blocks = 512
    pool = Pool.create(shm_name, blocks * BS, BS)
    writer = IndexWriter.create(shm_name + "-index", shm_name + "-reads",
                                default_slots(blocks), epoch=3, block_size=BS,
                                num_blocks=blocks, token=pool.token)
    store = Store(pool, StoreConfig(limits=Limits(max_key_bytes=400, max_batch=100_000)))
    store.index.attach_shared(writer)
    yield store, writer
    store.index.detach_shared()
    writer.unlink()
    pool.close()
    pool.unlink()


def _packed(values, per_frame):
    """Frames, counts and sizes as a client packs ``values`` (``per_frame`` a frame)."""
    frames, counts = [], []
    for a in range(0, len(values), per_frame):
        frames.append(b"".join(values[a:a + per_frame]))
        counts.append(len(values[a:a + per_frame]))
    return frames, counts, [len(v) for v in values]


# ------------------------------------------------------------------ PackedValues


def test_packed_values_read_in_place_as_unpack_gives():
    rnd = random.Random(1)
    values = [bytes(rnd.randrange(256) for _ in range(rnd.randrange(0, 50)))
              for _ in range(40)]
    frames, counts, sizes = _packed(values, 7)
    pv = PackedValues.of(frames, counts, sizes)
    assert pv is not None and len(pv) == 40
    assert [bytes(v) for v in unpack_frames(frames, counts, sizes)] == values
    assert [bytes(pv[i]) for i in range(40)] == values
    assert bytes(pv[-1]) == values[-1] and pv.sizes() == sizes
    part = pv[5:23]
    assert len(part) == 18 and part.sizes() == sizes[5:23]
    assert [bytes(part[i]) for i in range(18)] == values[5:23]
    assert [bytes(v) for v in part[3:6]] == values[8:11]
    assert len(pv[30:10]) == 0 and len(pv[35:100]) == 5
    with pytest.raises(IndexError):
        pv[40]
    with pytest.raises(IndexError):
        part[-19]
    with pytest.raises(ValueError):
        pv[::2]


@pytest.mark.parametrize("frames,counts,sizes", [
    ([b"abc"], [0], []),                       # a count of 0 (a value continued)
    ([b"abc"], [2], [1, 1]),                   # frame longer than its values
    ([b"ab"], [2], [1, 2]),                    # shorter
    ([b"abc", b""], [2], [1, 2]),              # counts and frames differ
    ([b"abc"], [3], [1, 1]),                   # counts add up to more than sizes
    ([b"abc"], [2], [1, 2.0]),                 # a size not an int
    ([b"abc"], [2], [-1, 4]),                  # a negative size that sums right
    ([b"abc"], [True, 1], [1, 2]),             # a count not an int
    ([b"abc"], [1 << 62], [3]),                # a hostile count
    ([12345], [1], [5]),                       # a frame that is no buffer
    ((b"abc",), [1], [3]),                     # not lists
    ([], [], []),
])
def test_packed_values_refuse_what_is_not_plain(frames, counts, sizes):
    assert PackedValues.of(frames, counts, sizes) is None


def test_write_values_copies_checks_then_moves(shm_name):
    pool = Pool.create(shm_name, 8 * BS, BS)
    try:
        pv = PackedValues.of([b"aaabbcccc", b"dd"], [3, 1], [3, 2, 4, 2])
        assert pool.write_values([0, -1, BS, 3 * BS - 1], pv) == 3 + 4 + 2
        assert pool.read_bytes(0, 3) == b"aaa" and pool.read_bytes(BS, 4) == b"cccc"
        assert pool.read_bytes(3 * BS - 1, 2) == b"dd"
        assert pool.read_bytes(3, 2) == b"\0\0"        # -1: not written
        assert pool.write_values([2 * BS], pv[1:2]) == 2
        assert pool.read_bytes(2 * BS, 2) == b"bb"
        with pytest.raises(IndexError):                  # checked before any byte moves
            pool.write_values([5 * BS, -1, 6 * BS, 8 * BS - 1], pv)
        assert pool.read_bytes(5 * BS, 3) == b"\0\0\0"
        with pytest.raises(ValueError):
            pool.write_values([0, 1], pv)
        with pytest.raises(TypeError):
            pool.write_values([0], [b"x"])
    finally:
        pool.close()
        pool.unlink()


def test_read_groups_packs_ranges_into_frames(shm_name):
    pool = Pool.create(shm_name, 4 * BS, BS)
    try:
        pool.write(0, b"0123456789")
        pool.write(BS, b"abcdef")
        out = pool.read_groups([0, BS, 5, BS + 4], [3, 2, 5, 2], [2, 0, 2])
        assert out == [b"012ab", b"", b"56789ef"]
        assert all(type(f) is bytes for f in out)
        assert pool.read_groups([], [], []) == []
        with pytest.raises(ValueError):
            pool.read_groups([0, 1], [1, 1], [1])       # counts short of the ranges
        with pytest.raises(ValueError):
            pool.read_groups([0], [1], [2])
        with pytest.raises(ValueError):
            pool.read_groups([0], [1, 2], [1])
        with pytest.raises(IndexError):
            pool.read_groups([4 * BS - 1], [2], [1])
    finally:
        pool.close()
        pool.unlink()


# ------------------------------------------------------------------ the store


def test_store_put_of_packed_values_equals_put_of_bytes(rig):
    store, writer = rig
    rnd = random.Random(2)
    keys = [b"k%03d" % rnd.randrange(60) for _ in range(120)]      # repeats: overwrites
    values = [bytes([i % 251]) * rnd.randrange(0, 3 * BS) for i in range(120)]
    keys[7] = b""                                                   # refused per key
    frames, counts, sizes = _packed(values, 50)
    st = store.put(keys, PackedValues.of(frames, counts, sizes))
    assert st[7] == Outcome.INVALID_KEY and st.count(Outcome.OK) == 119
    want = {}
    for k, v in zip(keys, values):
        if k:
            want[k] = v
    for k, v in want.items():
        e = store.index.get(k)
        assert store.pool.read_bytes(e.start * BS, e.size) == v
        assert writer.contains_many([k]) == [True]
    # the LRU order is the order the keys were last written, as for a list of bytes
    assert list(store.index.keys()) == list(dict.fromkeys(reversed(
        [k for k in keys if k])))[::-1]
    assert store.exists(list(want) + [b"nope"]) == [True] * len(want) + [False]


def test_store_put_packed_values_over_several_runs(rig):
    store, _ = rig
    # scatter the free blocks: a value of 3 blocks then lies in several runs
    assert store.put([b"f%03d" % i for i in range(512)], [b"x"] * 512) == [Outcome.OK] * 512
    store.delete([b"f%03d" % i for i in range(0, 512, 2)])
    big = bytes(range(256)) * (3 * BS // 256)
    pv = PackedValues.of([b"small" + big], [2], [5, len(big)])
    assert store.put([b"s", b"big"], pv) == [Outcome.OK, Outcome.OK]
    e = store.index.get(b"big")
    assert e.nruns > 1
    got = b"".join(store.pool.read_bytes(o, k) for o, k in e.byte_extents(BS))
    assert got == big


def test_overwrite_that_fails_keeps_the_old_value_packed(shm_name):
    pool = Pool.create(shm_name, 4 * BS, BS)
    try:
        store = Store(pool, StoreConfig())
        assert store.put([b"a"], [b"old" * 10]) == [Outcome.OK]
        e = store.index.get(b"a")
        store.pin_for_send([b"a"])                      # pinned: not evicted
        pv = PackedValues.of([b"xy" + b"z" * (4 * BS)], [2], [2, 4 * BS])
        st = store.put([b"b", b"a"], pv)
        assert st[1] in (Outcome.POOL_FULL, Outcome.TOO_LARGE)
        assert store.index.get(b"a") is e
        assert store.pool.read_bytes(e.start * BS, e.size) == b"old" * 10
        store.unpin([e])
    finally:
        pool.close()
        pool.unlink()


def test_small_frames_plan_as_the_general_path(rig):
    store, _ = rig
    keys = [b"v%d" % i for i in range(30)]
    store.put(keys, [bytes([i]) * (i * 37) for i in range(30)])
    ask = keys[:10] + [b"missing"] + keys[3:5] + keys[10:]
    entries, _ = store.pin_for_send(ask)
    r = _index.small_frames(entries, BS, PACK_BELOW, 2000)
    assert r is not None
    sizes, hits, offs, lens, counts, queued = r
    assert sizes == [e.size if e is not None else -1 for e in entries]
    assert hits == [e for e in entries if e is not None]
    assert [(sum(counts[:j]), c) for j, c in enumerate(counts)] == _plan(
        [e.size for e in hits], 2000)
    assert _plan([e.size for e in hits], PACK_FRAME_BYTES) == plan_frames(
        [e.size for e in hits])
    assert list(offs) == [e.start * BS for e in hits] and list(lens) == [e.size for e in hits]
    frames = store.pool.read_groups(offs, lens, counts)
    assert [bytes(v) for v in unpack_frames(frames, counts, [s for s in sizes if s >= 0])] \
        == [store.pool.read_bytes(e.start * BS, e.size) for e in hits]
    want_q = 0
    i = 0
    for c in counts:
        want_q += -(-sum(e.size for e in hits[i:i + c]) // BS)
        i += c
    assert queued == want_q
    assert _index.small_frames([None, None], BS, PACK_BELOW, PACK_FRAME_BYTES)[4] == []
    store.unpin(hits)
    # a large value, or one of several runs: the general path answers
    store.put([b"large"], [b"L" * 3 * BS])
    e = store.index.get(b"large")
    assert _index.small_frames([e], BS, 3 * BS, PACK_FRAME_BYTES) is None
    store.index.relocate(e, ((100, 1), (200, 2)))
    assert _index.small_frames([e], BS, PACK_BELOW, PACK_FRAME_BYTES) is None


def _plan(sizes, frame_bytes):
    """kvshm.zmq_ctrl.frames.plan's rule for small values, with frames of ``frame_bytes``."""
    groups, start, acc = [], -1, 0
    for i, n in enumerate(sizes):
        if start >= 0 and acc + n > frame_bytes:
            groups.append((start, i - start))
            start = -1
        if start < 0:
            start, acc = i, 0
        acc += n
    if start >= 0:
        groups.append((start, len(sizes) - start))
    return groups


def test_exists_from_the_table_equals_the_dict(rig):
    store, writer = rig
    rnd = random.Random(3)
    keys = [b"e%04d" % i for i in range(300)]
    store.put(keys, [b"v"] * 300)
    store.delete(keys[::3])
    ask = [rnd.choice(keys) for _ in range(500)] + [b"", b"q" * 200, "str", 7, None, (1,)]
    assert writer.unpublished == 0
    want = [type(k) is bytes and k in store.index for k in ask]
    assert store.exists(ask) == want
    assert writer.contains_many(ask) == want
    assert writer.contains_many(tuple(ask)) == want
    # a key the table cannot hold (longer than a slot's key): the dict answers
    long_key = b"L" * 300
    assert store.put([long_key], [b"x"]) == [Outcome.OK]
    assert writer.unpublished == 1
    assert store.exists([long_key, keys[1], keys[0]]) == [True, True, False]
    assert writer.contains_many([long_key]) == [False]


# ------------------------------------------------------------------ over TCP


def test_tcp_batches_of_small_values_over_slices():
    rnd = random.Random(4)
    n = 5000                                        # > slice_keys: served in slices
    keys = [b"t%05d" % i for i in range(n)]
    vals = [bytes([i % 256]) * rnd.randrange(0, 200) for i in range(n)]
    with ServerProcess("--block-size", "4", prealloc_size=0.0625) as srv:
        with kvshm.Client(srv.address, transport="tcp", timeout=60) as c:
            assert c.transport == "tcp"
            c.put_batch(keys, vals)
            c.put_batch(keys[::2], vals[1::2] + vals[-1:] * (len(keys[::2]) - len(vals[1::2])))
            want = dict(zip(keys, vals))
            want.update(zip(keys[::2], vals[1::2] + vals[-1:] * (len(keys[::2])
                                                                 - len(vals[1::2]))))
            ask = keys[::-1] + [b"absent"] + keys[:10]
            got = c.get_batch(ask)
            assert got == [want.get(k) for k in ask]
            assert c.exists_batch(ask) == [k in want for k in ask]
            # checksums travel with the packed values and back with the small frames
            c.put_batch(keys[:3000], vals[:3000], checksum=True)
            assert c.get_batch(keys[:3000] + [b"absent"], verify=True) == \
                vals[:3000] + [None]
            # a batch with a large value among the small ones: the general path
            big = bytes(range(256)) * 1100
            c.put_batch([b"big", b"s1", b"s2"], [big, b"a", b""])
            assert c.get_batch([b"s1", b"big", b"s2", b"absent"]) == [b"a", big, b"", None]


_RACE = r'''
import sys, threading
import numpy as np
from kvshm import Pool
from kvshm._pool import PackedValues

name, BS = sys.argv[1], 4096
pool = Pool.create(name, 64 * BS, BS)
try:
    n, size = 2000, 32 * 1024            # 64 MB copied per call: a long GIL-free loop
    frame = bytes(range(256)) * (n * size // 256)
    pv = PackedValues.of([frame], [n], [size] * n)
    bad = 1 << 46                        # far outside the pool (a wild write on main)
    offs = np.zeros(n, dtype=np.int64)   # the caller's buffer, shared with a thread
    raced = 0
    for attempt in range(20):
        offs[:] = 0
        go = threading.Event()

        def flip():
            go.wait()
            offs[-1] = bad               # runs once write_values releases the GIL

        t = threading.Thread(target=flip)
        t.start()
        go.set()
        try:
            pool.write_values(offs, pv)  # checked 0 everywhere; the copy must use 0
        except IndexError:               # the flip came before the check: fine
            pass
        else:
            raced += offs[-1] == bad
        t.join()
    assert pool.read_bytes(0, size) == frame[:size]
    print("raced", raced)
finally:
    pool.close()
    pool.unlink()
'''


def test_write_values_copies_the_offsets_it_checked(shm_name):
    """Pool.write_values checks the offsets, then copies with the GIL released: a
    caller's int64 buffer that another thread changes meanwhile must not move the copy
    (on main the copy read the changed offset: a write far outside the pool, SIGSEGV).
    Run in a child: a wild write there must not take pytest down."""
    import os
    import subprocess
    import sys

    try:
        r = subprocess.run([sys.executable, "-c", _RACE, shm_name], capture_output=True,
                           text=True, timeout=300, env=dict(os.environ))
    finally:        # a child that crashed left its pool
        if os.path.exists(f"/dev/shm/{shm_name}"):
            os.unlink(f"/dev/shm/{shm_name}")
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.startswith("raced ")
