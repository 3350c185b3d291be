"""break12: run()'s lean turns (FastPath.serve) against the loop's deadlines.

run() makes its full collection (a pause of the whole loop, ~0.1 s at 50 k entries) only
once no request came for ``_FULL_GC_QUIET_S``; it learns that from the turns' "idle"
result. Requests served wholly in C turns did not count: a turn whose serve() ended on a
timer after serving requests said idle, and a steady trickle of requests (one every
20-100 ms) got a full collection every ``_FULL_GC_IDLE_S``."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import zmq

from kvshm.zmq_ctrl import router as router_mod
from kvshm.zmq_ctrl.protocol import Op, Status, decode_reply

from test_srvturn import Running, _head, _needs_fast, _put, call


def test_a_turn_that_served_requests_in_c_is_not_idle(shm_name: str) -> None:
    _needs_fast()
    b = Running(shm_name)
    try:
        b.add_tick(0.2)         # serve() hands back at the tick, on a timed-out wait
        s = b.peer()
        s.send_multipart([_head(Op.PUT, 1, {"keys": [b"k"], "sizes": [1], "counts": [1]}),
                          b"v"])
        deadline = time.monotonic() + 10
        while not s.poll(0) and time.monotonic() < deadline:
            b.loop.turn(50)     # the first message (the session) takes the Python path
        assert decode_reply(s.recv_multipart()[0])[0] == Status.OK
        b.loop.turn(0)
        b.loop._last_full_gc = time.monotonic()     # as run() sets it
        lean0 = b.loop.fast_counts()["lean_turns"]
        s.send(_head(Op.EXISTS, 2, {"keys": [b"k"]}))
        assert s.poll(0) == 0
        # one of run()'s turns: served in C, then the wait until the tick timed out
        idle = b.loop._turn(None, True)
        assert b.loop.fast_counts()["lean_turns"] > lean0, "not a lean turn"
        assert s.poll(5000, zmq.POLLIN)
        st, rid, body = decode_reply(s.recv_multipart()[0])
        assert (st, rid, body) == (Status.OK, 2, {"found": [True]})
        assert idle is False
    finally:
        b.close()


def test_no_full_collection_under_a_steady_trickle(shm_name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: every full collection the loop makes comes after a quiet spell (no
    request for about _FULL_GC_QUIET_S); a stall of this client on a loaded machine may
    make one legitimately, never a steady trickle."""
    _needs_fast()
    monkeypatch.setattr(router_mod, "_FULL_GC_IDLE_S", 0.3)
    quiet = router_mod._FULL_GC_QUIET_S
    b = Running(shm_name)
    full: list[float] = []

    def cb(phase: str, info: dict[str, Any]) -> None:
        if (phase == "start" and info["generation"] == 2 and b.thread is not None
                and threading.get_ident() == b.thread.ident):
            full.append(time.monotonic())

    gc.callbacks.append(cb)
    try:
        b.add_tick(0.1)
        b.start()
        s = b.peer()
        _put(s, 1, b"k", b"v")
        sent: list[float] = []
        n = 0
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            sent.append(time.monotonic())
            st, body, _ = call(s, Op.EXISTS, 10 + n, {"keys": [b"k"]})
            assert st == Status.OK
            n += 1
            time.sleep(0.02)
        assert b.loop.fast_counts()["lean_turns"] > n / 2
        during = [g for g in full if sent[0] + quiet < g < sent[-1]]
        for g in during:
            last = max(t for t in sent if t <= g)
            assert g - last >= 0.9 * quiet, (
                f"a full collection {g - last:.3f} s after a request "
                f"({len(during)} under {n} requests)")
        # quiet afterwards: the collection comes (deferred, not lost)
        deadline = time.monotonic() + 20
        while not [g for g in full if g > sent[-1]] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [g for g in full if g > sent[-1]]
    finally:
        gc.callbacks.remove(cb)
        b.close()
