"""The whole RDMA client/server flow, end to end, over the verbs double (tests/rdma_double.py).

What runs for real here: kvshm's server (pool, store, ZeroMQ loop, the RDMA endpoint and
its hello_hook), kvshm's client (sessions, HELLO handshake, ALLOC/COMMIT/LOOKUP/RELEASE,
the RdmaMover with its MR cache, planning, posting window and completion handling) and
the bytes in the server's real shared-memory pool. What is emulated: the NIC (the double
executes RDMA WRITE/READ by copying between registered memory and the pool's segment,
checks keys, states and routes as a NIC would, and produces completions and errors).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

import kvshm
from kvshm import Client, Server, TransportError
from kvshm.rdma import CompletionError, MemlockError, RdmaOptions
from rdma_double import FakeDevice, FakeVerbs, ib_gids, roce_gids
from servers import ServerProcess

KiB, MiB = 1024, 1 << 20


@pytest.fixture
def fabric(tmp_path):
    d = tmp_path / "fabric"
    d.mkdir()
    yield str(d)
    left = sorted(os.listdir(d))
    assert not left, f"QPs/MRs left on the fabric: {left}"


def start_server(fabric, shm_name, verbs=None, **kw):
    verbs = verbs or FakeVerbs(fabric)
    opts = dict(service_port=0, manage_port=None, prealloc_size=0.0625, shm_name=shm_name,
                ipc=False, dev_name="fake0")
    opts.update(kw)
    srv = Server(rdma_backend=verbs, **opts).start()
    return srv, verbs


@pytest.fixture
def server(fabric, shm_name):
    srv, verbs = start_server(fabric, shm_name)
    yield srv
    srv.stop()
    verbs.close()


@pytest.fixture
def cverbs(fabric):
    v = FakeVerbs(fabric)
    yield v
    v.close()


def rdma_client(srv, verbs, transport="rdma", **opts):
    return Client(srv.address, transport=transport, timeout=10,
                  rdma=RdmaOptions(backend=verbs, **opts))


def values(n, size, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


# ----------------------------------------------------------------------------- data path


@pytest.mark.parametrize("n,size", [(32, 64 * KiB), (8, 1 * MiB), (5, 3 * MiB + 17)])
def test_put_and_get_batches_byte_exact(server, cverbs, n, size):
    keys = [f"model/layer{i}/chunk" for i in range(n)]
    vals = values(n, size)
    with rdma_client(server, cverbs) as c, Client(server.address, transport="tcp") as t:
        assert c.transport == "rdma"
        c.put_batch(keys, vals)
        outs = [np.zeros(size, np.uint8) for _ in range(n)]
        assert c.get_batch_into(keys, outs) == [size] * n
        assert all(np.array_equal(a, b) for a, b in zip(vals, outs))
        got = c.get_batch(keys + ["missing"])
        assert got[-1] is None
        assert all(g == v.tobytes() for g, v in zip(got, vals))
        # the bytes are in the server's pool: a TCP client reads them from there
        assert t.get(keys[-1]) == vals[-1].tobytes()
        # and what TCP writes, RDMA reads
        t.put("from-tcp", b"z" * (size // 2))
        out = bytearray(size)
        assert c.get_into("from-tcp", out) == size // 2
        assert out[:size // 2] == b"z" * (size // 2)
    assert cverbs.bytes_moved >= 3 * n * size


def test_buffers_of_every_kind(server, cverbs):
    with rdma_client(server, cverbs) as c:
        big = np.arange(1 << 20, dtype=np.uint32)        # 4 MiB, sliced per key
        src = {"bytes": b"abc" * 1000, "bytearray": bytearray(b"q" * 70000),
               "memoryview": memoryview(b"m" * 5000), "slice": big[1000:50000],
               "2d": np.ones((64, 128), np.float16), "empty": b""}
        c.put_batch(list(src), list(src.values()))
        for k, v in src.items():
            assert c.get(k) == memoryview(v).cast("B").tobytes(), k
        out = np.zeros(49000, np.uint32)
        c.get_into("slice", out)
        assert np.array_equal(out, big[1000:50000])


def test_get_batch_scratch_grows_and_is_reregistered(server, cverbs):
    small, big = values(2, 100 * KiB, seed=6), values(3, 1 * MiB, seed=7)
    with rdma_client(server, cverbs) as c:
        c.put_batch(["s0", "s1", "b0", "b1", "b2"], small + big)
        assert c.get_batch(["s0", "s1"]) == [v.tobytes() for v in small]
        first = c._session.rdma.scratch
        assert c.get_batch(["b0", "b1", "b2"]) == [v.tobytes() for v in big]
        assert c._session.rdma.scratch is not first
        cache = c._session.rdma.cache
        assert not any(e.owner is first for e in cache._lru.values())
        assert c.get_batch(["s1", "b2"]) == [small[1].tobytes(), big[2].tobytes()]


def test_torch_cpu_tensors(server, cverbs):
    torch = pytest.importorskip("torch")
    with rdma_client(server, cverbs) as c:
        t = torch.arange(256 * 1024, dtype=torch.float32)
        c.put_batch(["t0", "t1"], [t[:1024], t[1024:2048]])
        out = torch.zeros(1024, dtype=torch.float32)
        c.get_into("t1", out)
        assert torch.equal(out, t[1024:2048])


def test_caller_buffers_are_registered_once(server, cverbs):
    kv = np.random.default_rng(1).integers(0, 256, (16, 64 * KiB), dtype=np.uint8)
    out = np.zeros_like(kv)
    keys = [f"p{i}" for i in range(16)]
    with rdma_client(server, cverbs) as c:
        c.put_batch(keys, list(kv))
        c.get_batch_into(keys, list(out))
        first = cverbs.registrations
        for _ in range(3):
            c.put_batch(keys, list(kv))
            c.get_batch_into(keys, list(out))
        assert cverbs.registrations == first == 2   # the kv array and the out array
        assert np.array_equal(kv, out)
        assert c._session.rdma.cache.hits >= 6 * 16


def test_send_queue_window_and_signalling(server, cverbs):
    n = 100
    vals = values(n, 4 * KiB, seed=3)
    with rdma_client(server, cverbs, max_send_wr=8, max_sge=1, signal_every=3) as c:
        mover = c._session.mover
        assert (mover.window, mover.signal_every) == (8, 3)
        posted = cverbs.posted
        c.put_batch([f"w{i}" for i in range(n)], vals)
        assert cverbs.posted - posted == n          # one WR per value with max_sge=1
        assert cverbs.max_outstanding_seen <= 8     # the double refuses more (ENOMEM)
        outs = [np.zeros(4 * KiB, np.uint8) for _ in range(n)]
        c.get_batch_into([f"w{i}" for i in range(n)], outs)
        assert all(np.array_equal(a, b) for a, b in zip(vals, outs))


def test_gathers_adjacent_values_into_few_work_requests(server, cverbs):
    vals = values(64, 64 * KiB, seed=4)   # one whole block each
    with rdma_client(server, cverbs, max_sge=8) as c:
        posted = cverbs.posted
        c.put_batch([f"g{i}" for i in range(64)], vals)
        # the allocator places a batch's blocks one after the other: 8 values per WR
        assert cverbs.posted - posted <= 16
        assert c.get_batch([f"g{i}" for i in (0, 63)]) == [vals[0].tobytes(),
                                                           vals[63].tobytes()]


def test_threads_share_one_client(server, cverbs):
    errors = []
    with rdma_client(server, cverbs) as c:
        def work(t):
            try:
                vals = values(8, 64 * KiB, seed=t)
                keys = [f"t{t}/{i}" for i in range(8)]
                for _ in range(5):
                    c.put_batch(keys, vals)
                    outs = [np.zeros(64 * KiB, np.uint8) for _ in range(8)]
                    c.get_batch_into(keys, outs)
                    assert all(np.array_equal(a, b) for a, b in zip(vals, outs))
            except BaseException as exc:   # reported below
                errors.append(exc)

        ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    assert not errors, errors


# ----------------------------------------------------------------------------- link layers


def test_infiniband_addresses_by_lid(fabric, shm_name):
    sv = FakeVerbs(fabric, [FakeDevice("ib0", link_layer="IB", lid=1, gids=ib_gids(1))])
    cv = FakeVerbs(fabric, [FakeDevice("ib0", link_layer="IB", lid=7, gids=ib_gids(7))])
    srv, _ = start_server(fabric, shm_name, sv, dev_name="ib0", link_type="IB")
    try:
        assert "InfiniBand" in srv.ready_line()
        with rdma_client(srv, cv, link_type="IB") as c:
            c.put("k", b"x" * 100_000)
            assert c.get("k") == b"x" * 100_000
            assert c._session.mover.remote.lid == 1
    finally:
        srv.stop()
        sv.close()
        cv.close()


def test_path_mtu_is_the_smaller_of_both_ports(fabric, shm_name):
    sv = FakeVerbs(fabric, [FakeDevice(mtu=4096)])
    cv = FakeVerbs(fabric, [FakeDevice(mtu=1024, gids=roce_gids("192.0.2.9", 9))])
    srv, _ = start_server(fabric, shm_name, sv)
    try:
        with rdma_client(srv, cv) as c:
            c.put("k", b"y" * 9000)
            assert c.get("k") == b"y" * 9000   # the double checks both ends agree
    finally:
        srv.stop()
        sv.close()
        cv.close()


def test_mixed_link_layers_are_refused(fabric, shm_name, server):
    cv = FakeVerbs(fabric, [FakeDevice("ib0", link_layer="IB", lid=3, gids=ib_gids(3))])
    try:
        with pytest.raises(TransportError, match="refused the RDMA connection.*IB"):
            rdma_client(server, cv)
        assert server.rdma.refused == 1
    finally:
        cv.close()


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kind,status", [
    ("retry_exceeded", "IBV_WC_RETRY_EXC_ERR"),
    ("remote_access", "IBV_WC_REM_ACCESS_ERR"),
    ("flush", "IBV_WC_WR_FLUSH_ERR"),
])
def test_write_error_names_key_and_cause_then_reconnects(server, cverbs, kind, status):
    vals = values(4, 64 * KiB, seed=5)
    with rdma_client(server, cverbs, max_sge=1) as c:
        c.put_batch(["a", "b", "c", "d"], vals)
        first = c._session.mover
        cverbs.inject(kind)
        with pytest.raises(CompletionError) as ei:
            c.put_batch(["new1", "new2"], vals[:2])
        e = ei.value
        assert e.status_name == status and e.key in (b"new1", b"new2")
        assert isinstance(e, TransportError) and "RDMA WRITE of key b'new" in str(e)
        assert status in str(e) and "re-establishes" in str(e)
        assert first.broken and first.conn.closed
        # the next call says HELLO with a new QP and works
        outs = [np.zeros(64 * KiB, np.uint8) for _ in range(4)]
        assert c.get_batch_into(["a", "b", "c", "d"], outs) == [64 * KiB] * 4
        assert all(np.array_equal(a, b) for a, b in zip(vals, outs))
        assert c._session.mover is not first and c.transport == "rdma"
        assert not c.exists("new1")   # never committed
        c.flush()
        assert c.stats()["pending"] == 0   # and its allocation was aborted, not leaked
        c.put_batch(["new1", "new2"], vals[:2])
        assert c.get("new2") == vals[1].tobytes()
        assert server.rdma.accepted == 2


def test_read_error_names_the_key(server, cverbs):
    with rdma_client(server, cverbs, max_sge=1) as c:
        c.put_batch(["r1", "r2"], [b"1" * 5000, b"2" * 5000])
        cverbs.inject("remote_access")
        with pytest.raises(CompletionError, match=r"RDMA READ of key b'r1'.*REM_ACCESS"):
            c.get_batch(["r1", "r2"])
        assert c.get_batch(["r1", "r2"]) == [b"1" * 5000, b"2" * 5000]
        # the failed read's pins went back with the reconnect's next request
        c.flush()
        stats = c.stats()
        assert stats["pins"] == 0 and stats["pending"] == 0


def test_server_dropping_the_qp_gives_retry_exceeded(server, cverbs):
    with rdma_client(server, cverbs) as c:
        c.put("k", b"v" * 1000)
        assert server.rdma.drop(c.session.nonce)
        with pytest.raises(CompletionError, match="RETRY_EXC_ERR"):
            c.get("k")
        assert c.get("k") == b"v" * 1000


def test_a_silent_nic_times_out_then_reconnects(server, cverbs):
    with rdma_client(server, cverbs, poll_timeout=0.3) as c:
        c.put("k", b"v" * 100)
        cverbs.rate = 0                 # work requests stay outstanding forever
        with pytest.raises(TransportError, match="no RDMA completion .* within 0.3 s"):
            c.get("k")
        cverbs.rate = 4
        assert c.get("k") == b"v" * 100


def test_lazy_commits_survive_a_reconnect(server, cverbs):
    with rdma_client(server, cverbs, max_sge=1), \
            Client(server.address, transport="tcp") as t:
        c2 = Client(server.address, transport="rdma", timeout=10, lazy_commit=True,
                    rdma=RdmaOptions(backend=cverbs))
        try:
            c2.put("lazy", b"L" * 3000)         # its COMMIT waits for the next request
            c2.ping()                            # a new HELLO (and QP) in between
            cverbs.inject("retry_exceeded")
            with pytest.raises(CompletionError):
                c2.put("other", b"O" * 10)
            c2.flush()                           # reconnects, sends the queued COMMIT
            assert t.get("lazy") == b"L" * 3000
        finally:
            c2.close()


def test_server_restart_reconnects(fabric, shm_name, cverbs):
    srv, sv = start_server(fabric, shm_name)
    port = srv.service_port
    c = rdma_client(srv, cverbs)
    try:
        c.put("k", b"1" * 100)
        srv.stop()
        sv.close()
        srv, sv = start_server(fabric, shm_name, service_port=port)
        c.put("k", b"2" * 100)     # STALE_EPOCH -> HELLO with a new QP -> retried
        assert c.get("k") == b"2" * 100 and c.transport == "rdma"
    finally:
        c.close()
        srv.stop()
        sv.close()


# ----------------------------------------------------------------------------- choosing


def test_rdma_needs_a_server_that_serves_it(fabric, shm_name, cverbs):
    with Server(service_port=0, manage_port=None, prealloc_size=0.0625, shm_name=shm_name,
                ipc=False) as srv:
        with pytest.raises(TransportError, match="does not serve RDMA .*--dev-name"):
            rdma_client(srv, cverbs)
        assert "rdma" not in srv.ready_line()


def test_rdma_without_a_device_names_the_cause(server, fabric):
    nodev = FakeVerbs(fabric, list_error="this host has no RDMA devices (emulated)")
    with pytest.raises(TransportError, match="no RDMA devices"):
        rdma_client(server, nodev)
    with pytest.raises(TransportError, match="RDMA device mlx5_9: no such device"):
        rdma_client(server, FakeVerbs(fabric), dev_name="mlx5_9")


@pytest.fixture
def remote_host(monkeypatch):
    """Make the client believe the server is on another host (its segment unreachable)."""
    class Unreachable:
        @staticmethod
        def attach(name, **kw):
            raise FileNotFoundError(f"no shared-memory segment {name}")

    monkeypatch.setattr("kvshm.client.Pool", Unreachable)


def test_auto_prefers_rdma_when_offered(server, cverbs, remote_host):
    with rdma_client(server, cverbs, transport="auto") as c:
        assert c.transport == "rdma" and server.rdma.accepted == 1
        c.put("a", b"x" * 70000)
        assert c.get("a") == b"x" * 70000


def test_auto_falls_back_to_tcp(fabric, shm_name, cverbs, remote_host):
    with Server(service_port=0, manage_port=None, prealloc_size=0.0625, shm_name=shm_name,
                ipc=False) as srv:
        with rdma_client(srv, cverbs, transport="auto") as c:   # no RDMA offered
            assert c.transport == "tcp"
            c.put("a", b"1")
            assert c.get("a") == b"1"


def test_auto_without_a_device_uses_tcp(server, fabric, remote_host):
    nodev = FakeVerbs(fabric, list_error="no RDMA here")
    with rdma_client(server, nodev, transport="auto") as c:
        assert c.transport == "tcp" and server.rdma.accepted == 0
        c.put("a", b"1")
        assert c.get("a") == b"1"


def test_auto_falls_back_when_the_server_refuses(server, fabric, remote_host):
    cv = FakeVerbs(fabric, [FakeDevice("ib0", link_layer="IB", lid=3, gids=ib_gids(3))])
    try:
        with rdma_client(server, cv, transport="auto") as c:
            assert c.transport == "tcp" and server.rdma.refused == 1
            c.ping()                    # does not try again
            assert server.rdma.refused == 1
            c.put("a", b"1")
            assert c.get("a") == b"1"
    finally:
        cv.close()


def test_auto_on_the_same_host_stays_on_shm(server, cverbs):
    with rdma_client(server, cverbs, transport="auto") as c:
        assert c.transport == "shm" and server.rdma.accepted == 0


# ----------------------------------------------------------------------------- server side


def test_memlock_is_checked_at_start(fabric, shm_name, monkeypatch):
    import kvshm.rdma.memlock as ml

    monkeypatch.setattr(ml, "has_cap_ipc_lock", lambda: False)
    monkeypatch.setattr(ml, "memlock_limit", lambda: 8 << 20)
    v = FakeVerbs(fabric, pins_memory=True)
    with pytest.raises(MemlockError, match=r"RLIMIT_MEMLOCK is 8 MiB.*ulimit -l"):
        Server(rdma_backend=v, service_port=0, manage_port=None, prealloc_size=0.0625,
               shm_name=shm_name, ipc=False, dev_name="fake0").start()
    v.close()


def test_server_stats_and_teardown(fabric, shm_name, cverbs):
    srv, sv = start_server(fabric, shm_name)
    try:
        assert srv.rdma.offer()["gid_type"] == "RoCEv2"
        with rdma_client(srv, cverbs) as c:
            c.put("k", b"v")
            c.ping()                           # a second QP; the first one is retired
            assert srv.rdma.stats()["connections"] == 1
            assert srv.rdma.stats()["retired"] == 1
            assert c.get("k") == b"v"
    finally:
        srv.stop()
        sv.close()
    assert srv.rdma is None


def test_bad_qp_info_in_hello_is_refused(server):
    good = server.rdma.local_info(5).to_wire()
    out = server.rdma.hello_hook(b"x" * 16, {"rdma": {"qp": dict(good, qpn="nope")}})
    assert "field 'qpn'" in out["rdma"]["error"] and server.rdma.connections == 0
    out = server.rdma.hello_hook(b"x" * 16, {"rdma": {"qp": "garbage"}})
    assert "must be a map" in out["rdma"]["error"]
    assert set(server.rdma.hello_hook(b"y", {})["rdma"]) == {"offer"}


# ----------------------------------------------------------------------------- another process


def test_server_in_another_process(fabric, tmp_path, cverbs):
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "rdma_double.py")

    from servers import unique_shm_name

    with ServerProcess("--fabric", fabric, "--no-manage", "--no-ipc", "--dev-name", "fake0",
                       prealloc_size=0.0625, shm_name=unique_shm_name("rdma-"),
                       launcher=[sys.executable, script]) as srv:
        assert "rdma fake0:1 RoCEv2" in srv.ready_line
        vals = values(4, 1 * MiB, seed=9)
        with Client(srv.address, transport="rdma", timeout=10,
                    rdma=RdmaOptions(backend=cverbs)) as c:
            c.put_batch(list("abcd"), vals)
            outs = [np.zeros(MiB, np.uint8) for _ in range(4)]
            c.get_batch_into(list("abcd"), outs)
            assert all(np.array_equal(a, b) for a, b in zip(vals, outs))
            cverbs.inject("retry_exceeded")
            with pytest.raises(CompletionError, match="RETRY_EXC_ERR"):
                c.get("a")
            assert c.get("a") == vals[0].tobytes()
        assert srv.stop() == 0
    assert srv.stderr_text == "" or "Traceback" not in srv.stderr_text


def test_version_exports():
    assert kvshm.TransportError is TransportError


def test_lease_reclaim_cuts_every_qp_of_the_client_retired_ones_too(fabric, shm_name,
                                                                     cverbs):
    """A newer HELLO retires the client's QP for a grace period; lease reclaim cut only
    the current one, so the retired QP kept REMOTE_WRITE to the whole pool."""
    from kvshm.client import _Req
    from kvshm.zmq_ctrl.protocol import Op

    srv, sv = start_server(fabric, shm_name, lease_timeout=0.5)
    try:
        with rdma_client(srv, cverbs) as c:
            c.put("k", b"v" * 1000)
            c.ping()                                   # a new QP; the old one retired
            assert srv.rdma.stats()["retired"] == 1 and srv.rdma.connections == 1

            def alloc_only():                          # a write that never commits
                r = yield _Req(Op.ALLOC, {"keys": [b"x"], "sizes": [10]}, stateful=True)
                return r.body["st"]

            assert c.run_op(alloc_only()) == [0]
            deadline = time.monotonic() + 20
            while c.stats()["pending"] and time.monotonic() < deadline:
                time.sleep(0.05)
            st = srv.rdma.stats()
            assert st["connections"] == 0 and st["retired"] == 0, st
    finally:
        srv.stop()
        sv.close()
