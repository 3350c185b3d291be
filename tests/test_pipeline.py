"""Pipelined batch EXISTS and TCP PUT (kvshm.client: PIPELINE / PIPE_KEYS; Channel.request_many)
against the one request it replaces (``PIPELINE`` off, the default): the same answers in
key order, the same errors at the same keys, replies taken in any order, a refused part
raising the one request's error, and a server that stops answering mid-pipeline ending
the call in ServerUnavailable at its timeout (no hang), both transports of the channel."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import pytest

import kvshm.client as client_mod
import kvshm.zmq_ctrl.channel as chmod
from kvshm import Client
from kvshm.errors import InvalidKey, InvalidRequest, ServerUnavailable
from kvshm.zmq_ctrl.channel import Channel
from kvshm.zmq_ctrl.protocol import Op, Status, encode_request
from servers import ServerProcess

_batchq = pytest.importorskip("kvshm.zmq_ctrl._batchq")

# A ROUTER that takes N requests, then answers them as its mode says: "reverse" (all,
# last first), "refuse" (all in order, the one at index ARG refused INVALID_REQUEST),
# "die" (only the first ARG, then it stops answering: it sleeps until killed).
_FAKE = r"""
import sys, time, msgpack, zmq
mode, n, arg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = zmq.Context().socket(zmq.ROUTER)
s.setsockopt(zmq.LINGER, 0)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
got = []
while len(got) < n:
    m = s.recv_multipart()
    v, op, rid, epoch, body = msgpack.unpackb(m[1], raw=False)
    got.append((m[0], rid, body["keys"]))
def answer(ident, rid, keys, st=0):
    body = {"found": [k.endswith(b"1") for k in keys]} if st == 0 else {"error": "refused"}
    s.send_multipart([ident, msgpack.packb([v, st, rid, body], use_bin_type=True)])
if mode == "reverse":
    for g in reversed(got):
        answer(*g)
elif mode == "refuse":
    for i, g in enumerate(got):
        answer(*g, st=9 if i == arg else 0)
elif mode == "die":
    for g in got[:arg]:
        answer(*g)
time.sleep(60)
"""


def _fake(mode: str, n: int, arg: int = 0) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([sys.executable, "-c", _FAKE, mode, str(n), str(arg)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


def _stop(p: subprocess.Popen[str]) -> None:
    p.kill()
    p.wait()
    if p.stdout is not None:
        p.stdout.close()


def _parts(n: int, k: int) -> list[list[bytes]]:
    keys = [f"key-{i:05d}".encode() for i in range(n)]
    return [keys[i:i + k] for i in range(0, n, k)]


@pytest.fixture(params=[False, True], ids=["libzmq", "zmtp"])
def zmtp(request, monkeypatch):
    if request.param and not chmod.ZMTP:
        pytest.skip("the ZMTP transport is not built or is turned off")
    monkeypatch.setattr(chmod, "ZMTP", request.param)
    return request.param


def _many(ch: Channel, parts: list[list[bytes]], packed: bool = False):
    reqs = []
    for p in parts:
        rid = ch.new_id()
        body = encode_request(Op.EXISTS, rid, 0, {"keys": p}) if packed else {"keys": p}
        reqs.append((Op.EXISTS, body, (), rid))
    with ch.lock:
        return reqs, ch.request_many(reqs)


@pytest.mark.parametrize("packed", [False, True], ids=["dict", "header"])
def test_request_many_takes_replies_in_any_order(zmtp, packed):
    parts = _parts(50, 7)
    p, port = _fake("reverse", len(parts))
    ch = Channel(f"tcp://127.0.0.1:{port}", 10.0)
    try:
        stray: list[int] = []
        ch.on_stray = lambda rid, st, body: stray.append(rid)
        reqs, got = _many(ch, parts, packed)
        assert [g[0] for g in got] == [r[3] for r in reqs]
        assert [g[1] for g in got] == [0] * len(parts)
        assert [g[2]["found"] for g in got] == [[k.endswith(b"1") for k in q] for q in parts]
        assert stray == []          # none of its replies went to on_stray
        assert ch._want is None
    finally:
        ch.close()
        _stop(p)


def test_request_many_a_refused_part_is_its_own(zmtp):
    parts = _parts(30, 10)
    p, port = _fake("refuse", len(parts), 1)
    ch = Channel(f"tcp://127.0.0.1:{port}", 10.0)
    try:
        _, got = _many(ch, parts)
        assert [g[1] for g in got] == [0, Status.INVALID_REQUEST, 0]
    finally:
        ch.close()
        _stop(p)


def test_request_many_server_stops_answering_midway(zmtp):
    parts = _parts(40, 10)
    p, port = _fake("die", len(parts), 2)     # answers 2 of 4, then nothing
    ch = Channel(f"tcp://127.0.0.1:{port}", 1.0)
    try:
        with pytest.raises(ServerUnavailable, match="no reply"):
            _many(ch, parts)
        assert ch._want is None
    finally:
        ch.close()
        _stop(p)


def test_pack_keys_request_part_is_the_slice():
    keys = [f"k{i}".encode() * (i % 5 + 1) for i in range(300)] + [b"x" * 300]
    for a, b in [(0, 301), (0, -1), (5, 17), (17, 17), (290, 301), (-3, 2), (300, 1000),
                 (20, 10)]:
        want = keys[max(a, 0):len(keys) if b < 0 else b]
        h = _batchq.pack_keys_request(3, 7, 11, 13, keys, a, b)
        assert h == _batchq.pack_keys_request(3, 7, 11, 13, want), (a, b)
        import msgpack
        assert h == msgpack.packb([3, 7, 11, 13, {"keys": want}], use_bin_type=True)
    assert _batchq.pack_keys_request(3, 7, 11, 13, [b"a", "b", b"c"], 0, 1) is not None
    assert _batchq.pack_keys_request(3, 7, 11, 13, [b"a", "b", b"c"], 0, 2) is None


# ------------------------------------------------------------------ through a server

@pytest.fixture(scope="module")
def server():
    with ServerProcess() as srv:
        yield srv


def _both(monkeypatch, c: Client, fn):
    """(result or (exception type, message), requests sent) with PIPELINE off, then on."""
    out = []
    for on in (False, True):
        monkeypatch.setattr(client_mod, "PIPELINE", on)
        sent = c._chan.sent
        try:
            r: object = fn()
        except Exception as exc:  # noqa: BLE001 - compared by the caller
            r = (type(exc), str(exc))
        out.append((r, c._chan.sent - sent))
    return out


@pytest.mark.parametrize("n", [1, 99, 100, 199, 200, 201, 1000, 1003])
def test_exists_batch_same_answers_on_and_off(server, monkeypatch, n):
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 100)
    with Client(server.address, transport="tcp", timeout=30) as c:
        keys = [f"pipe-{n}-{i}".encode() for i in range(n)]
        c.put_batch(keys[::3], [b"v"] * len(keys[::3]))
        (off, sent_off), (on, sent_on) = _both(monkeypatch, c, lambda: c.exists_batch(keys))
        assert off == on == [i % 3 == 0 for i in range(n)]
        assert sent_off == 1
        assert sent_on == (1 if n < 200 else -(-n // 100))
        # match_prefix stays one request (it stops at the first miss)
        (moff, _), (mon, _) = _both(monkeypatch, c, lambda: c.match_prefix(keys))
        assert moff == mon == 1


def test_exists_batch_same_errors_at_the_same_keys(server, monkeypatch):
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 100)
    with Client(server.address, transport="tcp", timeout=30) as c:
        keys: list = [f"err-{i}".encode() for i in range(1000)]
        for bad, cls in [(b"", InvalidKey), (b"x" * (c.session.limits.max_key_bytes + 1),
                                             InvalidKey), (17, InvalidKey)]:
            ks = list(keys)
            ks[950] = bad
            (off, s_off), (on, s_on) = _both(monkeypatch, c, lambda: c.exists_batch(ks))
            assert off == on and off[0] is cls, (off, on)
            assert s_off == s_on == 0          # refused before anything was sent
        monkeypatch.setattr(c.session, "limits",
                            dataclasses.replace(c.session.limits, max_batch=999))
        (off, _), (on, _) = _both(monkeypatch, c, lambda: c.exists_batch(keys))
        assert off == on and off[0] is InvalidRequest


def test_exists_batch_a_server_that_stops_answering(monkeypatch):
    """SIGSTOP: no reply comes; the pipelined call ends at its timeout, and once the
    server runs again the client's next call gets the right answers."""
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 100)
    monkeypatch.setattr(client_mod, "PIPELINE", True)
    with ServerProcess() as srv:
        with Client(srv.address, transport="tcp", timeout=1.0) as c:
            keys = [f"stop-{i}".encode() for i in range(1000)]
            c.put_batch(keys[:500], [b"v"] * 500)
            os.kill(srv.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(ServerUnavailable):
                    c.exists_batch(keys)
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            assert c.exists_batch(keys) == [True] * 500 + [False] * 500


def test_exists_batch_after_a_server_restart(monkeypatch, tmp_path):
    """A new server on the same port: the parts answered STALE_EPOCH go again after a
    HELLO (as the one request goes again), the answer is the new server's."""
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.EXISTS, 100)
    monkeypatch.setattr(client_mod, "PIPELINE", True)
    srv = ServerProcess()
    port = int(srv.address.rpartition(":")[2])
    keys = [f"re-{i}".encode() for i in range(1000)]
    try:
        with Client(srv.address, transport="tcp", timeout=10.0) as c:
            c.put_batch(keys, [b"v"] * 1000)
            assert c.exists_batch(keys) == [True] * 1000
            srv.stop()
            srv = ServerProcess(service_port=port)
            assert c.exists_batch(keys) == [False] * 1000
            c.put_batch(keys[:10], [b"w"] * 10)
            assert c.exists_batch(keys) == [True] * 10 + [False] * 990
    finally:
        srv.stop()


@pytest.mark.parametrize("n", [1, 99, 100, 199, 200, 201, 1003])
def test_put_batch_same_results_on_and_off(server, monkeypatch, n):
    """A TCP put_batch pipelined as PUTs of 100 keys stores what the one PUT stores:
    every value read back is the last one written, in as many requests as parts."""
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.PUT, 100)
    with Client(server.address, transport="tcp", timeout=30) as c:
        keys = [f"pput-{n}-{i}".encode() for i in range(n)]
        for on in (False, True):
            monkeypatch.setattr(client_mod, "PIPELINE", on)
            vals = [os.urandom(1 + i % 300) + bytes([on]) for i in range(n)]
            sent = c._chan.sent
            assert c.put_batch(keys, vals) is None
            assert c._chan.sent - sent == (1 if not on or n < 200 else -(-n // 100))
            monkeypatch.setattr(client_mod, "PIPELINE", False)
            assert c.get_batch(keys) == vals


def test_put_batch_same_errors_at_the_same_keys(server, monkeypatch):
    """Bad keys, a value past the pool, a count mismatch: the one PUT's error (type
    and message), raised before any part is sent."""
    monkeypatch.setitem(client_mod.PIPE_KEYS, Op.PUT, 100)
    with Client(server.address, transport="tcp", timeout=30) as c:
        keys: list = [f"perr-{i}".encode() for i in range(1000)]
        vals: list = [b"v"] * 1000
        for bad_key, bad_val, extra in [(b"", b"v", 0), (17, b"v", 0),
                                        (b"ok", b"x" * (c.session.capacity + 1), 0),
                                        (b"ok", b"v", 1)]:
            ks, vs = list(keys), list(vals)
            ks[950], vs[950] = bad_key, bad_val
            vs += [b"v"] * extra
            (off, s_off), (on, s_on) = _both(monkeypatch, c, lambda: c.put_batch(ks, vs))
            assert type(off) is tuple and off == on, (off, on)
            assert s_off == s_on == 0          # refused before anything was sent
