"""The cluster on the test bed: hosts in network namespaces, each with its own /dev/shm.

Every test builds its bed and etcd and removes them (tests/bed.py). Figures each test
measures (times, rates) are printed (``pytest -s``) and gathered in docs/CLUSTER.md; the
asserts are about behaviour only (who sees whom, hits, misses, timed-out batches,
requests per owner, bytes verified), never about wall time.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from bed import ETCD, Agent, Bed, Etcd, bed_refusal, wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.bed]

_why = bed_refusal() if ETCD is not None else "etcd is not installed"
if _why is None:
    try:
        import pyetcd  # noqa: F401
    except ImportError:
        _why = "the cluster extra is not installed (pip install -e '.[cluster]')"
if _why is not None:
    pytest.skip(_why, allow_module_level=True)

TTL = 2
PORT = 7400
#: Per-server egress limit of the fan-out test. The issue asks 1 Gbit; on this 2-core VM
#: shared with other jobs three 1 Gbit/s TCP streams through Python are CPU-bound (the
#: ratio measured: 2.27x alone, 1.45x under a full test run), so the default is a rate
#: the CPUs sustain; KVSHM_BED_RATE=1gbit runs it as the issue states. The test asserts
#: the fan-out (one request per owner, all bytes verified) and prints the ratio.
RATE = os.environ.get("KVSHM_BED_RATE", "300mbit")


class BedCluster:
    def __init__(self, hosts: int = 3) -> None:
        self.bed = Bed(hosts).create()
        self.etcd: Etcd | None = None
        self.servers: dict[int, subprocess.Popen[bytes]] = {}
        self.agents: list[Agent] = []
        # the members share one door token (no CURVE here): agents name its file
        self._tokdir = tempfile.mkdtemp(prefix="kvshm-bed-token-")
        self.token_file = os.path.join(self._tokdir, "door.token")
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32).hex().encode() + b"\n")
        os.close(fd)

    def start_etcd(self, n: int = 1) -> None:
        self.etcd = Etcd(n, host=self.bed.switch_addr, prefix=self.bed.prefix(None),
                         ports=[2379 + i for i in range(n)] + [2479 + i for i in range(n)])
        self.etcd.start()

    def serve(self, i: int, size: float = 0.25) -> str:
        assert self.etcd is not None
        addr = self.bed.addr(i)
        argv = [sys.executable, "-m", "kvshm", "serve", "--host", addr, "--insecure",
                "--door-token-file", self.token_file,
                "--service-port", str(PORT), "--no-manage", "--prealloc-size", str(size),
                "--cluster", self.etcd.url, "--cluster-name", "bed", "--node-id", f"h{i}",
                "--cluster-ttl", str(TTL), "--log-level", "WARNING"]
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        p = self.bed.spawn(i, argv, stdout=subprocess.PIPE, env=env)
        assert p.stdout is not None
        r, _, _ = select.select([p.stdout], [], [], 60)
        line = p.stdout.readline().decode() if r else ""
        assert line.startswith("kvshm ready"), f"server on h{i} did not start: {line!r}"
        self.servers[i] = p
        return f"{addr}:{PORT}"

    def agent(self, i: int, server: int | None = None, **kw: object) -> Agent:
        """A client process on host i of the server on host ``server`` (default i)."""
        a = Agent(self.bed, i, env={"KVSHM_TOKEN_FILE": self.token_file})
        self.agents.append(a)
        kw.setdefault("timeout", 1.0)
        a("connect", address=f"{self.bed.addr(i if server is None else server)}:{PORT}",
          **kw)
        return a

    def close(self) -> None:
        for a in self.agents:
            a.close()
        for p in self.servers.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        if self.etcd is not None:
            self.etcd.close()
        self.bed.destroy()
        shutil.rmtree(self._tokdir, ignore_errors=True)


@pytest.fixture
def bc() -> Iterator[BedCluster]:
    c = BedCluster(hosts=4)
    try:
        c.start_etcd()
        yield c
    finally:
        c.close()


def test_three_servers_seen_by_two_clients_on_other_hosts(bc: BedCluster) -> None:
    for i in range(3):
        bc.serve(i)
    c1 = bc.agent(0)
    c2 = bc.agent(2)
    ids = ["h0", "h1", "h2"]
    t1 = c1("wait_members", ids=ids)
    t2 = c2("wait_members", ids=ids)
    print(f"\nview complete at the clients {t1:.3f} s / {t2:.3f} s after connect")
    keys = [f"key-{i}" for i in range(3000)]
    o1, o2 = c1("owners", keys=keys), c2("owners", keys=keys)
    assert o1 == o2 and set(o1) == set(ids)
    # a server that starts now reaches the client's view by the push (etcd's watch at
    # its local server, then the parked CLUSTER_VIEW answered)
    bc.serve(3)                       # returns at the new server's ready line
    t_new = c1("wait_members", ids=ids + ["h3"])
    print(f"a new server seen by a client {t_new:.3f} s after its ready line")


def test_prefill_decode_handoff_over_the_bridge(bc: BedCluster) -> None:
    for i in range(3):
        bc.serve(i)
    pre = bc.agent(0)
    dec = bc.agent(2)
    dec("wait_members", ids=["h0", "h1", "h2"])
    n, size = 64, 1 << 20                               # 64 MiB
    r = pre("put", prefix="req", n=n, size=size, pin_ttl=30)
    h = r["handoff"]
    assert h["node_id"] == "h0" and h["address"] == f"{bc.bed.addr(0)}:{PORT}"
    sent0, recv2 = bc.bed.port_rx(0), bc.bed.port_tx(2)
    got = dec("check", prefix="req", n=n, size=size, handoff=h)
    sent = bc.bed.port_rx(0) - sent0
    recv = bc.bed.port_tx(2) - recv2
    assert all(got["hits"]) and got["corrupt"] == 0
    payload = n * size
    print(f"\nP/D 64 MiB: prefill write {r['seconds']:.4f} s (local shm), decode read "
          f"{got['seconds']:.3f} s; bytes on the bridge from h0 {sent / payload:.4f}x, "
          f"to h2 {recv / payload:.4f}x the payload")
    assert 1.0 <= sent / payload <= 1.05
    assert 1.0 <= recv / payload <= 1.05
    st = pre("server_stats")
    assert st["handoff_pins_held"] == 0 and st["handoff_unpinned"] == 1
    # an unread handoff expires
    pre("put", prefix="late", n=2, size=4096, pin_ttl=0.5)
    assert pre("server_stats")["handoff_pins_held"] == 1
    wait_for(lambda: pre("server_stats")["handoff_expired"] == 1, 10, "the handoff to expire")
    assert pre("server_stats")["handoff_pins_held"] == 0


def test_host_killed(bc: BedCluster) -> None:
    for i in range(3):
        bc.serve(i)
    c = bc.agent(0)
    c("wait_members", ids=["h0", "h1", "h2"])
    n, size = 600, 4096
    c("put", prefix="k", n=n, size=size)
    owners = c("owners", keys=[f"k/{i}" for i in range(n)])
    t0 = time.monotonic()
    bc.bed.kill_host(2)
    r = c("read_loop", prefix="k", n=n, size=size, until_gone="h2")
    leave = time.monotonic() - t0
    slow = sum(r["timed_out"])
    print(f"\nhost kill: leave seen (pushed view) {leave:.2f} s after the kill (TTL {TTL} s), "
          f"{len(r['batches'])} batches, {slow} met a timeout, longest batch "
          f"{max(r['batches'], default=0):.2f} s, corrupt {r['corrupt']}")
    # the leave reached the client through its view: a newer revision without h2
    assert r["revision_after"] > r["revision_before"]
    assert sorted(r["members_after"]) == ["h0", "h1"]
    assert slow <= 1                    # one ServerUnavailable, then h2 is suspect
    # and only that batch waited (a batch placed just before the leave reached the view
    # asks a member that is gone: a miss at once, no wait, no suspect mark)
    assert sum(b > 0.5 for b in r["batches"]) <= 1
    assert r["corrupt"] == 0
    assert r["hits"] == [o != "h2" for o in owners]


def test_partition_longer_than_ttl_then_heal(bc: BedCluster) -> None:
    for i in range(3):
        bc.serve(i)
    c = bc.agent(0)
    c("wait_members", ids=["h0", "h1", "h2"])
    n, size = 300, 2048
    c("put", prefix="p", n=n, size=size)
    bc.bed.port_down(1)
    c("wait_members", ids=["h0", "h2"])
    time.sleep(0.5)
    bc.bed.port_up(1)
    t = c("wait_members", ids=["h0", "h1", "h2"])
    print(f"\npartition healed: h1 back in the view {t:.2f} s after the port came up")
    r = c("check", prefix="p", n=n, size=size)
    # same server instance: old keys hit (the message says what a rare CI failure was)
    assert all(r["hits"]) and r["corrupt"] == 0, \
        (f"{r['hits'].count(False)} misses, {r['corrupt']} corrupt; client metrics "
         f"{c('metrics')}")


def test_join_fallback_restores_surviving_keys(bc: BedCluster) -> None:
    bc.serve(0)
    bc.serve(1)
    c = bc.agent(0)
    c("wait_members", ids=["h0", "h1"])
    n, size = 400, 2048
    c("put", prefix="j", n=n, size=size)
    bc.serve(2)
    c("wait_members", ids=["h0", "h1", "h2"])
    owners = c("owners", keys=[f"j/{i}" for i in range(n)])
    r = c("check", prefix="j", n=n, size=size)
    m = c("metrics")
    assert all(r["hits"]) and r["corrupt"] == 0
    assert m["fallback_hits"] == owners.count("h2") > 0
    assert m["fallback_copies"] == owners.count("h2")


def test_fan_out_under_a_rate_limit(bc: BedCluster) -> None:
    for i in range(3):
        bc.serve(i, size=0.3)
        bc.bed.rate_limit(i, RATE)
    # a host without a server of its own; 32 MiB per owner at the rate limit take ~1 s,
    # so a timeout of its own (a timed-out read would be a miss, not a slower read)
    c = bc.agent(3, server=0, workers=8, timeout=20.0)
    c("wait_members", ids=["h0", "h1", "h2"])
    n, size = 96, 1 << 20
    c("put", prefix="f", n=n, size=size)
    one = c("read_from", prefix="f", n=n, size=size, only="h0")
    all3 = c("read_from", prefix="f", n=n, size=size)
    r1 = one["bytes"] / one["seconds"]
    r3 = all3["bytes"] / all3["seconds"]
    print(f"\nfan-out under tbf {RATE} per server: one link {r1 * 8 / 1e9:.2f} Gbit/s, "
          f"three owners {r3 * 8 / 1e9:.2f} Gbit/s = {r3 / r1:.2f}x")
    assert one["misses"] == 0 and all3["misses"] == 0
    assert one["corrupt"] == 0 and all3["corrupt"] == 0
    assert all3["bytes"] == n * size
    # one request per owner, all three in the one batch (the fan-out; its rate is printed)
    assert one["requests"] == {"h0": 1}
    assert all3["requests"] == {"h0": 1, "h1": 1, "h2": 1}
