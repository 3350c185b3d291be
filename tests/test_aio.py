"""AsyncClient against a real `kvshm serve`: concurrency, reply matching, cancellation,
a dead or stuck server, uvloop (issue 5)."""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time

import numpy as np
import pytest

import kvshm
from kvshm import AsyncClient, KeyNotFound, ServerUnavailable
from kvshm.movers import ShmMover
from servers import ServerProcess

uvloop = pytest.importorskip("uvloop")

LOOPS = ["asyncio", "uvloop"]


def run(coro, loop_kind="asyncio"):
    """Run a coroutine on a fresh loop of the given kind (pytest-asyncio is not used)."""
    if loop_kind == "uvloop":
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            return r.run(coro)
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def server():
    with ServerProcess(prealloc_size=0.25) as s:
        yield s


def values(n, size, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


async def settled(c):
    """stats() after the queued releases/aborts rode on it and the server holds no GET
    reply still queued. A zero-copy reply stays pinned until pyzmq's tracker says libzmq
    let it go, which its gc thread reports after the client already has the bytes: on a
    loaded machine later than the server's bounded wait (0.1 s) when STATS comes, so the
    test waits for ``sending == 0`` instead of assuming it (the bound only turns a hang
    into a failure)."""
    deadline = time.monotonic() + 120
    while True:
        st = await c.stats(verify=True)
        assert st["accounting_ok"]
        if st["sending"] == 0:
            return st
        assert time.monotonic() < deadline, f"GET replies still queued after 120 s: {st}"
        await asyncio.sleep(0.05)


# ----------------------------------------------------------------------------- basics


@pytest.mark.parametrize("loop_kind", LOOPS)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_same_methods_as_client(server, transport, loop_kind):
    async def main():
        async with AsyncClient(server.address, transport=transport, timeout=10) as c:
            assert c.transport == transport
            await c.purge()
            await c.put("hello", b"world")
            assert await c.get("hello") == b"world"
            out = bytearray(16)
            assert await c.get_into("hello", out) == 5 and bytes(out[:5]) == b"world"
            with pytest.raises(KeyNotFound):
                await c.get("nope")
            await c.put_batch(["a", "b"], [b"1" * 100, b"2" * 200_000], checksum=True)
            assert await c.get_batch(["a", "nope", "b"], verify=True) == \
                [b"1" * 100, None, b"2" * 200_000]
            outs = [bytearray(100), bytearray(10), bytearray(200_000)]
            assert await c.get_batch_into(["a", "nope", "b"], outs) == [100, -1, 200_000]
            assert await c.exists("a") and not await c.exists("nope")
            assert await c.exists_batch(["a", "nope"]) == [True, False]
            assert await c.match_prefix(["hello", "a", "nope", "b"]) == 2
            assert await c.delete("a") == 1
            assert await c.evict(1.0) == 0
            await c.flush()
            assert (await c.ping())["epoch"] == c.server_info["epoch"]
            st = await settled(c)
            assert st["pinned"] == 0 and st["pending"] == 0

    run(main(), loop_kind)


def test_lazy_commit_and_flush(server):
    async def main():
        async with AsyncClient(server.address, lazy_commit=True) as w, \
                AsyncClient(server.address) as r:
            await w.put("lazy", b"x" * 1000)
            assert not await r.exists("lazy")       # COMMIT not sent yet
            await w.flush()
            assert await r.get("lazy") == b"x" * 1000

    run(main())


def test_closed_client(server):
    async def main():
        c = AsyncClient(server.address)
        await c.put("k", b"v")
        await c.close()
        await c.close()
        with pytest.raises(kvshm.KvshmError, match="closed"):
            await c.get("k")

    run(main())


def test_one_client_per_loop(server):
    c = AsyncClient(server.address)
    run(c.connect())
    with pytest.raises(RuntimeError, match="another event loop"):
        run(c.stats())
    run(c.close())         # from another loop: no flush, but sockets and mapping go
    assert c._conn is None and c._session.mover is None


# ----------------------------------------------------------------------------- concurrency


@pytest.mark.parametrize("loop_kind", LOOPS)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_64_concurrent_get_batch_shuffled(server, transport, loop_kind):
    """64 get_batch coroutines of different keys, gathered in shuffled order: each gets
    its own bytes. Some groups are large, so their copies run in threads."""
    groups = []
    for g in range(64):
        size = 300_000 if g % 4 == 0 else 3_000 + g      # 4 x 300 kB > 1 MiB: thread copy
        keys = [f"g{g}-k{j}" for j in range(4)]
        groups.append((keys, values(4, size, seed=g)))

    async def main():
        async with AsyncClient(server.address, transport=transport, timeout=20) as c:
            await c.purge()
            await asyncio.gather(*(c.put_batch(k, v) for k, v in groups))
            order = list(range(64))
            random.Random(5).shuffle(order)
            got = await asyncio.gather(*(c.get_batch(groups[g][0]) for g in order))
            for g, data in zip(order, got):
                assert data == [v.tobytes() for v in groups[g][1]], f"group {g}"
            # into caller buffers, again shuffled, with other calls interleaved
            outs = {g: [np.zeros(v.size, np.uint8) for v in groups[g][1]] for g in order}
            random.Random(6).shuffle(order)
            coros = [c.get_batch_into(groups[g][0], outs[g]) for g in order]
            coros += [c.exists_batch(groups[g][0]) for g in range(8)]
            res = await asyncio.gather(*coros)
            for g, sizes in zip(order, res):
                assert sizes == [v.size for v in groups[g][1]]
                assert all(np.array_equal(o, v) for o, v in zip(outs[g], groups[g][1]))
            assert all(r == [True] * 4 for r in res[64:])
            st = await settled(c)
            assert st["pinned"] == 0 and st["pending"] == 0

    run(main(), loop_kind)


# ----------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_cancel_100_in_flight_get_batch(server, loop_kind, no_local_reads):
    async def main():
        async with AsyncClient(server.address, transport="shm") as c:
            await c.purge()
            keys = [f"c{i}" for i in range(100)]
            await c.put_batch(keys, values(100, 70_000, seed=1))
            before = await settled(c)
            tasks = [asyncio.ensure_future(c.get_batch(keys[i:i + 5])) for i in range(100)]
            await asyncio.sleep(0)           # each task sends its LOOKUP and waits
            assert all(not t.done() for t in tasks)
            for t in tasks:
                t.cancel()
            res = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in res)
            assert len(c._session.releases) == 100
            st = await settled(c)            # the releases ride on this request
            assert st["pinned"] == 0 and st["pins"] == 0
            assert st["usage"] == before["usage"]
            assert st["used_bytes"] == before["used_bytes"]
            # the late LOOKUP replies were dropped; the connection still works
            assert await c.get("c0") == (await c.get_batch(["c0"]))[0]

    run(main(), loop_kind)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_cancel_at_random_points(server, loop_kind):
    """Timeouts (asyncio.wait_for) that hit before the send, while waiting, during the
    thread copy and after it: pins, pending writes and usage always come back."""
    async def main():
        async with AsyncClient(server.address, transport="shm", copy_threshold=0) as c:
            await c.purge()
            keys = [f"r{i}" for i in range(64)]
            vals = values(64, 200_000, seed=2)
            await c.put_batch(keys, vals)
            before = await settled(c)
            rng = random.Random(3)
            outs = [np.zeros(200_000, np.uint8) for _ in range(64)]

            async def one(i):
                ks = keys[i % 60:i % 60 + 4]
                await asyncio.wait_for(c.get_batch_into(ks, outs[i % 60:i % 60 + 4]),
                                       rng.uniform(0, 0.004))

            async def put_one(i):
                ks = [f"new{i}-{j}" for j in range(4)]
                await asyncio.wait_for(c.put_batch(ks, vals[:4]), rng.uniform(0, 0.004))
                return ks

            res = await asyncio.gather(*(one(i) for i in range(100)),
                                       *(put_one(i) for i in range(40)),
                                       return_exceptions=True)
            assert all(r is None or isinstance(r, (asyncio.TimeoutError, list))
                       for r in res), [r for r in res if isinstance(r, Exception)
                                       and not isinstance(r, asyncio.TimeoutError)]
            st = await settled(c)
            assert st["pinned"] == 0 and st["pins"] == 0 and st["pending"] == 0
            # a cancelled put is stored whole or not at all
            for i in range(40):
                ks = [f"new{i}-{j}" for j in range(4)]
                got = await c.get_batch(ks)
                for g, v in zip(got, vals[:4]):
                    assert g is None or g == v.tobytes()
            n = await c.delete([f"new{i}-{j}" for i in range(40) for j in range(4)])
            assert n >= sum(1 for r in res[100:] if isinstance(r, list)) * 4
            st = await settled(c)
            assert st["used_bytes"] == before["used_bytes"]

    run(main(), loop_kind)


def _slow_mover(c, method, started, delay=0.3):
    """Make the client's shm mover slow in ``method`` (a copy running in a thread)."""
    mover = c._session.mover
    assert isinstance(mover, ShmMover)
    real = getattr(mover, method)
    ended = []

    def slow(*a, **kw):
        started.set()
        time.sleep(delay)
        out = real(*a, **kw)
        ended.append(time.monotonic())
        return out

    setattr(mover, method, slow)
    return ended


def test_cancel_during_thread_copy_waits_for_the_copy(server, no_local_reads):
    async def main():
        async with AsyncClient(server.address, transport="shm", copy_threshold=0) as c:
            await c.purge()
            await c.put("big", b"b" * 500_000)
            before = await settled(c)
            started = threading.Event()
            ended = _slow_mover(c, "read_into", started)
            out = bytearray(500_000)
            task = asyncio.ensure_future(c.get_into("big", out))
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, started.wait, 5)
            task.cancel()
            await asyncio.sleep(0.05)
            # the copy still runs: nothing may be released yet
            assert not task.done() and c._session.releases == []
            with pytest.raises(asyncio.CancelledError):
                await task
            t_end = time.monotonic()
            assert ended and ended[0] <= t_end
            assert len(c._session.releases) == 1
            st = await settled(c)
            assert st["pinned"] == 0 and st["used_bytes"] == before["used_bytes"]

    run(main())


def test_cancelled_put_during_copy_is_aborted(server):
    async def main():
        async with AsyncClient(server.address, transport="shm", copy_threshold=0) as c:
            await c.purge()
            before = await settled(c)
            started = threading.Event()
            _slow_mover(c, "write", started)
            task = asyncio.ensure_future(c.put("p", b"p" * 400_000))
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, started.wait, 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert c._session.commits == [] and len(c._session.aborts) == 1
            st = await settled(c)
            assert st["pending"] == 0 and st["used_bytes"] == before["used_bytes"]
            assert not await c.exists("p")

    run(main())


# ----------------------------------------------------------------------------- failures


@pytest.fixture
def own_server():
    s = ServerProcess("--lease-timeout", "2", prealloc_size=0.0625)
    try:
        yield s
    finally:
        if s.alive():
            try:
                s.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
            s.stop()
        s.remove_segment()


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_server_dies_mid_await(own_server, loop_kind, no_local_reads):
    async def main():
        c = AsyncClient(own_server.address, transport="shm", timeout=3)
        try:
            await c.put_batch([f"d{i}" for i in range(8)], [b"x" * 1000] * 8)
            own_server.proc.send_signal(signal.SIGSTOP)    # requests queue up unanswered
            tasks = [asyncio.ensure_future(c.get_batch([f"d{i}"])) for i in range(8)]
            tasks.append(asyncio.ensure_future(c.stats()))
            await asyncio.sleep(0)
            t0 = time.monotonic()
            own_server.kill()                               # dies while they wait
            res = await asyncio.gather(*tasks, return_exceptions=True)
            waited = time.monotonic() - t0
            assert all(isinstance(r, ServerUnavailable) for r in res), res
            assert own_server.address in str(res[0])
            assert waited < 3 + 1.0, waited
            with pytest.raises(ServerUnavailable):         # still gone: bounded again
                await c.stats()
        finally:
            await c.close()

    run(main(), loop_kind)


def test_stuck_server_times_out_then_recovers(own_server, no_local_reads):
    async def main():
        async with AsyncClient(own_server.address, transport="shm", timeout=1) as c:
            await c.put("s", b"s" * 1000)
            own_server.proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            res = await asyncio.gather(*(c.get("s") for _ in range(4)),
                                       return_exceptions=True)
            assert all(isinstance(r, ServerUnavailable) for r in res), res
            assert "within 1 s" in str(res[0]) and own_server.address in str(res[0])
            assert time.monotonic() - t0 < 1 + 1.0
            own_server.proc.send_signal(signal.SIGCONT)
            assert await c.get("s") == b"s" * 1000          # reconnects by itself
            # the abandoned LOOKUPs' pins go: released (same connection order) or, for
            # a LOOKUP the server read after the RELEASE, by the 2 s lease
            deadline = time.monotonic() + 10
            while (await c.stats())["pinned"] and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert (await c.stats())["pinned"] == 0

    run(main())


def test_stale_epoch_says_hello_once_and_retries(server, no_local_reads):
    """Requests in flight that find the server restarted (STALE_EPOCH) say HELLO once
    and are sent again."""
    async def main():
        async with AsyncClient(server.address, transport="shm") as c:
            await c.purge()
            keys = [f"e{i}" for i in range(16)]
            vals = values(16, 5000, seed=7)
            await c.put_batch(keys, vals)
            hellos = []
            real = c._hello

            async def counting(**kw):
                hellos.append(kw)
                await real(**kw)

            c._hello = counting
            c._session.epoch ^= 0x5A5A       # as if the server had restarted
            got = await asyncio.gather(*(c.get_batch([k]) for k in keys))
            assert [g[0] for g in got] == [v.tobytes() for v in vals]
            assert len(hellos) == 1 and hellos[0] == {"fresh": False}
            assert (await settled(c))["pinned"] == 0

    run(main())


def test_server_restart_on_same_port(server):
    async def main():
        s1 = ServerProcess(prealloc_size=0.0625)
        port = s1.port
        try:
            async with AsyncClient(s1.address, transport="shm", timeout=3) as c:
                await c.put("a", b"1")
                s1.stop()
                s1.remove_segment()
                s2 = ServerProcess(service_port=port, prealloc_size=0.0625)
                try:
                    for attempt in range(3):     # the first may see the disconnect
                        try:
                            assert await c.get_batch(["a"]) == [None]
                            break
                        except ServerUnavailable:
                            continue
                    else:
                        pytest.fail("did not recover after the restart")
                    await c.put("b", b"2")
                    assert await c.get("b") == b"2"
                finally:
                    s2.stop()
                    s2.remove_segment()
        finally:
            if s1.alive():
                s1.stop()
            s1.remove_segment()

    run(main())


def test_curve_keys(tmp_path):
    from kvshm.errors import AuthenticationFailed
    from kvshm.security import keygen

    public, secret = keygen(str(tmp_path), "server")
    with ServerProcess("--curve-secret-key", secret, "--curve-allow-any",
                       prealloc_size=0.0625) as s:
        async def main():
            async with AsyncClient(s.address, curve_server_key=public) as c:
                await c.put("secret", b"s")
                assert await c.get("secret") == b"s"
            c = AsyncClient(s.address, timeout=3)        # no key: refused, not a hang
            try:
                t0 = time.monotonic()
                with pytest.raises(AuthenticationFailed, match="CURVE"):
                    await c.stats()
                assert time.monotonic() - t0 < 3
            finally:
                await c.close()

        run(main())
