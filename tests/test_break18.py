"""break18: attacks on the work merged to main at 03:00-03:50 UTC (gcpause2's decoder
without a reference cycle, tcpbatch's pipelined exists_batch / Channel.request_many /
pack_keys_request, debt's server no-reply fixes and the write-behind/lazy-commit
reporting). Each finding's test failed before its fix; the others held."""

from __future__ import annotations

import os
import signal

import pytest

import kvshm.client as client_mod
from kvshm import Client
from kvshm.errors import LeaseExpired, ServerUnavailable
from kvshm.zmq_ctrl.protocol import Op
from servers import ServerProcess
from test_faults import free_port


@pytest.mark.parametrize("pipeline", [False, True], ids=["one", "pipelined"])
def test_pipelined_exists_after_restart_reports_lazy_commits_lost(monkeypatch, pipeline):
    """Lazy COMMITs ride on the first part of a pipelined exists_batch; a new server on
    the same port (new epoch) answers it STALE_EPOCH, so no server applied them. As for
    the one request (_roundtrip, 31012e6), the next call must raise LeaseExpired for
    those puts (before: _roundtrip_many requeued them without ``unapplied``: dropped,
    flush() passed and the keys were silently missing)."""
    monkeypatch.setattr(client_mod, "IDLE_FLUSH_S", 3600.0)
    monkeypatch.setattr(client_mod, "PIPELINE", pipeline)
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 100)
    # exists_batch through the server (the same-host index would answer it here)
    monkeypatch.setattr(client_mod.localread, "fits", lambda keys, limits: False)
    port = free_port()
    srv = ServerProcess(service_port=port, prealloc_size=1 / 64)
    srv2 = None
    c = None
    try:
        c = Client(srv.address, lazy_commit=True, transport="shm", timeout=5)
        c.put("before", b"x" * 100)
        c.flush()
        for i in range(3):
            c.put(f"after{i}", bytes([i]) * 9000)      # COMMIT queued (lazy)
        assert c._session.commits
        srv.kill()
        srv.remove_segment()
        srv2 = ServerProcess(service_port=port, prealloc_size=1 / 64)
        keys = [f"probe{i}".encode() for i in range(1000)]
        seen: list[BaseException] = []
        for _ in range(10):
            try:
                assert c.exists_batch(keys) == [False] * 1000
                break
            except (LeaseExpired, ServerUnavailable) as exc:
                seen.append(exc)
        for _ in range(10):
            try:
                c.flush()
                break
            except (LeaseExpired, ServerUnavailable) as exc:
                seen.append(exc)
        with Client(srv2.address, transport="tcp") as other:
            stored = [other.exists(f"after{i}") for i in range(3)]
        assert stored == [False] * 3
        assert any(isinstance(e, LeaseExpired) for e in seen), seen
    finally:
        if c is not None:
            c.close()
        srv.kill()
        srv.remove_segment()
        if srv2 is not None:
            srv2.stop()
