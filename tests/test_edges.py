"""Edge cases found by review: each was a wrong byte, a hang, a leak or a traceback."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest
import zmq

import kvshm
from kvshm import Client
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op
from servers import ServerProcess, raw_hello


@pytest.fixture(scope="module")
def server():
    with ServerProcess(prealloc_size=1 / 16) as s:
        yield s


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_strided_value_is_refused_and_nothing_is_half_sent(server, transport):
    with Client(server.address, transport=transport, timeout=5) as c:
        c.put("victim", b"good value")
        with pytest.raises(ValueError, match="contiguous"):
            c.put("victim", np.arange(200, dtype=np.uint8)[::2])
        assert c.exists("other") is False            # the connection is still sound
        assert c.get("victim") == b"good value"      # and nothing was overwritten
        with pytest.raises(ValueError, match="contiguous"):
            c.get_into("victim", np.zeros(40, np.uint8)[::2])


def test_strided_value_async(server):
    async def main():
        async with kvshm.AsyncClient(server.address, transport="tcp", timeout=5) as a:
            await a.put("avictim", b"good")
            with pytest.raises(ValueError):
                await a.put("avictim", np.arange(200, dtype=np.uint8)[::2])
            assert await a.exists("other") is False
            assert await a.get("avictim") == b"good"

    asyncio.run(main())


@pytest.mark.parametrize("slice_keys", ["2048", "1"])
def test_a_commit_sent_again_is_answered_as_the_first(slice_keys):
    # a client whose COMMIT reply was lost sends the identical COMMIT again: answered
    # as the first was (no commit_failed: no LeaseExpired reported for a write that
    # is in), and the value is there; an unknown grant's COMMIT still fails. With
    # --slice-keys 1 the first COMMIT (of 3 entries) is settled in slices
    with ServerProcess("--slice-keys", slice_keys) as srv:
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{srv.address}")
        try:
            def call(op, body, rid):
                s.send(msgpack.packb([PROTOCOL_VERSION, op, rid, epoch, body]))
                assert s.poll(10000)
                return msgpack.unpackb(s.recv())

            epoch = raw_hello(s, srv.address)["epoch"]
            r = call(Op.ALLOC, {"keys": [b"r0", b"r1", b"r2"], "sizes": [10] * 3}, 2)
            assert r[1] == 0 and r[3]["st"] == [0, 0, 0], r
            first = call(Op.COMMIT, {"commit": [2]}, 3)
            again = call(Op.COMMIT, {"commit": [2]}, 3)          # the same message
            assert first[1] == again[1] == 0, (first, again)
            assert "commit_failed" not in first[3], first
            assert "commit_failed" not in again[3], again
            r = call(Op.EXISTS, {"keys": [b"r0", b"r2"], "commit": [2]}, 4)
            assert r[3]["found"] == [True, True] and "commit_failed" not in r[3], r
            r = call(Op.COMMIT, {"commit": [99]}, 5)
            assert r[3].get("commit_failed") == [99], r
        finally:
            s.close()


def test_lazy_commit_refused_late_is_reported(tmp_path):
    with ServerProcess("--lease-timeout", "0.3") as srv:
        # a raw client (no pid in HELLO: remote) whose commit arrives after its lease
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{srv.address}")
        try:
            def call(op, body, rid):
                s.send(msgpack.packb([PROTOCOL_VERSION, op, rid, epoch, body]))
                assert s.poll(5000)
                return msgpack.unpackb(s.recv())

            epoch = raw_hello(s, srv.address)["epoch"]
            r = call(Op.ALLOC, {"keys": [b"lazy"], "sizes": [10]}, 2)
            assert r[3]["st"] == [0]
            time.sleep(0.8)                               # the lease runs out
            r = call(Op.EXISTS, {"keys": [b"x"], "commit": [2]}, 3)
            assert r[3].get("commit_failed") == [2]
        finally:
            s.close()
        # the client library turns such a report into LeaseExpired on flush/next put
        sess = kvshm.client._Session("tcp", True)
        sess.lazy_rids[7] = None
        sess.note_reply({"commit_failed": [7]})
        with pytest.raises(kvshm.LeaseExpired):
            sess.raise_lost_commits()


def test_many_pins_do_not_slow_eviction(tmp_path):
    from kvshm import Pool
    from kvshm.store import Store
    from servers import unique_shm_name

    pool = Pool.create(unique_shm_name("pins-"), 4096 * 20000, 4096)
    try:
        st = Store(pool)
        for i in range(20000):
            o, s = st.alloc_entries(b"w", i + 1, [b"k%d" % i], [100])
            st.commit(b"w", [i + 1])
        st.lookup(b"reader", 1, [b"k%d" % i for i in range(15000)])   # the oldest pinned
        t = time.perf_counter()
        for i in range(2000):
            o, s = st.alloc_entries(b"w", 100000 + i, [b"n%d" % i], [100])
            st.commit(b"w", [100000 + i])
        took = time.perf_counter() - t
        assert st.counters["evictions"] == 2000
        assert st.exists([b"k0", b"k14999"]) == [True, True]       # pinned: kept
        assert st.stats(verify=True)["accounting_ok"]
        # without moving pinned entries out of the way this took seconds (O(pins) each)
        assert took < 2.0, took
        st.release(b"reader", [1])
    finally:
        pool.close()
        pool.unlink()


def test_unread_zero_copy_replies_cannot_pin_the_pool():
    with ServerProcess("--lease-timeout", "2", prealloc_size=1 / 16) as srv, \
            Client(srv.address) as c:
        n = 20
        for i in range(n):
            c.put(f"v{i}", np.full(1 << 20, i, np.uint8))
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
        s.connect(f"tcp://{srv.address}")
        try:
            raw_hello(s, srv.address)
            for r in range(20):         # GETs whose replies are never read
                s.send(msgpack.packb([PROTOCOL_VERSION, Op.GET, r + 1, 0,
                                      {"keys": [f"v{i}".encode() for i in range(n)]}]))
            deadline = time.monotonic() + 10
            while c.stats()["hits"] < 20 * n and time.monotonic() < deadline:
                time.sleep(0.05)
            st = c.stats()
            # at most a quarter of the pool stays pinned for one peer's unsent replies
            assert st["pins"] * (1 << 20) <= st["capacity_bytes"] // 4 + (1 << 20)
            c.purge()
            c.put_batch([f"new{i}" for i in range(40)], [b"x" * (1 << 20)] * 40)
        finally:
            s.close()


@pytest.mark.parametrize("argv,flag", [
    (["serve", "--lease-timeout", "inf"], "--lease-timeout"),
    (["serve", "--evict-interval", "1e400"], "--evict-interval"),
    (["serve", "--prealloc-size", "nan"], "--prealloc-size"),
    (["serve", "--shm-name", "a/b"], "--shm-name"),
    (["ctl", "--timeout", "inf", "stats"], "--timeout"),
    (["ctl", "--address", "127.0.0.1", "stats"], "--address"),
    (["ctl", "--address", "foo:bar", "stats"], "--address"),
    (["ctl", "--curve-server-key", "bogus", "stats"], "--curve-server-key"),
    (["replay", "--timeout", "inf"], "--timeout"),
    (["replay", "--ssd-path", "/tmp/x"], "--ssd-path"),
    (["replay", "--shm-name", "a/b"], "--shm-name"),
])
def test_usage_errors_name_the_flag(argv, flag):
    r = subprocess.run([sys.executable, "-m", "kvshm", *argv], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert flag in r.stderr and "Traceback" not in r.stderr


def test_taken_port_fails_before_the_pool_is_made(server):
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--service-port",
                        str(server.port), "--manage-port", "0", "--prealloc-size", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot bind" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t < 20


def test_client_address_errors():
    with pytest.raises(ValueError, match="ZeroMQ"):
        Client("http://127.0.0.1:1")
    with pytest.raises(ValueError):
        Client("127.0.0.1")
    t = time.monotonic()
    with pytest.raises(kvshm.ServerUnavailable, match="resolve"):
        Client("nosuch.invalid:1", timeout=5)
    assert time.monotonic() - t < 4
    with pytest.raises(ValueError):
        Client("127.0.0.1:1", timeout=float("inf"))


def test_key_and_batch_errors(server):
    with Client(server.address) as c:
        with pytest.raises(kvshm.InvalidKey, match="UTF-8"):
            c.put("\udc80", b"x")
        big = [b"k" * 4000] * 70_000
        with pytest.raises(kvshm.InvalidRequest, match="split the batch"):
            c.exists_batch(big)
        with pytest.raises(kvshm.QuotaExceeded, match="--max-client-pending"):
            c.put("huge", b"x" * int(c.stats()["capacity_bytes"] * 0.8))


def test_keygen_does_not_overwrite(tmp_path):
    def keygen(*extra):
        return subprocess.run([sys.executable, "-m", "kvshm", "keygen", str(tmp_path),
                               *extra], capture_output=True, text=True, timeout=60)

    assert keygen().returncode == 0
    first = (tmp_path / "server.key").read_text()
    r = keygen()
    assert r.returncode == 1 and "--force" in r.stderr
    assert (tmp_path / "server.key").read_text() == first
    assert keygen("--force").returncode == 0
    assert (tmp_path / "server.key").read_text() != first


def test_stale_ipc_dirs_are_cleaned():
    from kvshm import segments

    with tempfile.TemporaryDirectory() as base:
        stale = os.path.join(base, "kvshm-ipc-stale")
        os.mkdir(stale)
        import socket as pysocket

        s = pysocket.socket(pysocket.AF_UNIX)
        s.bind(os.path.join(stale, "service.sock"))     # bound, never listened: refused
        s.close()
        fresh = os.path.join(base, "kvshm-ipc-fresh")    # no socket yet, young: kept
        os.mkdir(fresh)
        live = os.path.join(base, "kvshm-ipc-live")
        os.mkdir(live)
        ls = pysocket.socket(pysocket.AF_UNIX)
        ls.bind(os.path.join(live, "service.sock"))
        ls.listen(1)
        try:
            assert segments.cleanup_ipc_dirs(base) == [stale]
            assert os.path.isdir(fresh) and os.path.isdir(live) and not os.path.exists(stale)
        finally:
            ls.close()


def test_management_methods_and_health(server):
    base = f"http://127.0.0.1:{server.manage_port}"
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(base + "/purge", timeout=10)
    assert ei.value.code == 405
    ei.value.close()
    with urllib.request.urlopen(base + "/healthz", timeout=10) as r:
        assert json.loads(r.read())["ok"] is True


def test_ipv6_loopback_server():
    if not os.path.exists("/proc/net/if_inet6"):
        pytest.skip("no IPv6 on this host")
    with ServerProcess("--host", "::1") as srv:
        assert srv.host == "[::1]"
        with Client(f"[::1]:{srv.port}", transport="tcp") as c:
            c.put("v6", b"yes")
            assert c.get("v6") == b"yes"


def test_verify_after_a_round_trip_through_the_ssd_tier(tmp_path):
    with ServerProcess("--ssd-path", str(tmp_path / "ssd"), "--ssd-size", "0.125",
                       prealloc_size=1 / 64) as srv, Client(srv.address) as c:
        c.put("pc", b"abc" * 1000, checksum=True)
        assert c.get("pc", verify=True) == b"abc" * 1000
        for i in range(40):              # push it out of the 16 MiB pool to the SSD
            c.put(f"push{i}", np.full(1 << 20, i, np.uint8))
        deadline = time.monotonic() + 20
        while c.stats()["tiers"]["ssd"]["entries"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.get("pc", verify=True) == b"abc" * 1000
