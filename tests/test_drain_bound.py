"""Channel.drain hands on at most DRAIN_MAX replies a call: a server flooding replies to
other request ids cannot hold a caller that only meant to pick up what was there (before,
drain read for as long as the flood lasted: the lead's follow-up of break13's finding on
requests). Both transports; the hostile server is test_break13's, in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import kvshm.zmq_ctrl.channel as chmod
from kvshm.zmq_ctrl.channel import Channel
from kvshm.zmq_ctrl.protocol import Op

from test_break13 import _SERVER


@pytest.mark.parametrize("zmtp", [False, True], ids=["libzmq", "zmtp"])
def test_drain_stops_at_its_bound_during_a_flood(zmtp, monkeypatch):
    if zmtp and not chmod.ZMTP:
        pytest.skip("the ZMTP transport is not built or is turned off")
    monkeypatch.setattr(chmod, "ZMTP", zmtp)
    total = 1_000_000                   # far more than one drain may take
    p = subprocess.Popen([sys.executable, "-c", _SERVER, "stray", str(total)],
                         stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    ch = None
    try:
        assert p.stdout is not None
        port = int(p.stdout.readline())
        ch = Channel(f"tcp://127.0.0.1:{port}", 5.0)
        assert ch.zmtp == zmtp
        seen: list[int] = []
        ch.on_stray = lambda rid, status, body: seen.append(rid)
        counts = []
        with ch.lock:
            ch.send(Op.EXISTS, {"keys": [b"k"]}, req_id=ch.new_id())
            for _ in range(200000):     # until three drains took something
                seen.clear()
                ch.drain()
                if seen:
                    counts.append(len(seen))
                    assert len(seen) <= chmod.DRAIN_MAX, len(seen)
                    if len(counts) == 3:
                        break
                else:
                    time.sleep(0.001)
            assert len(counts) == 3, "the hostile server sent nothing"
            for _ in range(200000):     # a bound of the caller's
                seen.clear()
                ch.drain(7)
                if seen:
                    break
                time.sleep(0.001)
            assert 0 < len(seen) <= 7, len(seen)
    finally:
        if ch is not None:
            ch.close()
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()
