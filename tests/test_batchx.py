"""Batch EXISTS / MATCH_PREFIX in C (kvshm.zmq_ctrl._batchq, issue 13): the same requests
sent to one loop with its batch path on and off (``loop._batchq`` set or None: what
``KVSHM_BATCHPATH=0`` does) give byte-identical replies, the same store counters and the
same LRU order; hostile or unusual headers are declined before anything changed and the
Python path answers them (the same bytes either way); large requests stay in slices (a
bystander's request is answered between two). Also the client's end: the C request
packer and EXISTS-reply reader against msgpack."""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshm._pool import Pool
from kvshm._shmindex import IndexWriter, default_slots
from kvshm.limits import Limits
from kvshm.store import Store, StoreConfig
from kvshm.zmq_ctrl import protocol
from kvshm.zmq_ctrl import router as router_mod
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op

BS = 4096
EPOCH = 7
SLICE = 16          # the loop's slice_keys: C slices of SLICE_MULT * 16 keys
MAX_KEY = 200       # over the shared table's 152: such keys stay unpublished (dict path)
NBLOCKS = 4096

_batchq = pytest.importorskip("kvshm.zmq_ctrl._batchq")


class Bed:
    """A door-less loop over TCP (``shared``: with the server's shared table attached)
    and DEALER peers, driven one turn at a time."""

    #: most turns :meth:`raw` drives waiting for a reply
    TURNS = 5000

    def __init__(self, name: str, shared: bool) -> None:
        self.ctx = zmq.Context()
        self.pool = Pool.create(name, NBLOCKS * BS, BS)
        self.store = Store(self.pool, StoreConfig(limits=Limits(max_key_bytes=MAX_KEY,
                                                                max_batch=20_000)))
        self.writer = None
        if shared:
            self.writer = IndexWriter.create(name + "-index", name + "-reads",
                                             default_slots(NBLOCKS), epoch=EPOCH,
                                             block_size=BS, num_blocks=NBLOCKS,
                                             token=self.pool.token)
            self.store.index.attach_shared(self.writer)
        self.loop = router_mod.ServiceLoop(self.store, ["tcp://127.0.0.1:0"],
                                           {"version": PROTOCOL_VERSION}, EPOCH,
                                           context=self.ctx, slice_keys=SLICE)
        self.c_path = self.loop._batchq
        self.socks: list[zmq.Socket] = []
        self.sock = self.peer()

    def peer(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.loop.endpoints[0])
        self.socks.append(s)
        return s

    def raw(self, parts: list[Any], sock: zmq.Socket | None = None) -> list[bytes]:
        s = sock or self.sock
        s.send_multipart(parts)
        for _ in range(self.TURNS):
            self.loop.turn(5)
            if s.poll(0):
                return s.recv_multipart()
        raise AssertionError("no reply")

    def both(self, parts: list[Any]) -> tuple[list[bytes], list[bytes], dict[str, int]]:
        """The reply with the batch path on, then off, and the C path's counts' change;
        the store's counters and LRU order are the same after either."""
        assert self.c_path is not None
        before = (dict(self.store.counters), list(self.store.index.keys()))
        f0 = self.loop.fast_counts()
        self.loop._batchq = self.c_path
        on = self.raw(parts)
        f1 = self.loop.fast_counts()
        mid = (dict(self.store.counters), list(self.store.index.keys()))
        self.loop._batchq = None
        off = self.raw(parts)
        self.loop._batchq = self.c_path
        after = (dict(self.store.counters), list(self.store.index.keys()))
        assert before == mid == after
        return on, off, {k: f1[k] - f0[k] for k in ("EXISTS_batch", "MATCH_PREFIX_batch",
                                                    "batch_declined")}

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.loop.close()
        self.ctx.term()
        if self.writer is not None:
            self.writer.unlink()
        self.pool.close()
        self.pool.unlink()


def _head(op: int, rid: int, body: Any, version: int = PROTOCOL_VERSION,
          epoch: int = EPOCH) -> bytes:
    return msgpack.packb([version, int(op), rid, epoch, body], use_bin_type=True)


def _key(i: int) -> bytes:
    return f"bx-key-{i:08d}".encode()


@pytest.fixture(params=[True, False], ids=["shared", "dict"])
def bed(request: Any, shm_name: str) -> Iterator[Bed]:
    if router_mod._batchq is None or not router_mod._BATCH_ON:
        pytest.skip("kvshm.zmq_ctrl._batchq not built, or KVSHM_BATCHPATH=0")
    b = Bed(shm_name, request.param)
    # the peer's implicit session is opened by its first request (the Python path's)
    assert b.raw([_head(Op.EXISTS, 1, {"keys": [b"warm"]})])
    keys = [_key(i) for i in range(0, 3000, 2)]
    st_ = b.store.put(keys, [b"v" * 10] * len(keys))
    assert set(st_) == {0}
    yield b
    b.close()


@pytest.mark.parametrize("n", [20, 127, 128, 129, 500, 2500])
@pytest.mark.parametrize("op", [Op.EXISTS, Op.MATCH_PREFIX])
def test_same_reply_as_python(bed: Bed, op: Op, n: int) -> None:
    # even keys are present: a mix; then all present (a full prefix), then none
    for keys in ([_key(i) for i in range(n)], [_key(2 * i) for i in range(n)],
                 [_key(2 * i + 1) for i in range(n)]):
        for rid in (5, 2**64 - 1, -3):
            on, off, d = bed.both([_head(op, rid, {"keys": keys})])
            assert on == off
            assert d[f"{op.name}_batch"] == 1 and d["batch_declined"] == 0
            if op == Op.EXISTS:
                body = protocol.decode_reply(on[0])[2]
                assert body["found"] == [k in bed.store.index.mapping for k in keys]


def test_sliced_and_unsliced_counts(bed: Bed) -> None:
    c = bed.loop.slice_counters
    s0 = dict(c)
    keys = [_key(i) for i in range(2000)]       # > SLICE_MULT * 16 keys: in slices
    on, off, d = bed.both([_head(Op.EXISTS, 9, {"keys": keys})])
    assert on == off and d["EXISTS_batch"] == 1
    assert c["sliced_requests"] == s0["sliced_requests"] + 2     # C, then Python
    assert c["abandoned"] == s0["abandoned"]
    assert bed.loop.in_progress == 0


def test_long_keys_go_to_the_dict(bed: Bed) -> None:
    # keys over the shared table's limit stay unpublished: the C path asks the dict
    long = [b"L" * 180 + bytes([i]) for i in range(40)]
    bed.store.put(long[::2], [b"x"] * 20)
    keys = long + [_key(i) for i in range(40)]
    for op in (Op.EXISTS, Op.MATCH_PREFIX):
        on, off, d = bed.both([_head(op, 3, {"keys": keys})])
        assert on == off and d[f"{op.name}_batch"] == 1


def _arr(n: int) -> bytes:
    return bytes([0x90 | n]) if n <= 15 else (b"\xdc" + struct.pack(">H", n) if n <= 0xFFFF
                                              else b"\xdd" + struct.pack(">I", n))


def _raw_head(op: int, body: bytes, rid: int = 4) -> bytes:
    return bytes([0x95, PROTOCOL_VERSION, int(op), rid, EPOCH]) + body


def _keys_body(items: bytes, n: int) -> bytes:
    return b"\x81\xa4keys" + _arr(n) + items


def _bins(keys: list[bytes]) -> bytes:
    return b"".join(msgpack.packb(k, use_bin_type=True) for k in keys)


GOOD = [_key(i) for i in range(40)]


def _hostile() -> list[tuple[str, list[bytes]]]:
    g = _bins(GOOD)
    E = Op.EXISTS
    cases = [
        ("truncated array", _raw_head(E, _keys_body(g[:-30], 40))),
        ("array of 2M, short frame", _raw_head(E, _keys_body(g, 2_000_000))),
        ("array16 says more", _raw_head(E, _keys_body(g, 41))),
        ("array says fewer (trailing)", _raw_head(E, _keys_body(g, 39))),
        ("bin8 past the end", _raw_head(E, _keys_body(g + b"\xc4\xf0abc", 41))),
        ("bin32 past the end", _raw_head(E, _keys_body(g + b"\xc6\x7f\xff\xff\xffab", 41))),
        ("nested array", _raw_head(E, _keys_body(g + b"\x92\xc4\x01a\xc4\x01b", 41))),
        ("nested map", _raw_head(E, _keys_body(g + b"\x81\xa1a\x01", 41))),
        ("str key", _raw_head(E, _keys_body(g + msgpack.packb("a-str-key"), 41))),
        ("nil key", _raw_head(E, _keys_body(g + b"\xc0", 41))),
        ("int key", _raw_head(E, _keys_body(g + b"\x05", 41))),
        ("empty key", _raw_head(E, _keys_body(g + b"\xc4\x00", 41))),
        ("key over max_key_bytes", _raw_head(E, _keys_body(
            g + msgpack.packb(b"k" * (MAX_KEY + 1), use_bin_type=True), 41))),
        ("trailing byte", _raw_head(E, _keys_body(g, 40) + b"\x00")),
        ("two fields", _raw_head(E, b"\x82\xa4keys" + _arr(40) + g + b"\xa7release\x90")),
        ("piggyback first", _raw_head(E, b"\x82\xa7release\x90\xa4keys" + _arr(40) + g)),
        ("keys not a list", _raw_head(E, b"\x81\xa4keys" + b"\xc4\xff" + b"x" * 255)),
        ("keys as bin map key", _raw_head(E, b"\x81\xc4\x04keys" + _arr(40) + g)),
        ("4-element header", bytes([0x94, PROTOCOL_VERSION, 8, 4]) + _keys_body(g, 40)),
        ("float req_id", bytes([0x95, PROTOCOL_VERSION, 8]) + b"\xcb" + b"\0" * 8
         + bytes([EPOCH]) + _keys_body(g, 40)),
        ("op as str", bytes([0x95, PROTOCOL_VERSION]) + b"\xa1x" + bytes([4, EPOCH])
         + _keys_body(g, 40)),
        ("cut in the ints", bytes([0x95, PROTOCOL_VERSION, 8, 0xcf, 1, 2])),
    ]
    many = _bins([_key(i) for i in range(5000)])    # a frame >= STREAM_HEADER_BYTES
    cases += [
        ("large, a str key last", _raw_head(E, _keys_body(many + msgpack.packb("s"), 5001))),
        ("large, cut short", _raw_head(E, _keys_body(many[:-5], 5000))),
        ("large, one key too many", _raw_head(E, _keys_body(many, 4999))),
    ]
    out = [(name, [h]) for name, h in cases]
    out.append(("other version", [_head(Op.EXISTS, 4, {"keys": GOOD}, version=1)]))
    out.append(("over max_batch", [_head(Op.EXISTS, 4, {"keys": [b"k"] * 20_001})]))
    out.append(("a payload frame", [_head(Op.EXISTS, 4, {"keys": GOOD}), b"payload"]))
    out.append(("another op (DELETE)", [_head(Op.DELETE, 4, {"keys": [b"nope"] * 40})]))
    return out


@pytest.mark.parametrize("name,parts", _hostile(), ids=[c[0] for c in _hostile()])
def test_hostile_declined_same_answer(bed: Bed, name: str, parts: list[bytes]) -> None:
    on, off, d = bed.both(parts)
    assert on == off, name
    assert d["EXISTS_batch"] == 0 and d["MATCH_PREFIX_batch"] == 0
    if len(parts[0]) >= router_mod._BATCHQ_MIN_BYTES:
        assert d["batch_declined"] == 1, name


def test_bin32_key_served(bed: Bed) -> None:
    g = _bins(GOOD)
    h = _raw_head(Op.EXISTS, _keys_body(g + b"\xc6\x00\x00\x00\x03abc", 41))
    on, off, d = bed.both([h])
    assert on == off and d["EXISTS_batch"] == 1


def test_bystander_between_slices(bed: Bed) -> None:
    """A big EXISTS (many C slices) and then a small request of another peer: the small
    one is answered first (the loop serves it between two slices)."""
    big = bed.sock
    other = bed.peer()
    assert bed.raw([_head(Op.EXISTS, 1, {"keys": [b"hello"]})], other)  # its session
    n0 = bed.loop.fast_counts()["EXISTS_batch"]
    keys = [_key(i) for i in range(_batchq.SLICE_MULT * SLICE * 10)]   # 10 C slices
    big.send_multipart([_head(Op.EXISTS, 77, {"keys": keys})])
    for _ in range(1000):
        bed.loop.turn(5)
        if bed.loop.in_progress:
            break
    assert bed.loop.in_progress == 1
    other.send_multipart([_head(Op.EXISTS, 78, {"keys": [_key(0)]})])
    # wait until the small request is queued at the server before the next turn: else,
    # on a loaded machine, the turns could run every slice before it arrives
    poller = zmq.Poller()
    poller.register(bed.loop._sock, zmq.POLLIN)
    assert poller.poll(10_000), "the small request never reached the server"
    assert bed.loop.in_progress == 1
    # the order of service is read at the server (the one-key path's count), not from
    # which reply reaches its peer first: libzmq's I/O thread delivers them later, and
    # on a loaded machine the loop's next turns can finish the big one meanwhile
    small = bed.loop.fast_counts()["EXISTS"]
    for _ in range(1000):
        bed.loop.turn(5)
        if bed.loop.fast_counts()["EXISTS"] > small:
            break
    assert bed.loop.fast_counts()["EXISTS"] == small + 1, "the small request was not served"
    assert bed.loop.in_progress == 1, "the big request was done before the small one"
    assert other.poll(10_000)
    assert protocol.decode_reply(other.recv_multipart()[0])[2] == {"found": [True]}
    for _ in range(1000):
        bed.loop.turn(5)
        if big.poll(0):
            break
    st_, rid, body = protocol.decode_reply(big.recv_multipart()[0])
    assert (st_, rid) == (0, 77) and body["found"] == [i % 2 == 0 for i in range(len(keys))]
    assert bed.loop.fast_counts()["EXISTS_batch"] == n0 + 1


def test_sliced_prefix_stops_at_miss(bed: Bed) -> None:
    keys = [_key(2 * i) for i in range(700)] + [_key(1)] + [_key(0)] * 300
    on, off, d = bed.both([_head(Op.MATCH_PREFIX, 6, {"keys": keys})])
    assert on == off and protocol.decode_reply(on[0])[2] == {"n": 700}


def test_abandoned_on_session_end(bed: Bed) -> None:
    keys = [_key(i) for i in range(_batchq.SLICE_MULT * SLICE * 10)]
    bed.sock.send_multipart([_head(Op.EXISTS, 90, {"keys": keys})])
    for _ in range(1000):
        bed.loop.turn(5)
        if bed.loop.in_progress:
            break
    assert bed.loop.in_progress == 1
    a0 = bed.loop.slice_counters["abandoned"]
    for s in list(bed.loop.sessions()):
        bed.loop.end_session(s, "test")
    for _ in range(5):
        bed.loop.turn(5)
    assert bed.loop.in_progress == 0
    assert bed.loop.slice_counters["abandoned"] == a0 + 1


keys_st = st.lists(st.one_of(st.sampled_from([_key(i) for i in range(0, 60)]),
                             st.binary(min_size=1, max_size=MAX_KEY)),
                   min_size=1, max_size=300)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=keys_st, op=st.sampled_from([Op.EXISTS, Op.MATCH_PREFIX]),
       rid=st.integers(-(2**63), 2**64 - 1))
def test_hypothesis_same_reply(bed: Bed, keys: list[bytes], op: Op, rid: int) -> None:
    on, off, _ = bed.both([_head(op, rid, {"keys": keys})])
    assert on == off


# ------------------------------------------------------------------ the client's end

@settings(max_examples=200, deadline=None)
@given(keys=st.lists(st.binary(min_size=0, max_size=300), max_size=40),
       pad=st.sampled_from([0, 20, 70_000]),
       op=st.integers(0, 2**64 - 1), rid=st.integers(-(2**63), 2**64 - 1),
       epoch=st.integers(-(2**63), 2**64 - 1))
def test_pack_keys_request_is_msgpack(keys: list[bytes], pad: int, op: int, rid: int,
                                      epoch: int) -> None:
    keys = keys + [b"p"] * pad
    got = _batchq.pack_keys_request(PROTOCOL_VERSION, op, rid, epoch, keys)
    assert got == msgpack.packb([PROTOCOL_VERSION, op, rid, epoch, {"keys": keys}],
                                use_bin_type=True)


def test_pack_keys_request_declines() -> None:
    p = _batchq.pack_keys_request
    assert p(PROTOCOL_VERSION, 8, 1, 1, [b"a", "str"]) is None
    assert p(PROTOCOL_VERSION, 8, 1, 1, [b"a", bytearray(b"b")]) is None
    assert p(PROTOCOL_VERSION, 8, 2**64, 1, [b"a"]) is None
    assert p(PROTOCOL_VERSION, 8, True, 1, [b"a"]) is None
    assert p(PROTOCOL_VERSION, 8, 1.0, 1, [b"a"]) is None
    big = [b"k" * 70_000] * 3                   # bin32 keys
    assert p(PROTOCOL_VERSION, 8, 1, 1, big) == msgpack.packb(
        [PROTOCOL_VERSION, 8, 1, 1, {"keys": big}], use_bin_type=True)


@settings(max_examples=200, deadline=None)
@given(found=st.lists(st.booleans(), max_size=40), pad=st.sampled_from([0, 20, 70_000]),
       status=st.integers(0, 127), rid=st.integers(-(2**63), 2**64 - 1))
def test_unpack_found_reply_is_msgpack(found: list[bool], pad: int, status: int,
                                       rid: int) -> None:
    found = found + [True] * pad
    frame = msgpack.packb([PROTOCOL_VERSION, status, rid, {"found": found}])
    assert _batchq.unpack_found_reply(frame, PROTOCOL_VERSION) == (status, rid,
                                                                    {"found": found})
    assert protocol.decode_reply(frame) == (status, rid, {"found": found})


def test_unpack_found_reply_declines() -> None:
    u = _batchq.unpack_found_reply
    good = msgpack.packb([PROTOCOL_VERSION, 0, 5, {"found": [True] * 30}])
    assert u(good, PROTOCOL_VERSION) is not None
    assert u(good, PROTOCOL_VERSION + 1) is None
    assert u(good[:-1], PROTOCOL_VERSION) is None
    assert u(good + b"\xc3", PROTOCOL_VERSION) is None
    assert u(msgpack.packb([PROTOCOL_VERSION, 0, 5, {"found": [True] * 29 + [1]}]),
             PROTOCOL_VERSION) is None
    assert u(msgpack.packb([PROTOCOL_VERSION, 0, 5, {"found": [True] * 30, "x": 1}]),
             PROTOCOL_VERSION) is None
    assert u(msgpack.packb([PROTOCOL_VERSION, 0, 5, {"n": 30}]), PROTOCOL_VERSION) is None
    assert u(msgpack.packb([PROTOCOL_VERSION, 300, 5, {"found": [True] * 30}]),
             PROTOCOL_VERSION) == (300, 5, {"found": [True] * 30})
    # decode_reply still raises what it raised for what the C reader declines
    with pytest.raises(protocol.DecodeError):
        protocol.decode_reply(good[:-1])
    with pytest.raises(protocol.DecodeError):
        protocol.decode_reply(msgpack.packb([1, 0, 5, {"found": [True] * 30}]))


def test_encode_request_uses_c_for_keys() -> None:
    keys = [random.randbytes(random.randint(1, 40)) for _ in range(100)]
    for body in ({"keys": keys}, {"keys": keys, "release": [1]}, {"keys": keys[:3]},
                 {"keys": keys + ["s"]}):
        assert protocol.encode_request(Op.EXISTS, 3, 4, body) == msgpack.packb(
            [PROTOCOL_VERSION, 8, 3, 4, body], use_bin_type=True)


def test_off_switch() -> None:
    """KVSHM_BATCHPATH=0: neither the loop's batch path nor the client's C codec."""
    import os
    import subprocess
    import sys

    code = ("from kvshm.zmq_ctrl import router, protocol; "
            "print(router._BATCH_ON, protocol._batchq is None)")
    for v, want in (("0", "False True"), ("1", "True False")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "KVSHM_BATCHPATH": v})
        assert out.stdout.split() == want.split(), out.stderr
