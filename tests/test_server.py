"""A real `kvshm serve` process driven through the shm and TCP movers (issue 3's cases)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import msgpack
import numpy as np
import pytest
import zmq

import kvshm
from kvshm import Client, InvalidKey, KeyNotFound, ValueTooLarge
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, Status, decode_reply
from servers import ServerProcess, bearer, raw_hello, segment_exists

TRANSPORTS = ["shm", "tcp"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(prealloc_size=0.25) as s:
        yield s
    assert not segment_exists(s.shm_name)


@pytest.fixture
def client(server, request):
    transport = getattr(request, "param", "shm")
    with Client(server.address, transport=transport, timeout=10) as c:
        c.purge()
        yield c


def values(n, size, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("client", TRANSPORTS, indirect=True)
def test_put_get_single(client):
    assert client.transport == client._session.transport or client.transport == "tcp"
    client.put("hello", b"world")
    assert client.get("hello") == b"world"
    out = bytearray(16)
    assert client.get_into("hello", out) == 5
    assert bytes(out[:5]) == b"world"
    assert client.exists("hello") and not client.exists("nope")
    with pytest.raises(KeyNotFound):
        client.get("nope")
    with pytest.raises(KeyNotFound):
        client.get_into("nope", out)


@pytest.mark.parametrize("client", TRANSPORTS, indirect=True)
@pytest.mark.parametrize("size", [65536, 1 << 20])
def test_batch_256_with_misses(client, size):
    n = 256 if size == 65536 else 64
    keys = [f"b{size}-{i}" for i in range(n)]
    vals = values(n, size, seed=size)
    client.put_batch(keys, vals)
    ask = keys[:] + [f"missing-{i}" for i in range(8)]
    ask[10], ask[-1] = ask[-1], ask[10]          # a miss in the middle
    outs = [np.zeros(size, np.uint8) for _ in ask]
    sizes = client.get_batch_into(ask, outs)
    for k, s, o in zip(ask, sizes, outs):
        if k.startswith("missing"):
            assert s == -1
        else:
            assert s == size
            assert np.array_equal(o, vals[keys.index(k)])
    got = client.get_batch(ask)
    assert [g is None for g in got] == [k.startswith("missing") for k in ask]
    assert got[0] == vals[0].tobytes()
    assert client.exists_batch(ask) == [not k.startswith("missing") for k in ask]
    assert client.match_prefix(ask) == 10
    st = client.stats(verify=True)
    assert st["accounting_ok"] and st["pending"] == 0


def test_tcp_get_of_unknown_key_is_a_prompt_miss(server):
    with Client(server.address, transport="tcp", timeout=2) as c:
        t = time.monotonic()
        assert c.get_batch(["never-written"]) == [None]
        with pytest.raises(KeyNotFound):
            c.get("never-written")
        assert time.monotonic() - t < 2


def test_overwrite_while_reader_holds_pin(server):
    """A reader pinned on the old entry keeps reading the old bytes after an overwrite."""
    with Client(server.address, transport="shm") as writer:
        writer.put("ow", b"A" * 200_000)
        # a raw reader: LOOKUP pins, and it does not release
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{server.address}")
        epoch = raw_hello(s, server.address)["epoch"]
        s.send_multipart([msgpack.packb([PROTOCOL_VERSION, Op.LOOKUP, 1, epoch,
                                         {"keys": [b"ow"]}])])
        assert s.poll(5000)
        st, _, body = decode_reply(s.recv())
        assert st == Status.OK
        old_off, old_size = body["offsets"][0], body["sizes"][0]
        pool = kvshm.Pool.attach(writer.server_info["pool"]["name"])
        try:
            for i in range(50):           # overwrite again and again, with churn
                writer.put("ow", bytes([66 + i % 20]) * 200_000)
                writer.put(f"churn-{i}", b"c" * 300_000)
            assert pool.read_bytes(old_off, old_size) == b"A" * 200_000
            stats = writer.stats(verify=True)
            assert stats["dead"] == 1 and stats["accounting_ok"]
            s.send_multipart([msgpack.packb([PROTOCOL_VERSION, Op.RELEASE, 2, epoch,
                                             {"release": [1]}])])
            assert s.poll(5000)
            s.recv()
            stats = writer.stats(verify=True)
            assert stats["dead"] == 0 and stats["pinned"] == 0 and stats["accounting_ok"]
            assert writer.get("ow") == bytes([66 + 49 % 20]) * 200_000
        finally:
            pool.close()
            s.close()


def test_lru_order_and_pins(tmp_path):
    # 1 MiB pool, 64 KiB blocks: 16 blocks; values of 4 blocks
    with ServerProcess(prealloc_size=1 / 1024) as srv, \
            Client(srv.address, transport="shm") as c, \
            Client(srv.address, transport="shm") as holder:
        v = 4 * 65536
        for i in range(4):
            c.put(f"k{i}", bytes([i]) * v)
        c.get("k0")                         # k0 most recent; k1 oldest
        c.put("n1", b"n" * v)
        assert c.exists_batch(["k0", "k1", "k2", "k3"]) == [True, False, True, True]
        holder.get("k2")                    # pinned by holder (release rides later)
        c.put("n2", b"n" * v)               # k2 is oldest but pinned: k3 goes
        assert c.exists_batch(["k2", "k3", "k0"]) == [True, False, True]
        holder.flush()
        st = c.stats(verify=True)
        assert st["evictions"] == 2 and st["accounting_ok"] and st["pinned"] == 0


def test_pool_full_purge_refill(server):
    with Client(server.address, transport="shm") as c:
        c.purge()
        cap = c.stats()["capacity_bytes"]
        size = 1 << 20
        n = int(cap * 0.9) // size
        keys = [f"fill-{i}" for i in range(n)]
        vals = [bytes([i % 251]) * size for i in range(n)]
        step = n // 4                      # below the per-client pending limit (3/4)
        for i in range(0, n, step):
            c.put_batch(keys[i:i + step], vals[i:i + step])
        assert c.stats()["evictions"] == 0
        assert c.purge() == n
        assert c.stats()["used_bytes"] == 0
        for i in range(0, n, step):
            c.put_batch(keys[i:i + step], vals[i:i + step])
        assert all(c.exists_batch(keys))
        assert c.get(keys[-1]) == vals[-1]


def test_full_pool_of_unpinned_entries_evicts(server):
    with Client(server.address, transport="tcp") as c:
        c.purge()
        cap = c.stats()["capacity_bytes"]
        size = 1 << 20
        n = cap // size
        for i in range(0, n, 32):
            c.put_batch([f"e{j}" for j in range(i, min(n, i + 32))],
                        [b"e" * size] * (min(n, i + 32) - i))
        assert c.stats()["free_blocks"] == 0
        before = c.stats()["evictions"]
        c.put("one-more", b"m" * size)
        assert c.get("one-more") == b"m" * size
        assert c.stats()["evictions"] > before


@pytest.mark.parametrize("client", TRANSPORTS, indirect=True)
def test_value_larger_than_pool(client):
    cap = client.stats()["capacity_bytes"]
    with pytest.raises(ValueTooLarge):
        client.put("too-big", np.zeros(cap + 65536, np.uint8))
    client.put("after", b"fine")
    assert client.get("after") == b"fine"


def test_value_too_large_refused_by_server_too(server):
    """A client that skips its own check still gets TOO_LARGE from the server."""
    with Client(server.address, transport="shm") as c:
        cap = c.stats()["capacity_bytes"]
        c._session.capacity = 1 << 60        # defeat the client-side check
        with pytest.raises(ValueTooLarge):
            c.put("too-big", np.zeros(cap + 65536, np.uint8))
        c.put("after", b"fine")
        assert c.get("after") == b"fine"


@pytest.mark.slow
def test_4k_blocks_hold_100k_small_values():
    with ServerProcess("--block-size", "4", prealloc_size=1.0) as srv, \
            Client(srv.address, transport="shm", timeout=30) as c:
        n = 100_000
        for i in range(0, n, 10_000):
            keys = [f"small-{j}" for j in range(i, i + 10_000)]
            c.put_batch(keys, [b"%010d" % j for j in range(i, i + 10_000)])
        st = c.stats(verify=True)
        assert st["num_keys"] == n and st["evictions"] == 0 and st["accounting_ok"]
        assert st["used_bytes"] == n * 4096
        sample = [f"small-{j}" for j in range(0, n, 997)]
        assert c.get_batch(sample) == [b"%010d" % j for j in range(0, n, 997)]


@pytest.mark.parametrize("client", TRANSPORTS, indirect=True)
def test_key_edge_cases(client):
    with pytest.raises(InvalidKey):
        client.put("", b"x")
    with pytest.raises(InvalidKey):
        client.put(b"k" * 5 * 1024, b"x")
    with pytest.raises(InvalidKey):
        client.get("")
    with pytest.raises(InvalidKey):
        client.exists_batch([b"ok", 12])           # type: ignore[list-item]
    weird = b"\xff\xfe\x00binary\x80key"
    client.put(weird, b"bytes key")
    assert client.get(weird) == b"bytes key"
    assert client.exists(weird)
    client.put("ключ-utf8", b"str key")
    assert client.get("ключ-utf8".encode()) == b"str key"
    assert client.put_batch([], []) is None
    assert client.get_batch([]) == []
    assert client.get_batch_into([], []) == []
    assert client.exists_batch([]) == []
    assert client.match_prefix([]) == 0
    assert client.delete([]) == 0
    with pytest.raises(ValueError):
        client.put_batch(["a", "b"], [b"x"])


def test_server_refuses_bad_keys_sent_raw(server):
    """Keys that skip the client's checks are refused per key by the server."""
    with Client(server.address, transport="tcp") as c:
        c._session.limits = kvshm.zmq_ctrl.Limits(max_key_bytes=1 << 20)
        with pytest.raises(InvalidKey) as ei:
            c.put_batch([b"k" * 5000, b"good-key"], [b"1", b"2"])
        assert list(ei.value.failed) == [b"k" * 5000]
        assert c.get("good-key") == b"2"


WRITER = textwrap.dedent("""
    import json, sys, random, struct, xxhash
    import kvshm
    wid, address, transport, rounds = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    rng = random.Random(wid)
    def make(seq, size):
        head = struct.pack("<II", wid, seq)
        body = random.Random(wid * 1_000_003 + seq).randbytes(size - 16)
        s = xxhash.xxh64_intdigest(head + body)
        return head + struct.pack("<Q", s) + body
    def check(v):
        if v is None:
            return True
        head, s, body = v[:8], struct.unpack("<Q", v[8:16])[0], v[16:]
        return xxhash.xxh64_intdigest(head + body) == s
    bad = reads = misses = 0
    with kvshm.Client(address, transport=transport, timeout=20) as c:
        for r in range(rounds):
            keys = [f"shared-{rng.randrange(12)}" for _ in range(4)] + \
                   [f"own-{wid}-{rng.randrange(20)}" for _ in range(4)]
            keys = list(dict.fromkeys(keys))
            vals = [make(r * 100 + i, rng.choice([4096, 70_000, 300_000])) for i in range(len(keys))]
            c.put_batch(keys, vals, checksum=True)
            got = c.get_batch(keys + ["shared-0", "never"], verify=True)
            for v in got:
                reads += 1
                misses += v is None
                bad += not check(v)
    print(json.dumps({"bad": bad, "reads": reads, "misses": misses}))
""")


def test_four_processes_same_and_different_keys():
    with ServerProcess(prealloc_size=1 / 64) as srv:       # 16 MiB: eviction under load
        procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(w), srv.address,
                                   ("shm", "tcp")[w % 2], "60"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for w in range(4)]
        results = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=120)
                assert p.returncode == 0, err.decode()
                results.append(json.loads(out))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert sum(r["bad"] for r in results) == 0
        assert sum(r["reads"] for r in results) >= 4 * 60 * 5
        with Client(srv.address) as c:
            st = c.stats(verify=True)
            assert st["accounting_ok"] and st["pending"] == 0
            assert st["evictions"] > 0


def _raw(server, frames, timeout=5000):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{server.address}")
    try:
        raw_hello(s, server.address)
        s.send_multipart(frames)
        assert s.poll(timeout), f"no reply to {frames!r}"
        reply = s.recv_multipart()
        return decode_reply(reply[0])
    finally:
        s.close()


def _req(op, body, req_id=9, epoch=0, version=PROTOCOL_VERSION):
    return msgpack.packb([version, op, req_id, epoch, body], use_bin_type=True)


@pytest.mark.parametrize("frames,status", [
    ([b""], Status.MALFORMED),
    ([b"\xc1garbage"], Status.MALFORMED),
    ([msgpack.packb({"not": "an array"})], Status.MALFORMED),
    ([msgpack.packb([1, 2, 3])], Status.MALFORMED),
    ([msgpack.packb([PROTOCOL_VERSION, "op", 1, 0, {}])], Status.MALFORMED),
    ([msgpack.packb([PROTOCOL_VERSION, 1, 1, 0, []])], Status.MALFORMED),
    ([_req(999, {})], Status.UNKNOWN_OP),
    ([_req(Op.HELLO, {}, version=99)], Status.BAD_VERSION),
    ([_req(Op.EXISTS, {"keys": "notalist"})], Status.MALFORMED),
    ([_req(Op.EXISTS, {})], Status.MALFORMED),
    ([_req(Op.ALLOC, {"keys": [b"a"], "sizes": [1, 2]}, epoch=1)], Status.STALE_EPOCH),
    ([_req(Op.PUT, {"keys": [b"a", b"b"]}), b"only one frame"], Status.INVALID_REQUEST),
    ([_req(Op.EVICT, {"ratio": 7})], Status.INVALID_REQUEST),
    ([_req(Op.EVICT, {"ratio": "x"})], Status.INVALID_REQUEST),
    ([_req(Op.COMMIT, {"commit": ["x"]})], Status.STALE_EPOCH),  # piggyback not applied
    ([_req(Op.DELETE, {"keys": [[1, 2], {"a": 1}]})], Status.OK),
])
def test_malformed_frames_get_error_replies(server, frames, status):
    st, _, body = _raw(server, frames)
    assert st == status, body
    if status != Status.OK:
        assert body.get("error")
    with Client(server.address, transport="tcp") as c:   # the server goes on serving
        c.put("still-alive", b"yes")
        assert c.get("still-alive") == b"yes"


def test_malformed_with_fresh_epoch(server):
    with Client(server.address, transport="tcp") as c:
        epoch = c.server_info["epoch"]
    st, _, body = _raw(server, [_req(Op.ALLOC, {"keys": [b"a"], "sizes": [1, 2]}, epoch=epoch)])
    assert st == Status.MALFORMED
    st, _, body = _raw(server, [_req(Op.ALLOC, {"keys": [b"a"], "sizes": ["x"]}, epoch=epoch)])
    assert st == Status.OK and body["st"] == [Status.INVALID_REQUEST]
    st, _, body = _raw(server, [_req(Op.LOOKUP, {"keys": [None, 3, b"x"]}, epoch=epoch)])
    assert st == Status.OK and body["offsets"] == [-1, -1, -1]
    st, _, body = _raw(server, [_req(Op.STATS, {"release": "bad"}, epoch=epoch)])
    assert st == Status.MALFORMED
    with Client(server.address) as c:
        assert c.stats(verify=True)["accounting_ok"]


def test_batch_limit(tmp_path):
    with ServerProcess("--max-batch", "100") as srv, Client(srv.address) as c:
        with pytest.raises(kvshm.KvshmError):
            c.exists_batch([f"k{i}" for i in range(101)])
        st, _, body = _raw(srv, [_req(Op.EXISTS, {"keys": [b"k"] * 101})])
        assert st == Status.INVALID_REQUEST and "100" in body["error"]
        assert c.exists_batch([f"k{i}" for i in range(100)]) == [False] * 100


def test_management_port(server):
    base = f"http://127.0.0.1:{server.manage_port}"
    # over TCP: a GET op reaches the server (a same-host client reads the shared index)
    with Client(server.address, transport="tcp") as c:
        c.put("m", b"1" * 1000)
        c.get("m")

    def fetch(path, method="GET", auth=True):
        hdr = bearer(server.address, operator=path == "/purge") if auth else {}
        req = urllib.request.Request(base + path, method=method, headers=hdr)
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read()

    for path, method in (("/selftest", "GET"), ("/purge", "POST")):   # the door token
        with pytest.raises(urllib.error.HTTPError) as ei:
            fetch(path, method, auth=False)
        assert ei.value.code == 401
        ei.value.close()
    with pytest.raises(urllib.error.HTTPError) as ei:    # purge: the operator token
        urllib.request.urlopen(urllib.request.Request(
            base + "/purge", method="POST", headers=bearer(server.address)), timeout=10)
    assert ei.value.code == 401
    ei.value.close()

    rep = json.loads(fetch("/selftest"))
    assert rep["ok"] is True and rep["transport"] == "shm"
    stats = json.loads(fetch("/stats"))
    assert stats["num_keys"] >= 1 and stats["capacity_bytes"] > 0
    metrics = fetch("/metrics").decode()
    for name in ("kvshm_hits_total", "kvshm_misses_total", "kvshm_bytes_in_total",
                 "kvshm_bytes_out_total", "kvshm_evictions_total", "kvshm_used_bytes",
                 "kvshm_num_keys", "kvshm_pinned", "kvshm_errors_total",
                 'kvshm_request_duration_seconds_bucket{le="0.001",op="GET"}'):
        assert name in metrics, name
    assert json.loads(fetch("/purge", "POST"))["purged"] >= 1
    with pytest.raises(urllib.error.HTTPError) as ei:
        fetch("/nope")
    assert ei.value.code == 404
    ei.value.close()


def test_ctl_commands(server):
    def ctl(*args):
        return subprocess.run([sys.executable, "-m", "kvshm", "ctl", "--address",
                               server.address, *args], capture_output=True, text=True,
                              timeout=60)
    with Client(server.address) as c:
        c.purge()
        c.put_batch(["c1", "c2", "c3"], [b"x" * 70000] * 3)
    r = ctl("stats", "--verify")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["num_keys"] == 3 and st["accounting_ok"]
    r = ctl("exists", "c1", "nope")
    assert r.stdout.split() == ["c1", "yes", "nope", "no"]
    assert ctl("delete", "c1").stdout.strip() == "1"
    assert sorted(ctl("keys", "--prefix", "c").stdout.split()) == ["c2", "c3"]
    assert ctl("evict", "0").stdout.strip() == "2"
    assert ctl("purge").stdout.strip() == "0"
    r = subprocess.run([sys.executable, "-m", "kvshm", "ctl", "--address", "127.0.0.1:1",
                        "--timeout", "0.5", "stats"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "no reply" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flag,value", [
    ("--block-size", "3"), ("--block-size", "6"), ("--prealloc-size", "0"),
    ("--prealloc-size", "abc"), ("--service-port", "70000"), ("--lease-timeout", "-1"),
    ("--evict-min-threshold", "1.5"), ("--evict-interval", "0"), ("--manage-port", "x"),
])
def test_serve_bad_flags(flag, value):
    r = subprocess.run([sys.executable, "-m", "kvshm", "serve", flag, value],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert flag in r.stderr and "Traceback" not in r.stderr


def test_serve_inconsistent_thresholds():
    r = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--evict-min-threshold",
                        "0.9", "--evict-max-threshold", "0.5"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--evict-min-threshold" in r.stderr


def test_pool_larger_than_shm_fails_cleanly():
    free = os.statvfs("/dev/shm")
    gib = (free.f_bavail * free.f_frsize) / 2**30 + 4
    r = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--service-port", "0",
                        "--manage-port", "0", "--prealloc-size", f"{gib:.1f}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "does not fit" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_cleanly(sig):
    srv = ServerProcess()
    with Client(srv.address) as c:
        c.put("x", b"y")
    assert segment_exists(srv.shm_name)
    assert srv.stop(sig) == 0
    assert not segment_exists(srv.shm_name)
    assert "Traceback" not in srv.stderr_text


def test_periodic_eviction():
    with ServerProcess("--enable-periodic-evict", "--evict-interval", "0.2",
                       "--evict-min-threshold", "0.2", "--evict-max-threshold", "0.5",
                       prealloc_size=1 / 128) as srv, Client(srv.address) as c:
        cap = c.stats()["capacity_bytes"]
        c.put_batch([f"p{i}" for i in range(6)], [b"p" * (cap // 8)] * 6)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and c.stats()["usage"] > 0.2:
            time.sleep(0.05)
        st = c.stats(verify=True)
        assert st["usage"] <= 0.2 and st["evictions"] >= 4 and st["accounting_ok"]
        assert c.exists_batch(["p0", "p5"]) == [False, True]


def test_lease_timeout_reclaims_dead_writer():
    with ServerProcess("--lease-timeout", "0.5") as srv, Client(srv.address) as c:
        epoch = c.server_info["epoch"]
        st, _, body = _raw(srv, [_req(Op.ALLOC, {"keys": [b"w1", b"w2"],
                                                 "sizes": [100, 70000]}, epoch=epoch)])
        assert st == Status.OK and body["st"] == [0, 0]
        assert c.stats()["pending"] == 2
        deadline = time.monotonic() + 10
        while c.stats()["pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        s = c.stats(verify=True)
        assert s["pending"] == 0 and s["used_bytes"] == 0 and s["accounting_ok"]
        assert s["lease_expired_writes"] == 1


def test_idle_server_uses_no_cpu(server):
    import resource  # noqa: F401  (CPU time of the server process from /proc)

    def cpu(pid):
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

    with Client(server.address) as c:
        c.put("warm", b"x")
        c.flush()
    t0 = cpu(server.pid)
    time.sleep(1.0)
    assert cpu(server.pid) - t0 <= 0.02


def test_per_client_limits_hold_one_greedy_client_back(no_local_reads):
    # pins are taken by reads that go through the server; same-host lock-free reads
    # (kvshm.localread) hold none
    with ServerProcess("--max-client-pending", str(4 << 20), "--max-client-pinned",
                       str(4 << 20), prealloc_size=1 / 64) as srv, \
            Client(srv.address) as greedy, Client(srv.address) as other:
        with pytest.raises(kvshm.QuotaExceeded):
            greedy.put_batch([f"g{i}" for i in range(5)], [b"g" * (1 << 20)] * 5)
        greedy.put_batch([f"g{i}" for i in range(3)], [b"g" * (1 << 20)] * 3)
        greedy.put_batch([f"g{i}" for i in range(3, 6)], [b"g" * (1 << 20)] * 3)
        with pytest.raises(kvshm.QuotaExceeded):
            greedy.get_batch([f"g{i}" for i in range(6)])
        assert len(greedy.get_batch([f"g{i}" for i in range(3)])) == 3
        # greedy and other are one principal (this uid): they share one quota, so
        # other can read 3 MiB only once greedy's pins are released
        greedy.flush()
        other.put("o", b"o" * (3 << 20))
        assert other.get("o") == b"o" * (3 << 20)
        st = other.stats(verify=True)
        assert st["pinned"] == 0 and st["pending"] == 0 and st["accounting_ok"]


@pytest.mark.parametrize("client", TRANSPORTS, indirect=True)
def test_end_to_end_checksums_catch_corruption(client):
    client.put("sum", b"A" * 100_000, checksum=True)
    client.put("nosum", b"B" * 1000)
    assert client.get("sum", verify=True) == b"A" * 100_000
    out = bytearray(100_000)
    assert client.get_into("sum", out, verify=True) == 100_000
    with pytest.raises(kvshm.CorruptValue, match="without a checksum"):
        client.get("nosum", verify=True)
    # flip one byte in the pool behind the store's back (a stray writer, bad memory)
    info = client.server_info
    with Client(client.address, transport="shm") as spy:
        spy._run(spy._session.op_simple(Op.STATS, {}, "stats"))   # a HELLO'd shm session
        r = spy._run(_lookup_raw(spy, b"sum"))
        pool = kvshm.Pool.attach(info["pool"]["name"])
        try:
            pool.write(r["offsets"][0] + 777, b"Z")
        finally:
            pool.close()
        spy.flush()
    with pytest.raises(kvshm.CorruptValue, match="does not match its checksum"):
        client.get("sum", verify=True)
    with pytest.raises(kvshm.CorruptValue):
        client.get_batch(["nosum", "sum"], verify=True)
    assert client.get("sum")[777:778] == b"Z"        # without verify: the bytes as stored


def _lookup_raw(c, key):
    from kvshm.client import _Req

    r = yield _Req(Op.LOOKUP, {"keys": [key]}, stateful=True)
    c._session.releases.append(r.req_id)
    return r.body


@pytest.mark.parametrize("client", TRANSPORTS, indirect=True)
def test_list_keys(client):
    client.put_batch([f"lst/a{i}" for i in range(25)] + ["other"], [b"v"] * 26)
    assert sorted(client.list_keys("lst/")) == sorted(f"lst/a{i}".encode() for i in range(25))
    assert len(client.list_keys("lst/", page=7)) == 25           # pages of 7
    assert len(client.list_keys(b"lst/", limit=10, page=3)) == 10
    assert client.list_keys("nothing-here") == []
    assert set(client.list_keys()) >= {b"other"}


@pytest.mark.parametrize("client", TRANSPORTS, indirect=True)
def test_idle_client_lets_go_of_its_pins(client):
    client.put_batch(["idle1", "idle2"], [b"a" * 70_000, b"b" * 70_000])
    assert client.get_batch(["idle1", "idle2"])[0] == b"a" * 70_000
    # no further call: the queued RELEASE goes out by itself (Client.IDLE_FLUSH_S)
    with Client(client.address, transport="tcp") as probe:
        deadline = time.monotonic() + 5
        while probe.stats()["pins"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert probe.stats()["pins"] == 0


def test_idle_async_client_lets_go_of_its_pins(server):
    import asyncio

    async def main():
        async with kvshm.AsyncClient(server.address, transport="shm") as a:
            await a.put("aidle", b"z" * 70_000)
            await a.get("aidle")
            await asyncio.sleep(0.5)
            with Client(server.address, transport="tcp") as probe:
                assert probe.stats()["pins"] == 0

    asyncio.run(main())
