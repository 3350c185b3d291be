"""break14's review findings (issue 13 follow-ups): each test failed on main before
its fix. Also the fuzz that held (kept as a regression net)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from kvshm.zmq_ctrl import router as router_mod
from kvshm.zmq_ctrl.protocol import Op
import test_batchx
from test_batchx import Bed, _head, _key


class BigBed(Bed):
    """test_batchx's Bed with room for requests of many slices (its SLICE is 16 keys a
    Python slice: 131072 keys take ~8000 turns)."""

    def raw(self, parts: list[Any], sock: Any = None) -> list[bytes]:
        s = sock or self.sock
        s.send_multipart(parts)
        for _ in range(200_000):
            self.loop.turn(5)
            if s.poll(0):
                return s.recv_multipart()
        raise AssertionError("no reply")

_batchq = pytest.importorskip("kvshm.zmq_ctrl._batchq")


@pytest.fixture(params=[True, False], ids=["shared", "dict"])
def bed(request: Any, shm_name: str) -> Iterator[Bed]:
    if router_mod._batchq is None or not router_mod._BATCH_ON:
        pytest.skip("kvshm.zmq_ctrl._batchq not built, or KVSHM_BATCHPATH=0")
    b = BigBed(shm_name, request.param)
    assert b.raw([_head(Op.EXISTS, 1, {"keys": [b"warm"]})])
    keys = [_key(i) for i in range(0, 3000, 2)]
    assert set(b.store.put(keys, [b"v" * 10] * len(keys))) == {0}
    yield b
    b.close()


def _frames(rng: random.Random) -> list[bytes]:
    out = []
    for op in (Op.EXISTS, Op.MATCH_PREFIX):
        n = rng.choice([17, 40, 200])
        keys = [_key(rng.randrange(200)) for _ in range(n)]
        out.append(_head(op, rng.choice([5, 300, 2**40, -7]), {"keys": keys}))
    return out


def test_fuzz_cuts_and_flips_same_reply(bed: Bed) -> None:
    """Every cut point, and random byte flips / insertions, of valid frames: the same
    reply bytes with the batch path on and off."""
    rng = random.Random(14)
    for f in _frames(rng):
        for cut in range(len(f) - 1, 0, -1 if len(f) < 400 else -7):
            on, off, _ = bed.both([f[:cut]])
            assert on == off, (cut, f[:cut][:80])
    for _ in range(300):
        f = bytearray(rng.choice(_frames(rng)))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(f))
            r = rng.random()
            if r < 0.5:
                f[i] = rng.randrange(256)
            elif r < 0.75:
                f[i:i] = bytes([rng.randrange(256)])
            else:
                del f[i]
        on, off, _ = bed.both([bytes(f)])
        assert on == off, bytes(f)[:80]


@pytest.mark.parametrize("n", [16384, 16385, 65535, 65536, 131072, 131073])
@pytest.mark.parametrize("op", [Op.EXISTS, Op.MATCH_PREFIX])
def test_big_requests_same_reply(bed: Bed, op: Op, n: int) -> None:
    """The array16/array32 and stream-reply boundaries, and PARSE_MAX (131072: C; one
    more: the Python path's RequestDecoder): byte-identical replies."""
    from kvshm.limits import Limits

    bed.store.config.limits = Limits(max_key_bytes=200, max_batch=200_000)
    keys = [_key(2 * (i % 1500)) for i in range(n)]
    if op == Op.EXISTS:
        keys[n // 2] = _key(1)
    on, off, d = bed.both([_head(op, 11, {"keys": keys})])
    assert on == off
    assert d[f"{op.name}_batch"] == (1 if n <= _batchq.PARSE_MAX else 0)


# ------------------------------------------------------------------ write-behind replies

def _hostile_place_replies(monkeypatch: pytest.MonkeyPatch, module: Any,
                           extra: dict[str, Any]) -> list[int]:
    """Patch ``module.decode_reply``: every PLACE reply (a body with ``st`` and no
    other field the server sends for it) gets ``extra`` added. Returns the request ids
    so treated."""
    real = module.decode_reply
    done: list[int] = []

    def decode(buf: Any) -> tuple[int, int, dict[str, Any]]:
        st, rid, body = real(buf)
        if st == 0 and set(body) == {"st"}:
            done.append(rid)
            return st, rid, {**body, **extra}
        return st, rid, body

    monkeypatch.setattr(module, "decode_reply", decode)
    return done


HOSTILE_COMMIT_FAILED = {"int": 5, "float": 1.5, "bool": True, "unhashable": [[1]],
                         "map_of_lists": [{"a": 1}]}


@pytest.fixture(scope="module")
def srv() -> Iterator[Any]:
    from servers import ServerProcess

    with ServerProcess(prealloc_size=1 / 16) as s:
        yield s


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(HOSTILE_COMMIT_FAILED))
def test_hostile_commit_failed_in_a_place_reply(srv: Any, monkeypatch: pytest.MonkeyPatch,
                                                case: str) -> None:
    """A PLACE reply (read by late_reply, which must never raise) whose
    ``commit_failed`` is not a list of request ids: the puts that read it went on
    (before: TypeError out of _Session.note_reply, out of whichever call drained it)."""
    from kvshm import Client
    from kvshm.zmq_ctrl import channel as chmod

    with Client(srv.address, write_behind=True, timeout=10) as c:
        c.put("b14-warm", b"w")
        c.flush()
        done = _hostile_place_replies(monkeypatch, chmod,
                                      {"commit_failed": HOSTILE_COMMIT_FAILED[case]})
        keys = [f"b14-{case}-{i}" for i in range(40)]
        for i, k in enumerate(keys):
            c.put(k, bytes([i]) * 4096)
        c.flush()
        assert done, "no PLACE reply was read"
        monkeypatch.undo()
        assert c.get_batch(keys) == [bytes([i]) * 4096 for i in range(len(keys))]
        c.delete(keys + ["b14-warm"])


@pytest.mark.timeout(120)
def test_async_reader_survives_hostile_commit_failed(srv: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The AsyncClient's reader task hands a PLACE reply to late_reply: a hostile
    ``commit_failed`` must not end that task (every later call then waited its
    timeout)."""
    import asyncio

    import kvshm.aio as kaio
    from kvshm.aio import AsyncClient

    async def main() -> None:
        async with AsyncClient(srv.address, write_behind=True, timeout=5) as c:
            await c.put("b14-awarm", b"w")
            await c.flush()
            done = _hostile_place_replies(monkeypatch, kaio, {"commit_failed": 7})
            keys = [f"b14-a{i}" for i in range(40)]
            for i, k in enumerate(keys):
                await c.put(k, bytes([i]) * 4096)
            await c.flush()
            assert done, "no PLACE reply was read"
            got = await c.get_batch(keys)
            assert got == [bytes([i]) * 4096 for i in range(len(keys))]
            await c.delete(keys + ["b14-awarm"])

    asyncio.run(main())
