"""The Store on its own (no sockets): grants, leases, LRU, overwrite under pins, accounting."""

from __future__ import annotations

import pytest

from kvshm import Pool
from kvshm.store import Store, StoreConfig
from kvshm.zmq_ctrl.protocol import Limits, Status
from servers import unique_shm_name

BS = 4096


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def pool():
    p = Pool.create(unique_shm_name("store-"), 64 * BS, BS)
    yield p
    p.close()
    p.unlink()


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def store(pool, clock):
    return Store(pool, StoreConfig(lease_timeout=5.0, limits=Limits(max_key_bytes=64,
                                                                    max_batch=1000)),
                 clock=clock)


def put(store, key, data, client=b"c1", rid=[0]):
    rid[0] += 1
    offsets, st = store.alloc_entries(client, rid[0], [key], [len(data)])
    assert st == [Status.OK], st
    store.pool.write(offsets[0], data)
    assert store.commit(client, [rid[0]]) == []
    return offsets[0]


def read(store, key, client=b"r1", rid=100):
    offsets, sizes, _ = store.lookup(client, rid, [key])
    if offsets[0] < 0:
        return None
    data = store.pool.read_bytes(offsets[0], sizes[0])
    store.release(client, [rid])
    return data


def check_accounting(store):
    s = store.stats(verify=True)
    assert s["accounting_ok"], s
    return s


def test_pending_invisible_until_commit(store):
    offsets, st = store.alloc_entries(b"c", 1, [b"k"], [10])
    assert st == [Status.OK]
    assert store.exists([b"k"]) == [False]
    assert store.lookup(b"r", 1, [b"k"])[0] == [-1]
    assert store.match_prefix([b"k"]) == 0
    store.pool.write(offsets[0], b"0123456789")
    assert store.commit(b"c", [1]) == []
    assert store.exists([b"k"]) == [True]
    assert read(store, b"k") == b"0123456789"
    check_accounting(store)


def test_abort_frees(store):
    before = store.alloc.num_free
    store.alloc_entries(b"c", 1, [b"a", b"b"], [BS, 3 * BS])
    assert store.alloc.num_free == before - 4
    store.abort(b"c", [1])
    assert store.alloc.num_free == before
    assert store.stats()["pending"] == 0


def test_overwrite_keeps_pinned_reader_bytes(store):
    put(store, b"k", b"A" * 100)
    offsets, sizes, _ = store.lookup(b"reader", 7, [b"k"])
    old = offsets[0]
    # the writer replaces it many times; the pinned blocks must not be reused
    for i in range(40):
        put(store, b"k", bytes([66 + i % 20]) * 100)
    assert store.pool.read_bytes(old, 100) == b"A" * 100
    s = check_accounting(store)
    assert s["dead"] == 1 and s["pinned"] == 1
    store.release(b"reader", [7])
    s = check_accounting(store)
    assert s["dead"] == 0 and s["pinned"] == 0 and s["pins"] == 0
    assert read(store, b"k") == bytes([66 + 39 % 20]) * 100


def test_delete_while_pinned(store):
    put(store, b"k", b"x" * 10)
    store.lookup(b"r", 1, [b"k"])
    assert store.delete([b"k", b"missing"]) == 1
    assert store.exists([b"k"]) == [False]
    used = store.alloc.num_used
    store.release(b"r", [1])
    assert store.alloc.num_used == used - 1
    check_accounting(store)


def test_lru_evicts_least_recently_read(store):
    # 64 blocks: 8 values of 8 blocks fill the pool
    for i in range(8):
        put(store, b"k%d" % i, bytes([i]) * (8 * BS))
    assert store.alloc.num_free == 0
    read(store, b"k0")            # k0 becomes most recent; k1 is now the oldest
    put(store, b"new", b"n" * (8 * BS))
    assert store.exists([b"k0", b"k1", b"k2"]) == [True, False, True]
    assert store.counters["evictions"] == 1
    check_accounting(store)


def test_pinned_and_pending_never_evicted(store):
    off, st = store.alloc_entries(b"w", 50, [b"p"], [8 * BS])       # pending: blocks 0-7
    assert st == [Status.OK] and off == [0]
    for i in range(4):                                              # blocks 8-39
        put(store, b"k%d" % i, bytes([i]) * (8 * BS))
    store.lookup(b"r", 1, [b"k0"])                                  # pinned, oldest
    # ask for everything that is free plus all unpinned live entries (contiguous)
    offsets, st = store.alloc_entries(b"w", 51, [b"big"], [(64 - 16) * BS])
    assert st == [Status.OK]
    assert store.exists([b"k0", b"k1", b"k2", b"k3"]) == [True, False, False, False]
    # nothing evictable is left: pool full, the store stays consistent
    offsets, st = store.alloc_entries(b"w", 52, [b"more"], [BS])
    assert st == [Status.POOL_FULL] and offsets == [-1]
    assert store.commit(b"w", [50, 51]) == []
    check_accounting(store)


def test_lease_expiry_reclaims_writes_and_pins(store, clock):
    put(store, b"k", b"v" * 100)
    store.alloc_entries(b"dead-writer", 1, [b"x", b"y"], [BS, BS])
    store.lookup(b"dead-reader", 1, [b"k"])
    s = store.stats()
    assert s["pending"] == 2 and s["pinned"] == 1
    clock.t += 4.9
    assert store.expire() is not None
    assert store.stats()["pending"] == 2
    clock.t += 0.2
    assert store.expire() is None
    s = check_accounting(store)
    assert s["pending"] == 0 and s["pinned"] == 0 and s["clients"] == 0
    assert s["lease_expired_writes"] == 1 and s["lease_expired_pins"] == 1
    assert store.commit(b"dead-writer", [1]) == [1]     # too late
    assert store.exists([b"x", b"k"]) == [False, True]


def test_request_validation(store):
    offsets, st = store.alloc_entries(
        b"c", 1, [b"", b"k" * 65, "str", b"ok", b"neg", b"huge"],
        [1, 1, 1, 1, -5, store.pool.size + 1])
    assert st == [Status.INVALID_KEY, Status.INVALID_KEY, Status.INVALID_KEY, Status.OK,
                  Status.INVALID_REQUEST, Status.TOO_LARGE]
    assert offsets[3] >= 0 and [o for i, o in enumerate(offsets) if i != 3] == [-1] * 5
    store.abort(b"c", [1])
    check_accounting(store)


def test_purge_and_evict_ratio(store):
    for i in range(16):
        put(store, b"k%d" % i, b"z" * (2 * BS))
    assert store.evict(0.25) == 8
    assert store.alloc.num_used == 16
    assert store.purge() == 8
    assert store.alloc.num_used == 0 and len(store.index) == 0
    check_accounting(store)


def test_client_quota(pool, clock):
    st = Store(pool, StoreConfig(max_client_pending_bytes=3 * BS), clock=clock)
    _, s1 = st.alloc_entries(b"greedy", 1, [b"a", b"b"], [2 * BS, 2 * BS])
    assert s1 == [Status.OK, Status.QUOTA_EXCEEDED]
    _, s2 = st.alloc_entries(b"other", 1, [b"c"], [2 * BS])
    assert s2 == [Status.OK]
    st.commit(b"greedy", [1])
    _, s3 = st.alloc_entries(b"greedy", 2, [b"d"], [3 * BS])
    assert s3 == [Status.OK]


def test_zero_byte_value(store):
    off = put(store, b"empty", b"")
    assert off >= 0
    assert read(store, b"empty") == b""
    check_accounting(store)


def test_overwrite_in_a_full_pool_frees_the_old_copy_not_another_key(store):
    # 64 blocks of one value each: full. Overwriting k5 must not evict k0 (the LRU).
    for i in range(64):
        put(store, b"k%d" % i, bytes([i]) * BS)
    assert store.alloc.num_free == 0
    put(store, b"k5", b"new" * 10)
    assert all(store.exists([b"k%d" % i for i in range(64)]))
    assert store.counters["evictions"] == 0 and store.counters["replaced_early"] == 1
    assert read(store, b"k5") == b"new" * 10
    # a pinned old copy is kept for its reader: then the LRU entry goes instead
    store.lookup(b"reader", 9, [b"k6"])
    put(store, b"k6", b"six")
    assert store.exists([b"k0"]) == [False] and store.counters["evictions"] == 1
    store.release(b"reader", [9])
    check_accounting(store)


def test_a_commit_sent_again_is_answered_committed_not_lease_expired(store, clock):
    # a COMMIT whose reply was lost, sent again: the grant was settled by the first, so
    # it is answered as that one was (committed), and only a grant that was never
    # committed (expired, aborted, unknown) is reported failed; bounded per session
    from kvshm.store import sessions

    sess = store.session_for(b"w")
    offsets, st = store.alloc_entries(sess, 7, [b"k"], [5])
    store.pool.write(offsets[0], b"hello")
    assert store.commit(sess, [7]) == []
    assert store.commit(sess, [7]) == []                 # sent again
    assert store.settle_some(sess, 7, "commit", 10) == 0  # the sliced path: the same
    assert store.counters["commits"] == 1 and store.counters["commits_again"] == 2
    assert store.counters["puts"] == 1
    assert read(store, b"k") == b"hello"
    assert store.commit(b"other", [7]) == [7]            # another session's: unknown
    # aborted, expired, never made: failed, as before
    store.alloc_entries(sess, 8, [b"a"], [5])
    store.abort(sess, [8])
    store.alloc_entries(sess, 9, [b"e"], [5])
    clock.t += 10
    store.expire()
    assert store.commit(sess, [8, 9, 10]) == [8, 9, 10]
    assert store.settle_some(sess, 9, "commit", 10) == -1
    # a reused id: the new grant is what a COMMIT of it names (expired: failed)
    store.alloc_entries(sess, 7, [b"k2"], [5])
    clock.t += 10
    store.expire()
    assert store.commit(sess, [7]) == [7]
    # a new HELLO of the same process (replace_session): its commits go with it
    store.alloc_entries(sess, 11, [b"m"], [5])
    assert store.commit(sess, [11]) == []
    new = store.open_session(b"w", nonce=b"n")
    store.replace_session(sess, new)
    assert store.commit(new, [11]) == []
    # bounded: the oldest commits are forgotten (then failed, as before)
    n = sessions.RECENT_COMMITS + 5
    for rid in range(1000, 1000 + n):
        store.alloc_entries(new, rid, [b"x%d" % (rid % 3)], [1])
        assert store.commit(new, [rid]) == []
    assert len(new.committed) == sessions.RECENT_COMMITS
    assert store.commit(new, [1000, 1000 + n - 1]) == [1000]
    st = store.stats(verify=True)
    assert st["accounting_ok"], st
