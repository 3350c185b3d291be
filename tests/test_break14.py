"""break14's review findings (issue 13 follow-ups): each test failed on main before
its fix. Also the fuzz that held (kept as a regression net)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from kvshm.zmq_ctrl import protocol
from kvshm.zmq_ctrl import router as router_mod
from kvshm.zmq_ctrl.protocol import Op
import test_batchx
from test_batchx import Bed, _head, _key


class BigBed(Bed):
    """test_batchx's Bed with room for requests of many slices (its SLICE is 16 keys a
    Python slice: 131072 keys take ~8000 turns)."""

    TURNS = 200_000

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


@pytest.mark.parametrize("op", [Op.EXISTS, Op.MATCH_PREFIX])
def test_changes_between_slices(bed: Bed, op: Op) -> None:
    """A request of many C slices while, between two turns, keys are deleted and new
    ones put (the shared table grows: a migration under way between slices): a key
    untouched is answered as it is, one deleted or put meanwhile either way."""
    n = _batchq.SLICE_MULT * 16 * 40
    keys = [_key(i) for i in range(n)]          # even ones present
    if op == Op.MATCH_PREFIX:
        keys = [_key(2 * i) for i in range(n)] + [_key(1)]
    gone = set(keys[3::7])
    new = [_key(i) for i in range(1, n, 2)][::5]
    c0 = bed.loop.fast_counts()[f"{op.name}_batch"]
    bed.sock.send_multipart([_head(op, 21, {"keys": keys})])
    steps = 0
    todo_del = sorted(gone)
    fill = 1500
    if bed.writer is not None:          # enough puts to start a growth (GROWTH's start)
        from kvshm._shmindex import GROWTH
        fill = max(fill, bed.writer.nslots * GROWTH[0] // 16 - bed.writer.live + 64)
    todo_put = list(new) + [b"b14-fill-%d" % i for i in range(fill)]
    while not bed.sock.poll(0):
        bed.loop.turn(5)
        steps += 1
        assert steps < 100_000
        if todo_del:
            bed.store.delete(todo_del[:5])
            del todo_del[:5]
        if todo_put:
            assert set(bed.store.put(todo_put[:150], [b"n"] * len(todo_put[:150]))) == {0}
            del todo_put[:150]
    st_, rid, body = protocol.decode_reply(bed.sock.recv_multipart()[0])
    assert (st_, rid) == (0, 21)
    assert bed.loop.fast_counts()[f"{op.name}_batch"] == c0 + 1
    if bed.writer is not None:
        assert bed.writer.rebuilds >= 1, "the table grew meanwhile"
    was = {_key(i) for i in range(0, 3000, 2)}
    newset = set(new)
    if op == Op.EXISTS:
        for k, f in zip(keys, body["found"]):
            if k in gone or k in newset:
                continue
            assert f == (k in was), k
    else:
        m = body["n"]
        assert all(k in was for k in keys[:m])
        assert m < len(keys) and (keys[m] not in was or keys[m] in gone), m


def _item(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.75:
        return _key(rng.randrange(300))
    return rng.choice([b"", b"k" * 201, b"k" * 152, b"k" * 153, "strkey", 5, None, True,
                       [b"a"], {"a": b"b"}, 1.5, b"\xff" * 3, "\u00e9" * 3])


def test_fuzz_structured_same_reply(bed: Bed) -> None:
    """Random request headers of the usual outline (keys of every kind, extra fields,
    bytes packed as str or bin, ints of every width): the same reply bytes with the batch
    path on and off."""
    rng = random.Random(1414)
    for _ in range(250):
        n = rng.choice([16, 30, 64, 65, 100, 300])
        pure = rng.random() < 0.5
        keys = [_key(rng.randrange(300)) if pure else _item(rng) for _ in range(n)]
        body: dict[str, Any] = {"keys": keys}
        if rng.random() < 0.15:
            body[rng.choice(["release", "abort", "commit", "x"])] = rng.choice([[], [1], 0])
        op = rng.choice([Op.EXISTS, Op.MATCH_PREFIX, Op.EXISTS, 77])
        rid = rng.choice([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63, 2**64 - 1,
                          -1, -33, -129, -2**31 - 1, -2**63])
        epoch = rng.choice([7, 0, 8, 2**40, -1])
        head = [protocol.PROTOCOL_VERSION, int(op), rid, epoch, body]
        f = msgpack.packb(head, use_bin_type=rng.random() < 0.85)
        on, off, _ = bed.both([f])
        assert on == off, (op, rid, epoch, keys[:5])


@pytest.mark.timeout(120)
def test_exists_of_an_iterator_while_writes_are_behind(srv: Any) -> None:
    """exists_batch / match_prefix of a one-shot iterator of keys while a value written
    behind is not yet answered: the same answer as for a list (before: own_flags used
    the iterator up, so the lookup got no keys: ``[]`` and 0)."""
    import asyncio

    from kvshm import Client
    from kvshm.aio import AsyncClient

    with Client(srv.address, write_behind=True, timeout=10) as c:
        c.put("b14-it-warm", b"w")
        c.flush()
        c.put("b14-it-a", b"x" * 100)
        assert c.session.wb is not None and c.session.wb.placed, "the put is in flight"
        assert c.exists_batch(iter(["b14-it-a", "b14-it-b"])) == [True, False]
        assert c.match_prefix(iter(["b14-it-a", "b14-it-b"])) == 1
        assert c.match_prefix(k for k in ["b14-it-a", "b14-it-warm"]) == 2
        c.flush()
        c.delete(["b14-it-a", "b14-it-warm"])

    async def main() -> None:
        async with AsyncClient(srv.address, write_behind=True, timeout=5) as c:
            await c.put("b14-ait-warm", b"w")
            await c.flush()
            await c.put("b14-ait-a", b"x" * 100)
            assert c._session.wb is not None and c._session.wb.placed
            assert await c.exists_batch(iter(["b14-ait-a", "b14-ait-b"])) == [True, False]
            assert await c.match_prefix(iter(["b14-ait-a", "b14-ait-b"])) == 1
            await c.flush()
            await c.delete(["b14-ait-a", "b14-ait-warm"])

    asyncio.run(main())


def test_fuzz_client_reply_reader_and_packer() -> None:
    """unpack_found_reply of cut and flipped replies: whatever it takes is what msgpack
    decodes (else None); pack_keys_request of mixed lists: msgpack's bytes or None."""
    rng = random.Random(7)
    V = protocol.PROTOCOL_VERSION
    for _ in range(3000):
        n = rng.choice([0, 1, 15, 16, 100, 65535, 65536]) if rng.random() < 0.05 else \
            rng.randrange(80)
        found = [rng.random() < 0.5 for _ in range(n)]
        f = bytearray(msgpack.packb([V, rng.choice([0, 3, 200, -1]),
                                     rng.choice([0, 5, 2**64 - 1, -2**63]), {"found": found}]))
        for _ in range(rng.randint(0, 3)):
            if not f:
                break
            i = rng.randrange(len(f))
            r = rng.random()
            if r < 0.6:
                f[i] = rng.randrange(256)
            elif r < 0.8:
                del f[i:]
            else:
                f[i:i] = bytes([rng.choice([0xc2, 0xc3, 0x90, 0xdc, 0x00])])
        got = _batchq.unpack_found_reply(bytes(f), V)
        if got is not None:
            h = msgpack.unpackb(bytes(f), raw=False, strict_map_key=True)
            assert got == (h[1], h[2], h[3]) and h[0] == V and len(h) == 4
    for _ in range(500):
        keys = [rng.choice([b"k", b"", b"x" * 300, "s", bytearray(b"b"), 1])
                if rng.random() < 0.02 else rng.randbytes(rng.randrange(1, 40))
                for _ in range(rng.randrange(40))]
        rid = rng.choice([1, 2**64 - 1, -2**63, True, 2**64, 1.0])
        got = _batchq.pack_keys_request(V, 8, rid, 3, keys)
        if got is not None:
            assert got == msgpack.packb([V, 8, rid, 3, {"keys": keys}], use_bin_type=True)
        else:
            assert any(type(k) is not bytes for k in keys) or type(rid) is not int \
                or not -2**63 <= rid < 2**64


@pytest.mark.parametrize("kind", ["strided", "str"])
def test_decode_reply_error_class_with_the_c_reader(kind: str) -> None:
    """decode_reply raises DecodeError for what it cannot read, C reader on or off
    (before: the C reader's buffer request raised BufferError for a strided view and
    TypeError for a str, where msgpack's path says DecodeError)."""
    good = msgpack.packb([protocol.PROTOCOL_VERSION, 0, 5, {"found": [True] * 80}])
    frame: Any = memoryview(good * 2)[::2] if kind == "strided" else good.decode("latin-1")
    assert _batchq.unpack_found_reply(frame, protocol.PROTOCOL_VERSION) is None
    with pytest.raises(protocol.DecodeError):
        protocol.decode_reply(frame)


def _hostile_heads() -> list[tuple[str, bytes]]:
    V, E = protocol.PROTOCOL_VERSION, int(Op.EXISTS)
    g = b"".join(msgpack.packb(_key(i), use_bin_type=True) for i in range(40))
    head = bytes([0x95, V, E, 4, 7]) + b"\x81\xa4keys"
    return [
        ("array32 of 2**32-1", head + b"\xdd\xff\xff\xff\xff" + g),
        ("array32 of 2**31", head + b"\xdd\x80\x00\x00\x00" + g),
        ("array32 of 40 (long form)", head + b"\xdd\x00\x00\x00\x28" + g),
        ("array16 of 40 (long form)", head + b"\xdc\x00\x28" + g),
        ("bin32 of 2**32-1", head + b"\xdc\x00\x29" + g + b"\xc6\xff\xff\xff\xff" + b"x" * 8),
        ("bin16 of 0", head + b"\xdc\x00\x29" + g + b"\xc5\x00\x00"),
        ("bin8 of 200 (max_key)", head + b"\xdc\x00\x29" + g + b"\xc4\xc8" + b"k" * 200),
        ("bin16 of 201", head + b"\xdc\x00\x29" + g + b"\xc5\x00\xc9" + b"k" * 201),
        ("duplicates", head + b"\xdc\x00\x50" + g + g),
        ("map16 of one", bytes([0x95, V, E, 4, 7]) + b"\xde\x00\x01\xa4keys\xdc\x00\x28" + g),
        ("str8 'keys'", bytes([0x95, V, E, 4, 7]) + b"\x81\xd9\x04keys\xdc\x00\x28" + g),
        ("version as uint8", bytes([0x95, 0xcc, V, E, 4, 7]) + b"\x81\xa4keys\xdc\x00\x28" + g),
        ("op as int64", bytes([0x95, V, 0xd3]) + (E).to_bytes(8, "big") + bytes([4, 7])
         + b"\x81\xa4keys\xdc\x00\x28" + g),
        ("epoch nil", bytes([0x95, V, E, 4, 0xc0]) + b"\x81\xa4keys\xdc\x00\x28" + g),
        ("req_id as uint64 small", bytes([0x95, V, E, 0xcf]) + (4).to_bytes(8, "big")
         + bytes([7]) + b"\x81\xa4keys\xdc\x00\x28" + g),
        ("header array16", bytes([0xdc, 0, 5, V, E, 4, 7]) + b"\x81\xa4keys\xdc\x00\x28" + g),
        ("6-element header", bytes([0x96, V, E, 4, 7]) + b"\x81\xa4keys\xdc\x00\x28" + g
         + b"\x00"),
    ]


@pytest.mark.parametrize("name,frame", _hostile_heads(), ids=[c[0] for c in _hostile_heads()])
def test_more_hostile_heads_same_reply(bed: Bed, name: str, frame: bytes) -> None:
    on, off, _ = bed.both([frame])
    assert on == off, name
