"""The pushed member view, the native async cluster client, cluster metrics on /metrics
and per-principal handoff pin shares (loopback etcd, servers in this process)."""

from __future__ import annotations

import asyncio
import re
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

import kvshm
from kvshm.cluster.cli import op_view
from kvshm.handoff import Handoff

from bed import Etcd, wait_for
from test_cluster import Cluster, cluster, etcd, needs_client, needs_etcd  # noqa: F401

pytestmark = [pytest.mark.timeout(120), needs_etcd, needs_client]


def _view(c: kvshm.Client, since: int, wait: float | None = None,
          stats: bool = False) -> dict[str, Any]:
    return c.run_op(op_view(c.session, since, stats=stats, wait=wait))  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- push

def test_a_view_change_reaches_a_waiting_client_by_the_push(cluster: Cluster) -> None:
    a = cluster.add("a")
    # a long wait: a reply that is not the push could come only after 60 s
    cc = cluster.client("a", view_wait=60.0)
    assert {m.id for m in cc.view.members} == {"a"}
    ops = a.cluster_ops
    wait_for(lambda: ops._waiters >= 1, 10, "the follower's CLUSTER_VIEW to be parked")
    pushed0 = ops.counters["view_pushed"]
    rev0 = cc.view.revision
    cluster.add("b")
    # no refresh(): only the follower can bring b into the client's view
    wait_for(lambda: {m.id for m in cc.view.members} == {"a", "b"}, 15,
             "the follower to receive b")
    assert cc.view.revision > rev0
    assert ops.counters["view_pushed"] > pushed0      # answered on the change, not forced
    assert cc.metrics()["view_pushes"] >= 1
    assert cc.metrics()["view_changes"] >= 2          # the first view, then b
    # and the follower parks again for the next change
    wait_for(lambda: ops._waiters >= 1, 10, "the follower to wait again")


def test_a_stale_revision_gets_the_view_at_once_and_a_current_one_waits(
        cluster: Cluster) -> None:
    a = cluster.add("a")
    with kvshm.Client(a.address, transport="tcp", timeout=5.0) as c:
        cur = _view(c, -1)
        assert cur["view"]["nodes"][0]["id"] == "a"
        rev = cur["revision"]
        # a stale revision with a wait far longer than the client's timeout: answered at
        # once (had it been parked, this call would raise ServerUnavailable)
        stale = _view(c, rev - 1, wait=60.0)
        assert stale["revision"] == rev and stale["view"]["nodes"][0]["id"] == "a"
        waits0 = a.cluster_ops.counters["view_waits"]
        # the current revision is parked until the wait is over: no view in the reply
        same = _view(c, rev, wait=0.2)
        assert same["revision"] == rev and "view" not in same
        assert a.cluster_ops.counters["view_waits"] == waits0 + 1
        assert a.cluster_ops._waiters == 0
        with pytest.raises(kvshm.KvshmError):
            _view(c, rev, wait=61.0)                 # over MAX_VIEW_WAIT
        with pytest.raises(kvshm.KvshmError):
            _view(c, rev, wait="soon")  # type: ignore[arg-type]


def test_a_parked_request_is_answered_by_the_change(cluster: Cluster) -> None:
    a = cluster.add("a")
    got: dict[str, Any] = {}
    with kvshm.Client(a.address, transport="tcp", timeout=70.0) as c:
        rev = _view(c, -1)["revision"]

        def park() -> None:
            got["body"] = _view(c, rev, wait=60.0)

        t = threading.Thread(target=park)
        t.start()
        wait_for(lambda: a.cluster_ops._waiters == 1, 10, "the request to be parked")
        cluster.add("b")
        t.join(timeout=30)
        assert not t.is_alive()
    body = got["body"]
    assert body["revision"] > rev
    assert {n["id"] for n in body["view"]["nodes"]} == {"a", "b"}
    assert a.cluster_ops.counters["view_pushed"] == 1 and a.cluster_ops._waiters == 0


def test_closing_a_client_ends_its_follower(cluster: Cluster) -> None:
    cluster.add("a")
    before = {t.name for t in threading.enumerate()}
    cc = kvshm.ClusterClient(cluster.servers["a"].address, view_wait=60.0)
    wait_for(lambda: cluster.servers["a"].cluster_ops._waiters >= 1, 10, "a parked view")
    cc.close()          # returns without waiting for the parked request's 60 s
    assert not cc._follower._thread.is_alive()
    assert "kvshm-cluster-view" not in {t.name for t in threading.enumerate()} - before


# ---------------------------------------------------------------------- async

class _AsyncAsSync:
    """Runs an AsyncClusterClient's coroutines on a loop of this thread."""

    def __init__(self, address: str, **kw: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.ac = kvshm.AsyncClusterClient(address, **kw)
        self.run(self.ac.connect())

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.ac, name)
        if not callable(attr) or name in ("metrics", "suspects", "collector"):
            return attr
        return lambda *a, **kw: self.run(attr(*a, **kw))

    @property
    def view(self) -> Any:
        return self.ac.view

    def close(self) -> None:
        self.run(self.ac.close())
        self.loop.close()


def _client(cluster: Cluster, kind: str, node: str, **kw: Any) -> Any:
    kw.setdefault("timeout", 1.0)
    if kind == "sync":
        return cluster.client(node, **kw)
    c = _AsyncAsSync(cluster.servers[node].address, **kw)
    cluster.clients.append(c)    # type: ignore[arg-type]
    return c


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_clients_fan_out_to_owners_and_agree(cluster: Cluster, kind: str) -> None:
    for n in ("a", "b", "c"):
        cluster.add(n)
    ref = cluster.client("a")
    cluster.see(ref, {"a", "b", "c"})
    cc = _client(cluster, kind, "b")
    wait_for(lambda: len(cc.refresh().members) == 3, 15, "three members")
    keys = [f"k{i}" for i in range(300)]
    vals = [i.to_bytes(2, "big") * 100 for i in range(300)]
    owners = cc.owners(keys)
    assert owners == ref.owners(keys) and set(owners) == {"a", "b", "c"}
    cc.put_batch(keys, vals)
    for n, srv in cluster.servers.items():          # each key at its owner only
        with kvshm.Client(srv.address, transport="tcp") as d:
            assert d.exists_batch(keys) == [o == n for o in owners]
    assert cc.get_batch(keys) == vals
    assert cc.get_batch(keys + ["nope"])[-1] is None
    assert cc.exists_batch(keys[:5] + ["nope"]) == [True] * 5 + [False]
    assert cc.match_prefix(keys[:10] + ["nope"] + keys[10:20]) == 10
    assert cc.delete(keys[:50]) == 50
    assert cc.get_batch(keys[:50]) == [None] * 50
    m = cc.metrics()
    assert m["misses"]["absent"] == 51 and set(m["peers"]) == {"a", "b", "c"}
    assert sum(p["bytes_out"] for p in m["peers"].values()) == sum(map(len, vals))
    if kind == "async":
        # native: one AsyncClient per remote owner, no fan-out threads
        assert all(isinstance(c, kvshm.AsyncClient) for _, c in cc.ac._clients.values())
        assert not [t for t in threading.enumerate() if t.name.startswith("kvshm-cluster")
                    and t.name != "kvshm-cluster-view"
                    and t not in _threads_of(ref)]


def _threads_of(c: kvshm.ClusterClient) -> list[threading.Thread]:
    return list(getattr(c._pool, "_threads", ()))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_clients_handoff_and_suspect(cluster: Cluster, kind: str) -> None:
    pre = cluster.add("p")
    cluster.add("d")
    prefill = _client(cluster, kind, "p")
    decode = _client(cluster, kind, "d")
    wait_for(lambda: len(decode.refresh().members) == 2, 15, "two members")
    keys = [f"r/{i}" for i in range(4)]
    vals = [bytes([i]) * 50_000 for i in range(4)]
    h = prefill.put_batch(keys, vals, pin_ttl=30)
    assert isinstance(h, Handoff) and h.node_id == "p"
    assert decode.get_handoff(h.to_dict()) == vals
    with kvshm.Client(pre.address, transport="tcp") as admin:
        assert admin.stats()["pins"] == 0
    stale = Handoff.from_dict({**h.to_dict(), "epoch": h.epoch + 1})
    assert decode.get_handoff(stale) == [None] * 4
    assert decode.metrics()["misses"]["epoch"] == 4
    # p dies without leaving: one batch times out, then p is suspect (immediate misses)
    ks = [f"s{i}" for i in range(60)]
    decode.put_batch(ks, [b"v"] * 60)
    on_p = [k for k, o in zip(ks, decode.owners(ks)) if o == "p"]
    assert on_p
    cluster.crash("p")
    assert decode.get_batch(on_p) == [None] * len(on_p)
    assert "p" in decode.suspects()
    assert decode.get_batch(on_p) == [None] * len(on_p)
    m = decode.metrics()
    assert m["suspect_marks"] == 1 and m["misses"]["suspect"] == len(on_p)


def test_async_client_follows_pushes(cluster: Cluster) -> None:
    a = cluster.add("a")

    async def main() -> None:
        async with kvshm.AsyncClusterClient(a.address, view_wait=60.0, timeout=1.0) as ac:
            wait = asyncio.get_running_loop().run_in_executor
            await wait(None, wait_for, lambda: a.cluster_ops._waiters >= 1, 10, "parked")
            await wait(None, cluster.add, "b")
            for _ in range(1500):              # until the follower task brings b in
                if len(ac.view.members) == 2:
                    break
                await asyncio.sleep(0.01)
            assert {m.id for m in ac.view.members} == {"a", "b"}
            assert ac.metrics()["view_pushes"] >= 1

    asyncio.run(main())


# ---------------------------------------------------------------------- metrics

def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()  # type: ignore[no-any-return]


def _sample(text: str, name: str, labels: str = "") -> float:
    pat = re.escape(name) + (re.escape("{" + labels + "}") if labels else r"(?:\{\})?") \
        + r" ([-+0-9.e]+)$"
    m = re.search(pat, text, re.M)
    assert m, f"{name}{{{labels}}} not in /metrics"
    return float(m.group(1))


def test_cluster_metrics_on_the_prometheus_page(cluster: Cluster) -> None:
    a = cluster.add("a", manage_port=0)
    cluster.add("b")
    cc = cluster.client("a")
    cluster.see(cc, {"a", "b"})
    wait_for(lambda: a.membership.view.revision == cc.view.revision, 10, "a's view")
    text = _scrape(a.manage_port)  # type: ignore[arg-type]
    assert _sample(text, "kvshm_cluster_view_revision") == a.membership.view.revision
    assert _sample(text, "kvshm_cluster_members", 'status="up"') == 2
    assert _sample(text, "kvshm_cluster_members", 'status="draining"') == 0
    assert _sample(text, "kvshm_cluster_view_changes_total") >= 2
    assert _sample(text, "kvshm_cluster_etcd_errors_total") >= 0
    assert _sample(text, "kvshm_cluster_registered") == 1
    assert _sample(text, "kvshm_cluster_handoff_pins_held") == 0
    with kvshm.Client(a.address) as w:
        w.put_batch(["m1", "m2"], [b"x" * 5000] * 2, pin_ttl=30)
        h2 = w.put_batch(["m3"], [b"y"], pin_ttl=0.2)
        assert w.renew(h2, 0.2) is not None
        wait_for(lambda: w.run_op(op_view(w.session, stats=True))["stats"]
                 ["handoff_expired"] == 1, 10, "the short pin to expire")
    text = _scrape(a.manage_port)  # type: ignore[arg-type]
    assert _sample(text, "kvshm_cluster_handoff_pins_held") == 1
    assert _sample(text, "kvshm_cluster_handoff_pins_total") == 2
    assert _sample(text, "kvshm_cluster_handoff_expired_total") == 1
    assert _sample(text, "kvshm_cluster_handoff_renewed_total") == 1
    assert _sample(text, "kvshm_cluster_handoff_pinned_bytes") >= 2 * 5000


def test_client_metrics_collector(cluster: Cluster) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    cluster.add("a")
    cluster.add("b")
    cc = cluster.client("a")
    cluster.see(cc, {"a", "b"})
    keys = [f"c{i}" for i in range(50)]
    cc.put_batch(keys, [b"z" * 100] * 50)
    assert cc.get_batch(keys + ["absent"])[-1] is None
    reg = CollectorRegistry()
    reg.register(cc.collector({"engine": "e0"}))
    text = generate_latest(reg).decode()
    assert _sample(text, "kvshm_cluster_client_misses_total",
                   'engine="e0",reason="absent"') == 1
    assert _sample(text, "kvshm_cluster_client_members", 'engine="e0"') == 2
    assert _sample(text, "kvshm_cluster_client_view_revision",
                   'engine="e0"') == cc.view.revision
    total = sum(_sample(text, "kvshm_cluster_client_peer_bytes_out_total",
                        f'engine="e0",peer="{p}"') for p in ("a", "b"))
    assert total == 50 * 100
    n = sum(_sample(text, "kvshm_cluster_client_peer_request_seconds_count",
                    f'engine="e0",peer="{p}"') for p in ("a", "b"))
    assert n == sum(p["requests"] for p in cc.metrics()["peers"].values())


# ---------------------------------------------------------------------- pin shares

def test_one_client_cannot_take_every_handoff_pin(cluster: Cluster) -> None:
    srv = cluster.add("a")
    ops = srv.cluster_ops
    ops.max_pins = 8                       # share 1/2: 4 pins per principal
    assert ops.pin_share == 0.5
    with kvshm.Client(srv.address) as greedy:
        greedy.put("k", b"x")
        hs = [greedy.pin(["k"], 60) for _ in range(4)]
        with pytest.raises(kvshm.QuotaExceeded, match="share"):
            greedy.pin(["k"], 60)
        assert ops.counters["refused_share"] == 1
        # another principal still gets pins (the local client is its uid; a TCP peer
        # without CURVE that holds the door token is "door")
        with kvshm.Client(srv.address, transport="tcp") as other:
            h = other.pin(["k"], 60)
            assert h.pin != 0
            assert other.unpin(h)
        for h in hs:
            assert greedy.unpin(h)
        assert ops._by_principal == {}
        h = greedy.pin(["k"], 60)           # the share is free again
        assert greedy.unpin(h)


def test_pin_share_counts_bytes_per_principal(cluster: Cluster) -> None:
    srv = cluster.add("a")
    ops = srv.cluster_ops
    bs = srv.store.block_size
    ops.max_pinned_bytes = 8 * bs           # share 1/2: 4 blocks per principal
    with kvshm.Client(srv.address) as c:
        c.put_batch([f"b{i}" for i in range(6)], [b"q" * bs] * 6)
        h = c.pin([f"b{i}" for i in range(4)], 60)
        with pytest.raises(kvshm.QuotaExceeded, match="share"):
            c.pin(["b4"], 60)
        assert c.unpin(h)
        h = c.pin(["b4", "b5"], 60)
        assert c.unpin(h)


def test_a_parked_view_is_looked_at_on_the_poke_not_at_every_store_progress(
        cluster: Cluster) -> None:
    """A busy server frees blocks on most turns of its loop; the parked view requests
    are attempted only when the membership agent pokes the loop (or at their end)."""
    a = cluster.add("a")
    ops = a.cluster_ops
    calls = [0]
    real = ops._view

    def counting() -> Any:
        calls[0] += 1
        return real()

    ops._view = counting
    with kvshm.Client(a.address, transport="tcp", timeout=70.0) as c:
        rev = _view(c, -1)["revision"]
        t = threading.Thread(target=lambda: _view(c, rev, wait=60.0), daemon=True)
        t.start()
        wait_for(lambda: ops._waiters == 1, 10, "the request to be parked")
        parked_at = calls[0]
        with kvshm.Client(a.address, transport="tcp") as w:
            progress0 = a.store.progress
            for i in range(50):
                w.put(f"p{i}", b"x" * 100)
                w.delete([f"p{i}"])
            assert a.store.progress > progress0
        assert calls[0] == parked_at and ops._waiters == 1      # never attempted
        a.loop.poke()
        wait_for(lambda: calls[0] > parked_at, 10, "the attempt after the poke")
        assert ops._waiters == 1          # same revision: parked again
        cluster.add("b")                  # a change: the push answers it
        t.join(timeout=30)
        assert not t.is_alive() and ops._waiters == 0
        ops._view = real
