"""break12: run()'s lean turns (FastPath.serve) against the loop's deadlines."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest

from kvshm.zmq_ctrl import router as router_mod
from kvshm.zmq_ctrl.protocol import Op, Status

from test_srvturn import Running, _needs_fast, _put, call


def test_requests_served_in_lean_turns_keep_the_full_gc_away(
        shm_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """run() makes its full collection (a pause of the whole loop) only once no request
    came for _FULL_GC_QUIET_S: requests served wholly in C turns count as requests. Before
    the fix they did not, and a steady 50 requests/s got a full collection every
    _FULL_GC_IDLE_S."""
    _needs_fast()
    monkeypatch.setattr(router_mod, "_FULL_GC_IDLE_S", 0.3)
    b = Running(shm_name)
    full: list[float] = []

    def cb(phase: str, info: dict[str, Any]) -> None:
        if (phase == "start" and info["generation"] == 2 and b.thread is not None
                and threading.get_ident() == b.thread.ident):
            full.append(time.monotonic())

    gc.callbacks.append(cb)
    try:
        b.add_tick(0.1)         # serve() hands back at each tick, often on a timed-out wait
        b.start()
        s = b.peer()
        _put(s, 1, b"k", b"v")
        full.clear()
        n = 0
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            st, body, _ = call(s, Op.EXISTS, 10 + n, {"keys": [b"k"]})
            assert st == Status.OK
            n += 1
            time.sleep(0.02)
        assert b.loop.fast_counts()["lean_turns"] > n / 2
        assert full == [], f"{len(full)} full collections under {n} requests"
        # quiet afterwards: the collection comes (it is only deferred)
        deadline = time.monotonic() + 20
        while not full and time.monotonic() < deadline:
            time.sleep(0.05)
        assert full
    finally:
        gc.callbacks.remove(cb)
        b.close()
