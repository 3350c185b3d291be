"""Every request the server takes gets a reply, and the loop keeps serving, when handling
it raises after a path took it: the C batch path's Python part (a sliced batch EXISTS),
a reply that cannot be encoded (whole, in slices, or a large one encoded over turns).
Each is answered with the server's generic error status (INTERNAL), counted as an
internal error, and the next request is served (before: no reply at all, the client
waited for its timeout; in slices or over turns the exception left ``turn()``, which
stops the server's loop)."""

from __future__ import annotations

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
    """A loop over TCP with one DEALER peer (as tests/test_srvdisp.py's), ``slice_keys``
    chosen by the test."""

    def __init__(self, name: str, slice_keys: int) -> None:
        self.ctx = zmq.Context()
        self.pool = Pool.create(name, 512 * BS, BS)
        self.store = Store(self.pool, StoreConfig(limits=Limits(max_batch=100_000)))
        self.loop = router_mod.ServiceLoop(self.store, ["tcp://127.0.0.1:0"],
                                           {"version": PROTOCOL_VERSION}, EPOCH,
                                           context=self.ctx, slice_keys=slice_keys)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.loop.endpoints[0])

    def req(self, op: int, rid: int, body: Any) -> tuple[int, int, dict[str, Any]]:
        self.sock.send_multipart([msgpack.packb([PROTOCOL_VERSION, int(op), rid, EPOCH,
                                                 body], use_bin_type=True)])
        for _ in range(400):
            self.loop.turn(5)
            if self.sock.poll(0):
                parts = self.sock.recv_multipart()
                assert not self.sock.poll(50), "a second reply"
                return decode_reply(parts[0])
        raise AssertionError("no reply")

    def close(self) -> None:
        self.sock.close(0)
        self.loop.close()
        self.ctx.term()
        self.pool.close()
        self.pool.unlink()


def _bed(name: str, slice_keys: int) -> Iterator[Bed]:
    b = Bed(name, slice_keys)
    assert b.req(Op.EXISTS, 1, {"keys": [b"warm-up"]})[2] == {"found": [False]}
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def bed(shm_name: str) -> Iterator[Bed]:
    yield from _bed(shm_name, 8)


@pytest.fixture
def wide(shm_name: str) -> Iterator[Bed]:
    yield from _bed(shm_name, 20_000)       # no slices: a large reply is encoded over turns


def _internal(b: Bed, before: int) -> None:
    assert b.loop.errors.get("internal", 0) == before + 1


def _unencodable_lookup(b: Bed, monkeypatch: pytest.MonkeyPatch) -> None:
    """store.lookup answers something msgpack cannot encode (a handler bug)."""
    real = b.store.lookup

    def lookup(*a: Any, **k: Any) -> Any:
        offs, sizes, sums = real(*a, **k)
        return [object()] * len(offs), sizes, sums

    monkeypatch.setattr(b.store, "lookup", lookup)


def test_sliced_batch_exists_of_the_c_path_is_answered(bed: Bed,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if bed.loop._batchq is None:
        pytest.skip("kvshm.zmq_ctrl._batchq not built, or KVSHM_BATCHPATH=0")

    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(bed.loop, "_sliced_c", boom)
    n0 = bed.loop.errors.get("internal", 0)
    keys = [b"key-%06d" % i for i in range(200)]       # > SLICE_MULT * 8: sliced in C
    st, rid, body = bed.req(Op.EXISTS, 5, {"keys": keys})
    assert (st, rid) == (Status.INTERNAL, 5) and "injected" in body["error"]
    _internal(bed, n0)
    monkeypatch.undo()
    st, rid, body = bed.req(Op.EXISTS, 6, {"keys": keys})
    assert (st, rid) == (Status.OK, 6) and body["found"] == [False] * 200


@pytest.mark.parametrize("nkeys", [3, 50])         # whole; in slices of 8
def test_lookup_reply_that_cannot_be_encoded(bed: Bed, monkeypatch: pytest.MonkeyPatch,
                                             nkeys: int) -> None:
    _unencodable_lookup(bed, monkeypatch)
    n0 = bed.loop.errors.get("internal", 0)
    st, rid, body = bed.req(Op.LOOKUP, 7, {"keys": [b"x%d" % i for i in range(nkeys)]})
    assert (st, rid) == (Status.INTERNAL, 7), body
    _internal(bed, n0)
    monkeypatch.undo()
    st, rid, body = bed.req(Op.EXISTS, 8, {"keys": [b"nope"]})
    assert (st, rid, body) == (Status.OK, 8, {"found": [False]})


def test_large_reply_that_cannot_be_encoded(wide: Bed,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    real = wide.store.lookup

    def lookup(*a: Any, **k: Any) -> Any:
        offs, sizes, sums = real(*a, **k)
        return list(offs[:-1]) + [object()], sizes, sums      # the last item only

    monkeypatch.setattr(wide.store, "lookup", lookup)
    n0 = wide.loop.errors.get("internal", 0)
    keys = [b"y%d" % i for i in range(17_000)]      # > STREAM_REPLY_ITEMS items
    st, rid, body = wide.req(Op.LOOKUP, 9, {"keys": keys})
    assert (st, rid) == (Status.INTERNAL, 9), body
    _internal(wide, n0)
    monkeypatch.undo()
    st, rid, body = wide.req(Op.EXISTS, 10, {"keys": [b"nope"]})
    assert (st, rid, body) == (Status.OK, 10, {"found": [False]})


def test_dispatch_bug_outside_the_handlers_is_answered(bed: Bed,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the Python dispatch before the handler (here: finding the session) is
    answered INTERNAL, once."""
    def boom(ident: bytes, src: Any = None) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(bed.loop, "_session_of", boom)
    n0 = bed.loop.errors.get("internal", 0)
    st, rid, body = bed.req(Op.LOOKUP, 11, {"keys": [b"a", b"b"]})
    assert (st, rid) == (Status.INTERNAL, 11) and "injected" in body["error"]
    _internal(bed, n0)
    monkeypatch.undo()
    st, rid, body = bed.req(Op.EXISTS, 12, {"keys": [b"nope"]})
    assert (st, rid, body) == (Status.OK, 12, {"found": [False]})


def test_bug_after_the_reply_is_not_answered_twice(bed: Bed,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug after the reply went (here: recording its latency) is logged and counted;
    the request is not answered a second time (Bed.req checks)."""
    def boom(op: int, t0: float) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(bed.loop, "_record_latency", boom)
    n0 = bed.loop.errors.get("internal", 0)
    st, rid, body = bed.req(Op.LOOKUP, 13, {"keys": [b"a", b"b"]})
    assert (st, rid) == (Status.OK, 13)
    _internal(bed, n0)
