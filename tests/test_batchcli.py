"""kvshm._batch (a batch's per-key loops in C) against the Python loops it replaces:
same results, same exception types and messages, over the C paths and the fallbacks."""

from __future__ import annotations

import random

import numpy as np
import pytest

import kvshm.client as client_mod
from kvshm import Client
from kvshm.client import _Session
from kvshm.errors import InvalidKey, InvalidRequest, ValueTooLarge
from kvshm.limits import Limits
from kvshm.zmq_ctrl import frames as F
from servers import ServerProcess

_batch = pytest.importorskip("kvshm._batch")


def _session(capacity: int = 1 << 20, max_value: int = 0, max_key: int = 16,
             max_batch: int = 1000) -> _Session:
    s = _Session("tcp", False)
    s.capacity = capacity
    s.limits = Limits(max_key_bytes=max_key, max_batch=max_batch, max_value_bytes=max_value)
    return s


def _both(monkeypatch, fn):
    """(result or exception) of ``fn()`` with the C loops, then with the Python ones."""
    out = []
    for mod in (_batch, None):
        monkeypatch.setattr(client_mod, "_batch", mod)
        try:
            out.append(("ok", fn()))
        except Exception as exc:  # noqa: BLE001 - compared below
            out.append((type(exc), str(exc)))
    monkeypatch.setattr(client_mod, "_batch", _batch)
    return out


KEY_CASES = [
    [b"a", b"bb", "c\u00e9"],
    ("t1", "t2"),
    [],
    [b"a", 3],
    [b"a", b""],
    [b"x" * 17],
    ["x" * 17],
    ["ok", "\udcff"],
    [b"a", bytearray(b"ba"), memoryview(b"mv")],
    [b"k%d" % i for i in range(1001)],
    [None],
]


@pytest.mark.parametrize("keys", KEY_CASES, ids=range(len(KEY_CASES)))
def test_keys_same_as_python(monkeypatch, keys):
    s = _session()
    c, py = _both(monkeypatch, lambda: s.keys(keys))
    assert c == py
    if c[0] == "ok":
        assert all(type(k) is bytes for k in c[1])


def test_keys_message_limit():
    s = _session()
    s.max_message = 20
    with pytest.raises(InvalidRequest, match="split the batch"):
        s.keys([b"abc"] * 3)
    assert s.keys(iter([b"abc", "d"])) == [b"abc", b"d"]   # any iterable


def _values_cases():
    base = np.arange(64, dtype=np.uint8)
    return [
        [b"v1", bytearray(b"v22"), memoryview(b"v333"), base, np.zeros(4, np.float16)],
        [b"", b"x", bytearray()],                        # 0-byte values
        [b"ok", 42],                                     # wrong type
        [b"ok", "a str"],
        [b"ok", base[::2]],                              # not contiguous
        [b"ok", np.zeros((4, 4), np.uint8).T],
        [b"x" * 200, b"ok"],                             # over max_value
        [b"x" * 200, 42],                                # type error is raised first
        [b"ok", b"y" * 2000],                            # over the capacity
        [np.zeros((2, 3), np.int32), memoryview(b"abcd").cast("B", (2, 2))],
    ]


@pytest.mark.parametrize("idx", range(10))
def test_values_same_as_python(monkeypatch, idx):
    vals = _values_cases()[idx]
    s = _session(capacity=1000, max_value=100)
    keys = [b"k%d" % i for i in range(len(vals))]

    def run():
        views, sizes = s._views_sizes(keys, vals)
        assert all(type(v) is memoryview and v.ndim == 1 and v.format == "B" for v in views)
        assert sizes == [v.nbytes for v in views]
        return [v.tobytes() for v in views]

    c, py = _both(monkeypatch, run)
    assert c == py
    if idx == 6:
        assert c[0] is ValueTooLarge
    if idx == 2:
        assert c[0] is TypeError and "value for key b'k1'" in c[1]
    if idx == 4:
        assert c[0] is ValueError and "C-contiguous" in c[1]


def test_values_count_mismatch(monkeypatch):
    s = _session()
    c, py = _both(monkeypatch, lambda: s._views_sizes([b"a"], [b"1", b"2"]))
    assert c == py and c[0] is ValueError


@pytest.mark.parametrize("outs", [
    [bytearray(8), np.zeros(8, np.uint8), memoryview(bytearray(8))],
    [bytearray(8), b"readonly"],
    [bytearray(8), np.zeros(16, np.uint8)[::2]],
    [bytearray(8), 7],
    [np.zeros((2, 4), np.float32)],
])
def test_out_views_same_as_python(outs):
    keys = [b"k%d" % i for i in range(len(outs))]
    got = []
    for fn in (lambda: _batch.out_views(keys, outs, client_mod.byte_view),
               lambda: [client_mod.byte_view(o, writable=True, what=f"output for key {k!r}")
                        for k, o in zip(keys, outs)]):
        try:
            got.append([(v.nbytes, v.readonly) for v in fn()])
        except Exception as exc:  # noqa: BLE001
            got.append((type(exc), str(exc)))
    assert got[0] == got[1]


def _rand_sizes(rng, n):
    pick = [0, 1, 64, 4096, F.PACK_BELOW - 1, F.PACK_BELOW, F.PACK_BELOW + 3]
    return [rng.choice(pick) for _ in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_plan_pack_unpack_same_as_python(seed):
    rng = random.Random(seed)
    sizes = _rand_sizes(rng, rng.randrange(0, 40))
    views = [memoryview(bytes([i % 251]) * n) for i, n in enumerate(sizes)]
    assert F.plan(sizes) == F._py_plan(sizes)
    fc, cc = F.pack(views)
    fp, cp = F._py_pack(views)
    assert cc == cp and [bytes(f) for f in fc] == [bytes(f) for f in fp]
    assert [bytes(v) for v in F.unpack(fc, cc, sizes)] == [bytes(v) for v in views]


def test_pack_many_small_is_split_at_the_frame_limit():
    n = F.PACK_FRAME_BYTES // 1000 + 5
    views = [memoryview(b"z" * 1000)] * n
    fc, cc = F.pack(views)
    assert cc == F._py_pack(views)[1] and len(cc) == 2


MALFORMED = [
    ([b"abc"], [1, 1], [3]),
    ([b"abc"], [True], [3]),
    ([b"abc"], [-1], [3]),
    ([b"abc"], [2], [3]),
    ([b"abc"], [1], ["3"]),
    ([b"abc"], [1], [-3]),
    ([b"abc"], [1], [2]),
    ([b"abc", b"de"], [0, 1], [5]),
    ([b"abc", b"de"], [2, 0], [3, 2]),
    ([b"abc", b"de"], [1, 0], [4]),
    ([b"abc", b"de"], [1, 0], [5]),        # a value over two frames: fine
    ([b"abcde"], [2], [2, 3]),
    ([b"abcde"], [2], [2, 2]),
    ([], [], []),
]


@pytest.mark.parametrize("case", MALFORMED, ids=range(len(MALFORMED)))
def test_unpack_errors_same_as_python(case):
    frames, counts, sizes = case
    got = []
    for fn in (F.unpack, F._py_unpack):
        try:
            got.append([bytes(v) for v in fn(frames, counts, sizes)])
        except F.FrameLayoutError as exc:
            got.append(("FrameLayoutError", str(exc)))
    assert got[0] == got[1]


@pytest.mark.parametrize("case", MALFORMED, ids=range(len(MALFORMED)))
def test_fill_takes_only_what_adds_up(case):
    frames, counts, sizes = case
    try:
        want = [bytes(v) for v in F._py_unpack(frames, counts, sizes)]
    except F.FrameLayoutError:
        want = None
    got = _batch.fill(frames, counts, list(sizes), None)
    if got is not None:
        assert got == want
    elif want is not None:
        assert 0 in counts            # a value over several frames: the Python loop


def test_fill_misses_outs_and_refusals():
    frames, counts = [b"aaabb", b"c" * 300], [2, 1]
    sizes = [3, -1, 2, 300, -1]
    assert _batch.fill(frames, counts, sizes, None) == [b"aaa", None, b"bb", b"c" * 300,
                                                       None]
    outs = [memoryview(bytearray(4)) for _ in sizes]
    assert _batch.fill(frames, counts, sizes, outs) is None   # too small: Python path
    outs[3] = memoryview(bytearray(300))
    data = _batch.fill(frames, counts, sizes, outs)
    assert [None if d is None else bytes(d) for d in data] == [b"aaa", None, b"bb",
                                                               b"c" * 300, None]
    assert bytes(outs[0]) == b"aaa\0"
    outs[0] = memoryview(b"1234")                     # read-only
    assert _batch.fill(frames, counts, sizes, outs) is None
    assert _batch.fill(frames, counts, [3, -1, 2.0, 300, -1], None) is None
    assert _batch.fill(frames, counts, [3, -1, 2, 300, 5], None) is None


@pytest.fixture(scope="module")
def server():
    with ServerProcess(prealloc_size=1 / 16) as s:
        yield s


@pytest.mark.parametrize("fast", [True, False])
def test_tcp_batches_end_to_end(server, monkeypatch, fast):
    if not fast:
        monkeypatch.setattr(client_mod, "_batch", None)
    tag = b"f" if fast else b"p"
    keys = [tag + b"-%04d" % i for i in range(300)]
    vals = [bytes([i % 256]) * (i % 7) * 10 for i in range(300)]       # 0-byte ones too
    vals[5] = np.arange(300 << 10, dtype=np.uint8) % 251               # one large alone
    vals[6] = np.ones(8, np.float16)
    with Client(server.address, transport="tcp", timeout=10) as c:
        c.put_batch(keys, vals)
        want = [client_mod.byte_view(v).tobytes() for v in vals]
        got = c.get_batch(keys + [tag + b"-missing"])
        assert got[:-1] == want and got[-1] is None
        outs = [np.zeros(len(w) + 3, np.uint8) for w in want] + [np.zeros(1, np.uint8)]
        sizes = c.get_batch_into([k.decode() for k in keys] + [tag + b"-missing"], outs)
        assert sizes == [len(w) for w in want] + [-1]
        assert all(o[:len(w)].tobytes() == w for o, w in zip(outs, want))
        with pytest.raises(ValueError, match="holds 2 bytes"):
            c.get_batch_into(keys[1:2], [bytearray(2)])
        assert c.exists_batch(keys[:3] + [tag + b"-missing"]) == [True] * 3 + [False]
        assert c.match_prefix(keys[:10] + [tag + b"-missing"] + keys[:2]) == 10
        with pytest.raises(TypeError, match=r"value for key b'bad'"):
            c.put_batch([b"bad"], [object()])
        with pytest.raises(ValueError, match="contiguous"):
            c.put_batch([b"bad"], [np.arange(10, dtype=np.uint8)[::2]])
        with pytest.raises(InvalidKey):
            c.put_batch([b""], [b"x"])
        assert c.exists_batch([b"bad"]) == [False]
        with pytest.raises(ValueTooLarge):
            c.put_batch([b"huge"], [bytearray(c._session.capacity + 1)])


@pytest.mark.parametrize("idx", range(10))
def test_pack_values_same_as_views_then_pack(idx):
    vals = _values_cases()[idx]
    big = np.arange(F.PACK_BELOW + 5, dtype=np.uint8)
    vals = [vals[0], b"q" * 7, big.tobytes(), b"", big] + vals[1:]
    keys = [b"k%d" % i for i in range(len(vals))]
    s = _session(capacity=F.PACK_BELOW * 2, max_value=F.PACK_BELOW + 100)
    got = []
    for fn in (lambda: _batch.pack_values(keys, vals, s.capacity, s.limits.max_value_bytes,
                                          client_mod.byte_view, ValueTooLarge),
               lambda: (lambda vs: ([v.nbytes for v in vs[0]], *F._py_pack(vs[0])))(
                   s._views_sizes(keys, vals))):
        try:
            sizes, frames, counts = fn()
            got.append((sizes, [bytes(f) for f in frames], counts))
        except Exception as exc:  # noqa: BLE001
            got.append((type(exc), str(exc)))
    assert got[0] == got[1]


BAD_OUTS = [
    [bytearray(8), b"readonly"],
    [bytearray(8), np.zeros(16, np.uint8)[::2]],
    [bytearray(8), 7],
    [bytearray(8), bytearray(2)],                       # smaller than the value
    [bytearray(8), np.zeros((2, 4), np.float32)],       # fine: 32 bytes
    [memoryview(bytearray(16))[::2], bytearray(8)],
]


@pytest.mark.parametrize("idx", range(len(BAD_OUTS)))
def test_get_batch_into_outs_same_errors(server, monkeypatch, idx):
    keys = [b"o-1", b"o-2"]
    with Client(server.address, transport="tcp", timeout=10) as c:
        c.put_batch(keys, [b"12345678", b"abcdefgh"])

        def run():
            outs = [o.copy() if isinstance(o, np.ndarray) else
                    (bytearray(o) if type(o) is bytearray else o) for o in BAD_OUTS[idx]]
            n = c.get_batch_into(keys, outs)
            return n, [client_mod.byte_view(o).tobytes()[:8] for o in outs]

        fast, py = _both(monkeypatch, run)
        assert fast == py
        if idx == 4:
            assert fast[0] == "ok" and fast[1][0] == [8, 8]
