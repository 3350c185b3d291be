"""The engine-free helpers under the integrations (``kvshm.integrations._common``): values
in pieces, self-describing chunk values, the fail-fast client. Runs in any venv (no
engine), over both the shared-memory and the TCP mover."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvshm
from _support import free_port, server_exists_counter, stop_server, wait_for
from kvshm.integrations import _common as C
from servers import ServerProcess


@pytest.fixture(params=["shm", "tcp"])
def client(request: Any, kvshm_server: ServerProcess) -> Iterator[kvshm.Client]:
    with kvshm.Client(kvshm_server.address, transport=request.param) as c:
        c.purge()
        assert c.transport == request.param
        yield c


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)


def test_header_round_trip_and_errors() -> None:
    h = C.pack_header(1, ["bfloat16", "float32"], [(2, 4, 256, 128), (7,)], 12345)
    assert len(h) % 64 == 0
    p = C.parse_header(h + b"payload")
    assert (p.fmt, p.dtypes, p.shapes, p.payload_len, p.header_len) == \
        (1, ("bfloat16", "float32"), ((2, 4, 256, 128), (7,)), 12345, len(h))
    many = C.pack_header(4, ["uint8"] * 20, [(1, 2, 3, 4, 5)] * 20, 1)
    assert len(many) > C.HEADER_PROBE and C.parse_header(many).shapes[-1] == (1, 2, 3, 4, 5)
    for bad in (b"", b"XXXX" + h[4:], h[:30]):
        with pytest.raises(ValueError):
            C.parse_header(bad)
    with pytest.raises(ValueError):
        C.pack_header(0, ["a"], [], 0)


def test_pieces_round_trip(client: kvshm.Client) -> None:
    a, b, c = rand(1000, 1), rand(5000, 2), rand(0, 3)
    C.put_pieces(client, ["k1", "k2"], [[a, b], [b, c, a]])
    assert client.get("k1") == a.tobytes() + b.tobytes()
    outs = [[np.zeros(1000, np.uint8), np.zeros(5000, np.uint8)],
            [np.zeros(5000, np.uint8), np.zeros(1000, np.uint8)]]
    views = [[memoryview(x) for x in o] for o in outs]
    assert C.get_pieces_into(client, ["k1", "k2"], views) == [True, True]
    assert np.array_equal(outs[0][0], a) and np.array_equal(outs[0][1], b)
    assert np.array_equal(outs[1][0], b) and np.array_equal(outs[1][1], a)


def test_pieces_prefix_and_wrong_size(client: kvshm.Client) -> None:
    a = rand(4096, 4)
    C.put_pieces(client, ["p0", "p1", "p3"], [[a], [a], [a]])
    client.put("small", b"abc")
    views = [[memoryview(np.zeros(4096, np.uint8))] for _ in range(4)]
    assert C.get_pieces_into(client, ["p0", "p1", "p2", "p3"], views, prefix=True) == \
        [True, True, False, False]
    assert not views[3][0].tobytes().strip(b"\0")           # not copied after the miss
    assert C.get_pieces_into(client, ["p0", "p1", "p2", "p3"], views) == \
        [True, True, False, True]
    assert C.get_pieces_into(client, ["small", "p0"], views[:2]) == [False, True]
    assert C.get_pieces_into(client, ["small", "p0"], views[:2], prefix=True) == \
        [False, False]


class Alloc:
    """A stand-in for LMCache's allocator: numpy buffers, optionally out of room."""

    def __init__(self, room: int = 1 << 30) -> None:
        self.room = room
        self.live: list[np.ndarray] = []
        self.headers: list[C.ChunkHeader] = []

    def __call__(self, h: C.ChunkHeader, i: int) -> Any:
        if h.payload_len > self.room:
            return None
        self.room -= h.payload_len
        buf = np.zeros(h.payload_len, np.uint8)
        self.live.append(buf)
        self.headers.append(h)
        return buf, memoryview(buf)

    def release(self, buf: np.ndarray) -> None:
        self.live = [b for b in self.live if b is not buf]
        self.room += buf.nbytes


def put_chunks(client: kvshm.Client, keys: list[str], datas: list[np.ndarray]) -> None:
    hs = [C.pack_header(1, ["uint8"], [(d.size,)], d.size) for d in datas]
    C.put_framed(client, keys, hs, [memoryview(d) for d in datas])


def test_framed_get_and_prefix(client: kvshm.Client) -> None:
    datas = [rand(3000 + i, 10 + i) for i in range(4)]
    put_chunks(client, ["c0", "c1", "c3"], [datas[0], datas[1], datas[3]])
    client.put("junk", b"not a chunk value")
    al = Alloc()
    got = C.get_framed(client, ["c0", "c1", "c2", "c3", "junk"], al, al.release)
    assert [g is not None for g in got] == [True, True, False, True, False]
    for g, d in zip([got[0], got[1], got[3]], [datas[0], datas[1], datas[3]]):
        assert np.array_equal(g, d)
    assert al.headers[0].shapes == ((3000,),)
    al2 = Alloc()
    got = C.get_framed(client, ["c0", "c1", "c2", "c3"], al2, al2.release, prefix=True)
    assert [g is not None for g in got] == [True, True, False, False]
    assert len(al2.live) == 2                      # nothing allocated after the miss


def test_framed_get_waits_for_room(client: kvshm.Client) -> None:
    datas = [rand(4000, 20 + i) for i in range(3)]
    put_chunks(client, ["w0", "w1", "w2"], datas)
    al = Alloc(room=8000)                          # room for two
    t0 = time.monotonic()
    got = C.get_framed(client, ["w0", "w1", "w2"], al, al.release, alloc_wait=0.1)
    assert [g is not None for g in got] == [True, True, False]
    assert time.monotonic() - t0 >= 0.1
    for g in got:
        if g is not None:
            al.release(g)
    al = Alloc(room=8000)
    got = C.get_framed(client, ["w0", "w1", "w2"], al, al.release, prefix=True,
                       alloc_wait=0.1)
    assert [g is not None for g in got] == [True, True, False]
    assert len(al.live) == 2


def test_resilient_client_fails_fast_then_recovers() -> None:
    """An unreachable server costs one short probe, then calls fail without touching the
    server (the operation never runs) until a background probe finds it back; a server
    lost between calls costs one call its timeout, then the same."""
    port = free_port()
    rc = C.ResilientClient(f"kvshm://127.0.0.1:{port}", timeout=1.0, retry_interval=0.1,
                           probe_timeout=0.2)
    ran: list[str] = []

    def op(c: kvshm.Client) -> bool:
        ran.append("op")
        return c.exists("x")

    srv = None
    try:
        with pytest.raises(kvshm.ServerUnavailable, match=r"HELLO within 0.2 s"):
            rc.call(op)
        assert ran == [] and not rc.up               # the probe failed; op never ran
        for _ in range(50):
            with pytest.raises(kvshm.ServerUnavailable, match="probing again"):
                rc.call(op)
        assert ran == []
        srv = ServerProcess(prealloc_size=0.0625, service_port=port)
        wait_for(lambda: rc.up, what="the background probe to find the server")
        assert rc.call(op) is False and ran == ["op"]
        stop_server(srv)
        srv = None
        with pytest.raises(kvshm.ServerUnavailable):  # lost mid-way: this call waits
            rc.call(op)
        assert ran == ["op", "op"] and not rc.up
        for _ in range(20):
            with pytest.raises(kvshm.ServerUnavailable, match="probing again"):
                rc.call(op)
        assert ran == ["op", "op"]
        srv = ServerProcess(prealloc_size=0.0625, service_port=port)
        wait_for(lambda: rc.up, what="the background probe to find the restarted server")
        assert rc.call(op) is False
    finally:
        rc.close()
        if srv is not None:
            stop_server(srv)
    with pytest.raises(kvshm.ServerUnavailable, match="closed"):
        rc.call(lambda c: c.exists("x"))


@pytest.mark.parametrize("required", [False, True])
def test_missing_engine_skips_or_fails(tmp_path: Any, required: bool) -> None:
    """An engine test module whose pinned engine is missing skips, unless CI requires the
    engines (KVSHM_REQUIRE_ENGINES=1): then it fails, so CI cannot stay green."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    mod = tmp_path / "test_fake_engine.py"
    mod.write_text("import _engines\n"
                   "_engines.load_dist('kvshm-no-such-engine', '1.0', 'kvshm_no_such_engine')\n"
                   "def test_x():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "KVSHM_REQUIRE_ENGINES"}
    if required:
        env["KVSHM_REQUIRE_ENGINES"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-rs", str(mod)], capture_output=True, text=True, timeout=120,
                       env=env, cwd=tmp_path)
    if required:
        assert p.returncode in (1, 2) and "KVSHM_REQUIRE_ENGINES is set" in p.stdout, p.stdout
    else:
        assert p.returncode in (0, 5) and "1 skipped" in p.stdout, p.stdout


# ------------------------------------------------------- compact keys (local lookups)

#: The vLLM tier's namespace fields for a model given by a pytest tmp path, as in
#: test_vllm_e2e.py: in the readable form its keys are ~177 bytes.
E2E_FIELDS = ["vllm", "%2Ftmp%2Fpytest-of-root%2Fpytest-12%2Ftiny-llama0", "torch.float32",
              "tp2pp1pcp1dcp1", "default", "c1x16", "r65536"]


def test_long_keys_are_compacted_and_read_locally(kvshm_server: ServerProcess) -> None:
    """The vLLM tier's keys for a long model path fit the shared-memory index; a local
    client's exists / exists_batch on them send nothing to the server (before: the
    177-byte keys were not published, each lookup was a server round trip)."""
    from kvshm._shmindex import KEY_MAX
    ids = [bytes([i]) * 32 + (0).to_bytes(4, "big") for i in range(4)]
    readable = ("|".join(E2E_FIELDS) + "|").encode() + ids[0].hex().encode()
    assert len(readable) > KEY_MAX                      # the form that was not published
    ns, hex_ids = C.compact_fields(E2E_FIELDS, 1, 36)
    assert not hex_ids and ns.split("|")[3] == "tp2pp1pcp1dcp1"
    keys = [C.compact_key(ns.encode(), hex_ids, r) for r in ids]
    assert all(len(k) <= KEY_MAX for k in keys)
    with kvshm.Client(kvshm_server.address) as c:
        c.purge()
        c.put_batch(keys[:3], [b"v" * 64] * 3)
    with kvshm.Client(kvshm_server.address) as c:
        assert c._session.local_reader() is not None, "the test client is not local"
        n = server_exists_counter(c)
        assert [c.exists(k) for k in keys] == [True, True, True, False]
        assert c.exists_batch(keys) == [True, True, True, False]
        assert n[0] == 0, f"{n[0]} EXISTS went to the server"
        c.exists(readable)                               # the counter does count
        assert n[0] == 1


def test_compact_fields_keep_inputs_apart() -> None:
    """Distinct inputs give distinct keys in the compact form; short namespaces keep the
    readable form (hex ids), unchanged."""
    short = ["vllm", "org%2Ffake-model", "bfloat16", "tp1pp1pcp1dcp1", "default", "c1x16",
             "r16384"]
    ns, hex_ids = C.compact_fields(short, 1, 36)
    assert hex_ids and ns == "|".join(short) + "|"
    raw = bytes(range(36))
    assert C.compact_key(ns.encode(), hex_ids, raw) == ns.encode() + raw.hex().encode()
    spaces = set()
    for model in (E2E_FIELDS[1], E2E_FIELDS[1] + "x", E2E_FIELDS[1][:-1] + "1"):
        for tp in ("tp1pp1pcp1dcp1", "tp2pp1pcp1dcp1"):
            f = list(E2E_FIELDS)
            f[1], f[3] = model, tp
            got, h = C.compact_fields(f, 1, 36)
            assert not h and "%h" in got and tp in got.split("|")
            spaces.add(got)
    assert len(spaces) == 6
    ids = [bytes([i, j]) * 16 + g.to_bytes(4, "big") for i in range(16) for j in range(16)
           for g in range(2)]
    keys = {C.compact_key(s.encode(), False, r) for s in spaces for r in ids}
    assert len(keys) == 6 * len(ids)
    assert all(k.count(b"|") == 7 for k in keys)         # the fields still split on "|"


def test_key_field_is_injective_and_keeps_plain_fields() -> None:
    """key_field: a field without the separator (and not starting with "%~") as it is;
    any other escaped, without the separator; never two inputs to one field."""
    from urllib.parse import quote

    plain = ["vllm", "sgl", "bfloat16", "NHD", "", "a%7Cb", "%h", quote("org/m", safe="")]
    for s in plain:
        assert C.key_field(s) == s
    odd = ["a|b", "|", "%~x", "a%7Cb|", "%~" + quote("a|b", safe=""), "x@y|z"]
    inputs = plain + odd
    out = [C.key_field(s) for s in inputs]
    assert len(set(out)) == len(inputs)
    assert all("|" not in f for f in out)
    assert C.key_field("a@b", "@%") != "a@b" and "@" not in C.key_field("a@b", "@%")
    assert C.key_field("a%b", "@%") != C.key_field("a%25b", "@%")
    # joined, the fields split again: two configurations never share a namespace
    a = "|".join(C.key_field(f) for f in ["v|m", "x"])
    b = "|".join(C.key_field(f) for f in ["v", "m|x"])
    assert a != b and "v|m|x" not in (a, b)


def test_layout_field_is_injective_in_name_and_flags() -> None:
    """vLLM's namespace appended "+canonical" to the layout's name and then escaped the
    whole: a layout literally named "X+canonical" got the key of layout "X" with
    canonical rows (two configurations, one key). layout_field escapes the name with
    "+" a separator too (failed before: the two fields were equal)."""
    names = ["NHD", "HND", "default", "NHD+canonical", "NHD+replicated",
             "NHD+canonical+replicated", "+", "a|b", "%~x", "NHD%2Bcanonical"]
    seen: dict[str, tuple[str, bool, bool]] = {}
    for name in names:
        for canonical in (False, True):
            for replicated in (False, True):
                f = C.layout_field(name, canonical, replicated)
                assert "|" not in f
                assert f not in seen, (f, seen.get(f), (name, canonical, replicated))
                seen[f] = (name, canonical, replicated)
    # today's fields byte for byte for a name without "|" or "+"
    assert C.layout_field("NHD") == "NHD"
    assert C.layout_field("NHD", True) == "NHD+canonical"
    assert C.layout_field("NHD", True, True) == "NHD+canonical+replicated"
    assert C.layout_field("NHD+canonical") != C.layout_field("NHD", True)
