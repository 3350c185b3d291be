"""The loop's common turns in C (FastPath.serve, from ServiceLoop.run): one-key requests
served a turn at a time without the Python turn, while timers (ticks, leases, liveness
checks) still run on schedule, large requests still go in slices beside them, and stop()
still ends the loop at once."""

from __future__ import annotations

import threading
import time
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


def _head(op: int, rid: int, body: Any) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, int(op), rid, EPOCH, body], use_bin_type=True)


class Running:
    """A loop over TCP served by ``run()`` on a thread, and DEALER peers."""

    def __init__(self, name: str, lease_timeout: float = 10.0, **kw: Any) -> None:
        self.ctx = zmq.Context()
        self.pool = Pool.create(name, 2048 * BS, BS)
        self.store = Store(self.pool, StoreConfig(limits=Limits(),
                                                  lease_timeout=lease_timeout))
        self.loop = router_mod.ServiceLoop(self.store, ["tcp://127.0.0.1:0"],
                                           {"version": PROTOCOL_VERSION}, EPOCH,
                                           context=self.ctx, **kw)
        self.ticks: list[float] = []
        self.socks: list[zmq.Socket] = []
        self.thread: threading.Thread | None = None

    def add_tick(self, every: float) -> None:
        def tick(now: float) -> float:
            self.ticks.append(now)
            return now + every
        self.loop.add_ops({}, tick)

    def start(self) -> None:
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def peer(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.loop.endpoints[0])
        self.socks.append(s)
        return s

    def close(self) -> None:
        self.loop.stop()
        if self.thread is not None:
            self.thread.join(10)
            assert not self.thread.is_alive()
        for s in self.socks:
            s.close(0)
        self.loop.close()
        self.ctx.term()
        self.pool.close()
        self.pool.unlink()


def call(s: zmq.Socket, op: int, rid: int, body: Any, frames: list[Any] = (),  # type: ignore[assignment]
         ) -> tuple[int, dict[str, Any], list[bytes]]:
    s.send_multipart([_head(op, rid, body), *frames])
    assert s.poll(10000), "no reply"
    parts = s.recv_multipart()
    st, got, rbody = decode_reply(parts[0])
    assert got == rid
    return st, rbody, parts[1:]


def _needs_fast() -> None:
    if router_mod._zmqc is None or router_mod._fastpath is None or not router_mod._FAST_ON:
        pytest.skip("kvshm.zmq_ctrl._zmqc/_fastpath not built, or KVSHM_FASTPATH=0")


@pytest.fixture
def bed(shm_name: str) -> Iterator[Running]:
    _needs_fast()
    b = Running(shm_name)
    yield b
    b.close()


def _stream(s: zmq.Socket, seconds: float, rid0: int = 100) -> int:
    """One EXISTS at a time (window 1) for ``seconds``; returns how many."""
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        st, body, _ = call(s, Op.EXISTS, rid0 + n, {"keys": [b"k"]})
        assert st == Status.OK and body == {"found": [True]}
        n += 1
    return n


def _put(s: zmq.Socket, rid: int, key: bytes, val: bytes) -> None:
    st, body, _ = call(s, Op.PUT, rid, {"keys": [key], "sizes": [len(val)], "counts": [1]},
                       [val])
    assert st == Status.OK, body


def test_one_request_a_turn_is_served_by_lean_turns(bed: Running) -> None:
    bed.start()
    s = bed.peer()
    _put(s, 1, b"k", b"v" * 100)
    n = _stream(s, 0.3)
    st, body, parts = call(s, Op.GET, 2, {"keys": [b"k"]})
    assert st == Status.OK and b"".join(parts) == b"v" * 100
    c = bed.loop.fast_counts()
    assert c["EXISTS"] >= n
    # nearly every request's turn ran wholly in C
    assert c["lean_turns"] >= n - 10, c
    assert c["lean_returns"] < n / 4, c


def test_ticks_run_on_schedule_not_every_turn(bed: Running) -> None:
    bed.add_tick(0.05)
    bed.start()
    s = bed.peer()
    _put(s, 1, b"k", b"v")
    bed.ticks.clear()
    n = _stream(s, 0.6)
    calls = len(bed.ticks)
    assert n > 50
    # every 50 ms under the stream (a loaded machine may run late, never skip them all)
    assert calls >= 4, calls
    assert calls < n / 2, (calls, n)
    gaps = [b - a for a, b in zip(bed.ticks, bed.ticks[1:])]
    assert min(gaps) >= 0.045, gaps


def test_a_lease_expires_on_schedule_under_a_stream(shm_name: str) -> None:
    _needs_fast()
    b = Running(shm_name, lease_timeout=0.3)
    try:
        b.start()
        s = b.peer()
        _put(s, 1, b"k", b"v")
        st, body, _ = call(s, Op.ALLOC, 2, {"keys": [b"a"], "sizes": [10]})
        assert st == Status.OK, body
        assert b.store.stats()["grants"] == 1
        lean0 = b.loop.fast_counts()["lean_turns"]
        _stream(s, 1.0)
        # the grant was reclaimed (its lease ran out) while the stream ran lean turns
        assert b.store.stats()["grants"] == 0
        assert b.loop.fast_counts()["lean_turns"] > lean0
    finally:
        b.close()


def test_a_sliced_batch_beside_a_stream(shm_name: str) -> None:
    _needs_fast()
    b = Running(shm_name, slice_keys=16)
    try:
        b.start()
        s, big = b.peer(), b.peer()
        _put(s, 1, b"k", b"v")
        keys = [b"b%d" % i for i in range(200)]
        vals = [b"x" * 64] * len(keys)
        big.send_multipart([_head(Op.PUT, 9, {"keys": keys, "sizes": [64] * len(keys),
                                              "counts": [1] * len(keys)}), *vals])
        n = _stream(s, 0.2)
        assert big.poll(10000)
        st, got, body = decode_reply(big.recv_multipart()[0])
        assert (st, got) == (Status.OK, 9), body
        assert b.loop.slice_counters["sliced_requests"] >= 1
        st, body, _ = call(s, Op.EXISTS, 5, {"keys": keys[-3:]})
        assert body == {"found": [True] * 3}
        assert n > 0 and b.loop.fast_counts()["lean_turns"] > 0
    finally:
        b.close()


def test_stop_ends_the_loop_during_a_stream(bed: Running) -> None:
    bed.start()
    s = bed.peer()
    _put(s, 1, b"k", b"v")
    _stream(s, 0.1)
    t0 = time.monotonic()
    bed.loop.stop()
    assert bed.thread is not None
    bed.thread.join(5)
    assert not bed.thread.is_alive()
    assert time.monotonic() - t0 < 2


def test_a_poke_wakes_the_python_turn(bed: Running) -> None:
    bed.add_tick(3600.0)
    bed.start()
    s = bed.peer()
    _put(s, 1, b"k", b"v")
    _stream(s, 0.1)
    before = bed.loop.fast_counts()["lean_returns"]
    n0 = len(bed.ticks)
    bed.loop.poke()
    for _ in range(200):
        if len(bed.ticks) > n0:
            break
        time.sleep(0.01)
    # the wake pipe ends the C turns: the Python turn ran (its ticks with it)
    assert len(bed.ticks) > n0
    assert bed.loop.fast_counts()["lean_returns"] > before


def test_wait_in_reports_what_poll_in_reports() -> None:
    """_zmqc.wait_in: 0 on a timeout, 2 the fd, 1 a queued message (found through
    ZMQ_EVENTS, at once); with a monitor socket it is poll_in."""
    if router_mod._zmqc is None:
        pytest.skip("kvshm.zmq_ctrl._zmqc not built")
    import os
    zc = router_mod._zmqc
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    r, w = os.pipe()
    try:
        a.bind("inproc://wait-in")
        b.connect("inproc://wait-in")
        assert zc.wait_in(a, r, None, 10) == 0
        os.write(w, b"x")
        assert zc.wait_in(a, r, None, 1000) == 2
        os.read(r, 1)
        b.send(b"m")
        assert zc.wait_in(a, r, None, 1000) & 1
        assert zc.wait_in(a, r, None, 0) == 1          # still queued: ZMQ_EVENTS says so
        assert a.recv() == b"m"
        assert zc.wait_in(a, r, None, 10) in (0, 1)     # 1: a spurious wake (a command)
        assert zc.wait_in(a, r, None, 10) == 0
    finally:
        os.close(r)
        os.close(w)
        a.close(0)
        b.close(0)
        ctx.term()
