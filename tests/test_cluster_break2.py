"""A second hostile review of the cluster work: the pushed view's parked requests,
placement's table against its direct rows, the async cluster client under cancellation
and a hanging member, cluster metrics, handoff pin shares.

Servers run in this process without etcd where the test is about one server's handlers
or a client's fan-out: their CLUSTER_VIEW answers a view the test sets (``_FakeView``),
and the test pokes the loop as the membership agent would. Tests that failed before a
fix say so in their docstring; the others pin down what held.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvshm
from kvshm.cluster import _hrw
from kvshm.cluster.cli import op_view
from kvshm.cluster.placement import Placement, hash_key
from kvshm.cluster.view import Member, View
from kvshm.zmq_ctrl import ops_cluster
from kvshm.zmq_ctrl.protocol import Op

from bed import wait_for
from test_cluster import Cluster, cluster, etcd, needs_client, needs_etcd  # noqa: F401

pytestmark = pytest.mark.timeout(180)


class _FakeView:
    """The view a server's CLUSTER_VIEW answers (what its membership agent would hold);
    :meth:`bump` changes the revision and pokes the servers' loops."""

    def __init__(self, members: tuple[Member, ...] = (), revision: int = 5) -> None:
        self.view = View(revision=revision, members=members, cluster="fake")
        self.servers: list[kvshm.Server] = []

    def __call__(self) -> View:
        return self.view

    def attach(self, srv: kvshm.Server, node_id: str = "") -> None:
        srv.cluster_ops._view = self
        srv.cluster_ops.node_id = node_id
        self.servers.append(srv)

    def bump(self, members: tuple[Member, ...] | None = None) -> None:
        v = self.view
        self.view = View(revision=v.revision + 1,
                         members=v.members if members is None else members,
                         cluster=v.cluster)
        for s in self.servers:
            s.loop.poke()


@pytest.fixture
def server(shm_name: str) -> Iterator[kvshm.Server]:
    with kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.02,
                      shm_name=shm_name) as srv:
        yield srv


@pytest.fixture
def fake(server: kvshm.Server) -> _FakeView:
    fv = _FakeView((Member("a", server.address, 1, 1 << 24, 4096),))
    fv.attach(server, "a")
    return fv


def _sid(c: Any) -> int:
    """The server-side session id of a (sync or async) client, from its HELLO."""
    return int(c.server_info["session"])


def _parked_of(srv: kvshm.Server, sid: int) -> int:
    return sum(1 for p in list(srv.loop._parked) if p.session.id == sid)


def _until(loop: asyncio.AbstractEventLoop, pred: Any, what: str,
           timeout: float = 20.0) -> None:
    """wait_for(pred) while ``loop`` runs (its clients' replies arrive)."""
    def ok() -> bool:
        loop.run_until_complete(asyncio.sleep(0.02))
        return bool(pred())
    wait_for(ok, timeout, what)


async def _flood(c: kvshm.AsyncClient, since: int, n: int, wait: float = 60.0
                 ) -> list[asyncio.Future[Any]]:
    return [asyncio.ensure_future(c.run_op(op_view(c.session, since, wait=wait)))
            for _ in range(n)]


# ---------------------------------------------------------------------- parked views

def test_one_session_cannot_take_every_parked_view_slot(
        server: kvshm.Server, fake: _FakeView, monkeypatch: pytest.MonkeyPatch) -> None:
    """One session could park MAX_VIEW_WAITERS (4096) CLUSTER_VIEWs: every other
    client's follower was then answered at once with nothing new and fell back to
    polling (no push) until the hog's waits ended, and a hog that parked again kept it
    so. Now a session parks at most MAX_VIEW_WAITS_PER_SESSION; beyond, it is answered
    at once."""
    monkeypatch.setattr(ops_cluster, "MAX_VIEW_WAITERS", 32)
    ops = server.cluster_ops
    loop = asyncio.new_event_loop()
    hog = kvshm.AsyncClient(server.address, transport="tcp", timeout=100.0)
    try:
        loop.run_until_complete(hog.connect())
        tasks = loop.run_until_complete(_flood(hog, 5, 200))
        # the hog's requests are all answered or parked (a session keeps few parked)
        _until(loop, lambda: sum(t.done() for t in tasks)
               + _parked_of(server, _sid(hog)) == 200,
               "the hog's 200 requests to be answered or parked", 30)
        assert _parked_of(server, _sid(hog)) <= getattr(
            ops_cluster, "MAX_VIEW_WAITS_PER_SESSION", 4)
        got: dict[str, Any] = {}
        with kvshm.Client(server.address, transport="tcp", timeout=100.0) as other:
            sid = _sid(other)

            def park() -> None:
                got["body"] = other.run_op(op_view(other.session, 5, wait=60.0))

            t = threading.Thread(target=park, daemon=True)
            t.start()
            # parked (before the fix: answered at once, the cap being spent)
            wait_for(lambda: _parked_of(server, sid) == 1 or not t.is_alive(), 20,
                     "the other client's request to be parked or answered")
            assert _parked_of(server, sid) == 1, got
            fake.bump()                       # a change: the push answers it
            t.join(timeout=30)
            assert not t.is_alive()
            assert got["body"]["revision"] == 6 and "view" in got["body"]
        for tk in tasks:
            tk.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    finally:
        loop.run_until_complete(hog.close())
        loop.close()
    wait_for(lambda: ops._waiters == 0, 20, "every parked view to be gone")


def test_a_closed_session_frees_its_parked_views_at_once(
        server: kvshm.Server, fake: _FakeView) -> None:
    """A client that closed (BYE) with CLUSTER_VIEWs parked left them parked, counted
    against the server's cap, until their wait ended (up to 60 s): a client that parks,
    closes and comes back could keep every slot taken. Its session's end now drops them
    on the loop's next turn (the store counts a session's end as progress)."""
    ops = server.cluster_ops
    loop = asyncio.new_event_loop()
    try:
        for _ in range(3):                   # park, close, again
            c = kvshm.AsyncClient(server.address, transport="tcp", timeout=100.0)
            loop.run_until_complete(c.connect())
            sid = _sid(c)
            tasks = loop.run_until_complete(_flood(c, 5, 3))
            _until(loop, lambda: _parked_of(server, sid) == 3, "3 parked views")
            for t in tasks:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(c.close())
            # the waits are 60 s; their end is not what frees them
            wait_for(lambda: _parked_of(server, sid) == 0 and ops._waiters == 0, 20,
                     "the closed session's parked views to be dropped")
    finally:
        loop.close()
    assert ops.stats()["view_waiting"] == 0


@pytest.mark.parametrize("since", [-1, -(2 ** 63), 2 ** 64 - 1, 0, 4, 6])
@pytest.mark.parametrize("wait", [None, 0, -0.0, 1e-300, 0.05, -1, math.nan, math.inf,
                                  2 ** 64 - 1, "5", True, [1], {"a": 1}])
def test_absurd_since_and_wait_are_answered_and_park_nothing_for_long(
        server: kvshm.Server, fake: _FakeView, since: Any, wait: Any) -> None:
    """Held: every since/wait is answered (a view when since is not the revision, an
    INVALID_REQUEST for a wait outside 0-60 s) and nothing stays parked."""
    ops = server.cluster_ops
    with kvshm.Client(server.address, transport="tcp", timeout=10.0) as c:
        try:
            r = c.run_op(c.session.op_simple(Op.CLUSTER_VIEW,
                                             {"since": since, "wait": wait}, "view"))
        except kvshm.InvalidRequest as exc:
            assert "wait must be" in str(exc)
            assert not (isinstance(wait, (int, float)) and not isinstance(wait, bool)
                        and 0 <= wait <= 60)
        else:
            assert r["revision"] == 5
            assert ("view" in r) == (since != 5)
        c.ping()
    assert ops._waiters == 0


def test_server_stop_with_thousands_parked_answers_every_client(
        shm_name: str) -> None:
    """Held: a server stopping with 3000 parked views stops at once, drops every
    parked entry, and each parked call ends with ServerUnavailable (no hang)."""
    srv = kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.02,
                       shm_name=shm_name).start()
    fv = _FakeView((Member("a", srv.address, 1, 1 << 24, 4096),))
    fv.attach(srv, "a")
    loop = asyncio.new_event_loop()
    c = kvshm.AsyncClient(srv.address, transport="tcp", timeout=100.0)
    try:
        loop.run_until_complete(c.connect())
        n = ops_cluster.MAX_VIEW_WAITS_PER_SESSION
        clients = [c] + [kvshm.AsyncClient(srv.address, transport="tcp", timeout=100.0)
                         for _ in range(3)]
        for x in clients[1:]:
            loop.run_until_complete(x.connect())
        tasks = [t for x in clients for t in loop.run_until_complete(_flood(x, 5, n))]
        _until(loop, lambda: srv.cluster_ops._waiters == len(tasks), "parked views")
        srv.stop()
        assert srv.cluster_ops._waiters == 0 and not srv.loop._parked
        res = loop.run_until_complete(asyncio.wait_for(
            asyncio.gather(*tasks, return_exceptions=True), 60))
        assert all(isinstance(r, kvshm.ServerUnavailable) for r in res), res[:3]
        for x in clients:
            loop.run_until_complete(x.close())
    finally:
        srv.stop()
        loop.close()


# ---------------------------------------------------------------------- placement

def _ref_rows(bucket: int, seeds: list[int], weights: list[float], r: int) -> list[int]:
    from test_cluster_placement import reference
    return reference(bucket, seeds, weights, r)


_WEIGHT = st.one_of(
    st.integers(1, (1 << 63) - 1).map(float),                  # any member record's pool
    st.sampled_from([1.0, 2.0, 1e-300, 5e-324 * 2 ** 60, 1e300, 1.7e308, 3.0]),
    st.floats(1e-6, 1e12, allow_nan=False, allow_infinity=False))


@st.composite
def _member_lists(draw: Any) -> tuple[list[int], list[float]]:
    m = draw(st.sampled_from([1, 2, 3, 5, 17, 64, 200]))
    ids = draw(st.lists(st.integers(0, max(1, m // 2) if draw(st.booleans()) else 10 ** 6),
                        min_size=m, max_size=m))                # duplicates often
    seeds = [hash_key(f"node-{i}".encode()) for i in ids]
    weights = draw(st.lists(_WEIGHT, min_size=m, max_size=m))
    return seeds, weights


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(_member_lists(), st.integers(0, 2 ** 32))
def test_the_table_and_direct_rows_agree_for_any_member_list(
        ml: tuple[list[int], list[float]], seed: int) -> None:
    """Held: for member lists of 1-200 nodes with any weights a record can carry (1 to
    2**63 bytes) and hostile ones (1e-300, 1e300, near DBL_MAX) and duplicate ids
    (equal seeds), the bucket table's owners are the directly computed rows, and both
    are the definition's exact order."""
    seeds, weights = ml
    keys = [os.urandom(8) + seed.to_bytes(5, "little") for _ in range(2 * _hrw.DIRECT_BELOW)]
    direct = _hrw.Ring(seeds, weights)
    few = direct.owners(keys[:_hrw.DIRECT_BELOW - 1], 1, 2)    # computed (not built)
    assert not direct.built
    table = _hrw.Ring(seeds, weights)
    table.build()
    assert (table.owners(keys[:_hrw.DIRECT_BELOW - 1], 1, 2) == few).all()
    many = table.owners(keys, 1, 2)
    wide = table.owners(keys, 1, 3)                           # more columns: computed
    assert (wide[:, :2] == many).all()
    rng = np.random.default_rng(seed)
    r = min(3, len(seeds))
    for b in rng.integers(0, 1 << _hrw.BUCKET_BITS, 40).tolist():
        assert list(direct.bucket_owners(b, r)) == _ref_rows(b, seeds, weights, r), b


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_a_weight_that_is_no_pool_size_is_refused(bad: float) -> None:
    """Held: a weight of 0, negative, NaN or inf is a ValueError of the ring (a member
    record cannot carry one: Member.from_dict wants an int pool_size >= 1)."""
    with pytest.raises(ValueError):
        _hrw.Ring([1, 2, 3], [1.0, bad, 2.0])
    rec = {"id": "x", "service": "h:1", "epoch": 1, "pool_size": bad, "block_size": 1}
    with pytest.raises(ValueError):
        Member.from_dict(rec)


def test_a_member_list_change_mid_batch_places_each_call_by_one_view() -> None:
    """Held: a view switch while a thread places batches gives every call the owners of
    the old view or of the new one, never a mix (a Placement is immutable and a call
    reads ViewState.placement once)."""
    from kvshm.cluster.follower import ViewState

    def view(n: int, rev: int) -> dict[str, Any]:
        return {"revision": rev, "nodes": [
            {"id": f"n{i}", "service": f"h:{i}", "epoch": 1, "pool_size": 1 << 30,
             "block_size": 4096} for i in range(n)]}

    state = ViewState()
    state.apply({"node_id": "n0", "view": view(4, 1)})
    keys = [f"k{i}".encode() for i in range(5000)]
    want = {n: Placement(View.from_dict(view(n, 0))).owner_ids(keys) for n in (4, 5)}
    stop = threading.Event()
    bad: list[int] = []

    def place() -> None:
        while not stop.is_set():
            got = state.placement.owner_ids(keys)
            if got != want[4] and got != want[5]:
                bad.append(1)

    t = threading.Thread(target=place)
    t.start()
    try:
        for rev in range(2, 40):
            state.apply({"node_id": "n0", "view": view(4 + rev % 2, rev)})
    finally:
        stop.set()
        t.join()
    assert not bad


def test_owners_are_the_same_with_another_build_of_the_placement_core(
        tmp_path: Any) -> None:
    """Held (or skipped without a compiler): the placement core built with other code
    generation flags (-O0 and -O3 -march=native, fused multiply-add allowed for the
    rest of the module) computes the same owners, bit for bit: the scores use only
    this module's own arithmetic, and its build keeps -ffp-contract=off."""
    import shutil
    import sysconfig

    if shutil.which(sysconfig.get_config_var("CC").split()[0] if
                    sysconfig.get_config_var("CC") else "cc") is None:
        pytest.skip("no C compiler")
    src = os.path.join(os.path.dirname(_hrw.__file__), "_hrw.pyx")
    seeds = [hash_key(f"node-{j}".encode()) for j in range(37)]
    weights = [float((1 + j % 5) << 30) for j in range(37)]
    keys = [f"key-{i}".encode() for i in range(30000)]
    want = _hrw.Ring(seeds, weights).owners(keys, 1, 3)
    for flags in (["-O0", "-ffp-contract=off"], ["-O3", "-march=native",
                                                   "-ffp-contract=off"]):
        d = tmp_path / flags[0].strip("-")
        d.mkdir()
        shutil.copy(src, d / "_hrw_alt.pyx")
        (d / "setup.py").write_text(
            "from setuptools import setup, Extension\n"
            "from Cython.Build import cythonize\n"
            "import numpy\n"
            f"setup(ext_modules=cythonize([Extension('_hrw_alt', ['_hrw_alt.pyx'], "
            f"extra_compile_args={flags!r})], quiet=True), script_args="
            "['build_ext', '--inplace'])\n")
        r = subprocess.run([sys.executable, "setup.py"], cwd=d, capture_output=True,
                           text=True, timeout=170)
        if r.returncode != 0:
            pytest.skip(f"could not build the placement core: {r.stderr[-500:]}")
        code = ("import sys, json, numpy as np; sys.path.insert(0, '.'); import _hrw_alt;"
                "a = json.load(sys.stdin);"
                "o = _hrw_alt.Ring(a['s'], a['w']).owners([k.encode() for k in a['k']], 1, 3);"
                "print(json.dumps(o.tolist()))")
        import json
        out = subprocess.run([sys.executable, "-c", code], cwd=d, capture_output=True,
                             text=True, timeout=120,
                             input=json.dumps({"s": seeds, "w": weights,
                                               "k": [k.decode() for k in keys]}))
        assert out.returncode == 0, out.stderr[-2000:]
        assert np.array_equal(np.array(json.loads(out.stdout), dtype=np.int32), want), flags


# ---------------------------------------------------------------------- metrics

def test_hostile_member_ids_do_not_inject_into_the_prometheus_text() -> None:
    """Held: a member id made to close the label and start a sample of its own is
    escaped in the exposition (prometheus_client escapes label values)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvshm.cluster.metrics import ClientCollector, ClusterMetrics

    evil = 'x"} 1\nkvshm_evil_total 666\n# TYPE kvshm_evil_total counter\n'
    m = ClusterMetrics()
    m.request(evil, 0.5, 7)
    m.request("back\\slash", 0.5, 7)
    v = View.of([Member(evil, "h:1", 1, 10, 1)], revision=3)
    reg = CollectorRegistry()
    reg.register(ClientCollector(lambda: m.snapshot(v, [evil]), {"engine": 'e"\n'}))
    fams = list(text_string_to_metric_families(generate_latest(reg).decode()))
    assert "kvshm_evil" not in {f.name for f in fams}
    peers = {s.labels["peer"] for f in fams for s in f.samples if "peer" in s.labels}
    assert peers == {evil, "back\\slash"}


def _clients(server: kvshm.Server, n: int) -> list[kvshm.ClusterClient]:
    return [kvshm.ClusterClient(server.address, timeout=2.0) for _ in range(n)]


def test_two_cluster_clients_export_into_one_registry(
        server: kvshm.Server, fake: _FakeView) -> None:
    """Two ClusterClients of one process (an engine's scheduler and worker) could not
    both export: the second ``registry.register(cc.collector(labels))`` raised
    DuplicateTimeseries whatever the labels. ``register_metrics`` adds each client to
    one collector of the registry (one family per name, a sample per client), refuses
    the same labels twice, and a closed client's samples go."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    reg = CollectorRegistry(auto_describe=True)      # as prometheus_client.REGISTRY
    a, b, c = _clients(server, 3)
    try:
        a.put_batch(["x1", "x2"], [b"v" * 10] * 2)
        b.get_batch(["x1", "nope"])
        a.register_metrics(registry=reg, labels={"engine": "sched"})
        b.register_metrics(registry=reg, labels={"engine": "worker"})
        with pytest.raises(ValueError, match="same labels"):
            c.register_metrics(registry=reg, labels={"engine": "worker"})
        with pytest.raises(ValueError, match="already"):
            b.register_metrics(registry=reg, labels={"engine": "other"})

        def samples() -> dict[str, dict[str, float]]:
            text = generate_latest(reg).decode()
            fams = list(text_string_to_metric_families(text))
            names = [f.name for f in fams]
            assert len(names) == len(set(names)), names
            out: dict[str, dict[str, float]] = {}
            for f in fams:
                for s in f.samples:
                    out.setdefault(s.name, {})[s.labels.get("engine", "")] = s.value
            return out

        got = samples()
        assert got["kvshm_cluster_client_members"] == {"sched": 1, "worker": 1}
        assert got["kvshm_cluster_client_misses_total"]["worker"] >= 0
        a.close()
        got = samples()
        assert got["kvshm_cluster_client_members"] == {"worker": 1}
        a.register_metrics(registry=reg, labels={"engine": "sched"})   # closed: no-op
        assert samples()["kvshm_cluster_client_members"] == {"worker": 1}
    finally:
        for x in (a, b, c):
            x.close()


# ---------------------------------------------------------------------- pin shares

def test_a_principals_pin_share_spans_its_sessions_and_survives_bye_churn(
        server: kvshm.Server) -> None:
    """Held: the share is per principal, not per session: local clients of one uid
    (6 sessions, each closed with BYE after its PIN) hold 4 pins of a cap of 8 and the
    5th is refused from a fresh session; the pins outlive their sessions; UNPIN frees
    the share."""
    ops = server.cluster_ops
    ops.max_pins = 8
    with kvshm.Client(server.address) as w:
        w.put("k", b"x" * 100)
        assert w.transport == "shm"
    handoffs = []
    for _ in range(4):
        with kvshm.Client(server.address) as c:       # HELLO, PIN, BYE
            handoffs.append(c.pin(["k"], 60))
    assert ops.stats()["handoff_pins_held"] == 4 and len(ops._by_principal) == 1
    for _ in range(2):
        with kvshm.Client(server.address) as c:
            with pytest.raises(kvshm.QuotaExceeded, match="share"):
                c.pin(["k"], 60)
    with kvshm.Client(server.address) as c:
        for h in handoffs:
            assert c.renew(h, 60) is not None           # anyone holding the id
            assert c.unpin(h)
        assert ops._by_principal == {}
        h = c.pin(["k"], 60)
        assert c.unpin(h)
    assert ops.stats()["handoff_pins_held"] == 0


def test_a_pin_renewed_in_a_loop_keeps_its_place_and_expires_when_renewal_stops(
        server: kvshm.Server) -> None:
    """Held: a pin renewed 2000 times (from another connection) still counts once in
    its writer's share and in the heap; it expires once no one renews it, while
    other clients keep the loop busy."""
    ops = server.cluster_ops
    with kvshm.Client(server.address) as w, \
            kvshm.Client(server.address, transport="tcp") as r:
        w.put_batch(["p1", "p2"], [b"y" * 5000] * 2)
        h = w.pin(["p1", "p2"], 60)
        for _ in range(2000):
            assert r.renew(h, 60) is not None
        assert ops.stats()["handoff_pins_held"] == 1
        assert len(ops._heap) <= 3
        assert ops._by_principal[next(iter(ops._by_principal))][0] == 1
        assert r.renew(h, 0.3) is not None
        stop = threading.Event()
        busy_ran = [0]

        def busy() -> None:
            with kvshm.Client(server.address, transport="tcp") as b:
                i = 0
                while not stop.is_set():
                    b.put(f"busy{i % 50}", b"z" * 2000)
                    b.get_batch([f"busy{(i + 7) % 50}"])
                    i += 1
                    busy_ran[0] = i

        t = threading.Thread(target=busy, daemon=True)
        t.start()
        try:
            wait_for(lambda: ops.stats()["handoff_pins_held"] == 0, 30,
                     "the pin to expire under load")
        finally:
            stop.set()
            t.join(timeout=30)
        assert ops.counters["expired"] == 1 and ops._by_principal == {}
        assert not t.is_alive() and busy_ran[0] > 0
        assert r.renew(h, 60) is None and not r.unpin(h)


# ---------------------------------------------------------------------- fan-out

@pytest.fixture
def three(shm_name: str) -> Iterator[tuple[dict[str, Any], _FakeView]]:
    """Members a, b (this process) and s (a ``kvshm serve`` child, to be SIGSTOPped),
    all in one fake view."""
    from servers import ServerProcess

    srvs = {i: kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.06,
                            shm_name=f"{shm_name}-{i}").start() for i in "ab"}
    sp = ServerProcess(prealloc_size=0.03, shm_name=f"{shm_name}-s")
    try:
        fv = _FakeView(tuple(Member(i, s.address, 1, 1 << 24, 4096, ttl=60.0)
                             for i, s in srvs.items())
                       + (Member("s", sp.address, 1, 1 << 24, 4096, ttl=60.0),))
        for i, s in srvs.items():
            fv.attach(s, i)
        yield {**srvs, "s": sp}, fv
    finally:
        try:
            os.killpg(sp.pid, 18)            # SIGCONT, so that it can stop
        except ProcessLookupError:
            pass
        sp.stop()
        for s in srvs.values():
            s.stop()


def _settled(srv: kvshm.Server) -> bool:
    st_ = srv.store.stats()
    return st_["pending"] == 0 and st_["pinned"] == 0 and st_["grants"] == 0


def test_async_fan_out_with_a_stopped_member_and_cancellation_mid_batch(
        three: tuple[dict[str, Any], _FakeView]) -> None:
    """Held: with one member SIGSTOPped, a batch returns (its keys there are misses),
    the member is marked suspect once (one timed-out request, the next batch does not
    wait for it), writes go around it; a put cancelled at any point of its fan-out
    leaves no pending write, pin or grant on any owner."""
    import signal

    srvs, _ = three
    keys = [f"k{i}" for i in range(90)]

    async def main() -> None:
        async with kvshm.AsyncClusterClient(srvs["a"].address, timeout=1.0,
                                            transport="tcp") as cc:
            own = await cc.owners(keys)
            assert {"a", "b", "s"} <= set(own)
            await cc.put_batch(keys, [b"v" * 1000] * len(keys))
            assert all(v is not None for v in await cc.get_batch(keys))
            os.kill(srvs["s"].pid, signal.SIGSTOP)
            got = await asyncio.wait_for(cc.get_batch(keys), 60)
            assert [v is None for v in got] == [o == "s" for o in own]
            assert cc.suspects() == ["s"]
            got = await asyncio.wait_for(cc.get_batch(keys), 60)
            m = cc.metrics()
            assert m["suspect_marks"] == 1 and m["peers"]["s"]["errors"] == 1
            assert m["misses"]["suspect"] == own.count("s")
            await asyncio.wait_for(cc.put_batch(keys, [b"w" * 1000] * len(keys)), 60)
            assert all(v == b"w" * 1000 for v in await cc.get_batch(keys))
            big = [os.urandom(1 << 18)] * 40
            for delay in (0.0, 0.001, 0.005, 0.02, 0.05, 0.1):
                t = asyncio.ensure_future(cc.put_batch([f"c{i}" for i in range(40)], big))
                await asyncio.sleep(delay)
                t.cancel()
                try:
                    await t
                except asyncio.CancelledError:
                    pass
                for n in "ab":
                    await asyncio.to_thread(wait_for, lambda n=n: _settled(srvs[n]), 30,
                                            f"{n} to hold no grant after the cancel")

    asyncio.run(main())
    for n in "ab":
        assert _settled(srvs[n])


def test_sync_fan_out_with_a_stopped_member(
        three: tuple[dict[str, Any], _FakeView]) -> None:
    """Held: the same for the synchronous client (its fan-out threads)."""
    import signal

    srvs, _ = three
    keys = [f"k{i}" for i in range(90)]
    with kvshm.ClusterClient(srvs["b"].address, timeout=1.0, transport="tcp") as cc:
        own = cc.owners(keys)
        cc.put_batch(keys, [b"v" * 1000] * len(keys))
        os.kill(srvs["s"].pid, signal.SIGSTOP)
        got = cc.get_batch(keys)
        assert [v is None for v in got] == [o == "s" for o in own]
        cc.get_batch(keys)
        m = cc.metrics()
        assert m["suspect_marks"] == 1 and m["peers"]["s"]["errors"] == 1
        cc.put_batch(keys, [b"w"] * len(keys))
        assert all(v == b"w" for v in cc.get_batch(keys))


# ---------------------------------------------------------------------- vanishing clients

def test_a_client_that_never_reads_its_replies_blocks_no_one(
        server: kvshm.Server, fake: _FakeView) -> None:
    """Held: a raw client that sends 20000 CLUSTER_VIEWs (waiting ones among them) and
    never reads a reply parks at most its per-session share; the others are answered
    into its full queue (dropped at the high-water mark) and the server serves others
    meanwhile."""
    import msgpack

    from kvshm.zmq_ctrl.channel import endpoint_of
    from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION

    from servers import raw_hello

    ops = server.cluster_ops
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 16)
    sock.setsockopt(zmq.RCVBUF, 4096)
    try:
        sock.connect(endpoint_of(server.address))
        hello = raw_hello(sock, server.address)
        sid, epoch = int(hello["session"]), int(hello["epoch"])
        for i in range(1, 20001):
            body = {"since": 5, "wait": 60.0} if i % 2 else {"since": -1}
            sock.send(msgpack.packb([PROTOCOL_VERSION, Op.CLUSTER_VIEW, i, epoch, body],
                                    use_bin_type=True))
        with kvshm.Client(server.address, transport="tcp", timeout=30.0) as other:
            wait_for(lambda: ops.counters["view_requests"] >= 20000, 60,
                     "the server to have read every request")
            other.ping()
            assert other.run_op(op_view(other.session, -1))["revision"] == 5
        assert _parked_of(server, sid) == ops_cluster.MAX_VIEW_WAITS_PER_SESSION
    finally:
        sock.close(0)
        ctx.term()


_PARK_AND_SLEEP = """
import asyncio, sys, time
import kvshm
from kvshm.cluster.cli import op_view

async def main():
    c = kvshm.AsyncClient(sys.argv[1], timeout=100.0)
    await c.connect()
    assert c.transport == "shm", c.transport
    ts = [asyncio.ensure_future(c.run_op(op_view(c.session, 5, wait=60.0)))
          for _ in range(3)]
    print(c.server_info["session"], flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_a_killed_local_client_frees_its_parked_views_at_once(
        server: kvshm.Server, fake: _FakeView) -> None:
    """A same-host client killed (SIGKILL) with views parked: its session ends as soon
    as its liveness proof is gone, and (since the fix of
    test_a_closed_session_frees_its_parked_views_at_once) its parked views go with it,
    not 60 s later."""
    ops = server.cluster_ops
    p = subprocess.Popen([sys.executable, "-c", _PARK_AND_SLEEP, server.address],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout is not None
        sid = int(p.stdout.readline())
        wait_for(lambda: _parked_of(server, sid) == 3, 30, "the child's 3 parked views")
        p.kill()
        p.wait(30)
        wait_for(lambda: _parked_of(server, sid) == 0 and ops._waiters == 0, 20,
                 "the killed client's parked views to be dropped")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        if p.stdout is not None:
            p.stdout.close()


# ---------------------------------------------------------------------- view changes vs calls

def _flip_while_calling(srvs: dict[str, kvshm.Server], fv: _FakeView, call: Any,
                        flips: int = 150) -> list[str]:
    """Run ``call()`` in 3 threads while member b leaves and comes back ``flips``
    times; the exceptions the calls raised."""
    import time

    full = fv.view.members
    errs: list[str] = []
    stop = threading.Event()
    done = [0]

    def loop() -> None:
        while not stop.is_set():
            try:
                call()
                done[0] += 1
            except Exception as exc:      # a cluster miss is never an error
                errs.append(repr(exc))

    ts = [threading.Thread(target=loop, daemon=True) for _ in range(3)]
    for t in ts:
        t.start()
    try:
        wait_for(lambda: done[0] > 0 or errs, 30, "a first call")
        for r in range(flips):
            fv.bump(full if r % 2 else full[:1])
            time.sleep(0.005)             # let the follower take it (not a timing assert)
    finally:
        stop.set()
        for t in ts:
            t.join(timeout=60)
    return errs


@pytest.fixture
def pair(shm_name: str) -> Iterator[tuple[dict[str, kvshm.Server], _FakeView]]:
    srvs = {i: kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.03,
                            shm_name=f"{shm_name}-{i}").start() for i in "ab"}
    fv = _FakeView(tuple(Member(i, s.address, 1, 1 << 24, 4096, ttl=60.0)
                         for i, s in srvs.items()))
    for i, s in srvs.items():
        fv.attach(s, i)
    try:
        yield srvs, fv
    finally:
        for s in srvs.values():
            s.stop()


def test_a_member_leaving_under_a_sync_batch_is_a_miss_not_an_error(
        pair: tuple[dict[str, kvshm.Server], _FakeView]) -> None:
    """A member that left the view while a batch was on its way to it: the follower
    closed that member's Client under the fan-out thread, and get_batch / put_batch
    raised KvshmError('client is closed'). Now such a call is the member gone: reads
    are misses, writes go to the next choice."""
    srvs, fv = pair
    keys = [f"k{i}" for i in range(200)]
    with kvshm.ClusterClient(srvs["a"].address, timeout=2.0, transport="tcp",
                             view_wait=5.0) as cc:
        cc.put_batch(keys, [b"v" * 5000] * len(keys))
        errs = _flip_while_calling(
            srvs, fv, lambda: (cc.get_batch(keys), cc.put_batch(keys[:50], [b"w"] * 50)))
        assert cc.suspects() == [] or cc.suspects() == ["b"]
    assert errs == [], errs[:5]


def test_a_member_leaving_under_an_async_batch_is_a_miss_not_an_error(
        pair: tuple[dict[str, kvshm.Server], _FakeView]) -> None:
    """The same for the async client (its dropped member clients are closed by a task
    of the loop while a gathered request may still use them)."""
    srvs, fv = pair
    keys = [f"k{i}" for i in range(200)]
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    cc = kvshm.AsyncClusterClient(srvs["a"].address, timeout=2.0, transport="tcp",
                                  view_wait=5.0)
    try:
        run(cc.connect())
        run(cc.put_batch(keys, [b"v" * 5000] * len(keys)))

        async def both() -> None:
            await asyncio.gather(cc.get_batch(keys), cc.get_batch(keys[::-1]),
                                 cc.put_batch(keys[:50], [b"w"] * 50))

        errs = _flip_while_calling(srvs, fv, lambda: run(both()))
    finally:
        run(cc.close())
        loop.call_soon_threadsafe(loop.stop)
        th.join(timeout=30)
        loop.close()
    assert errs == [], errs[:5]


# ---------------------------------------------------------------------- /metrics under churn


@needs_etcd
@needs_client
def test_metrics_scraped_while_members_join_and_leave(cluster: Cluster) -> None:
    """Held: /metrics of a member, scraped in a loop while two others join and leave
    (with a lease drop among them), answers every time with a page that parses, one
    family per name, and members by status that add up to a view it held."""
    from prometheus_client.parser import text_string_to_metric_families

    from test_cluster_push import _scrape

    a = cluster.add("a", manage_port=0)
    assert a.manage_port
    stop = threading.Event()
    pages: list[int] = []
    errs: list[str] = []

    def scrape() -> None:
        while not stop.is_set():
            try:
                fams = list(text_string_to_metric_families(_scrape(a.manage_port)))
                names = [f.name for f in fams]
                assert len(names) == len(set(names))
                mem = {s.labels["status"]: s.value for f in fams
                       if f.name == "kvshm_cluster_members" for s in f.samples}
                assert 1 <= sum(mem.values()) <= 3, mem
                pages.append(1)
            except Exception as exc:
                errs.append(repr(exc))

    t = threading.Thread(target=scrape, daemon=True)
    t.start()
    try:
        for _ in range(2):
            cluster.add("b")
            cluster.add("c")
            wait_for(lambda: len(a.membership.view.members) == 3, 15, "b and c")
            cluster.servers.pop("b").stop()                   # leaves
            cluster.crash("c")                                # its lease expires
            wait_for(lambda: len(a.membership.view.members) == 1, 20, "b and c gone")
    finally:
        stop.set()
        t.join(timeout=60)
    assert errs == [], errs[:3]
    assert pages
