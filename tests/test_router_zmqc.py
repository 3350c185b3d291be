"""The server loop over kvshm.zmq_ctrl._zmqc and over its pyzmq fallback: the same replies,
byte for byte, to good requests and to malformed ones (truncated, wrong types, huge
lengths), over TCP so frame metadata (peer address, fd) is real."""

from __future__ import annotations

import os
import uuid
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
    def __init__(self, name: str, fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        if not fast:
            monkeypatch.setattr(router_mod, "_zmqc", None)
        self.ctx = zmq.Context()
        self.pool = Pool.create(name, 2048 * BS, BS)
        self.store = Store(self.pool, StoreConfig(limits=Limits(max_batch=100_000)))
        self.loop = router_mod.ServiceLoop(self.store, ["tcp://127.0.0.1:0"],
                                           {"version": PROTOCOL_VERSION}, EPOCH,
                                           context=self.ctx)
        assert (self.loop._zmqc is not None) == fast
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.loop.endpoints[0])
        self.rid = 0

    def raw(self, parts: list[Any]) -> list[bytes]:
        self.sock.send_multipart(parts)
        for _ in range(2000):
            self.loop.turn(5)
            if self.sock.poll(0):
                return self.sock.recv_multipart()
        raise AssertionError("no reply")

    def req(self, op: int, body: Any, frames: list[Any] = ()  # type: ignore[assignment]
            ) -> tuple[int, int, dict[str, Any], list[bytes]]:
        self.rid += 1
        head = msgpack.packb([PROTOCOL_VERSION, int(op), self.rid, EPOCH, body],
                             use_bin_type=True)
        parts = self.raw([head, *frames])
        st, rid, rbody = decode_reply(parts[0])
        return st, rid, rbody, parts[1:]

    def close(self) -> None:
        self.sock.close(0)
        self.loop.close()
        self.ctx.term()
        self.pool.close()
        self.pool.unlink()


@pytest.fixture(params=[True, False], ids=["zmqc", "pyzmq"])
def bed(request: pytest.FixtureRequest, shm_name: str,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[Bed]:
    if request.param and router_mod._zmqc is None:
        pytest.skip("kvshm.zmq_ctrl._zmqc is not built")
    b = Bed(shm_name, request.param, monkeypatch)
    yield b
    b.close()


def test_single_key_round_trips(bed: Bed) -> None:
    small = os.urandom(4096)
    st, _, body, _ = bed.req(Op.PUT, {"keys": [b"a"], "sizes": [4096], "counts": [1]},
                             [small])
    assert st == Status.OK and body["st"] == [0]
    big = os.urandom(1 << 20)                       # zero-copy both ways
    st, _, body, _ = bed.req(Op.PUT, {"keys": [b"b"]}, [big])
    assert st == Status.OK and body["st"] == [0]
    st, _, body, frames = bed.req(Op.GET, {"keys": [b"a"]})
    assert st == Status.OK and body["sizes"] == [4096] and frames == [small]
    st, _, body, frames = bed.req(Op.GET, {"keys": [b"b", b"missing", b"a"]})
    assert st == Status.OK and body["sizes"] == [1 << 20, -1, 4096]
    assert b"".join(frames) == big + small
    st, _, body, _ = bed.req(Op.EXISTS, {"keys": [b"a", b"zz"]})
    assert body["found"] == [True, False]
    st, rid, body, _ = bed.req(Op.LOOKUP, {"keys": [b"a"]})
    assert st == Status.OK and body["sizes"] == [4096]
    st, _, _, _ = bed.req(Op.RELEASE, {"release": [rid]})
    assert st == Status.OK
    for _ in range(200):                            # the zero-copy reply is done
        bed.loop.turn(5)
        if not bed.loop._sending:
            break
    assert not bed.loop._sending
    s = bed.store.stats()
    assert s["num_keys"] == 2 and s["pins"] == 0


def test_big_header_frame(bed: Bed) -> None:
    keys = [b"k%06d" % i for i in range(20_000)]    # a header of > 64 KiB
    st, _, body, _ = bed.req(Op.EXISTS, {"keys": keys})
    assert st == Status.OK and body["found"] == [False] * len(keys)


MALFORMED_HEADERS = [
    b"",                                            # empty frame
    b"\xc1",                                        # never-used msgpack byte
    b"\x95\x01",                                    # array of 5, truncated
    b"\xc6\xff\xff\xff\xff",                        # bin32 claiming 4 GiB
    b"\xdd\xff\xff\xff\xff",                        # array32 claiming 4 G items
    msgpack.packb([1, 2, 3]),                       # 3 elements
    msgpack.packb({"a": 1}),                        # a map
    msgpack.packb([PROTOCOL_VERSION, "put", 1, EPOCH, {}]),
    msgpack.packb([PROTOCOL_VERSION, int(Op.GET), 1.5, EPOCH, {}]),
    msgpack.packb([PROTOCOL_VERSION, int(Op.GET), 1, EPOCH, [1]]),
    msgpack.packb([PROTOCOL_VERSION, int(Op.GET), True, EPOCH, {}]),
    msgpack.packb([PROTOCOL_VERSION, int(Op.GET), 1, EPOCH, {}]) + b"x",   # extra data
]


@pytest.mark.parametrize("head", MALFORMED_HEADERS)
def test_malformed_header(bed: Bed, head: bytes) -> None:
    parts = bed.raw([head])
    st, rid, body = decode_reply(parts[0])
    assert st == Status.MALFORMED, body
    assert bed.loop.errors.get("malformed", 0) == 1


@pytest.mark.parametrize("body,frames,status", [
    ({"keys": [b"a"], "sizes": [5], "counts": [1]}, [b"x" * 4096], Status.INVALID_REQUEST),
    ({"keys": [b"a"], "sizes": [4096], "counts": [True]}, [b"x" * 4096],
     Status.INVALID_REQUEST),
    ({"keys": [b"a"], "sizes": [4096.0], "counts": [1]}, [b"x" * 4096],
     Status.INVALID_REQUEST),
    ({"keys": [b"a"], "sizes": [4096], "counts": [2]}, [b"x" * 4096],
     Status.INVALID_REQUEST),
    ({"keys": [b"a"], "sizes": [4096], "counts": 1}, [b"x" * 4096], Status.MALFORMED),
    ({"keys": b"a", "sizes": [4096], "counts": [1]}, [b"x" * 4096], Status.MALFORMED),
    ({"keys": [b"a"], "sizes": [4096], "counts": [1]}, [], Status.INVALID_REQUEST),
    ({"keys": [b"a"], "sizes": [4096], "counts": [1]}, [b"x" * 4096, b""],
     Status.INVALID_REQUEST),
    ({"keys": [b"a"]}, [], Status.INVALID_REQUEST),
    ({"keys": [12], "sizes": [3], "counts": [1]}, [b"abc"], Status.OK),   # per-key status
])
def test_malformed_put(bed: Bed, body: dict[str, Any], frames: list[bytes],
                       status: int) -> None:
    st, _, rbody, _ = bed.req(Op.PUT, body, frames)
    assert st == status, rbody
    if st == Status.OK:
        assert rbody["st"] == [Status.INVALID_KEY]


def test_same_replies_both_ways(shm_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One script of requests, good and bad, answered alike with and without _zmqc."""
    script: list[tuple[int, Any, list[bytes]]] = [
        (Op.PUT, {"keys": [b"a", b"b"], "sizes": [3, 4], "counts": [2]}, [b"abcdefg"]),
        (Op.GET, {"keys": [b"a", b"b", b"c"]}, []),
        (Op.EXISTS, {"keys": [b"a", b"c"]}, []),
        (Op.MATCH_PREFIX, {"keys": [b"a", b"b", b"c"]}, []),
        (Op.GET, {"keys": "nope"}, []),
        (Op.PUT, {"keys": [b"x"], "sizes": [2], "counts": [1]}, [b"abc"]),
        (Op.DELETE, {"keys": [b"a"]}, []),
        (Op.GET, {"keys": [b"a"]}, []),
        (999, {}, []),
    ]
    got = []
    for fast in (True, False):
        if fast and router_mod._zmqc is None:
            continue
        with monkeypatch.context() as m:
            b = Bed(f"{shm_name}-{int(fast)}", fast, m)
            try:
                got.append([b.req(op, body, frames) for op, body, frames in script])
            finally:
                b.close()
    assert all(g == got[0] for g in got)
    assert got[0][1][3] == [b"abcdefg"] and got[0][-1][0] == Status.UNKNOWN_OP


def test_poll_in(shm_name: str) -> None:
    if router_mod._zmqc is None:
        pytest.skip("kvshm.zmq_ctrl._zmqc is not built")
    Z = router_mod._zmqc
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.bind(f"inproc://{uuid.uuid4().hex}")
    d = ctx.socket(zmq.DEALER)
    d.connect(r.getsockopt(zmq.LAST_ENDPOINT).decode())
    m = ctx.socket(zmq.PAIR)
    rd, wr = os.pipe()
    try:
        assert Z.poll_in(r, rd, m, 0) == 0
        assert Z.poll_in(r, -1, None, 1) == 0
        d.send(b"x")
        assert Z.poll_in(r, rd, m, 1000) == 1
        os.write(wr, b"w")
        assert Z.poll_in(r, rd, m, 0) == 3
        r.recv_multipart()
        assert Z.poll_in(r, rd, None, 0) == 2
    finally:
        os.close(rd)
        os.close(wr)
        for s in (r, d, m):
            s.close(0)
        ctx.term()


def _head(op: int, rid: int, body: Any) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, int(op), rid, EPOCH, body], use_bin_type=True)


def test_large_header_decoded_between_others(bed: Bed) -> None:
    """A header of > STREAM_HEADER_BYTES is decoded over several turns: another peer's
    request is answered meanwhile; the same peer's next request waits behind it."""
    other = bed.ctx.socket(zmq.DEALER)
    other.setsockopt(zmq.LINGER, 0)
    other.connect(bed.loop.endpoints[0])
    # the Python decoder is what this is about: a plain batch EXISTS is taken whole by
    # kvshm.zmq_ctrl._batchq (its own slices: tests/test_batchx.py), so that path is off
    bed.loop._batchq = None
    try:
        bed.req(Op.PUT, {"keys": [b"k000007"], "sizes": [1], "counts": [1]}, [b"v"])
        other.send_multipart([_head(Op.EXISTS, 1, {"keys": [b"warm"]})])
        for _ in range(2000):
            bed.loop.turn(5)
            if other.poll(0):
                other.recv_multipart()
                break
        keys = [b"k%06d" % i for i in range(40_000)]
        big = _head(Op.EXISTS, 50, {"keys": keys})
        assert len(big) >= router_mod.STREAM_HEADER_BYTES
        bed.sock.send_multipart([big])
        bed.sock.send_multipart([_head(Op.EXISTS, 51, {"keys": [b"k000007"]})])
        for _ in range(2000):           # both of this peer's requests are in
            bed.loop.turn(5)
            if bed.loop._decodes and sum(map(len, bed.loop._held.values())) == 1:
                break
        assert bed.loop.in_progress
        other.send_multipart([_head(Op.EXISTS, 2, {"keys": [b"k000007"]})])
        order: list[Any] = []
        for _ in range(5000):
            bed.loop.turn(5)
            while other.poll(0):
                order.append(("other", decode_reply(other.recv_multipart()[0])))
            while bed.sock.poll(0):
                order.append(("bed", decode_reply(bed.sock.recv_multipart()[0])))
            if len(order) == 3:
                break
        # 51 came before the other peer's request, and was held: answered after it (the
        # big one is itself served in slices once decoded, so 51 may overtake it then)
        assert order[0][0] == "other" and order[0][1][1] == 2
        got = {r[1]: r[2]["found"] for _, r in order[1:]}
        assert got == {50: [k == b"k000007" for k in keys], 51: [True]}
        assert not bed.loop.in_progress and not bed.loop._held
    finally:
        other.close(0)


@pytest.mark.parametrize("head", [
    b"\x95\x01\x07\x01\x07\x81\xa4keys\xdd\x00\x01\x86\xa0" + b"\xc1" * 70_000,   # junk
    b"\x95\x01\x07\x01\x07\x81\xa4keys\xdd\xff\xff\xff\xff" + b"\xc0" * 70_000,   # short
    b"\x95\x01\x07\x01\x07\x81\xa4keys\xdd\x00\x00\x00\x01" + b"\xc0" * 70_000,   # extra
    b"\x95\x01\x07\x01\x07\x81\x01\xdd\x00\x01\x11\x70" + b"\xc0" * 70_000,       # int key
    b"\x95\x01\x07\xa1x\x07\x81\xa4keys\xdd\x00\x01\x11\x70" + b"\xc0" * 70_000,  # str id
    b"\x95\x01\x07\x01\x07\xdd\x00\x01\x11\x70" + b"\xc0" * 70_000,               # list body
])
def test_large_malformed_header(bed: Bed, head: bytes) -> None:
    assert len(head) >= router_mod.STREAM_HEADER_BYTES
    bed.sock.send_multipart([head])
    parts = bed.raw([_head(Op.EXISTS, 9, {"keys": [b"a"]})])      # held behind it
    assert decode_reply(parts[0])[0] == Status.MALFORMED
    for _ in range(2000):
        if bed.sock.poll(0):
            break
        bed.loop.turn(5)
    st, rid, body = decode_reply(bed.sock.recv_multipart()[0])
    assert (st, rid, body["found"]) == (Status.OK, 9, [False])
    assert bed.loop.errors.get("malformed") == 1 and not bed.loop._held


def test_single_key_get_edges(bed: Bed) -> None:
    """The one-key GET path gives what the general one gives: empty value, a miss, a
    value over several runs, a value of >= PACK_BELOW."""
    st, _, body, _ = bed.req(Op.PUT, {"keys": [b"z"], "sizes": [0], "counts": [1]}, [b""])
    assert body["st"] == [0]
    assert bed.req(Op.GET, {"keys": [b"z"]})[2:] == ({"sizes": [0], "counts": [1]}, [b""])
    assert bed.req(Op.GET, {"keys": [b"nope"]})[2:] == ({"sizes": [-1], "counts": []}, [])
    big = os.urandom(300 << 10)
    bed.req(Op.PUT, {"keys": [b"big"]}, [big])
    st, _, body, frames = bed.req(Op.GET, {"keys": [b"big"]})
    assert body["sizes"] == [len(big)] and b"".join(frames) == big
    assert bed.store.stats()["pins"] in (0, 1)        # the zero-copy one until sent
