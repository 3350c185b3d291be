"""Hostile inputs against the cluster work: wire bodies, handoff records, member records.

Every test here failed before the fix named in its docstring.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

import kvshm
from kvshm.cluster.placement import Placement
from kvshm.cluster.view import Member, View
from kvshm.handoff import Handoff
from kvshm.zmq_ctrl.protocol import Op

pytestmark = pytest.mark.timeout(120)

GOOD = {"node_id": "n1", "address": "127.0.0.1:5000", "epoch": 7, "deadline": 1e9,
        "keys": ["6b31"], "pin": 3}
MEMBER = {"id": "n1", "service": "127.0.0.1:5000", "epoch": 7, "pool_size": 1 << 30,
          "block_size": 65536}


# ---------------------------------------------------------------------- handoff records

@pytest.mark.parametrize("d", [None, [], "handoff", 5, b"x"])
def test_handoff_from_dict_of_a_non_mapping_is_a_value_error(d: Any) -> None:
    """Handoff.from_dict(None / a list / a str) raised AttributeError, not ValueError."""
    with pytest.raises(ValueError, match="not a handoff record"):
        Handoff.from_dict(d)


@pytest.mark.parametrize("over", [{"keys": [10 ** 12]}, {"keys": [3]},
                                  {"first_key": 10 ** 12}, {"keys": "6b31"},
                                  {"keys": [None]}, {"epoch": 1.5}, {"epoch": True},
                                  {"deadline": math.nan}, {"pin": -1}, {"count": -4},
                                  {"pin": "x"}, {"count": 5}])
def test_handoff_from_dict_rejects_garbage_fields(over: dict[str, Any]) -> None:
    """An int key was taken as bytes(n): ``keys: [10**12]`` tried to allocate a TB of
    zeros, ``keys: [3]`` silently became b'\\0\\0\\0'; a str ``keys`` was iterated per
    character; a float epoch was truncated to another epoch; NaN deadline accepted."""
    with pytest.raises(ValueError, match="not a handoff record"):
        Handoff.from_dict({**GOOD, **over})


def test_handoff_constructor_takes_no_int_key() -> None:
    """Handoff(..., keys=(5,)) made the key b'\\0' * 5 (bytes(int))."""
    with pytest.raises(TypeError):
        Handoff("n", "h:1", 1, (5,), 0.0)       # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Handoff("n", "h:1", 1, (b"a", b"b"), 0.0, count=3)
    assert Handoff("n", "h:1", 1, (), 0.0, first_key=b"a", count=3).count == 3


def test_handoff_from_dict_still_reads_its_own_records() -> None:
    h = Handoff.from_dict(GOOD)
    assert h.keys == (b"k1",) and h.epoch == 7 and h.pin == 3
    assert Handoff.from_dict({**GOOD, "keys": [b"k1"]}) == h
    assert Handoff.from_dict(h.to_dict()) == h


# ---------------------------------------------------------------------- member records

def _rec(**over: Any) -> bytes:
    body = json.dumps(MEMBER)[:-1]
    extra = "".join(f', "{k}": {v}' for k, v in over.items())
    return (body + extra + "}").encode()


@pytest.mark.parametrize("over", [{"pool_size": "1e400"}, {"pool_size": "1" + "0" * 400},
                                  {"pool_size": "NaN"}, {"pool_size": "1.5"},
                                  {"block_size": "-5"}, {"block_size": "0"},
                                  {"ttl": "NaN"}, {"ttl": "-1"}, {"ttl": "1e400"},
                                  {"epoch": "1" + "0" * 30}, {"epoch": "-1"},
                                  {"epoch": "2.5"}, {"id": '""'}, {"id": "5"},
                                  {"service": "[1, 2]"}, {"status": "null"},
                                  {"curve_public_key": "[]"}, {"rdma": "7"}])
def test_member_record_rejects_absurd_fields(over: dict[str, Any]) -> None:
    """int(1e400) raised OverflowError (the membership thread dies: only ValueError was
    caught); a 400-digit pool size was accepted and then overflowed float() in
    Placement (every ClusterClient refresh failed); NaN / negative / infinite ttl were
    taken (a NaN suspect mark never ends); epochs beyond 64 bits cannot be packed by
    msgpack in CLUSTER_VIEW."""
    with pytest.raises(ValueError):
        Member.from_json(_rec(**over))


def test_member_record_nested_too_deep_is_a_value_error() -> None:
    """json.loads of a deeply nested record raised RecursionError (not ValueError)."""
    with pytest.raises(ValueError):
        Member.from_json(b"[" * 200_000 + b"]" * 200_000)
    with pytest.raises(ValueError):
        Member.from_json(_rec(rdma='{"a": ' * 100_000 + "1" + "}" * 100_000))


def test_member_record_survivors_place_keys() -> None:
    ok = Member.from_json(_rec(pool_size=str(1 << 50)))
    v = View.of([ok, Member.from_json(_rec(id='"n2"'))], revision=1)
    assert set(Placement(v).owner_ids([b"a", b"b", b"c"])) <= {"n1", "n2"}


# ---------------------------------------------------------------------- wire bodies

@pytest.fixture
def server(shm_name: str) -> Iterator[kvshm.Server]:
    with kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.02,
                      shm_name=shm_name) as srv:
        yield srv


def _raw(c: kvshm.Client, op: int, body: dict[str, Any]) -> Any:
    return c.run_op(c.session.op_simple(op, body, "raw"))


def _held(srv: kvshm.Server) -> int:
    return int(srv.cluster_ops.stats()["handoff_pins_held"])


HOSTILE = [
    (Op.PIN, {"keys": "x", "ttl": 5}), (Op.PIN, {"keys": [1, 2.5, None], "ttl": 5}),
    (Op.PIN, {"keys": [b"k"] * 100_000, "ttl": 5}), (Op.PIN, {"keys": [b"k"]}),
    (Op.PIN, {"keys": [b"k"], "ttl": math.nan}), (Op.PIN, {"keys": [b"k"], "ttl": -1}),
    (Op.PIN, {"keys": [b"k"], "ttl": math.inf}), (Op.PIN, {"keys": [b"k"], "ttl": 1e308}),
    (Op.PIN, {"keys": [b"k"], "ttl": "5"}), (Op.PIN, {"keys": [b"k"], "ttl": True}),
    (Op.PIN, {"keys": {"a": 1}, "ttl": 5}), (Op.RENEW, {"pin": "1", "ttl": 5}),
    (Op.RENEW, {"pin": 2 ** 63, "ttl": 5}), (Op.RENEW, {"pin": -1, "ttl": math.nan}),
    (Op.RENEW, {"pin": 1, "ttl": -5}), (Op.RENEW, {}), (Op.UNPIN, {"pin": None}),
    (Op.UNPIN, {"pin": -5}), (Op.UNPIN, {"pin": 1, "epoch": [1]}),
    (Op.UNPIN, {"pin": 1.0}), (Op.CLUSTER_VIEW, {"since": "x"}),
    (Op.CLUSTER_VIEW, {"since": 2 ** 63}), (Op.CLUSTER_VIEW, {"since": 1.5}),
    (Op.DRAIN, {"leave_after": math.nan}), (Op.DRAIN, {"leave_after": -1}),
]


def test_hostile_cluster_bodies_are_answered_cleanly_and_leak_no_pin(
        server: kvshm.Server) -> None:
    with kvshm.Client(server.address, transport="tcp") as c:
        c.put("k", b"v" * 5000)
        for op, body in HOSTILE:
            try:
                _raw(c, op, body)
            except kvshm.KvshmError as exc:
                assert "internal error" not in str(exc), (op, body, exc)
            c.ping()
        assert c.stats()["pins"] == 0
    assert _held(server) == 0


def test_pin_of_only_missing_keys_holds_no_pin(server: kvshm.Server) -> None:
    """Each PIN of absent keys created an empty pin held for its whole TTL (600 s):
    a loop of them grew the server's pin table without bound."""
    with kvshm.Client(server.address, transport="tcp") as c:
        for i in range(300):
            r = _raw(c, Op.PIN, {"keys": [f"absent-{i}".encode()], "ttl": 600})
            assert r["found"] == [False]
        assert _held(server) == 0
        with pytest.raises(kvshm.KeyNotFound):
            c.pin(["absent"], 5)
        assert _held(server) == 0


def test_pin_ids_cannot_be_guessed_by_counting(server: kvshm.Server) -> None:
    """Pin ids were 1, 2, 3...: any client could renew or drop every other client's
    handoff by counting (UNPIN needs only the id)."""
    with kvshm.Client(server.address) as w, kvshm.Client(server.address,
                                                         transport="tcp") as thief:
        h = w.put_batch(["a", "b"], [b"1" * 100, b"2" * 100], pin_ttl=60)
        for guess in range(0, 2000):
            assert not thief.unpin(guess)
        assert _held(server) == 1
        assert w.renew(h, 30) is not None
        assert w.unpin(h) and _held(server) == 0


def test_renewing_in_a_loop_does_not_grow_the_deadline_heap(server: kvshm.Server) -> None:
    """Held: every RENEW pushes a deadline, but tick() pops superseded ones as soon as
    they reach the top, so a renew loop keeps the heap small."""
    with kvshm.Client(server.address, transport="tcp") as c:
        c.put("k", b"x" * 100)
        h = c.pin(["k"], 600)
        for _ in range(1000):
            assert c.renew(h, 600) is not None
        assert len(server.cluster_ops._heap) <= 2 * _held(server) + 64
        assert c.unpin(h)


def test_pin_count_is_capped(server: kvshm.Server) -> None:
    """Only pinned bytes were capped: pins of empty or tiny values had no bound."""
    server.cluster_ops.max_pins = 4
    server.cluster_ops.pin_share = 1.0      # the server-wide cap (shares: test_cluster_push)
    with kvshm.Client(server.address, transport="tcp") as c:
        c.put("k", b"x")
        hs = [c.pin(["k"], 60) for _ in range(4)]
        with pytest.raises(kvshm.QuotaExceeded):
            c.pin(["k"], 60)
        assert _held(server) == 4
        for h in hs:
            assert c.unpin(h)
        assert c.stats()["pins"] == 0


def test_unread_handoff_expires_and_frees_its_blocks(server: kvshm.Server) -> None:
    """Held: an unread handoff pin expires; then eviction gives every block back."""
    from bed import wait_for

    keys = [f"h{i}" for i in range(8)]
    with kvshm.Client(server.address) as c:
        free0 = c.stats()["free_blocks"]
        c.put_batch(keys, [b"z" * 60_000] * 8, pin_ttl=0.2)
        assert _held(server) == 1 and c.stats()["pins"] == 8
        assert c.stats()["free_blocks"] < free0
        wait_for(lambda: _held(server) == 0, 20, "the handoff pin to expire")
        st = c.stats()
        assert st["pins"] == 0 and st["pinned"] == 0
        assert server.cluster_ops.stats()["handoff_pinned_bytes"] == 0
        assert server.cluster_ops.stats()["handoff_expired"] == 1
        c.evict(0.0)
        assert not any(c.exists_batch(keys))
        st = c.stats()
        assert st["free_blocks"] == free0 and st["used_bytes"] == 0


def test_handoff_pins_cannot_take_the_whole_pool(server: kvshm.Server) -> None:
    """Held: put_batch(pin_ttl=) over half the pool is refused and pins nothing."""
    size = server.pool.size
    with kvshm.Client(server.address) as c:
        n = size // 2 // 60_000 + 2
        keys = [f"w{i}" for i in range(n)]
        with pytest.raises(kvshm.QuotaExceeded):
            c.put_batch(keys, [b"q" * 60_000] * n, pin_ttl=60)
        assert _held(server) == 0 and c.stats()["pins"] == 0


# ---------------------------------------------------------------------- hostile etcd records

def _etcd_or_skip() -> Any:
    from bed import ETCD

    try:
        import pyetcd  # noqa: F401
    except ImportError:
        pytest.skip("the cluster extra is not installed (pip install -e '.[cluster]')")
    if ETCD is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    from bed import Etcd
    return Etcd


def test_hostile_member_records_break_neither_the_watcher_nor_placement(
        shm_name: str) -> None:
    """A record with ``pool_size: 1e400`` raised OverflowError in the relist, which
    killed the membership thread (only EtcdUnavailable was caught there): the server
    stopped keeping its lease alive and dropped out. A record under ``nodes/evil``
    naming id ``a`` replaced the real member a on every relist (its service address
    with it): any writer to the prefix could steal a member's keys."""
    import uuid

    from bed import wait_for

    Etcd = _etcd_or_skip()
    name = "x" + uuid.uuid4().hex[:8]
    prefix = f"/kvshm/{name}/nodes/"
    with Etcd(1).start() as etcd:
        servers: list[kvshm.Server] = []
        try:
            def add(node: str) -> kvshm.Server:
                srv = kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.02,
                                   shm_name=f"{shm_name}-{node}", cluster=etcd.url,
                                   cluster_name=name, node_id=node,
                                   cluster_ttl=2).start()
                servers.append(srv)
                wait_for(srv.membership.registered.is_set, 15, f"{node} to register")
                return srv

            a = add("a")
            rec = dict(MEMBER, service="10.66.66.66:1", epoch=1)
            hostile = {
                "garbage": b"{not json",
                "deep": b"[" * 100_000 + b"]" * 100_000,
                "inf": json.dumps({**rec, "id": "inf"}).replace(
                    str(MEMBER["pool_size"]), "1e400").encode(),
                "huge": json.dumps({**rec, "id": "huge",
                                    "pool_size": 10 ** 400}).encode(),
                "nan": json.dumps({**rec, "id": "nan", "ttl": math.nan}).encode(),
                "zero": json.dumps({**rec, "id": "zero", "pool_size": 0}).encode(),
                "neg": json.dumps({**rec, "id": "neg", "pool_size": -5}).encode(),
                "list": json.dumps([rec] * 1000).encode(),
                "evil": json.dumps({**rec, "id": "a"}).encode(),
            }
            cl = etcd._client()
            try:
                for k, v in hostile.items():
                    cl.put(prefix + k, v)
            finally:
                cl.close()
            b = add("b")      # registers after the hostile records
            ms = a.membership
            assert ms is not None
            relists = ms.counters["relists"]
            wait_for(lambda: ms.counters["relists"] >= relists + 2, 30,
                     "two relists over the hostile records")
            assert ms._thread is not None and ms._thread.is_alive()
            with kvshm.ClusterClient(a.address, timeout=2.0) as cc:
                def sees_both() -> bool:
                    return {m.id for m in cc.refresh().members} == {"a", "b"}
                wait_for(sees_both, 15, "the view to be exactly a and b")
                assert cc.view.get("a").service == a.address
                assert cc.view.get("a").epoch == a.epoch
                keys = [f"k{i}" for i in range(64)]
                assert set(cc.owners(keys)) == {"a", "b"}
                cc.put_batch(keys, [b"v"] * 64)
                assert cc.get_batch(keys) == [b"v"] * 64
            assert b.membership is not None and b.membership._thread.is_alive()
        finally:
            for s in servers:
                s.stop()


def test_a_member_back_with_a_new_epoch_is_not_left_suspect(shm_name: str) -> None:
    """A suspect mark lasted the member's whole lease window even when the member came
    back at once as a new instance (new epoch, new lease): its keys read as misses and
    writes went to the second choice until the old mark ran out."""
    from test_cluster import Cluster

    from bed import wait_for

    Etcd = _etcd_or_skip()
    with Etcd(1).start() as etcd:
        cl = Cluster(etcd, shm_name, ttl=60.0)      # marks last 60 s: far beyond the test
        try:
            cl.add("a")
            cl.add("b")
            cc = cl.client("a", timeout=1.0)
            cl.see(cc, {"a", "b"})
            keys = [f"k{i}" for i in range(200)]
            on_b = [k for k, o in zip(keys, cc.owners(keys)) if o == "b"]
            assert on_b
            old_epoch = cl.servers["b"].epoch
            cl.crash("b")
            assert cc.get_batch(on_b) == [None] * len(on_b)     # times out: suspect
            assert cc.suspects() == ["b"]
            b = cl.add("b")
            assert b.epoch != old_epoch
            wait_for(lambda: cc.refresh().get("b") is not None
                     and cc.view.get("b").epoch == b.epoch, 15, "b's new epoch in the view")
            assert cc.suspects() == []
            cc.put_batch(on_b, [b"new"] * len(on_b))
            with kvshm.Client(b.address, transport="tcp") as direct:
                assert all(direct.exists_batch(on_b))
            assert cc.get_batch(on_b) == [b"new"] * len(on_b)
        finally:
            cl.close()


def test_clients_of_members_that_left_are_closed(shm_name: str) -> None:
    """The per-member Client of a node that left the view stayed open forever (one
    socket per departed member and epoch under churn)."""
    from test_cluster import Cluster

    Etcd = _etcd_or_skip()
    with Etcd(1).start() as etcd:
        cl = Cluster(etcd, shm_name)
        try:
            cl.add("a")
            cl.add("b")
            cc = cl.client("a")
            cl.see(cc, {"a", "b"})
            keys = [f"k{i}" for i in range(100)]
            cc.put_batch(keys, [b"v"] * 100)
            assert "b" in cc._clients
            cl.servers.pop("b").stop()       # leaves (deletes its record)
            cl.see(cc, {"a"})
            assert "b" not in cc._clients
        finally:
            cl.close()


def test_a_handoff_read_whose_unpin_times_out_still_returns_the_bytes(
        server: kvshm.Server) -> None:
    """get_handoff read every value, then an UNPIN that timed out turned the whole read
    into misses (the engine recomputed KV it already had)."""
    from kvshm.errors import ServerUnavailable

    with kvshm.Client(server.address) as w, \
            kvshm.ClusterClient(server.address, timeout=2.0) as cc:
        h = w.put_batch(["a", "b"], [b"1" * 300, b"2" * 300], pin_ttl=30)
        assert h.node_id == ""           # outside a cluster: read by address

        def lost(self: kvshm.Client, handoff: Any) -> bool:
            raise ServerUnavailable("UNPIN timed out (test)")

        orig = kvshm.Client.unpin
        kvshm.Client.unpin = lost        # type: ignore[method-assign]
        try:
            assert cc.get_handoff(h) == [b"1" * 300, b"2" * 300]
        finally:
            kvshm.Client.unpin = orig     # type: ignore[method-assign]
        assert _held(server) == 1        # the pin runs to its deadline
        assert w.unpin(h)


def test_handoff_pins_of_tiny_values_cannot_take_the_whole_pool(
        server: kvshm.Server) -> None:
    """The cap counted the values' lengths, but each value holds whole blocks: 1-byte
    values under pin_ttl pinned every block of the pool (327 blocks against 327 bytes
    of a 10 MiB cap) and every other write failed with POOL_FULL."""
    with kvshm.Client(server.address) as c:
        n = c.stats()["num_blocks"]
        done = 0
        with pytest.raises(kvshm.QuotaExceeded):
            while done < n:
                ks = [f"t{j}" for j in range(done, min(n, done + 64))]
                c.put_batch(ks, [b"x"] * len(ks), pin_ttl=60)
                done += len(ks)
        st = c.stats()
        assert st["pinned"] <= n // 2 + 1
        assert server.cluster_ops.pinned_bytes <= server.cluster_ops.max_pinned_bytes
        c.put("big", b"y" * 100_000)        # the pool still takes writes


def test_an_unexpected_error_does_not_end_the_membership_agent(
        shm_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any exception other than EtcdUnavailable ended the agent's thread: no more
    keepalives, so the server silently fell out of the cluster at its lease's end."""
    import threading
    import uuid

    from kvshm.cluster.membership import Membership

    from bed import wait_for

    Etcd = _etcd_or_skip()
    with Etcd(1).start() as etcd:
        srv = kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.02,
                           shm_name=shm_name, cluster=etcd.url,
                           cluster_name="u" + uuid.uuid4().hex[:8], node_id="a",
                           cluster_ttl=2).start()
        try:
            ms = srv.membership
            assert ms is not None
            wait_for(ms.registered.is_set, 15, "a to register")
            hit = threading.Event()
            orig = Membership._parse

            def broken(node: str, raw: bytes) -> Any:
                hit.set()
                raise RuntimeError("unforeseen (test)")

            monkeypatch.setattr(Membership, "_parse", staticmethod(broken))
            wait_for(hit.is_set, 30, "a relist to hit the broken parser")
            monkeypatch.setattr(Membership, "_parse", staticmethod(orig))
            relists = ms.counters["relists"]
            wait_for(lambda: ms.counters["relists"] >= relists + 2, 30, "relists to go on")
            assert ms._thread is not None and ms._thread.is_alive()
            assert [m.id for m in ms.view.members] == ["a"]
        finally:
            srv.stop()
