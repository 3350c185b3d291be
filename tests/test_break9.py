"""Hostile review of the server's one-key fast path (kvshm.zmq_ctrl._fastpath) and the
batch paths in C (PackedValues, small_frames, read_groups, contains_many), each finding a
test that failed before its fix. Requests go over a raw DEALER to a loop whose store has
the shared index attached (as every server has by default), through the fast path and,
for the same bytes, with it off: both must answer alike and leave the store sound."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from kvshm._pool import Pool
from kvshm._shmindex import IndexReader, IndexWriter, default_slots
from kvshm.limits import Limits
from kvshm.store import Store, StoreConfig
from kvshm.zmq_ctrl import router as router_mod
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, Status, decode_reply

BS = 4096
EPOCH = 7
TABLE_EPOCH = 3


class Bed:
    """A loop over TCP with one DEALER peer, its store publishing into a shared table;
    ``fast``: the one-key fast path on (else the Python path serves everything)."""

    def __init__(self, name: str, fast: bool = True, blocks: int = 64, **limits: Any) -> None:
        self.ctx = zmq.Context()
        self.pool = Pool.create(name, blocks * BS, BS)
        self.store = Store(self.pool, StoreConfig(limits=Limits(**limits)))
        self.writer = IndexWriter.create(name + "-index", name + "-reads",
                                         default_slots(blocks), epoch=TABLE_EPOCH,
                                         block_size=BS, num_blocks=blocks,
                                         token=self.pool.token)
        self.store.index.attach_shared(self.writer)
        self.loop = router_mod.ServiceLoop(self.store, ["tcp://127.0.0.1:0"],
                                           {"version": PROTOCOL_VERSION}, EPOCH,
                                           context=self.ctx)
        if not fast:
            self.loop._fast = None
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.loop.endpoints[0])
        # the peer's implicit session (no door): opened by its first request
        self.req(Op.EXISTS, 1, {"keys": [b"warm-up"]})

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

    def reader(self) -> IndexReader:
        return IndexReader(self.writer.name, self.writer.reads_name, self.pool, TABLE_EPOCH)

    def close(self) -> None:
        self.sock.close(0)
        self.loop.close()
        self.ctx.term()
        self.store.index.detach_shared()
        self.writer.unlink()
        self.pool.close()
        self.pool.unlink()


def _head(op: int, rid: int, body: Any, version: int = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb([version, int(op), rid, EPOCH, body], use_bin_type=True)


def _needs_fast() -> None:
    if router_mod._zmqc is None or router_mod._fastpath is None or not router_mod._FAST_ON:
        pytest.skip("kvshm.zmq_ctrl._zmqc/_fastpath not built, or KVSHM_FASTPATH=0")


@pytest.fixture(params=[True, False], ids=["fast", "python"])
def bed(request: pytest.FixtureRequest, shm_name: str) -> Iterator[Bed]:
    if request.param:
        _needs_fast()
    b = Bed(shm_name, fast=request.param)
    yield b
    b.close()


def _sound(b: Bed) -> None:
    s = b.store.stats(verify=True)
    assert s["accounting_ok"], s
    assert b.store._pins == 0
    assert b.loop.errors.get("internal", 0) == 0, b.loop.errors


# ------------------------------------------------------------------ finding 1
# A checksum outside uint64 (sums: [-1]) reached the shared table's publish, which
# raised OverflowError between the slot's begin and end of write: the PUT was answered
# INTERNAL, the key's old value leaked its blocks for good (accounting_ok False; a
# hostile peer could fill the pool so), and the slot's version stayed odd, so every
# same-host lock-free read of that key fell back to the server from then on, even after
# a good overwrite (its seqlock parity inverted).

@pytest.mark.parametrize("nkeys", [1, 2])
def test_a_checksum_outside_uint64_leaks_nothing_and_keeps_the_slot(bed: Bed,
                                                                    nkeys: int) -> None:
    keys = [b"k%d" % i for i in range(nkeys)]
    old = [os.urandom(100) for _ in keys]
    new = [os.urandom(100) for _ in keys]
    good = [os.urandom(100) for _ in keys]

    def put(rid: int, vals: list[bytes], sums: Any = None) -> Any:
        body: dict[str, Any] = {"keys": keys, "sizes": [100] * nkeys, "counts": [1] * nkeys}
        if sums is not None:
            body["sums"] = sums
        if nkeys == 1:
            return bed.req(Op.PUT, rid, body, vals)[:3]
        body["counts"] = [nkeys]                    # packed: PackedValues
        return bed.req(Op.PUT, rid, body, [b"".join(vals)])[:3]

    assert put(2, old) == (Status.OK, 2, {"st": [0] * nkeys})
    r = bed.reader()
    try:
        assert [r.get(k) for k in keys] == old
        for rid, bad in ((3, -1), (4, -(2**63)), (5, -33)):
            assert put(rid, new, [bad] * nkeys) == (Status.OK, rid, {"st": [0] * nkeys})
            _sound(bed)
            # stored without a checksum (as a PLACE's out-of-range sum is kept)
            st, _, body, frames = bed.req(Op.GET, 10 + rid, {"keys": keys})
            assert st == Status.OK and "sums" not in body
            assert [r.get(k) for k in keys] == new
        assert put(6, good, [7] * nkeys) == (Status.OK, 6, {"st": [0] * nkeys})
        assert [r.get(k) for k in keys] == good
        assert r.fallbacks == 0
    finally:
        r.close()
    _sound(bed)
    assert bed.store.alloc.num_used == nkeys      # one block each: nothing leaked


def test_an_alloc_with_a_negative_checksum_commits_soundly(shm_name: str) -> None:
    b = Bed(shm_name, fast=False)
    try:
        st = b.store
        sess = st.open_session(("peer", b"x"))
        offs, sts = st.alloc_entries(sess, 1, [b"a"], [10], [-5])
        assert sts == [0]
        b.pool.write(offs[0], b"0123456789")
        assert st.commit(sess, [1]) == []
        assert st.index.get(b"a").checksum is None
        r = b.reader()
        try:
            assert r.get(b"a") == b"0123456789"
        finally:
            r.close()
        assert st.stats(verify=True)["accounting_ok"]
    finally:
        b.close()


def test_publish_refusing_a_checksum_changes_no_slot(shm_name: str) -> None:
    b = Bed(shm_name, fast=False)
    try:
        assert b.req(Op.PUT, 2, {"keys": [b"k"], "sizes": [3], "counts": [1]},
                     [b"abc"])[2] == {"st": [0]}
        e = b.store.index.get(b"k")
        with pytest.raises(OverflowError):
            b.writer.publish(b"k", 3, [(e.start, 1)], -1)
        r = b.reader()
        try:
            assert r.get(b"k") == b"abc" and r.fallbacks == 0
        finally:
            r.close()
    finally:
        b.close()


# ------------------------------------------------------------------ held (a guard)
# The same seeded stream of one-key requests, many of them hand-crafted or mutated
# (every msgpack int width, key in bin8/16/32, fields in any order, checksums of every
# sign and width, bytes flipped, cut or inserted), to a fast-path loop and to a
# Python-path loop: replies byte for byte, the store's counters, keys, LRU order, pins
# and accounting alike. (Before the checksum fix a negative sum broke accounting here.)

def _enc_int(rnd: Any, v: int) -> bytes:
    import struct

    opts = []
    if 0 <= v <= 0x7f:
        opts.append(bytes([v]))
    if -32 <= v < 0:
        opts.append(struct.pack("b", v))
    for tag, fmt, lo, hi in ((0xcc, ">B", 0, 2**8), (0xcd, ">H", 0, 2**16),
                             (0xce, ">I", 0, 2**32), (0xcf, ">Q", 0, 2**64),
                             (0xd0, ">b", -2**7, 2**7), (0xd1, ">h", -2**15, 2**15),
                             (0xd2, ">i", -2**31, 2**31), (0xd3, ">q", -2**63, 2**63)):
        if lo <= v < hi:
            opts.append(bytes([tag]) + struct.pack(fmt, v))
    return rnd.choice(opts)


def _crafted(rnd: Any) -> list[bytes]:
    import struct

    def fs(s: bytes) -> bytes:
        return bytes([0xa0 | len(s)]) + s

    op = rnd.choice([Op.PUT, Op.GET, Op.EXISTS])
    key = rnd.choice([b"a", b"bb", b"k" * 100, b"\xff"])
    rid = rnd.choice([0, 127, 128, 65536, 2**63 - 1, 2**64 - 1, -1, -33, -2**63])
    x = rnd.random()
    kb = (b"\xc4" + bytes([len(key)]) if x < 0.6 else
          b"\xc5" + struct.pack(">H", len(key)) if x < 0.9 else
          b"\xc6" + struct.pack(">I", len(key))) + key
    fields = [fs(b"keys") + b"\x91" + kb]
    frames = []
    if op == Op.PUT:
        v = rnd.choice([b"", b"x", bytes(300), os.urandom(5000)])
        fields.append(fs(b"sizes") + b"\x91" + _enc_int(rnd, len(v)))
        fields.append(fs(b"counts") + b"\x91" + _enc_int(rnd, 1))
        if rnd.random() < 0.4:
            fields.append(fs(b"sums") + b"\x91" + _enc_int(
                rnd, rnd.choice([0, 5, 2**64 - 1, 2**63, -1, -2**63])))
        frames = [v]
    rnd.shuffle(fields)
    head = (b"\x95" + _enc_int(rnd, PROTOCOL_VERSION) + _enc_int(rnd, int(op))
            + _enc_int(rnd, rid) + _enc_int(rnd, rnd.choice([EPOCH, 0, 2**64 - 1]))
            + bytes([0x80 | len(fields)]) + b"".join(fields))
    if rnd.random() < 0.4:
        b = bytearray(head)
        for _ in range(rnd.randrange(1, 3)):
            i = rnd.randrange(len(b))
            y = rnd.random()
            if y < 0.6:
                b[i] = rnd.randrange(256)
            elif y < 0.8:
                del b[i]
            else:
                b.insert(i, rnd.randrange(256))
        head = bytes(b)
    return [head, *frames]


def test_crafted_requests_fast_and_python_alike(shm_name: str) -> None:
    _needs_fast()
    import random

    rnd = random.Random(9)
    script = [_crafted(rnd) for _ in range(300)]
    seen = {}
    for fast in (True, False):
        b = Bed(shm_name + ("-f" if fast else "-p"), fast=fast, blocks=16)
        try:
            replies = [b.raw(p) for p in script]
            _sound(b)
            st = b.store
            seen[fast] = (replies, dict(st.counters), st.alloc.num_used,
                          [(e.key, e.size, e.checksum) for e in st.index.lru()])
            if fast:
                c = b.loop.fast_counts()
                assert c["PUT"] and c["GET"] and c["EXISTS"] and c["declined"]
        finally:
            b.close()
    assert seen[True][0] == seen[False][0]
    assert seen[True][1:] == seen[False][1:]
