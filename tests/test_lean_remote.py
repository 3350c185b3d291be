"""The lean one-key paths of a remote client (kvshm.client.Client._put1/_get1/_exists1)
and the channel under them: the same messages, results and errors as the general path.

Each error case runs twice, lean and with the lean path switched off (``_lean`` returning
None sends every call through _run and the operation generators), and compares the
exception types and messages. Crafted replies (a stubbed Channel.request) cover what a
live server rarely answers: refusals, per-key failures, malformed GET layouts, quota.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable

import numpy as np
import pytest
import zmq

from kvshm import Client
from kvshm.errors import KeyNotFound, KvshmError, ServerUnavailable
from kvshm.zmq_ctrl import channel as chmod
from kvshm.zmq_ctrl.protocol import Op, Status
from servers import ServerProcess


@pytest.fixture(scope="module")
def server():
    with ServerProcess(prealloc_size=1 / 16) as s:
        yield s


@pytest.fixture
def client(server):
    with Client(server.address, transport="tcp", timeout=5) as c:
        yield c


def _slow(c: Client) -> None:
    c._lean = lambda: None  # type: ignore[method-assign]


def _outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        r = fn()
    except Exception as exc:        # noqa: BLE001 - compared, not swallowed
        return type(exc).__name__, str(exc)
    return "ok", repr(r)


def _both(c: Client, fn: Callable[[Client], Any]) -> tuple[tuple[str, str], tuple[str, str]]:
    """``fn(c)`` on the lean path, then on the general path (same client)."""
    lean = _outcome(lambda: fn(c))
    _slow(c)
    try:
        slow = _outcome(lambda: fn(c))
    finally:
        del c._lean
    return lean, slow


def _counting(c: Client) -> list[int]:
    """Ops of the requests ``c`` sends from now on."""
    ops: list[int] = []
    real = c._chan.request

    def request(op: int, *a: Any, **kw: Any) -> Any:
        ops.append(int(op))
        return real(op, *a, **kw)

    c._chan.request = request  # type: ignore[method-assign]
    real1 = c._chan.call1

    def call1(kind: int, op: int, *a: Any) -> Any:   # the one-key path in C
        r = real1(kind, op, *a)
        if r is not chmod.NOT_SENT:
            ops.append(int(op))
        return r

    c._chan.call1 = call1  # type: ignore[method-assign]
    return ops


def test_round_trips_take_the_lean_path(client):
    ops = _counting(client)
    called: list[str] = []
    for name in ("_put1", "_get1", "_exists1"):
        real = getattr(client, name)

        def wrap(*a: Any, _real: Any = real, _name: str = name) -> Any:
            r = _real(*a)
            taken = r is not False if _name == "_put1" else r is not None
            called.append(_name if taken else "general")
            return r

        setattr(client, name, wrap)
    v = np.arange(4096, dtype=np.uint8)
    client.put(b"lean-a", v)
    client.put("lean-b", b"text key")               # an ASCII str key
    assert client.get(b"lean-a") == v.tobytes()
    out = np.zeros(8192, np.uint8)
    assert client.get_into("lean-a", out) == 4096
    assert (out[:4096] == v).all() and not out[4096:].any()
    assert client.exists("lean-b") is True
    assert client.exists(b"lean-missing") is False
    with pytest.raises(KeyNotFound):
        client.get(b"lean-missing")
    assert called == ["_put1", "_put1", "_get1", "_get1", "_exists1", "_exists1", "_get1"]
    assert ops == [Op.PUT, Op.PUT, Op.GET, Op.GET, Op.EXISTS, Op.EXISTS, Op.GET]


@pytest.mark.parametrize("size", [0, 1, 4096, 1 << 20, (4 << 20) + 3])
def test_sizes_and_dtypes(client, size):
    """Empty values, zero-copy frames (>= 64 KiB) both ways, non-byte dtypes."""
    raw = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    client.put(b"sz", raw)
    assert client.get(b"sz") == raw.tobytes()
    out = np.empty(size + 5, np.uint8)
    assert client.get_into(b"sz", out) == size
    assert out[:size].tobytes() == raw.tobytes()
    if size % 4 == 0:
        f32 = raw.view(np.float32).reshape(-1, 2) if size >= 8 else raw.view(np.float32)
        client.put(b"sz32", f32)
        assert client.get(b"sz32") == raw.tobytes()
        back = np.empty_like(f32)
        assert client.get_into(b"sz32", back) == size
        assert back.tobytes() == raw.tobytes()


def test_checksums_and_verify(client):
    client.put(b"ck", b"checked", checksum=True)
    assert client.get(b"ck", verify=True) == b"checked"
    out = bytearray(16)
    assert client.get_into(b"ck", out, verify=True) == 7
    client.put(b"nock", b"plain")
    lean, slow = _both(client, lambda c: c.get(b"nock", verify=True))
    assert lean == slow and lean[0] == "CorruptValue"


@pytest.mark.parametrize("case", [
    "missing", "small_out", "readonly_out", "strided_out", "empty_key", "long_key",
    "int_key", "bytearray_key", "unicode_key", "surrogate_key", "strided_value",
    "too_large", "not_a_buffer", "exists_missing", "exists_bad_key",
])
def test_errors_equal_the_general_path(client, case):
    client.put(b"have", b"x" * 100)
    limit = client._session.limits.max_key_bytes
    cases: dict[str, Callable[[Client], Any]] = {
        "missing": lambda c: c.get(b"nope"),
        "small_out": lambda c: c.get_into(b"have", bytearray(10)),
        "readonly_out": lambda c: c.get_into(b"have", b"\0" * 200),
        "strided_out": lambda c: c.get_into(b"have", np.zeros(400, np.uint8)[::2]),
        "empty_key": lambda c: c.put(b"", b"v"),
        "long_key": lambda c: c.put(b"k" * (limit + 1), b"v"),
        "int_key": lambda c: c.get(5),
        "bytearray_key": lambda c: (c.put(bytearray(b"ba"), b"v"), c.get(b"ba")),
        "unicode_key": lambda c: (c.put("ключ", b"v"), c.get("ключ")),
        "surrogate_key": lambda c: c.put("\udc80", b"v"),
        "strided_value": lambda c: c.put(b"sv", np.arange(200, dtype=np.uint8)[::2]),
        "too_large": lambda c: c.put(b"big", np.zeros(c._session.capacity + 1, np.uint8)),
        "not_a_buffer": lambda c: c.put(b"nb", 12345),
        "exists_missing": lambda c: c.exists(b"nope"),
        "exists_bad_key": lambda c: c.exists(b""),
    }
    lean, slow = _both(client, cases[case])
    assert lean == slow
    if case == "small_out":
        assert lean[0] == "ValueError"
    # the connection is still sound
    assert client.get(b"have") == b"x" * 100


def test_small_output_is_left_untouched(client):
    client.put(b"have", b"y" * 100)
    out = bytearray(b"\x07" * 50)
    with pytest.raises(ValueError, match="holds 50 bytes"):
        client.get_into(b"have", out)
    assert out == bytearray(b"\x07" * 50)


def _fake(c: Client, replies: list[tuple[int, dict[str, Any], list[Any]]]) -> list[Any]:
    """Answer the next requests with ``replies`` (status, body, frames); returns the
    bodies sent."""
    sent: list[Any] = []
    it = iter(replies)

    def request(op: int, body: dict[str, Any], frames: Any = (), *, epoch: int = 0,
                req_id: int | None = None, timeout: float | None = None,
                into: Any = None) -> Any:   # (into: never placed, as on libzmq)
        sent.append((int(op), dict(body)))
        st, rbody, rframes = next(it)
        return req_id, st, rbody, list(rframes)

    c._chan.request = request  # type: ignore[method-assign]
    # the one-key path in C sends nothing: the stub answers (tests/test_clidisp.py
    # crafts these replies on the wire for that path)
    c._chan.call1 = lambda *a: chmod.NOT_SENT  # type: ignore[method-assign]
    return sent


REPLIES: dict[str, tuple[Callable[[Client], Any], tuple[int, dict[str, Any], list[Any]]]] = {
    "put_refused": (lambda c: c.put(b"k", b"v"), (Status.INVALID_REQUEST, {"error": "no"}, [])),
    "put_unknown_status": (lambda c: c.put(b"k", b"v"), (99, {}, [])),
    "put_pool_full": (lambda c: c.put(b"k", b"v"), (0, {"st": [Status.POOL_FULL]}, [])),
    "put_quota": (lambda c: c.put(b"k", b"v"), (0, {"st": [Status.QUOTA_EXCEEDED]}, [])),
    "put_no_st": (lambda c: c.put(b"k", b"v"), (0, {}, [])),
    "put_empty_st": (lambda c: c.put(b"k", b"v"), (0, {"st": []}, [])),
    "get_refused": (lambda c: c.get(b"k"), (Status.INTERNAL, {"error": "bug"}, [])),
    "get_quota": (lambda c: c.get(b"k"), (0, {"sizes": [-2]}, [])),
    "get_no_sizes": (lambda c: c.get(b"k"), (0, {}, [])),
    "get_short_frame": (lambda c: c.get(b"k"), (0, {"sizes": [5], "counts": [1]}, [b"abc"])),
    "get_long_frame": (lambda c: c.get_into(b"k", bytearray(9)),
                       (0, {"sizes": [5], "counts": [1]}, [b"abcdefg"])),
    "get_no_frame": (lambda c: c.get(b"k"), (0, {"sizes": [5], "counts": [1]}, [])),
    "get_miss_with_frame": (lambda c: c.get(b"k"), (0, {"sizes": [-1], "counts": [1]}, [b"x"])),
    "get_bad_size": (lambda c: c.get(b"k"), (0, {"sizes": ["5"], "counts": [1]}, [b"abcde"])),
    "get_two_sizes": (lambda c: c.get(b"k"), (0, {"sizes": [1, 1], "counts": [2]}, [b"ab"])),
    "get_runs": (lambda c: c.get(b"k"), (0, {"sizes": [5], "counts": [1, 0]}, [b"ab", b"cde"])),
    "get_runs_into": (lambda c: c.get_into(b"k", bytearray(5)),
                      (0, {"sizes": [5], "counts": [1, 0]}, [b"ab", b"cde"])),
    "get_no_counts": (lambda c: c.get(b"k"), (0, {"sizes": [3]}, [b"abc"])),
    "get_miss": (lambda c: c.get(b"k"), (0, {"sizes": [-1], "counts": []}, [])),
    "get_miss_no_counts": (lambda c: c.get_into(b"k", bytearray(3)), (0, {"sizes": [-1]}, [])),
    "exists_refused": (lambda c: c.exists(b"k"), (Status.UNAUTHORIZED, {"error": "x"}, [])),
    "exists_no_found": (lambda c: c.exists(b"k"), (0, {}, [])),
}


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_crafted_replies_equal_the_general_path(client, case):
    fn, reply = REPLIES[case]
    sent_lean = _fake(client, [reply])
    lean = _outcome(lambda: fn(client))
    sent_slow = _fake(client, [reply])
    _slow(client)
    slow = _outcome(lambda: fn(client))
    del client._lean
    del client._chan.request
    vars(client._chan).pop("call1", None)
    assert lean == slow
    assert sent_lean == sent_slow           # the same request went
    assert client.exists(b"k") in (True, False)


def test_stale_epoch_says_hello_and_sends_again(client):
    hellos: list[int] = []

    def hello() -> None:
        hellos.append(1)
        client._session.need_hello = False

    client._hello_locked = hello  # type: ignore[method-assign]
    for lean in (True, False):
        if not lean:
            _slow(client)
        hellos.clear()
        sent = _fake(client, [(Status.STALE_EPOCH, {}, []), (0, {"st": [0]}, [])])
        client.put(b"k", b"v")
        assert [op for op, _ in sent] == [Op.PUT, Op.PUT] and hellos == [1]
        sent = _fake(client, [(Status.STALE_EPOCH, {}, [])] * 3)
        with pytest.raises(ServerUnavailable, match="keeps forgetting"):
            client.exists(b"k")
        assert len(sent) == 3 and hellos == [1, 1, 1, 1]
    del client._lean, client._hello_locked, client._chan.request
    vars(client._chan).pop("call1", None)


def test_piggybacked_ids_ride_and_are_requeued_on_failure(client):
    s = client._session
    s.releases.append(123456)
    sent = _fake(client, [(0, {"found": [False]}, [])])
    assert client.exists(b"k") is False
    assert sent[0][1]["release"] == [123456] and s.releases == []
    # a request that fails (the socket gives up) puts them back and asks for HELLO
    s.releases.append(777)

    def fail(*a: Any, **kw: Any) -> Any:
        raise ServerUnavailable("gone")

    client._chan.request = fail  # type: ignore[method-assign]
    with pytest.raises(ServerUnavailable):
        client.put(b"k", b"v")
    assert s.releases == [777] and s.need_hello
    del client._chan.request
    vars(client._chan).pop("call1", None)
    s.releases.clear()
    client.put(b"k", b"again")              # HELLO first, then the put
    assert client.get(b"k") == b"again"


def test_closed_and_forked_clients(server):
    c = Client(server.address, transport="tcp", timeout=5)
    c.close()
    with pytest.raises(KvshmError, match="closed"):
        c.put(b"k", b"v")
    with pytest.raises(KvshmError, match="closed"):
        c.get(b"k")
    c2 = Client(server.address, transport="tcp", timeout=5)
    try:
        c2._session.pid = -1                # as in a forked child
        with pytest.raises(KvshmError, match="fork"):
            c2.exists(b"k")
        with pytest.raises(KvshmError, match="fork"):
            c2.put(b"k", b"v")
    finally:
        c2._session.pid = os.getpid()
        c2.close()


def test_timeout_then_recovery(server):
    srv = ServerProcess(prealloc_size=1 / 32)
    try:
        with Client(srv.address, transport="tcp", timeout=0.5) as c:
            c.put(b"k", b"v")
            os.kill(srv.pid, signal.SIGSTOP)
            try:
                with pytest.raises(ServerUnavailable, match="within 0.5 s"):
                    c.get(b"k")
                assert c._session.need_hello and c._chan.timeouts == 1
            finally:
                os.kill(srv.pid, signal.SIGCONT)
            c._chan.timeout = 5
            assert c.get(b"k") == b"v"     # a fresh socket, HELLO again
    finally:
        srv.stop()


def test_server_restart_on_same_port():
    s1 = ServerProcess(prealloc_size=1 / 32)
    port = s1.port
    try:
        with Client(s1.address, transport="tcp", timeout=3) as c:
            c.put(b"a", b"1")
            epoch = c._session.epoch
            s1.stop()
            s2 = ServerProcess(service_port=port, prealloc_size=1 / 32)
            try:
                for _ in range(3):          # the first may see the disconnect
                    try:
                        assert c.exists(b"a") is False
                        break
                    except ServerUnavailable:
                        continue
                else:
                    pytest.fail("did not recover after the restart")
                assert c._session.epoch != epoch
                c.put(b"b", b"2")
                assert c.get(b"b") == b"2"
            finally:
                s2.stop()
    finally:
        if s1.alive():
            s1.stop()


def test_channel_without_zmqc(server, monkeypatch):
    """pyzmq's compiled layer carries the same messages when _zmqc is absent."""
    monkeypatch.setattr(chmod, "ZMTP", False)      # (libzmq carries it, through pyzmq)
    monkeypatch.setattr(chmod, "send_message", chmod._send_pyzmq)
    monkeypatch.setattr(chmod, "recv_message", chmod._recv_pyzmq)
    monkeypatch.setattr(chmod, "_zmqc", None)
    with Client(server.address, transport="tcp", timeout=5) as c:
        big = np.random.default_rng(1).integers(0, 255, 1 << 20, dtype=np.uint8)
        for v in (b"", b"small", big):
            c.put(b"nz", v)
            assert c.get(b"nz") == bytes(memoryview(v))
            out = bytearray(len(v) + 1)
            assert c.get_into(b"nz", out) == len(v)
            assert out[:len(v)] == bytes(memoryview(v))
        c.put_batch([b"b1", b"b2"], [b"1", big])
        assert c.get_batch([b"b1", b"b2", b"b3"]) == [b"1", big.tobytes(), None]
        assert c.exists_batch([b"b1", b"b3"]) == [True, False]
        with pytest.raises(KeyNotFound):
            c.get(b"b3")
    # sends without a wait and drain (write-behind PLACE/RESERVE and their replies)
    with Client(server.address, transport="shm", timeout=5, write_behind=True) as w:
        for i in range(40):
            w.put(f"wb{i}", bytes([i]) * 1000)
        w.flush()
        assert w.get_batch([f"wb{i}" for i in range(40)]) == [bytes([i]) * 1000
                                                               for i in range(40)]


def test_recv_slices_and_send_failures(server):
    """A wait longer than one slice still gets its reply; a frame that cannot be sent
    resets the socket (no half-sent message) and the next call works."""
    with Client(server.address, transport="tcp", timeout=5) as c:
        chan = c._chan
        assert chan._sock is not None
        if not chan.zmtp:           # (the ZMTP transport waits with poll(2), no RCVTIMEO)
            assert chan._sock.getsockopt(zmq.RCVTIMEO) == chan._slice_ms
        with pytest.raises(TypeError):
            chan.request(Op.PUT, {"keys": [b"k"], "sizes": [1], "counts": [1]}, [object()],
                         req_id=c._session.new_id(), epoch=c._session.epoch)
        assert chan._sock is None
        c._session.need_hello = True
        c.put(b"k", b"v")
        assert c.get(b"k") == b"v"


def test_lean_path_after_idle_flush_and_others(server):
    """A client of another transport on the same server keeps the general path (shm)."""
    with Client(server.address, transport="shm", timeout=5) as c:
        assert c._lean() is None
        c.put(b"shm-k", b"v")
        assert c.get(b"shm-k") == b"v"
    with Client(server.address, transport="tcp", timeout=5) as t:
        assert t._lean() is t._session
        assert t.get(b"shm-k") == b"v"
