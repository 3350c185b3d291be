"""breakdebts: a hostile review of main 0a7774f..2033497: linear grant settling
(``settle_some``, ``_Grant.done``), ``sends.shut_conn`` and held UNTOLD connections
(admission ``_hold_untold``), the client's checks of GET and LOOKUP replies
(:mod:`kvshm.replies`, ``_batch.sizes_ok`` / ``places_ok``), and a re-sent COMMIT of a
grant committed already answered committed (``Session.committed``, ``commits_again``).

Each finding is a test that failed before its fix; what held is a test too."""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack
import pytest
import zmq

from kvshm import Pool
from kvshm.store import Store, StoreConfig
from kvshm.store import sessions as store_sessions
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Limits, Op, Status
from servers import ServerProcess, raw_hello, unique_shm_name

BS = 4096
NBLOCKS = 64


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def st():
    """A Store over a 64-block pool, its clock in the test's hands."""
    p = Pool.create(unique_shm_name("bd-"), NBLOCKS * BS, BS)
    clock = _Clock()
    s = Store(p, StoreConfig(lease_timeout=5.0, limits=Limits(max_key_bytes=64,
                                                              max_batch=1000)),
              clock=clock)
    s.test_clock = clock  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        p.close()
        p.unlink()


def _alloc(store: Store, sess: Any, rid: int, keys: list[bytes], vals: list[bytes]) -> None:
    offsets, sts = store.alloc_entries(sess, rid, keys, [len(v) for v in vals])
    assert all(x == Status.OK for x in sts), sts
    for o, v in zip(offsets, vals):
        store.pool.write(o, v)


def _read(store: Store, key: bytes) -> bytes | None:
    offsets, sizes, _ = store.lookup(b"reader", 999_999, [key])
    if offsets[0] < 0:
        return None
    data = store.pool.read_bytes(offsets[0], sizes[0])
    store.release(b"reader", [999_999])
    return data


def _exact(store: Store, keys: dict[bytes, bytes]) -> dict[str, Any]:
    """The store holds exactly ``keys`` (their values), no grant, no pending block, no
    quota held, and its accounting is right."""
    s = store.stats(verify=True)
    assert s["accounting_ok"], s
    assert s["pending"] == 0, s
    assert store._ngrants == 0, store._ngrants
    for q in store._quotas.values():
        assert (q.pending, q.pinned, q.sending) == (0, 0, 0), (q.pending, q.pinned)
    assert s["num_keys"] == len(keys), (s["num_keys"], sorted(keys))
    for k, v in keys.items():
        assert _read(store, k) == v, k
    used = sum(-(-len(v) // BS) or 1 for v in keys.values())
    assert s["used_bytes"] == used * BS, (s["used_bytes"], used)
    return s


# ------------------------------------------------------------ a COMMIT sent again

def test_a_commit_sent_again_after_a_delete_or_an_overwrite_does_not_bring_back_the_old(st):
    # held: the re-sent COMMIT finds no grant (settled by the first) and is answered
    # committed; it installs nothing, so a key deleted or overwritten since stays so
    sess = st.open_session(("peer", b"w"), nonce=b"n" * 16)
    _alloc(st, sess, 7, [b"a", b"b"], [b"old-a", b"old-b"])
    assert st.commit(sess, [7]) == []
    st.delete([b"a"])
    _alloc(st, sess, 8, [b"b"], [b"new-b"])
    assert st.commit(sess, [8]) == []
    assert st.commit(sess, [7]) == []                   # sent again: committed
    assert st.settle_some(sess, 7, "commit", 100) == 0  # the sliced path: the same
    _exact(st, {b"b": b"new-b"})
    assert st.counters["commits"] == 2 and st.counters["commits_again"] == 2
    assert st.counters["puts"] == 3


def test_a_commit_sent_again_after_its_blocks_went_to_another_grant_touches_nothing(st):
    # held: the first grant's key deleted, its blocks given to a new grant (same
    # places); the first COMMIT sent again neither shows the new grant's bytes under
    # the old key nor commits the new grant
    sess = st.open_session(("peer", b"w"), nonce=b"n" * 16)
    _alloc(st, sess, 7, [b"a"], [b"A" * 100])
    assert st.commit(sess, [7]) == []
    place = st.index.get(b"a").start
    st.delete([b"a"])
    _alloc(st, sess, 9, [b"z"], [b"Z" * 100])
    assert st._pending == 1
    assert st.commit(sess, [7]) == []
    assert st.exists([b"a", b"z"]) == [False, False]    # the new grant still pending
    assert st.settle_some(sess, 7, "commit", 1) == 0
    assert st.exists([b"a", b"z"]) == [False, False]
    assert st.commit(sess, [9]) == []
    s = _exact(st, {b"z": b"Z" * 100})
    assert st.index.get(b"z").start == place, "not the blocks reused: test is moot"
    assert s["num_keys"] == 1


def test_an_abort_after_a_commit_leaves_the_commit(st):
    # held: ABORT of a committed grant (and RELEASE of it, a PIN's word) is a no-op:
    # the value stays, nothing freed twice, no abort counted
    sess = st.open_session(("peer", b"w"), nonce=b"n" * 16)
    _alloc(st, sess, 7, [b"a", b"b"], [b"1" * 5000, b"2" * 10])
    assert st.commit(sess, [7]) == []
    st.abort(sess, [7])
    st.release(sess, [7])
    assert st.settle_some(sess, 7, "abort", 10) == -1
    assert st.settle_some(sess, 7, "release", 10) == -1
    assert st.counters["aborts"] == 0
    _exact(st, {b"a": b"1" * 5000, b"b": b"2" * 10})
    assert st.commit(sess, [7]) == []       # and a COMMIT again is still committed


def test_a_commit_of_another_sessions_grant_ids_is_refused(st):
    # held: grant ids (and the memory of committed ones) are per session: another
    # client guessing ids (pending, committed, aborted) gets them all failed, and its
    # ABORT of them touches nothing; a same-nonce replacement is the owner's only
    a = st.open_session(("door",), nonce=b"a" * 16)
    b = st.open_session(("door",), nonce=b"b" * 16)     # the same principal, even
    _alloc(st, a, 1, [b"k1"], [b"v1"])
    assert st.commit(a, [1]) == []
    _alloc(st, a, 2, [b"k2"], [b"v2"])              # pending
    _alloc(st, a, 3, [b"k3"], [b"v3"])
    st.abort(a, [3])
    assert st.commit(b, [1, 2, 3, 4]) == [1, 2, 3, 4]
    for rid in (1, 2, 3):
        assert st.settle_some(b, rid, "commit", 5) == -1
    st.abort(b, [2])
    assert st.settle_some(b, 2, "abort", 5) == -1
    assert st.exists([b"k2"]) == [False] and 2 in a.grants
    assert st.commit(a, [2]) == []
    assert st.counters["commits_again"] == 0
    _exact(st, {b"k1": b"v1", b"k2": b"v2"})


@pytest.mark.parametrize("rest", ["abort", "expire", "close"])
def test_interleaved_partial_settles_account_exactly(st, rest):
    # held: a 12-entry grant committed 3 at a time by settle_some, aborted 2, committed
    # 4 more, then the rest aborted / expired / its session closed: exactly the
    # entries committed are visible, every other block free, no quota, no pending;
    # counters as one settle would give. A COMMIT of it again: failed (it was not
    # committed whole), and it brings nothing back
    sess = st.open_session(("peer", b"w"), nonce=b"n" * 16)
    keys = [b"k%02d" % i for i in range(12)]
    vals = [bytes([65 + i]) * (100 + 3000 * (i % 3)) for i in range(12)]
    _alloc(st, sess, 5, keys, vals)
    q = sess.quota
    blocks = [-(-len(v) // BS) for v in vals]
    assert q.pending == sum(blocks)
    assert st.settle_some(sess, 5, "commit", 3) == 3
    assert st.settle_some(sess, 5, "abort", 2) == 2
    assert st.settle_some(sess, 5, "commit", 4) == 4
    assert q.pending == sum(blocks[9:]), (q.pending, blocks)
    assert st.grant_entries(sess, [5]) == 3
    committed = {k: v for i, (k, v) in enumerate(zip(keys, vals)) if i < 3 or 5 <= i < 9}
    if rest == "abort":
        st.abort(sess, [5])
    elif rest == "expire":
        st.test_clock.t += 100  # type: ignore[attr-defined]
        st.expire()
    else:
        st.close_session(sess)
    assert st.counters["puts"] == 7
    assert st.counters["commits"] == 0      # the grant was never committed whole
    if rest != "close":
        assert st.commit(sess, [5]) == [5]
        assert st.settle_some(sess, 5, "commit", 10) == -1
    _exact(st, committed)


def test_a_grant_committed_in_parts_then_whole_is_committed_once(st):
    # held: settle_some commits parts, commit() the rest: puts counted once per entry,
    # one commit, and a COMMIT again is answered committed
    sess = st.open_session(("peer", b"w"), nonce=b"n" * 16)
    keys = [b"p%d" % i for i in range(7)]
    vals = [b"%d" % i * 50 for i in range(7)]
    _alloc(st, sess, 5, keys, vals)
    assert st.settle_some(sess, 5, "commit", 2) == 2
    assert st.settle_some(sess, 5, "commit", 2) == 2
    assert st.commit(sess, [5]) == []
    assert st.commit(sess, [5]) == []
    assert st.counters["puts"] == 7 and st.counters["commits"] == 1
    assert st.counters["commits_again"] == 1
    _exact(st, dict(zip(keys, vals)))


def test_a_grant_being_settled_in_slices_is_settled_whole_one_way(st):
    # the store side of the sliced-settle fix: a grant a sliced COMMIT marked
    # (begin_settle) ignores ABORTs, one a sliced ABORT marked fails COMMITs; an
    # abandoned request's marks go even after its grants moved to a new session (a
    # same-nonce HELLO): the client may abort it again
    sess = st.open_session(("peer", b"w"), nonce=b"n" * 16)
    _alloc(st, sess, 5, [b"c%d" % i for i in range(6)], [b"x" * 10] * 6)
    _alloc(st, sess, 6, [b"d%d" % i for i in range(6)], [b"y" * 10] * 6)
    marked = st.begin_settle(sess, "commit", [5])
    assert st.begin_settle(sess, "abort", [5]) == []        # marked already
    marked6 = st.begin_settle(sess, "abort", [6])
    assert st.settle_some(sess, 5, "commit", 2) == 2
    st.abort(sess, [5])
    assert st.settle_some(sess, 5, "abort", 10) == 0
    assert st.commit(sess, [6]) == [6]
    assert st.settle_some(sess, 6, "commit", 10) == -1
    assert st.settle_some(sess, 6, "abort", 3) == 3
    new = st.open_session(("peer", b"w"), nonce=b"n" * 16)
    st.replace_session(sess, new)
    st.end_settle(marked + marked6)
    st.abort(new, [5])              # no longer being committed: the client's to abort
    assert st.commit(new, [6]) == []    # nor being aborted: committed (what is left)
    _exact(st, {b"c0": b"x" * 10, b"c1": b"x" * 10,
                **{b"d%d" % i: b"y" * 10 for i in range(3, 6)}})


def test_the_memory_of_commits_is_bounded_across_sessions_not_only_per_session(
        st, monkeypatch):
    # each session remembers its last RECENT_COMMITS (1024) commit ids (~70 B each:
    # ~70 KB a session) and the router keeps up to MAX_SESSIONS (65,536) sessions
    # without grants: one door-token holder opening sessions that each commit 1024
    # grants made the server hold ~4.5 GB of them. Bounded in all now
    # (RECENT_COMMITS_TOTAL, the oldest forgotten first, whichever session's); shown
    # here with small bounds: 12 sessions x 10 commits, 8 a session, 40 in all
    monkeypatch.setattr(store_sessions, "RECENT_COMMITS", 8)
    monkeypatch.setattr(store_sessions, "RECENT_COMMITS_TOTAL", 40, raising=False)
    sessions = [st.open_session(("door",), nonce=b"%016d" % i) for i in range(12)]
    rid = 100
    for sess in sessions:
        for _ in range(10):
            rid += 1
            _alloc(st, sess, rid, [b"k"], [b"v"])
            assert st.commit(sess, [rid]) == []
    total = sum(len(s.committed) for s in sessions)
    assert total <= 40, total
    last = sessions[-1]
    assert list(last.committed) == list(range(rid - 7, rid + 1))    # the newest kept
    assert sessions[0].committed == {}                              # the oldest went
    # a same-nonce HELLO carries them over within the bound too
    new = st.open_session(("door",), nonce=last.nonce)
    st.replace_session(last, new)
    assert list(new.committed) == list(range(rid - 7, rid + 1))
    assert sum(len(s.committed) for s in [*sessions, new] if not s.closed) <= 40
    assert st.commit(new, [rid]) == []
    assert st.commit(sessions[0], [101]) == [101]     # forgotten: failed, as before


# ------------------------------------------------------------ on the wire

class _Raw:
    """A raw DEALER with a session on ``srv``; ``call`` one request, ``send`` without
    waiting, ``recv`` the next reply."""

    def __init__(self, srv: ServerProcess) -> None:
        self.s = zmq.Context.instance().socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(f"tcp://{srv.address}")
        self.epoch = raw_hello(self.s, srv.address)["epoch"]

    def send(self, op: int, body: dict[str, Any], rid: int) -> None:
        self.s.send(msgpack.packb([PROTOCOL_VERSION, op, rid, self.epoch, body]))

    def recv(self) -> list[Any]:
        assert self.s.poll(20000), "no reply"
        return msgpack.unpackb(self.s.recv_multipart()[0])

    def call(self, op: int, body: dict[str, Any], rid: int) -> list[Any]:
        self.send(op, body, rid)
        return self.recv()

    def close(self) -> None:
        self.s.close()


@pytest.mark.timeout(120)
def test_a_commit_sent_again_from_another_client_is_refused_on_the_wire():
    # held: client B sends COMMITs (and an ABORT) of client A's request ids, committed
    # and pending ones: all commit_failed, A's pending write stays A's to commit
    with ServerProcess() as srv:
        a, b = _Raw(srv), _Raw(srv)
        try:
            r = a.call(Op.ALLOC, {"keys": [b"x1"], "sizes": [3]}, 2)
            assert r[1] == 0 and r[3]["st"] == [0], r
            assert "commit_failed" not in a.call(Op.COMMIT, {"commit": [2]}, 3)[3]
            r = a.call(Op.ALLOC, {"keys": [b"x2"], "sizes": [3]}, 4)
            assert r[1] == 0, r
            r = b.call(Op.COMMIT, {"commit": [2, 4]}, 2)
            assert r[3].get("commit_failed") == [2, 4], r
            b.call(Op.RELEASE, {"abort": [4]}, 3)
            r = b.call(Op.EXISTS, {"keys": [b"x1", b"x2"], "commit": [4]}, 4)
            assert r[3]["found"] == [True, False] and r[3]["commit_failed"] == [4], r
            r = a.call(Op.EXISTS, {"keys": [b"x2"], "commit": [4]}, 5)
            assert r[3]["found"] == [True] and "commit_failed" not in r[3], r
        finally:
            a.close()
            b.close()


@pytest.mark.timeout(120)
def test_an_abort_pipelined_behind_a_sliced_commit_does_not_undo_it():
    # a COMMIT of a grant larger than --slice-keys is settled over several turns; an
    # ABORT of the same grant the client sent after it (pipelined, or a confused
    # client) must not take effect before it: the COMMIT was first, so it commits every
    # entry and is answered so, and the ABORT finds nothing left. Before: the ABORT,
    # served between the COMMIT's slices, freed the entries not yet committed (the
    # grant half in, half gone) and the COMMIT answered commit_failed (LeaseExpired
    # for a write that is partly in)
    with ServerProcess("--slice-keys", "2") as srv:
        a = _Raw(srv)
        try:
            keys = [b"s%03d" % i for i in range(400)]
            r = a.call(Op.ALLOC, {"keys": keys, "sizes": [5] * 400}, 2)
            assert r[1] == 0 and r[3]["st"] == [0] * 400, r
            a.send(Op.COMMIT, {"commit": [2]}, 3)
            a.send(Op.RELEASE, {"abort": [2]}, 4)
            got = {}
            for _ in range(2):
                m = a.recv()
                got[m[2]] = m
            r = a.call(Op.EXISTS, {"keys": keys}, 5)
            assert got[3][1] == 0 and "commit_failed" not in got[3][3], (got[3], "".join("TF"[not x] for x in r[3]["found"]))
            assert r[3]["found"] == [True] * 400, "".join("TF"[not x] for x in r[3]["found"])
        finally:
            a.close()


@pytest.mark.timeout(120)
def test_a_commit_pipelined_behind_a_sliced_abort_does_not_half_commit_it():
    # the other way round: an ABORT of a large grant being settled in slices, then a
    # COMMIT of it: the ABORT was first, so every entry goes and the COMMIT fails.
    # Before: the two interleaved (abort 2 entries, commit 2, ...): half the keys in,
    # and the COMMIT answered committed when it took the last slice
    with ServerProcess("--slice-keys", "2") as srv:
        a = _Raw(srv)
        try:
            keys = [b"t%03d" % i for i in range(400)]
            r = a.call(Op.ALLOC, {"keys": keys, "sizes": [5] * 400}, 2)
            assert r[1] == 0 and r[3]["st"] == [0] * 400, r
            a.send(Op.RELEASE, {"abort": [2]}, 3)
            a.send(Op.COMMIT, {"commit": [2]}, 4)
            got = {}
            for _ in range(2):
                m = a.recv()
                got[m[2]] = m
            r = a.call(Op.EXISTS, {"keys": keys}, 5)
            found = "".join("TF"[not x] for x in r[3]["found"])
            assert got[4][3].get("commit_failed") == [2], (got[4], found)
            assert r[3]["found"] == [False] * 400, found
            st = a.call(Op.STATS, {}, 6)[3]["stats"]
            assert st["pending"] == 0 and st["num_keys"] == 0, st
        finally:
            a.close()


# ------------------------------------------------------------ hostile replies

def _nan_ext() -> Any:
    return msgpack.ExtType(5, b"\x00" * 8)


_BIG = 10 ** 7


def _hostile_get_cases() -> dict[str, tuple[Any, tuple[int, dict[str, Any], list[bytes]]]]:
    nan = float("nan")
    one = lambda c: c.get_batch([b"a", b"b"])       # noqa: E731
    into = lambda c: c.get_batch_into([b"a", b"b"], [bytearray(8), bytearray(8)])  # noqa
    get1 = lambda c: c.get(b"a")                    # noqa: E731 (the one-key C path)
    ver = lambda c: c.get_batch([b"a", b"b"], verify=True)   # noqa: E731
    return {
        "size_minus3": (one, (0, {"sizes": [-3, -1], "counts": []}, [])),
        "size_minus3_one": (get1, (0, {"sizes": [-3], "counts": []}, [])),
        "size_int64_min": (one, (0, {"sizes": [-2 ** 63, -1], "counts": []}, [])),
        "size_2_63": (into, (0, {"sizes": [2 ** 63, -1], "counts": [1]}, [b"x"])),
        "size_u64_max_one": (get1, (0, {"sizes": [2 ** 64 - 1], "counts": [1]}, [b"x"])),
        "size_nan": (one, (0, {"sizes": [nan, -1], "counts": [1]}, [b"x"])),
        "size_inf_into": (into, (0, {"sizes": [float("inf"), -1], "counts": [1]}, [b"x"])),
        "size_nested": (one, (0, {"sizes": [[1], -1], "counts": [1]}, [b"x"])),
        "size_map": (one, (0, {"sizes": [{"n": 1}, -1], "counts": [1]}, [b"x"])),
        "size_none": (one, (0, {"sizes": [None, -1], "counts": []}, [])),
        "size_bytes": (one, (0, {"sizes": [b"\x01", -1], "counts": [1]}, [b"x"])),
        "size_ext": (one, (0, {"sizes": [_nan_ext(), -1], "counts": [1]}, [b"x"])),
        "sizes_huge_list": (one, (0, {"sizes": [1] * _BIG, "counts": [_BIG]}, [b"x" * 16])),
        "sizes_huge_list_one": (get1, (0, {"sizes": [-1] * _BIG}, [])),
        "sizes_huge_into": (into, (0, {"sizes": [0] * _BIG, "counts": [_BIG]}, [b""])),
        "counts_u64_max": (one, (0, {"sizes": [1, -1], "counts": [2 ** 64 - 1]}, [b"x"])),
        "counts_negative_into": (into, (0, {"sizes": [1, 1], "counts": [-1, 3]}, [b"x", b"y"])),
        "counts_nan": (one, (0, {"sizes": [1, -1], "counts": [nan]}, [b"x"])),
        "counts_nested_into": (into, (0, {"sizes": [1, -1], "counts": [[1]]}, [b"x"])),
        "counts_huge_list": (one, (0, {"sizes": [1, -1], "counts": [0] * _BIG}, [b"x"])),
        "counts_huge_into": (into, (0, {"sizes": [1, -1], "counts": [1] + [0] * _BIG},
                                    [b"x"])),
        "sums_nan": (ver, (0, {"sizes": [1, -1], "counts": [1], "sums": [nan, None]},
                           [b"x"])),
        "sums_nested": (ver, (0, {"sizes": [1, -1], "counts": [1], "sums": [[1], None]},
                              [b"x"])),
        "sums_huge_list": (ver, (0, {"sizes": [1, -1], "counts": [1], "sums": [0] * _BIG},
                                 [b"x"])),
        "body_nested_deep": (one, (0, {"sizes": [[[[[[[[[[1]]]]]]]]], -1], "counts": [1]},
                                   [b"x"])),
    }


HOSTILE_GET = _hostile_get_cases()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(HOSTILE_GET))
def test_a_hostile_get_reply_is_a_protocol_error(case):
    # held: every one a ProtocolError, nothing else raised, no crash, no hang; the
    # client reads a good reply after it
    from kvshm import Client
    from kvshm.errors import ProtocolError
    from test_reply_shapes import FakeServer

    fake = FakeServer()
    c = Client(fake.address, transport="tcp", timeout=20)
    try:
        fn, reply = HOSTILE_GET[case]
        fake.script(reply)
        with pytest.raises(ProtocolError):
            fn(c)
        fake.script((0, {"sizes": [2, -1], "counts": [1]}, [b"ok"]))
        assert c.get_batch([b"a", b"b"]) == [b"ok", None]
    finally:
        c.close()
        fake.close()


def _hostile_lookup_cases(pool_bytes: int) -> dict[str, tuple[Any, dict[str, Any]]]:
    nan = float("nan")
    get1 = lambda c: c.get(b"a")                                     # noqa: E731
    two = lambda c: c.get_batch([b"a", b"b"])                        # noqa: E731
    into = lambda c: c.get_batch_into([b"a", b"b"], [bytearray(8)] * 2)  # noqa: E731
    return {
        "size_minus3": (get1, {"offsets": [0], "sizes": [-3]}),
        "size_2_63": (get1, {"offsets": [0], "sizes": [2 ** 63]}),
        "size_int64_min": (get1, {"offsets": [0], "sizes": [-2 ** 63]}),
        "size_nan": (get1, {"offsets": [0], "sizes": [nan]}),
        "offset_nan": (get1, {"offsets": [nan], "sizes": [3]}),
        "offset_2_63": (into, {"offsets": [2 ** 63, -1], "sizes": [3, -1]}),
        "offset_int64_min": (get1, {"offsets": [-2 ** 63], "sizes": [3]}),
        "offset_past_by_size": (get1, {"offsets": [pool_bytes - 2], "sizes": [3]}),
        "offset_none": (get1, {"offsets": [None], "sizes": [3]}),
        "offset_map": (get1, {"offsets": [{"o": 0}], "sizes": [3]}),
        "offset_ext": (get1, {"offsets": [_nan_ext()], "sizes": [3]}),
        "extent_nan": (get1, {"offsets": [[[nan, 3]]], "sizes": [3]}),
        "extent_len_2_63": (get1, {"offsets": [[[0, 2 ** 63]]], "sizes": [3]}),
        "extent_len_u64_max": (get1, {"offsets": [[[0, 2 ** 64 - 1]]], "sizes": [3]}),
        "extent_off_plus_len_wraps": (get1, {"offsets": [[[2 ** 62, 2 ** 62],
                                                          [2 ** 62, 2 ** 62]]],
                                             "sizes": [3]}),
        "extents_sum_wraps": (get1, {"offsets": [[[0, pool_bytes]] * 40], "sizes": [3]}),
        "extent_three": (get1, {"offsets": [[[0, 1, 2]]], "sizes": [1]}),
        "extent_nested": (get1, {"offsets": [[[[0, 1], [1, 2]]]], "sizes": [3]}),
        "extent_str": (get1, {"offsets": [[["0", 3]]], "sizes": [3]}),
        "extent_bool": (get1, {"offsets": [[[False, 3]]], "sizes": [3]}),
        "extents_huge_list": (get1, {"offsets": [[[0, 0]] * _BIG], "sizes": [3]}),
        "offsets_huge_list": (two, {"offsets": [0] * _BIG, "sizes": [3, 3]}),
        "sizes_huge_list": (two, {"offsets": [0, 0], "sizes": [3] * _BIG}),
        "sums_nan": (lambda c: c.get(b"a", verify=True),
                     {"offsets": [0], "sizes": [3], "sums": [nan]}),
    }


@pytest.mark.timeout(120)
def test_a_hostile_lookup_reply_is_a_protocol_error(shm_name):
    # held: the shm path's LOOKUP replies (places read in the client's own mapping):
    # every one a ProtocolError, the refused LOOKUP's pins released, a good reply read
    from kvshm import Client
    from kvshm.errors import ProtocolError
    from test_reply_shapes import BS as FBS, POOL_BYTES, FakeServer

    pool = Pool.create(shm_name, POOL_BYTES, FBS)
    fake = FakeServer(pool)
    c = None
    try:
        pool.write(0, b"0123456789")
        c = Client(fake.address, transport="shm", timeout=20)
        assert c._session.transport_name == "shm"
        bad = []
        for case, (fn, body) in sorted(_hostile_lookup_cases(POOL_BYTES).items()):
            fake.script((0, body, []))
            try:
                fn(c)
            except ProtocolError:
                pass
            except Exception as exc:        # noqa: BLE001 - what the test looks for
                bad.append((case, repr(exc)[:120]))
            else:
                bad.append((case, "no error"))
            op, rid, _ = fake.requests[-1]
            assert op == Op.LOOKUP, case
            fake.script((0, {"offsets": [0, -1], "sizes": [3, -1]}, []))
            assert c.get_batch([b"a", b"b"]) == [b"012", None], case
            assert any(rid in body.get("release", ()) for _, _, body in
                       fake.requests[-2:]), (case, [(o, r, sorted(b)) for o, r, b in
                                                    fake.requests[-3:]])
        assert not bad, bad
    finally:
        if c is not None:
            c.close()
        fake.close()
        pool.close()
        pool.unlink()


# ------------------------------------------------------------ the ipc probe

def _nfds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(120)
def test_cleanup_ipc_dirs_does_not_connect_to_a_live_servers_socket(tmp_path):
    # any kvshm server starting on the host runs segments.cleanup_ipc_dirs, which told
    # a live server's ipc directory from a stale one by connecting to its socket: a
    # server (libzmq listener) with no descriptor free at that moment aborted inside
    # libzmq (ipc_listener.cpp:297, EMFILE). The server now holds a lock on a file of
    # its ipc directory and the probe looks at that lock, connecting to nothing; a
    # killed server's directory (the lock gone with it) is still removed
    import resource

    from kvshm import Client, segments

    env = {"TMPDIR": str(tmp_path)}
    srv = ServerProcess("--hello-timeout", "1", env=env, listener="libzmq")
    try:
        assert srv.ipc, srv.ready_line
        ipc_dir = os.path.dirname(srv.ipc[len("ipc://"):])
        assert os.path.dirname(ipc_dir) == str(tmp_path), ipc_dir
        c = Client(srv.address, transport="tcp", timeout=20)
        try:
            c.put(b"k", b"v")
            pid = srv.proc.pid
            old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
            try:
                resource.prlimit(pid, resource.RLIMIT_NOFILE, (_nfds(pid), old[1]))
                assert segments.cleanup_ipc_dirs(str(tmp_path)) == []
                time.sleep(0.5)     # (an abort is at once; a bounded look for it)
                assert srv.proc.poll() is None, (srv.proc.returncode,
                                                 srv.stderr_text[-300:])
            finally:
                if srv.proc.poll() is None:
                    resource.prlimit(pid, resource.RLIMIT_NOFILE, old)
            assert c.get(b"k") == b"v"
            assert os.path.isdir(ipc_dir)
        finally:
            c.close()
        srv.kill()
        assert segments.cleanup_ipc_dirs(str(tmp_path)) == [ipc_dir]
    finally:
        srv.kill()
        srv.remove_segment()
        from kvshm.security import cleanup_tokens
        cleanup_tokens()


# ------------------------------------------------------------ EMFILE, many held

def _cut_within(s: Any, timeout: float) -> bool:
    """Whether the server ended ``s`` (end of stream or reset) within ``timeout`` s."""
    s.settimeout(timeout)
    try:
        while True:
            b = s.recv(65536)
            if not b:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@pytest.mark.timeout(180)
@pytest.mark.parametrize("listener", ["libzmq", "native"])
def test_many_silent_peers_due_while_no_descriptor_is_free_are_all_cut_after(listener):
    # 24 silent peers (ZMTP handshake done, no HELLO) accepted and held; the server's
    # soft limit then at its descriptor count while their --hello-timeout passes (each
    # shut_conn UNTOLD: held again, first in line), and 8 more connect meanwhile (the
    # kernel queues them; no descriptor to accept with). The limit raised: every one
    # of the 32 is cut, the server's descriptors come back to what they were, the
    # client that said HELLO is answered throughout after. --no-ipc: see break24
    import resource
    import socket

    from kvshm import Client
    from test_idlecut import peer

    with ServerProcess("--hello-timeout", "1", "--no-ipc", listener=listener) as srv:
        c = Client(srv.address, transport="tcp", timeout=30)
        held: list[Any] = []
        try:
            c.put(b"k", b"v")
            pid = srv.proc.pid
            base = _nfds(pid)
            held = [peer(srv.address) for _ in range(24)]
            for _ in range(3):
                assert c.get(b"k") == b"v"          # their accepts read, held
            old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
            try:
                resource.prlimit(pid, resource.RLIMIT_NOFILE, (_nfds(pid), old[1]))
                host, port = srv.address.rsplit(":", 1)
                for _ in range(8):
                    s = socket.create_connection((host, int(port)), timeout=10)
                    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f")    # a greeting begun
                    held.append(s)
                time.sleep(2.5)     # the thing tested: their time up, no descriptor
            finally:
                resource.prlimit(pid, resource.RLIMIT_NOFILE, old)
            left = [i for i, s in enumerate(held) if not _cut_within(s, 30)]
            assert not left, f"peers never cut: {left}"
            end = time.monotonic() + 30
            while _nfds(pid) > base and time.monotonic() < end:
                time.sleep(0.1)
            assert _nfds(pid) <= base, (_nfds(pid), base)
            assert c.get(b"k") == b"v"
            assert srv.proc.poll() is None
            errs = c.stats()["error_kinds"]
            assert errs.get("unadmitted_cut", 0) + errs.get("unadmitted_bound", 0) >= 24, \
                errs
        finally:
            for s in held:
                s.close()
            c.close()
