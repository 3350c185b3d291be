"""A member leaving the view between a plan reading its placement and the call to it.

CI once failed ``test_cluster_bed.py::test_host_killed`` (1 in ~4 runs): a batch placed an
instant before the dead host's leave reached the client's view counted ``peer_down`` misses
without waiting for anything, and the bed counted those misses as a second timed-out batch.
These tests pin the race down without the bed: the client's placement still names a member
its view no longer holds. The call must not wait, must not mark the member suspect (it is
gone, not slow) and must be a :class:`~kvshm.cluster.fanout.MemberLeft`; a write for it goes
to the next choice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

import kvshm
from kvshm.cluster.fanout import Call, MemberLeft
from kvshm.cluster.view import Member

from bed import wait_for
from test_cluster_break2 import _FakeView

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def two(shm_name: str) -> Iterator[tuple[dict[str, kvshm.Server], _FakeView]]:
    srvs = {i: kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.03,
                            shm_name=f"{shm_name}-{i}").start() for i in "ab"}
    try:
        fv = _FakeView(tuple(Member(i, s.address, 1, 1 << 24, 4096, ttl=60.0)
                             for i, s in srvs.items()))
        for i, s in srvs.items():
            fv.attach(s, i)
        yield srvs, fv
    finally:
        for s in srvs.values():
            s.stop()


def _leave_b(fv: _FakeView) -> None:
    fv.bump(tuple(m for m in fv.view.members if m.id != "b"))


def test_sync_a_read_placed_before_a_leave_is_a_miss_at_once(
        two: tuple[dict[str, kvshm.Server], _FakeView]) -> None:
    srvs, fv = two
    keys = [f"k{i}" for i in range(64)]
    with kvshm.ClusterClient(srvs["a"].address, timeout=5.0, transport="tcp") as cc:
        own = cc.owners(keys)
        assert set(own) == {"a", "b"}
        cc.put_batch(keys, [b"v" * 100] * len(keys))
        stale = cc._state.placement              # the table a plan read before the leave
        _leave_b(fv)
        wait_for(lambda: [m.id for m in cc.view.members] == ["a"], 20, "b to leave")
        with pytest.raises(MemberLeft):
            cc._one("b", Call("get_batch", (keys[:1],), {"verify": False}), {})
        fresh, cc._state.placement = cc._state.placement, stale   # the plan that raced
        t0 = time.perf_counter()
        got = cc.get_batch(keys)
        dt = time.perf_counter() - t0
        m = cc.metrics()
        assert [v is None for v in got] == [o == "b" for o in own]
        assert dt < 2.0, f"a read of a member gone from the view waited {dt:.2f} s"
        assert m["suspect_marks"] == 0 and cc.suspects() == []
        assert m["misses"]["peer_down"] == own.count("b")
        # a write placed on the stale table: b's keys go to the next choice (a)
        cc.put_batch(keys, [b"w" * 100] * len(keys))
        cc._state.placement = fresh
        assert cc.get_batch(keys) == [b"w" * 100] * len(keys)
        assert cc.metrics()["suspect_marks"] == 0


def test_async_a_read_placed_before_a_leave_is_a_miss_at_once(
        two: tuple[dict[str, kvshm.Server], _FakeView]) -> None:
    srvs, fv = two
    keys = [f"k{i}" for i in range(64)]

    async def main() -> dict[str, Any]:
        async with kvshm.AsyncClusterClient(srvs["a"].address, timeout=5.0,
                                            transport="tcp") as cc:
            own = await cc.owners(keys)
            await cc.put_batch(keys, [b"v" * 100] * len(keys))
            stale = cc._state.placement
            _leave_b(fv)
            t_end = time.monotonic() + 20
            while [m.id for m in cc.view.members] != ["a"]:
                assert time.monotonic() < t_end, "b never left the view"
                await asyncio.sleep(0.02)
            with pytest.raises(MemberLeft):
                await cc._one("b", Call("get_batch", (keys[:1],), {"verify": False}), {})
            fresh, cc._state.placement = cc._state.placement, stale
            t0 = time.perf_counter()
            got = await cc.get_batch(keys)
            dt = time.perf_counter() - t0
            assert [v is None for v in got] == [o == "b" for o in own]
            assert dt < 2.0
            await cc.put_batch(keys, [b"w" * 100] * len(keys))
            cc._state.placement = fresh
            assert await cc.get_batch(keys) == [b"w" * 100] * len(keys)
            return cc.metrics()

    m = asyncio.run(main())
    assert m["suspect_marks"] == 0
