"""Faults with real processes killed at the worst moment (issue 7).

* a client SIGKILLed after ALLOC and before COMMIT, and one SIGKILLed while holding pins:
  after the lease the server shows pending 0, pinned 0, and exact accounting;
* the server SIGKILLed while clients are mid-put and mid-get: every call raises
  ServerUnavailable within its timeout, the client processes survive, and after a
  restart on the same port the same Client objects work again;
* every exit path leaves no segment and no thread behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

import kvshm
from kvshm import Client, ServerUnavailable
from servers import ServerProcess, bearer, segment_exists, unique_shm_name

HERE = os.path.dirname(__file__)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_for(pred, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def run_py(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": HERE + os.pathsep +
                                 os.environ.get("PYTHONPATH", "")})


def wait_line(proc: subprocess.Popen, want: str, timeout: float = 30.0) -> str:
    """Read the child's stdout until a line starting with ``want`` (readiness, no sleep)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if sel.select(deadline - time.monotonic()):
                line = proc.stdout.readline()
                if not line:
                    raise AssertionError(f"child exited: {proc.stderr.read()}")
                if line.startswith(want):
                    return line
        raise AssertionError(f"no {want!r} line within {timeout}s")
    finally:
        sel.close()


STALL_AFTER_ALLOC = """
    import sys, os, time, kvshm
    from kvshm.movers import ShmMover
    def stall(self, *a):
        print("allocated", flush=True)
        time.sleep(3600)                      # killed here: after ALLOC, before COMMIT
    ShmMover.write = stall
    c = kvshm.Client(sys.argv[1], transport="shm")
    c.put_batch([f"w{i}" for i in range(8)], [b"x" * 200_000] * 8)
"""

HOLD_PINS = """
    import sys, time, kvshm
    from kvshm.movers import ShmMover
    def stall(self, *a):
        print("pinned", flush=True)
        time.sleep(3600)                      # killed here: after LOOKUP, in the copy
    ShmMover.read_bytes = stall
    c = kvshm.Client(sys.argv[1], transport="shm")
    c.get_batch([f"live{i}" for i in range(8)])
"""


def test_dead_writer_and_dead_reader_are_reclaimed(no_local_reads):
    with ServerProcess("--lease-timeout", "1") as srv, Client(srv.address) as c:
        c.put_batch([f"live{i}" for i in range(8)], [bytes([i]) * 100_000 for i in range(8)])
        live_blocks = c.stats()["used_bytes"]
        writer = run_py(STALL_AFTER_ALLOC, srv.address)
        reader = run_py(HOLD_PINS, srv.address)
        try:
            wait_line(writer, "allocated")
            wait_line(reader, "pinned")
            s = c.stats()
            assert s["pending"] == 8 and s["pinned"] == 8
            writer.kill()
            reader.kill()
        finally:
            for p in (writer, reader):
                p.kill()
                p.wait(10)
                p.stdout.close()
                p.stderr.close()
        wait_for(lambda: c.stats()["pending"] == 0 and c.stats()["pinned"] == 0,
                 what="lease expiry")
        s = c.stats(verify=True)
        assert s["accounting_ok"] and s["used_bytes"] == live_blocks
        assert s["lease_expired_writes"] == 1 and s["lease_expired_pins"] == 1
        assert c.exists_batch(["w0", "live0"]) == [False, True]
        # overwrite the pinned-then-freed entries: the blocks are reusable
        c.put_batch([f"live{i}" for i in range(8)], [b"n" * 100_000] * 8)
        assert c.get("live3") == b"n" * 100_000


WORKER = """
    import sys, time, json, numpy as np, kvshm
    address, transport = sys.argv[1], sys.argv[2]
    c = kvshm.Client(address, transport=transport, timeout=2.0)
    vals = [np.full(300_000, i, np.uint8) for i in range(16)]
    keys = [f"{transport}-{i}" for i in range(16)]
    outs = [np.empty(300_000, np.uint8) for _ in range(16)]
    print("ready", flush=True)
    errors = []
    # phase 1: hammer until the server dies; every call must fail within the timeout
    while True:
        t = time.monotonic()
        try:
            c.put_batch(keys, vals)
            c.get_batch_into(keys, outs)
        except kvshm.ServerUnavailable as e:
            errors.append(round(time.monotonic() - t, 3))
            break
    print("unavailable " + json.dumps(errors), flush=True)
    # phase 2: wait for the restart signal, then the same Client object works again
    sys.stdin.readline()
    c.put_batch(keys, vals)
    sizes = c.get_batch_into(keys, outs)
    ok = all(s == 300_000 for s in sizes) and all((o == i).all() for i, o in enumerate(outs))
    print("reconnected " + json.dumps({"ok": ok, "transport": c.transport}), flush=True)
    c.close()
"""


def test_server_killed_mid_traffic_then_restarted():
    port = free_port()
    srv = ServerProcess(service_port=port)
    workers = []
    try:
        for t in ("shm", "tcp"):
            w = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WORKER), srv.address, t],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            workers.append(w)
        for w in workers:
            wait_line(w, "ready")
        time.sleep(0.3)          # let both get mid-traffic (the kill must land mid-call)
        srv.kill()
        for w in workers:
            line = wait_line(w, "unavailable", timeout=20)
            waits = json.loads(line.split(" ", 1)[1])
            assert waits and waits[0] <= 2.0 + 1.0     # the client's timeout, plus slack
        # A SIGKILLed server cannot clean up: its segment stays, unlocked, until the next
        # server on this host starts (or `kvshm ctl cleanup` runs).
        srv2 = ServerProcess(service_port=port)
        try:
            assert not segment_exists(srv.shm_name)    # ... the next server removed it
            for w in workers:
                w.stdin.write("go\n")
                w.stdin.flush()
            for w in workers:
                line = wait_line(w, "reconnected", timeout=30)
                res = json.loads(line.split(" ", 1)[1])
                assert res["ok"], res
                assert w.wait(20) == 0
        finally:
            srv2.stop()
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait(10)
            for f in (w.stdin, w.stdout, w.stderr):
                f.close()
        srv.kill()
        srv.remove_segment()


def test_ctl_cleanup_removes_dead_servers_segment():
    # Names of this test alone, outside "kvshm-": every server start cleans orphans of
    # that prefix machine-wide (a parallel test's start-up would take the dead server's
    # segment first), and this test's cleanup touches nothing of others.
    prefix = f"kvshmx-faults-{os.getpid()}-{uuid.uuid4().hex[:8]}-"
    live = ServerProcess(shm_name=prefix + "live")   # must survive the cleanup
    srv = ServerProcess(shm_name=prefix + "dead")
    try:
        srv.kill()
        assert segment_exists(srv.shm_name)
        r = subprocess.run([sys.executable, "-m", "kvshm", "ctl", "segments",
                            "--prefix", prefix], capture_output=True, text=True,
                           timeout=60)
        states = dict(line.split("\t") for line in r.stdout.splitlines())
        # the pool and its shared index segments (-index, -reads)
        assert states == {**{srv.shm_name + x: "orphaned" for x in ("", "-index", "-reads")},
                          **{live.shm_name + x: "in use" for x in ("", "-index", "-reads")}
                          }, r.stdout
        r = subprocess.run([sys.executable, "-m", "kvshm", "ctl", "cleanup",
                            "--prefix", prefix], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0
        assert f"removed {srv.shm_name}" in r.stdout
        assert not any(segment_exists(srv.shm_name + x) for x in ("", "-index", "-reads"))
        assert all(segment_exists(live.shm_name + x) for x in ("", "-index", "-reads"))
        with Client(live.address) as c:
            c.put("still", b"here")
            assert c.get("still") == b"here"
    finally:
        live.stop()
        srv.remove_segment()


EMBEDDED_EXCEPTION = """
    import sys, kvshm
    srv = kvshm.Server(service_port=0, manage_port=0, prealloc_size=0.05,
                       shm_name=sys.argv[1]).start()
    c = kvshm.Client(srv.address)
    c.put("k", b"v")
    print("up", flush=True)
    raise RuntimeError("the embedding program fails")
"""


def test_embedded_server_removed_when_program_raises():
    name = unique_shm_name("emb-")
    p = run_py(EMBEDDED_EXCEPTION, name)
    out, err = p.communicate(timeout=60)
    assert "up" in out and "RuntimeError" in err
    assert p.returncode != 0
    assert not segment_exists(name)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_signal_with_clients_mid_get_leaves_nothing(sig):
    srv = ServerProcess()
    c = Client(srv.address, timeout=2)
    c.put_batch([f"s{i}" for i in range(32)], [b"s" * 100_000] * 32)
    c.get_batch([f"s{i}" for i in range(32)])        # pins outstanding at shutdown
    assert srv.stop(sig) == 0
    assert not segment_exists(srv.shm_name)
    with pytest.raises(ServerUnavailable):
        c.get("s0")
    c.close()


def test_in_process_server_and_client_leave_no_threads():
    before = {t.name for t in threading.enumerate()}
    srv = kvshm.Server(service_port=0, manage_port=0, prealloc_size=0.05,
                       shm_name=unique_shm_name("thr-")).start()
    import urllib.request
    req = urllib.request.Request(f"http://127.0.0.1:{srv.manage_port}/selftest",
                                 headers=bearer(srv.address))
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read())["ok"]
    with Client(srv.address) as c:
        c.put("t", b"t")
    name = srv.pool.name
    srv.stop()
    after = {t.name for t in threading.enumerate()}
    assert after - before == set()
    assert not segment_exists(name)


def test_client_exception_mid_write_aborts_pending(tmp_path):
    with ServerProcess() as srv, Client(srv.address) as c:
        class Boom(Exception):
            pass

        from kvshm.movers import ShmMover
        orig = ShmMover.write

        def failing(self, *a):
            raise Boom("copy failed")

        ShmMover.write = failing
        try:
            with pytest.raises(Boom):
                c.put_batch(["a", "b"], [b"1" * 70000, b"2" * 70000])
        finally:
            ShmMover.write = orig
        c.flush()                                  # the ABORT rides on this request
        s = c.stats(verify=True)
        assert s["pending"] == 0 and s["used_bytes"] == 0 and s["accounting_ok"]
        assert c.exists_batch(["a", "b"]) == [False, False]
        c.put("a", b"ok")
        assert c.get("a") == b"ok"


def test_stalled_live_client_keeps_its_blocks_past_the_lease(no_local_reads):
    """A client that is alive but stalled past the lease (GC pause, SIGSTOP) must not
    have its blocks handed to another key: its late copy would corrupt that key."""
    import threading

    from kvshm.movers import ShmMover

    with ServerProcess("--lease-timeout", "0.5", "--max-client-pending", "0",
                       prealloc_size=1 / 256) as srv, \
            Client(srv.address, transport="shm") as stalled, \
            Client(srv.address, transport="shm") as other:
        cap = other.stats()["capacity_bytes"]
        orig_write, orig_read = ShmMover.write, ShmMover.read_into
        gate = threading.Event()

        def slow_write(self, *a):
            if threading.current_thread().name == "stalled":
                gate.wait(20)            # stalled after ALLOC, before the copy
            return orig_write(self, *a)

        def slow_read(self, *a):
            if threading.current_thread().name == "stalled":
                gate.wait(20)            # stalled after LOOKUP, before the copy
            return orig_read(self, *a)

        ShmMover.write, ShmMover.read_into = slow_write, slow_read
        try:
            other.put("mine", b"M" * 65536)
            results = {}

            def writer():
                stalled.put("late", b"L" * 65536)
                out = bytearray(65536)
                stalled.get_into("mine", out)
                results["read"] = bytes(out)

            t = threading.Thread(target=writer, name="stalled")
            t.start()
            wait_for(lambda: other.stats()["pending"] == 1, what="the stalled ALLOC")
            wait_for(lambda: other.stats()["held_grants"] == 1, what="the lease to expire")
            # churn: fill the pool again and again while the writer is stalled
            for i in range(3):
                other.purge()
                n = cap // 65536 - 2
                other.put_batch([f"fill{j}" for j in range(n)],
                                [bytes([i]) * 65536] * n)
                assert other.get("fill3") == bytes([i]) * 65536
            other.put("mine", b"M" * 65536)
            gate.set()                   # the write resumes and is committed
            # now stall the read: LOOKUP, lease runs out, the key is deleted and refilled
            gate.clear()
            wait_for(lambda: other.stats()["pinned"] >= 1, what="the stalled LOOKUP")
            wait_for(lambda: other.stats()["held_grants"] == 1, what="the pin's lease")
            assert other.get("late") == b"L" * 65536   # the held write was committed
            other.delete(["mine"])
            other.purge()
            n = cap // 65536 - 2
            other.put_batch([f"refill{j}" for j in range(n)], [b"X" * 65536] * n)
            gate.set()
            t.join(20)
            assert results["read"] == b"M" * 65536     # the old bytes, intact
            for j in range(0, n, 7):
                assert other.get(f"refill{j}") == b"X" * 65536
            stalled.flush()
            s = other.stats(verify=True)
            assert s["accounting_ok"] and s["held_grants"] == 0 and s["pending"] == 0
        finally:
            ShmMover.write, ShmMover.read_into = orig_write, orig_read
            gate.set()
