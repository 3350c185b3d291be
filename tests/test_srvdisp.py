"""The server's one-key fast path (kvshm.zmq_ctrl._fastpath): plain one-key PUT, GET and
EXISTS are served in C (counted), with the reply bytes the Python path gives; anything
odd or hostile is declined before anything changed and the Python path answers it with
its own status and error."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from kvshm._pool import Pool
from kvshm.limits import Limits
from kvshm.store import Store, StoreConfig
from kvshm.zmq_ctrl import router as router_mod
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, Status, decode_reply

BS = 4096
EPOCH = 7


class Bed:
    """A loop over TCP with one DEALER peer; ``door``: the loop asks for a token."""

    def __init__(self, name: str, door: bytes | None = None, **limits: Any) -> None:
        self.ctx = zmq.Context()
        self.pool = Pool.create(name, 512 * BS, BS)
        self.store = Store(self.pool, StoreConfig(limits=Limits(**limits)))
        self.loop = router_mod.ServiceLoop(self.store, ["tcp://127.0.0.1:0"],
                                           {"version": PROTOCOL_VERSION}, EPOCH,
                                           context=self.ctx, door_token=door)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.loop.endpoints[0])

    def raw(self, parts: list[Any]) -> list[bytes]:
        self.sock.send_multipart(parts)
        for _ in range(2000):
            self.loop.turn(5)
            if self.sock.poll(0):
                return self.sock.recv_multipart()
        raise AssertionError("no reply")

    def req(self, op: int, rid: int, body: Any, frames: list[Any] = (),  # type: ignore[assignment]
            ) -> tuple[int, int, dict[str, Any], list[bytes]]:
        parts = self.raw([_head(op, rid, body), *frames])
        st, got, rbody = decode_reply(parts[0])
        return st, got, rbody, parts[1:]

    def close(self) -> None:
        self.sock.close(0)
        self.loop.close()
        self.ctx.term()
        self.pool.close()
        self.pool.unlink()


def _head(op: int, rid: int, body: Any, version: int = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb([version, int(op), rid, EPOCH, body], use_bin_type=True)


def _needs_fast() -> None:
    if router_mod._zmqc is None or router_mod._fastpath is None or not router_mod._FAST_ON:
        pytest.skip("kvshm.zmq_ctrl._zmqc/_fastpath not built, or KVSHM_FASTPATH=0")


@pytest.fixture
def bed(shm_name: str) -> Iterator[Bed]:
    _needs_fast()
    b = Bed(shm_name)
    # the peer's implicit session (no door) is opened by its first request, which the
    # fast path declines (no session yet) and the Python path serves
    assert b.req(Op.EXISTS, 1, {"keys": [b"warm-up"]})[2] == {"found": [False]}
    yield b
    b.close()


def _counts(b: Bed) -> dict[str, int]:
    return b.loop.fast_counts()


def test_plain_one_key_ops_take_the_fast_path(bed: Bed) -> None:
    before = _counts(bed)
    val = os.urandom(4096)
    st, rid, body, frames = bed.req(Op.PUT, 2, {"keys": [b"k"], "sizes": [4096],
                                                "counts": [1]}, [val])
    assert (st, rid, body, frames) == (Status.OK, 2, {"st": [0]}, [])
    assert bed.req(Op.GET, 3, {"keys": [b"k"]})[1:] == (3, {"sizes": [4096],
                                                           "counts": [1]}, [val])
    assert bed.req(Op.EXISTS, 4, {"keys": [b"k"]})[2] == {"found": [True]}
    # unknown key: a miss, served fast too
    assert bed.req(Op.GET, 5, {"keys": [b"nope"]})[2:] == ({"sizes": [-1], "counts": []}, [])
    assert bed.req(Op.EXISTS, 6, {"keys": [b"nope"]})[2] == {"found": [False]}
    after = _counts(bed)
    assert after["PUT"] - before["PUT"] == 1
    assert after["GET"] - before["GET"] == 2
    assert after["EXISTS"] - before["EXISTS"] == 2
    assert after["declined"] == before["declined"]
    assert bed.store.counters["puts"] == 1 and bed.store.counters["hits"] == 1
    assert bed.store.counters["misses"] == 1
    # latency recorded as the Python path records it
    assert sum(bed.loop.latency[Op.PUT]) == 1 and sum(bed.loop.latency[Op.GET]) == 2
    assert bed.loop.store.stats(verify=True)


def _script(val: bytes) -> list[tuple[list[Any], int]]:
    """Requests (parts) and whether the fast path should serve them (1) or not (0)."""
    big = os.urandom(100 << 10)
    k = [b"key-a"]
    return [
        ([_head(Op.PUT, 10, {"keys": k, "sizes": [len(val)], "counts": [1]}), val], 1),
        ([_head(Op.PUT, 11, {"keys": [b"s"], "sums": [2**64 - 1], "sizes": [3],
                             "counts": [1]}), b"abc"], 1),
        ([_head(Op.GET, 12, {"keys": [b"s"]})], 1),                 # with its checksum
        ([_head(Op.GET, 2**64 - 1, {"keys": k})], 1),              # req_id widths
        ([_head(Op.GET, -(2**63), {"keys": k})], 1),
        ([_head(Op.EXISTS, -5, {"keys": k})], 1),
        ([_head(Op.EXISTS, 300, {"keys": k})], 1),
        ([_head(Op.EXISTS, 70000, {"keys": k})], 1),
        ([_head(Op.PUT, 13, {"keys": [b"z"], "sizes": [0], "counts": [1]}), b""], 1),
        ([_head(Op.GET, 14, {"keys": [b"z"]})], 1),                # an empty value
        # declined: the Python path answers
        ([_head(Op.PUT, 20, {"keys": [b"big"], "sizes": [len(big)], "counts": [1]}), big], 0),
        ([_head(Op.GET, 21, {"keys": [b"big"]})], 0),              # sent zero-copy
        ([_head(Op.PUT, 22, {"keys": ["str"], "sizes": [3], "counts": [1]}), b"abc"], 0),
        ([_head(Op.PUT, 23, {"keys": [b""], "sizes": [3], "counts": [1]}), b"abc"], 0),
        ([_head(Op.PUT, 24, {"keys": [b"x" * 5000], "sizes": [3], "counts": [1]}), b"abc"],
         0),
        ([_head(Op.PUT, 25, {"keys": k, "sizes": [4], "counts": [1]}), b"abc"], 0),
        ([_head(Op.PUT, 26, {"keys": k, "sizes": [3], "counts": [2]}), b"abc"], 0),
        ([_head(Op.PUT, 27, {"keys": k, "sizes": [-1], "counts": [1]}), b"abc"], 0),
        ([_head(Op.PUT, 28, {"keys": k}), b"abc"], 0),             # one frame per value
        ([_head(Op.PUT, 29, {"keys": k, "sizes": [3], "counts": [1]})], 0),   # no frame
        ([_head(Op.PUT, 30, {"keys": k, "sizes": [3], "counts": [1], "commit": [1]}),
          b"abc"], 0),                                             # a piggybacked settle
        ([_head(Op.GET, 31, {"keys": k, "extra": 1})], 0),
        ([_head(Op.GET, 32, {"keys": [b"a", b"b"]})], 0),
        ([_head(Op.GET, 33, {"keys": k, "keys2": k})], 0),
        ([_head(Op.GET, 34, {"keys": k}, version=1)], 0),          # BAD_VERSION
        ([_head(Op.GET, 35, {"keys": k}) + b"\x00"], 0),           # trailing bytes
        ([_head(Op.GET, 36, {"keys": k})[:-3]], 0),                # cut short
        ([b"\x95\x02\x07\x01\x07\x81\xa4keys\x91\xc4\xff"], 0),    # a key past the end
        ([_head(Op.GET, 37, [1, 2])], 0),                          # body not a map
        ([b"\xc1garbage"], 0),
        ([_head(Op.DELETE, 38, {"keys": k})], 0),                  # not one of its ops
        ([_head(Op.GET, 39, {"keys": k}), b"extra frame"], 0),
    ]


def _replies(b: Bed, script: list[tuple[list[Any], int]]) -> list[list[bytes]]:
    return [b.raw(parts) for parts, _ in script]


def test_replies_are_the_python_paths_byte_for_byte(shm_name: str) -> None:
    _needs_fast()
    val = os.urandom(4096)
    script = _script(val)
    got = {}
    counters = {}
    for fast in (True, False):
        b = Bed(shm_name + ("-f" if fast else "-p"))
        try:
            b.req(Op.EXISTS, 1, {"keys": [b"warm-up"]})
            if not fast:
                b.loop._fast = None
            c0 = _counts(b)
            got[fast] = _replies(b, script)
            c1 = _counts(b)
            if fast:
                served = sum(c1[op] - c0[op] for op in ("PUT", "GET", "EXISTS"))
                assert served == sum(w for _, w in script)
                assert c1["declined"] - c0["declined"] == sum(1 for _, w in script if not w)
            assert b.store.stats(verify=True)
            assert b.store._pins == 0           # every GET's pin went
            counters[fast] = (dict(b.store.counters), b.store.alloc.num_used,
                              sorted(b.store.index.keys()))
            assert b.loop.errors.get("internal", 0) == 0
        finally:
            b.close()
    assert got[True] == got[False]
    assert counters[True] == counters[False]
    # and what the Python path said to the odd ones (a sample)
    st = [decode_reply(r[0])[0] for r in got[True]]
    names = [s[0][:1] for s in script]
    assert len(names) == len(st)
    assert st[-1] == Status.INVALID_REQUEST or st[-1] == Status.OK
    assert Status.MALFORMED in st and Status.BAD_VERSION in st


def test_no_session_is_refused_by_the_python_path(shm_name: str) -> None:
    _needs_fast()
    b = Bed(shm_name, door=b"t" * 32)
    try:
        st, rid, body, _ = b.req(Op.GET, 9, {"keys": [b"k"]})
        assert st == Status.STALE_EPOCH and rid == 9 and "HELLO" in body["error"]
        st, _, body, _ = b.req(Op.PUT, 10, {"keys": [b"k"], "sizes": [1], "counts": [1]},
                               [b"x"])
        assert st == Status.STALE_EPOCH
        assert b.store.counters["puts"] == 0
        c = _counts(b)
        assert c["declined"] == 2 and c["GET"] == c["PUT"] == 0
        # a HELLO with the token opens the session: then the fast path serves it
        st, _, _, _ = b.req(Op.HELLO, 11, {"nonce": os.urandom(16), "token": b"t" * 32})
        assert st == Status.OK
        assert b.req(Op.PUT, 12, {"keys": [b"k"], "sizes": [1], "counts": [1]},
                     [b"x"])[2] == {"st": [0]}
        assert _counts(b)["PUT"] == 1
        # its session closed (BYE, idle, replaced): declined again, refused again
        sess = b.loop._by_ident[next(iter(b.loop._by_ident))]
        b.loop.end_session(sess, "test")
        assert b.req(Op.GET, 13, {"keys": [b"k"]})[0] == Status.STALE_EPOCH
        assert _counts(b)["GET"] == 0
    finally:
        b.close()


def test_replies_unsent_or_a_quota_go_to_the_python_path(bed: Bed) -> None:
    val = os.urandom(4096)
    bed.req(Op.PUT, 2, {"keys": [b"k"], "sizes": [4096], "counts": [1]}, [val])
    sess = next(iter(bed.loop._by_ident.values()))
    c0 = _counts(bed)
    sess.sending += 1               # replies of this session not sent yet
    try:
        st, _, body, frames = bed.req(Op.GET, 3, {"keys": [b"k"]})
    finally:
        sess.sending -= 1
    assert st == Status.OK and frames == [val]
    assert _counts(bed)["declined"] == c0["declined"] + 1
    assert _counts(bed)["GET"] == c0["GET"]


def test_oversized_value_is_refused_as_before(shm_name: str) -> None:
    _needs_fast()
    b = Bed(shm_name, max_value_bytes=1024)
    try:
        b.req(Op.EXISTS, 1, {"keys": [b"w"]})
        st, _, body, _ = b.req(Op.PUT, 2, {"keys": [b"k"], "sizes": [2048], "counts": [1]},
                               [b"x" * 2048])
        assert st == Status.OK and body == {"st": [Status.TOO_LARGE]}
        assert b.req(Op.PUT, 3, {"keys": [b"k"], "sizes": [1024], "counts": [1]},
                     [b"x" * 1024])[2] == {"st": [0]}
        c = _counts(b)
        assert c["PUT"] == 1 and c["declined"] == 2      # the first EXISTS, the 2 KiB
    finally:
        b.close()


def test_batch_limit_below_one_key_goes_to_the_python_path(shm_name: str) -> None:
    _needs_fast()
    b = Bed(shm_name, max_batch=0)
    try:
        b.req(Op.EXISTS, 1, {"keys": []})
        st, _, body, _ = b.req(Op.GET, 2, {"keys": [b"k"]})
        assert st == Status.INVALID_REQUEST and "limit" in body["error"]
        assert _counts(b)["GET"] == 0
    finally:
        b.close()


def test_a_store_error_is_answered_internal(bed: Bed, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(router_mod._fastpath, "_install_entries", broken)
    st, rid, body, _ = bed.req(Op.PUT, 7, {"keys": [b"k"], "sizes": [1], "counts": [1]},
                               [b"x"])
    assert st == Status.INTERNAL and rid == 7 and "boom" in body["error"]
    assert bed.loop.errors["internal"] == 1
    assert sum(bed.loop.latency[Op.PUT]) == 1
    # the loop serves on
    monkeypatch.undo()
    assert bed.req(Op.EXISTS, 8, {"keys": [b"k"]})[2] == {"found": [False]}


def test_a_replaced_handler_is_not_bypassed(bed: Bed) -> None:
    seen = []

    def my_get(session: Any, req_id: int, body: Any, frames: Any, on_sent: Any) -> Any:
        seen.append(req_id)
        return Status.OK, {"mine": True}, []

    bed.loop.add_ops({Op.GET: my_get})
    assert bed.req(Op.GET, 5, {"keys": [b"k"]})[2] == {"mine": True}
    assert seen == [5]
    assert _counts(bed)["GET"] == 0
    # the other ops are still served fast
    assert bed.req(Op.EXISTS, 6, {"keys": [b"k"]})[2] == {"found": [False]}
    assert _counts(bed)["EXISTS"] == 1


def test_messages_behind_a_large_header_keep_their_order(bed: Bed) -> None:
    # a header of >= STREAM_HEADER_BYTES is decoded over turns; the peer's later
    # one-key requests wait behind it (not served fast ahead of it): the PUT lands
    # after the DELETE (not sliced: at most slice_keys keys)
    n = bed.loop.slice_keys
    keys = [b"key-%036d" % i for i in range(n)]
    assert len(_head(Op.DELETE, 2, {"keys": keys})) >= router_mod.STREAM_HEADER_BYTES
    bed.req(Op.PUT, 1, {"keys": [keys[0]], "sizes": [1], "counts": [1]}, [b"y"])
    bed.sock.send_multipart([_head(Op.DELETE, 2, {"keys": keys})])
    bed.sock.send_multipart([_head(Op.PUT, 3, {"keys": [keys[0]], "sizes": [1],
                                               "counts": [1]}), b"x"])
    bed.sock.send_multipart([_head(Op.EXISTS, 4, {"keys": [keys[0]]})])
    out = []
    for _ in range(4000):
        bed.loop.turn(5)
        while bed.sock.poll(0):
            out.append(decode_reply(bed.sock.recv_multipart()[0]))
        if len(out) == 3:
            break
    assert [r[1] for r in out] == [2, 3, 4]
    assert out[0][2] == {"n": 1} and out[2][2] == {"found": [True]}


def test_puts_past_a_full_pool_evict_as_the_python_path(shm_name: str) -> None:
    _needs_fast()
    vals = [os.urandom(4096) for _ in range(8)]
    seen = {}
    for fast in (True, False):
        b = Bed(shm_name + ("-f" if fast else "-p"))
        try:
            b.req(Op.EXISTS, 1, {"keys": [b"w"]})
            if not fast:
                b.loop._fast = None
            for i in range(700):                # 512 blocks: the later ones evict
                st, _, body, _ = b.req(Op.PUT, 10 + i, {"keys": [b"k%d" % i],
                                                        "sizes": [4096], "counts": [1]},
                                       [vals[i % 8]])
                assert st == Status.OK and body == {"st": [0]}
            assert b.store.counters["evictions"] > 0
            assert b.req(Op.GET, 5000, {"keys": [b"k699"]})[3] == [vals[699 % 8]]
            assert b.store.stats(verify=True)
            if fast:
                assert _counts(b)["PUT"] == 700
            seen[fast] = (dict(b.store.counters), sorted(b.store.index.keys()))
        finally:
            b.close()
    assert seen[True] == seen[False]


def test_a_fast_path_bug_is_logged_and_the_python_path_serves(bed: Bed) -> None:
    msgs: list[list[Any]] = [[b"peer", 12345]]      # a header that is no buffer
    handled: list[Any] = []

    def recv(*args: Any) -> Any:
        return msgs.pop() if msgs else None

    fast = bed.loop._fast
    assert fast.drain(recv, None, [], handled.append, 10) == 1
    assert handled == [[b"peer", 12345]]
    assert bed.loop.errors["internal"] == 1


def test_a_remote_clients_one_key_calls_take_it() -> None:
    _needs_fast()
    import numpy as np

    from kvshm import Client
    from servers import ServerProcess

    with ServerProcess(prealloc_size=1 / 16) as srv:
        with Client(srv.address, transport="tcp", timeout=10) as c:
            before = c.stats()["fast_path"]
            val = np.frombuffer(os.urandom(4096), np.uint8)
            for i in range(20):
                c.put(b"k%d" % i, val)
            out = np.empty(4096, np.uint8)
            for i in range(20):
                c.get_into(b"k%d" % i, out)
                assert np.array_equal(out, val)
                assert c.get(b"k%d" % i) == val.tobytes()
                assert c.exists(b"k%d" % i)
            with pytest.raises(KeyError):
                c.get(b"nope")
            assert not c.exists(b"nope")
            after = c.stats()["fast_path"]
    assert after["PUT"] - before["PUT"] == 20
    assert after["GET"] - before["GET"] == 41
    assert after["EXISTS"] - before["EXISTS"] == 21
