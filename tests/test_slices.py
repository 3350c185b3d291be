"""Large requests are served in slices (issue 13 part 3, issue 12): a request of more than
``slice_keys`` keys is worked through ``slice_keys`` at a time, and the loop serves other
clients' requests between two slices; the reply goes out when the last slice is done.

The loop is driven one turn at a time (:meth:`ServiceLoop.turn`), so the orderings asserted
here are exact, not timings: each turn serves what is queued and advances every large
request by one slice.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
import zmq

from kvshm import Client
from kvshm._pool import Pool
from kvshm.limits import Limits
from kvshm.store import Store, StoreConfig
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, Status, decode_reply
from kvshm.zmq_ctrl.router import ServiceLoop

BS = 4096
SLICE = 100


def _pack(x: Any) -> bytes:
    return msgpack.packb(x, use_bin_type=True)


class Bed:
    """A Store and its ServiceLoop (no door: every peer gets an implicit session), driven
    one turn at a time from the test's thread."""

    def __init__(self, name: str, nblocks: int = 4096, slice_keys: int = SLICE,
                 **cfg: Any) -> None:
        self.ctx = zmq.Context()
        self.pool = Pool.create(name, nblocks * BS, BS)
        self.store = Store(self.pool, StoreConfig(limits=Limits(max_batch=1_000_000), **cfg))
        self.endpoint = f"inproc://slices-{uuid.uuid4().hex}"
        self.loop = ServiceLoop(self.store, [self.endpoint], {"version": PROTOCOL_VERSION},
                                7, context=self.ctx, slice_keys=slice_keys)
        self.socks: list[zmq.Socket] = []
        self.rid = 100

    def client(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.endpoint)
        self.socks.append(s)
        return s

    def send(self, s: zmq.Socket, op: int, body: dict[str, Any],
             frames: list[bytes] = ()) -> int:   # type: ignore[assignment]
        self.rid += 1
        s.send_multipart([_pack([PROTOCOL_VERSION, int(op), self.rid, 7, body]), *frames])
        return self.rid

    def arrived(self, s: zmq.Socket) -> bool:
        return bool(s.poll(0))

    def recv(self, s: zmq.Socket) -> tuple[int, int, dict[str, Any], list[bytes]]:
        assert s.poll(0), "no reply"
        parts = s.recv_multipart()
        st, rid, body = decode_reply(parts[0])
        return st, rid, body, parts[1:]

    def turn(self) -> None:
        # inproc delivery is synchronous, but give the poll a moment to see a message
        # sent just before (the reply ordering is decided by the loop, not by this wait)
        self.loop.turn(10)

    def until(self, s: zmq.Socket, limit: int = 100_000) -> int:
        """Turns until ``s`` has a reply; returns how many it took."""
        for n in range(1, limit + 1):
            self.turn()
            if self.arrived(s):
                return n
        raise AssertionError("no reply")

    def settle(self) -> None:
        """Turns until no large request is left in progress."""
        for _ in range(100_000):
            if not self.loop.in_progress:
                return
            self.turn()
        raise AssertionError("large requests never finished")

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.loop.close()
        self.ctx.term()
        self.pool.close()
        self.pool.unlink()


@pytest.fixture
def bed(shm_name: str) -> Iterator[Bed]:
    b = Bed(shm_name)
    yield b
    b.close()


def keys_of(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}-{i:07d}".encode() for i in range(n)]


def put_some(bed: Bed, keys: list[bytes]) -> None:
    st = bed.store.put(keys, [b"v" * 8] * len(keys))
    assert st == [Status.OK] * len(keys)


def test_small_requests_are_answered_between_the_slices_of_a_large_one(bed: Bed) -> None:
    keys = keys_of(5_000)
    put_some(bed, keys[::3])
    big, small = bed.client(), bed.client()
    bed.send(big, Op.EXISTS, {"keys": keys})
    answered_small = 0
    turns = 0
    while not bed.arrived(big):
        rid = bed.send(small, Op.EXISTS, {"keys": [keys[0]]})
        bed.turn()
        turns += 1
        if bed.arrived(big):
            break
        # the small request was served in this very turn, the large one is not done
        st, r, body, _ = bed.recv(small)
        assert (st, r, body["found"]) == (Status.OK, rid, [True])
        answered_small += 1
    # 5,000 keys in slices of 100: the large one needed 50 turns, and a small request was
    # answered in each of the turns before its last
    assert turns >= 5_000 // SLICE
    assert answered_small == turns - 1 >= 49
    st, _, body, _ = bed.recv(big)
    assert st == Status.OK
    assert body["found"] == [i % 3 == 0 for i in range(5_000)]
    assert bed.loop.slice_counters["sliced_requests"] == 1
    assert bed.loop.slice_counters["slices"] >= 50


def test_a_request_of_slice_keys_or_fewer_is_answered_at_once(bed: Bed) -> None:
    keys = keys_of(SLICE)
    put_some(bed, keys)
    s = bed.client()
    bed.send(s, Op.EXISTS, {"keys": keys})
    bed.turn()
    st, _, body, _ = bed.recv(s)
    assert body["found"] == [True] * SLICE
    assert bed.loop.slice_counters["sliced_requests"] == 0


def test_several_large_requests_advance_together(bed: Bed) -> None:
    keys = keys_of(3_000)
    put_some(bed, keys)
    a, b = bed.client(), bed.client()
    bed.send(a, Op.MATCH_PREFIX, {"keys": keys})
    bed.send(b, Op.EXISTS, {"keys": keys})
    done: dict[str, int] = {}
    for t in range(1, 1_000):
        bed.turn()
        for name, s in (("a", a), ("b", b)):
            if name not in done and bed.arrived(s):
                done[name] = t
        if len(done) == 2:
            break
    # one slice of each per turn: neither waits behind the other
    assert abs(done["a"] - done["b"]) <= 1, done
    assert min(done.values()) >= 3_000 // SLICE - 1
    assert bed.recv(a)[2]["n"] == 3_000
    assert bed.recv(b)[2]["found"] == [True] * 3_000


def test_match_prefix_stops_at_the_first_miss_and_delete_counts(bed: Bed) -> None:
    keys = keys_of(1_000)
    put_some(bed, keys[:733] + keys[734:])
    s = bed.client()
    bed.send(s, Op.MATCH_PREFIX, {"keys": keys})
    n = bed.until(s)
    assert bed.recv(s)[2]["n"] == 733
    assert n <= 733 // SLICE + 2          # no slice looked past the miss
    bed.send(s, Op.DELETE, {"keys": keys + [b"nope"]})
    bed.until(s)
    assert bed.recv(s)[2]["n"] == 999
    assert len(bed.store.index) == 0


def _alloc_reference(name: str, keys: list[Any], sizes: list[Any], **cfg: Any
                     ) -> tuple[list[Any], list[int]]:
    pool = Pool.create(name, 4096 * BS, BS)
    try:
        ref = Store(pool, StoreConfig(limits=Limits(max_batch=1_000_000), **cfg))
        r = ref.alloc_entries(b"ref", 1, keys, sizes)
        assert r is not None
        return r
    finally:
        pool.close()
        pool.unlink()


def test_sliced_alloc_gives_every_key_what_one_request_would(shm_name: str) -> None:
    cfg = {"max_client_pending_bytes": 1_500 * BS}
    b = Bed(shm_name, **cfg)
    try:
        n = 2_500
        keys: list[Any] = keys_of(n)
        keys[7] = b""                                   # INVALID_KEY
        sizes: list[Any] = [BS] * n
        sizes[11] = -1                                  # INVALID_REQUEST
        sizes[12] = 10 * 4096 * BS                      # TOO_LARGE
        want_off, want_st = _alloc_reference(shm_name + "-ref", keys, sizes, **cfg)
        assert Status.QUOTA_EXCEEDED in want_st         # the quota runs out mid-request
        s = b.client()
        rid = b.send(s, Op.ALLOC, {"keys": keys, "sizes": sizes})
        assert b.until(s) >= n // SLICE
        st, r, body, _ = b.recv(s)
        assert (st, r) == (Status.OK, rid)
        assert body["st"] == [int(x) for x in want_st]
        assert body["offsets"] == want_off
        granted = sum(1 for x in want_st if x == Status.OK)
        stats = b.store.stats(verify=True)
        assert stats["pending"] == granted and stats["grants"] == 1
        b.send(s, Op.COMMIT, {"commit": [rid]})
        b.until(s)                                      # a commit of 1,500: in slices too
        assert b.recv(s)[0] == Status.OK
        stats = b.store.stats(verify=True)
        assert stats["num_keys"] == granted and stats["pending"] == 0
        assert stats["accounting_ok"]
    finally:
        b.close()


def test_a_session_closed_mid_slices_frees_everything_and_gets_no_grant(bed: Bed) -> None:
    s = bed.client()
    rid = bed.send(s, Op.ALLOC, {"keys": keys_of(3_000), "sizes": [BS] * 3_000})
    for _ in range(5):
        bed.turn()
    stats = bed.store.stats()
    assert 0 < stats["pending"] < 3_000         # some slices made their entries
    sess = next(iter(bed.loop._by_ident.values()))
    assert rid in sess.grants
    bed.store.close_session(sess, "test: its process died")
    bed.settle()
    stats = bed.store.stats(verify=True)
    assert (stats["pending"], stats["used_bytes"], stats["grants"]) == (0, 0, 0)
    assert stats["accounting_ok"]
    assert not bed.arrived(s)                    # no reply for a session that is gone
    assert bed.loop.slice_counters["abandoned"] == 1


def test_abort_of_a_request_in_slices_cancels_it(bed: Bed) -> None:
    s, other = bed.client(), bed.client()
    rid = bed.send(s, Op.ALLOC, {"keys": keys_of(3_000), "sizes": [BS] * 3_000})
    for _ in range(3):
        bed.turn()
    assert bed.store.stats()["pending"] > 0
    bed.send(s, Op.COMMIT, {"abort": [rid]})      # its client gave up on it
    bed.until(s)                                  # (the abort of 300 entries: in slices)
    st, r, _, _ = bed.recv(s)
    assert st == Status.OK and r != rid
    bed.settle()
    # the rest of it never ran: no grant, nothing pending; another client's work goes on
    stats = bed.store.stats(verify=True)
    assert (stats["pending"], stats["grants"], stats["used_bytes"]) == (0, 0, 0)
    assert not bed.arrived(s)
    bed.send(other, Op.EXISTS, {"keys": [b"x"]})
    bed.turn()
    assert bed.recv(other)[2]["found"] == [False]


def test_sliced_lookup_pins_every_hit_once_and_release_drops_them(bed: Bed) -> None:
    keys = keys_of(1_000)
    put_some(bed, keys[::2])
    s = bed.client()
    rid = bed.send(s, Op.LOOKUP, {"keys": keys})
    bed.until(s)
    st, _, body, _ = bed.recv(s)
    hits = [i for i, sz in enumerate(body["sizes"]) if sz >= 0]
    assert hits == list(range(0, 1_000, 2))
    assert all(body["offsets"][i] == -1 for i in range(1, 1_000, 2))
    stats = bed.store.stats()
    assert (stats["pins"], stats["grants"]) == (500, 1)
    bed.send(s, Op.RELEASE, {"release": [rid]})
    assert bed.until(s) >= 500 // SLICE               # 500 pins: released in slices
    bed.recv(s)
    stats = bed.store.stats(verify=True)
    assert (stats["pins"], stats["grants"]) == (0, 0)


def test_sliced_lookup_of_a_session_that_dies_leaves_no_pin(bed: Bed) -> None:
    keys = keys_of(2_000)
    put_some(bed, keys)
    s = bed.client()
    bed.send(s, Op.LOOKUP, {"keys": keys})
    for _ in range(4):
        bed.turn()
    assert bed.store.stats()["pins"] > 0
    sess = next(iter(bed.loop._by_ident.values()))
    bed.store.close_session(sess)
    bed.settle()
    stats = bed.store.stats(verify=True)
    assert (stats["pins"], stats["grants"]) == (0, 0)


def test_sliced_put_and_get_carry_every_value(bed: Bed) -> None:
    n = 700
    keys = keys_of(n)
    vals = [bytes([i % 251]) * (1 + i % 300) for i in range(n)]
    s = bed.client()
    bed.send(s, Op.PUT, {"keys": keys}, vals)
    bed.until(s)
    st, _, body, _ = bed.recv(s)
    assert body["st"] == [Status.OK] * n
    bed.send(s, Op.GET, {"keys": keys + [b"missing"]})
    assert bed.until(s) >= n // SLICE
    st, _, body, frames = bed.recv(s)
    assert body["sizes"] == [len(v) for v in vals] + [-1]
    from kvshm.zmq_ctrl.frames import unpack

    got = unpack(frames, body["counts"], [x for x in body["sizes"] if x >= 0])
    assert [bytes(g) for g in got] == vals
    bed.settle()
    bed.turn()
    stats = bed.store.stats(verify=True)
    assert stats["pins"] == 0 and stats["accounting_ok"]


def test_a_large_request_through_a_server(shm_name: str) -> None:
    """End to end: `kvshm serve --slice-keys` serves a client's large batches in slices
    with the same per-key results."""
    from servers import ServerProcess

    with ServerProcess("--slice-keys", "64", shm_name=shm_name) as srv:
        with Client(srv.address, transport="tcp", timeout=60) as c:
            keys = [f"e{i}" for i in range(3_000)]
            c.put_batch(keys[::2], [np.full(16, i % 256, np.uint8)
                                    for i in range(0, 3_000, 2)])
            assert c.exists_batch(keys) == [i % 2 == 0 for i in range(3_000)]
            assert c.match_prefix(keys[::2]) == 1_500
            out = c.get_batch(keys[:200:2])
            assert all(bytes(o) == bytes([i * 2 % 256]) * 16 for i, o in enumerate(out))
            st = c.stats(verify=True)
            # put, exists, match_prefix and get: each over 64 keys
            assert st["slices"]["sliced_requests"] == 4, st["slices"]
            assert st["accounting_ok"] and st["pins"] == 0


def test_sliced_put_and_lookup_wait_for_the_ssd_tier_between_slices(shm_name: str,
                                                                     tmp_path: Any) -> None:
    """With a tier: slices of a PUT park while spills make room, slices of a LOOKUP park
    while what lives only on disk is promoted; every key arrives and reads back."""
    from kvshm.tiers import SsdConfig, SsdTier

    b = Bed(shm_name, nblocks=512, tier_wait=600.0)
    tier = SsdTier(b.pool, SsdConfig(path=str(tmp_path), size=4096 * BS, block_size=BS,
                                     files=1, workers=2, queue_bytes=64 * BS))
    tier.notify = b.loop.wake
    b.store.attach_tier(tier)
    try:
        n = 1_500
        keys = keys_of(n)
        vals = [bytes([i % 251]) * BS for i in range(n)]
        s = b.client()
        b.send(s, Op.PUT, {"keys": keys}, vals)
        b.until(s)
        assert b.recv(s)[2]["st"] == [Status.OK] * n      # 3x the pool: spilled, not lost
        assert len(b.store.index) < n
        b.send(s, Op.EXISTS, {"keys": keys})
        b.until(s)
        assert b.recv(s)[2]["found"] == [True] * n
        want = keys[:300]                                  # evicted long ago: on disk only
        assert sum(k in b.store.index for k in want) < 300
        rid = b.send(s, Op.LOOKUP, {"keys": want})
        b.until(s)
        _, _, body, _ = b.recv(s)
        assert all(sz == BS for sz in body["sizes"]), body["sizes"]
        for i, off in enumerate(body["offsets"]):
            assert bytes(b.pool.view(off, BS, readonly=True)) == vals[i]
        assert b.store.tier_counters["promotions"] > 0
        b.send(s, Op.RELEASE, {"release": [rid]})
        b.until(s)
        b.recv(s)
        stats = b.store.stats(verify=True)
        assert stats["accounting_ok"] and stats["grants"] == 0
    finally:
        b.store.close_tier()
        b.close()


def test_a_large_commit_is_settled_in_slices_and_then_answered(bed: Bed) -> None:
    n = 1_000
    keys = keys_of(n)
    big, small = bed.client(), bed.client()
    rid = bed.send(big, Op.ALLOC, {"keys": keys, "sizes": [BS] * n})
    bed.until(big)
    assert bed.recv(big)[2]["st"] == [Status.OK] * n
    bed.send(big, Op.COMMIT, {"commit": [rid, 999_999]})      # 999,999: no such grant
    turns = 0
    while True:
        bed.send(small, Op.EXISTS, {"keys": [keys[-1]]})
        bed.turn()
        turns += 1
        if bed.arrived(big):
            break
        # answered between two slices of the commit: the last key is not in yet
        assert bed.recv(small)[2]["found"] == [False]
    assert turns >= n // SLICE
    st, _, body, _ = bed.recv(big)
    assert st == Status.OK and body["commit_failed"] == [999_999]
    stats = bed.store.stats(verify=True)
    assert (stats["num_keys"], stats["pending"], stats["grants"]) == (n, 0, 0)
    assert (stats["commits"], stats["puts"]) == (1, n) and stats["accounting_ok"]


def test_a_large_release_rides_on_a_request_that_is_served_after_it(bed: Bed) -> None:
    keys = keys_of(800)
    put_some(bed, keys)
    s = bed.client()
    rid = bed.send(s, Op.LOOKUP, {"keys": keys})
    bed.until(s)
    bed.recv(s)
    assert bed.store.stats()["pins"] == 800
    bed.send(s, Op.EXISTS, {"keys": keys[:3], "release": [rid]})
    n = bed.until(s)
    assert n >= 800 // SLICE
    assert bed.recv(s)[2]["found"] == [True] * 3
    stats = bed.store.stats(verify=True)
    assert (stats["pins"], stats["grants"]) == (0, 0)


def test_a_session_that_dies_mid_commit_loses_only_what_was_not_committed(bed: Bed) -> None:
    n = 1_000
    keys = keys_of(n)
    s = bed.client()
    rid = bed.send(s, Op.ALLOC, {"keys": keys, "sizes": [BS] * n})
    bed.until(s)
    bed.recv(s)
    bed.send(s, Op.COMMIT, {"commit": [rid]})
    for _ in range(3):
        bed.turn()
    installed = len(bed.store.index)
    assert 0 < installed < n
    sess = next(iter(bed.loop._by_ident.values()))
    bed.store.close_session(sess)
    bed.settle()
    stats = bed.store.stats(verify=True)
    assert stats["num_keys"] == installed
    assert (stats["pending"], stats["grants"]) == (0, 0) and stats["accounting_ok"]
    assert stats["used_bytes"] == installed * BS
    assert [k in bed.store.index for k in keys] == [True] * installed + [False] * (n - installed)
