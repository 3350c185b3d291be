"""get_batch_into over TCP with the reply's values received straight into the caller's
buffers (kvshm.zmq_ctrl._zmtp Conn.recv's ``into``, Channel.request's ``into``;
``KVSHM_ZMTP_INTO=0`` / channel.INTO off): the same sizes and the same bytes in every
buffer as with the switch off and as on libzmq (KVSHM_ZMTP=0); misses, short and odd
buffers, values in several block runs; against fake peers: a server that dies or stalls
mid-reply (an error, never a success; no byte lands after the call), layouts that do
not match the sizes, a stray reply first."""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from typing import Any

import numpy as np
import pytest

import kvshm.zmq_ctrl.channel as chmod
from kvshm.client import Client
from kvshm.errors import ServerUnavailable
from kvshm.zmq_ctrl import _zmtp
from kvshm.zmq_ctrl import frames as F
from kvshm.zmq_ctrl.protocol import Op, decode_request, encode_reply

sys.path.insert(0, os.path.dirname(__file__))
from servers import ServerProcess  # noqa: E402
from test_zmtp import FakeServer, _accept, _channel, _frames, _read_message  # noqa: E402

pytestmark = pytest.mark.skipif(_zmtp is None, reason="_zmtp not built")

MODES = [("zmtp", True), ("zmtp", False), ("libzmq", False)]


@pytest.fixture(scope="module")
def server() -> Any:
    srv = ServerProcess(prealloc_size=1 / 8)
    yield srv
    srv.stop()


@pytest.fixture
def spy(monkeypatch) -> list[bool]:
    """What each GET-into reply's frames were: True placed, False received as usual."""
    seen: list[bool] = []
    real = F.placed

    def placed(frames, counts, sizes):
        r = real(frames, counts, sizes)
        seen.append(r)
        return r
    monkeypatch.setattr(F, "placed", placed)
    return seen


def _mode(monkeypatch, transport: str, into: bool) -> None:
    monkeypatch.setattr(chmod, "ZMTP", transport == "zmtp")
    monkeypatch.setattr(chmod, "INTO", into)


def _outs(sizes: list[int], extra: int = 5) -> list[Any]:
    """Buffers of several kinds, each ``extra`` bytes longer than its value, filled with
    a pattern (bytes past the value must keep it)."""
    outs: list[Any] = []
    for i, n in enumerate(sizes):
        kind = i % 3
        if kind == 0:
            o: Any = np.full(max(n, 0) + extra, 0xA5, np.uint8)
        elif kind == 1:
            o = bytearray(b"\xa5" * (max(n, 0) + extra))
        else:
            o = memoryview(bytearray(b"\xa5" * (max(n, 0) + extra)))
        outs.append(o)
    return outs


def _bytes_of(outs: list[Any]) -> list[bytes]:
    return [bytes(memoryview(o).cast("B")) if isinstance(o, np.ndarray) else bytes(o)
            for o in outs]


def _run_mode(server, monkeypatch, transport: str, into: bool, tag: str,
              values: dict[bytes, bytes], ask: list[bytes]) -> tuple[Any, list[bytes]]:
    _mode(monkeypatch, transport, into)
    with Client(server.address, transport="tcp", timeout=10) as c:
        assert c._chan.zmtp is (transport == "zmtp")
        c.put_batch([tag.encode() + k for k in values], list(values.values()))
        sizes = [len(values.get(k, b"")) for k in ask]
        outs = _outs(sizes)
        got = c.get_batch_into([tag.encode() + k for k in ask], outs)
        return got, _bytes_of(outs)


def test_values_and_misses_equal_in_every_mode(server, monkeypatch, spy):
    rng = np.random.default_rng(3)
    lens = [0, 1, 255, 256, 4096, 65535, 65536, 70000, 262143, 262144, 300_000, 1 << 20,
            (1 << 20) + 7, 3 << 20]
    values = {b"v%d" % n: rng.integers(0, 255, n, dtype=np.uint8).tobytes() for n in lens}
    ask = list(values)[::-1] + [b"missing", b"v1", b"v65536", b"nope"] + list(values)
    results = {}
    for transport, into in MODES:
        spy.clear()
        results[transport, into] = _run_mode(server, monkeypatch, transport, into,
                                             f"{transport}{into}", values, ask)
        assert spy == [into], (transport, into, spy)    # placed exactly when on
    want_sizes = [len(values[k]) if k in values else -1 for k in ask]
    for k, r in results.items():
        assert r[0] == want_sizes, k
        for key, b in zip(ask, r[1]):
            v = values.get(key, b"")
            assert b[:len(v)] == v and set(b[len(v):]) == {0xA5}, (k, key)
    assert results[("zmtp", True)] == results[("zmtp", False)] == results[("libzmq", False)]


def test_many_small_values_and_all_misses(server, monkeypatch, spy):
    values = {b"s%d" % i: bytes([i % 251]) * (i % 700) for i in range(3000)}
    ask = [b"s%d" % i for i in range(0, 3000, 3)] + [b"x%d" % i for i in range(50)]
    results = [_run_mode(server, monkeypatch, t, i, f"m{t}{i}", values, ask)
               for t, i in MODES]
    assert results[0] == results[1] == results[2]
    assert results[0][0][-50:] == [-1] * 50
    # only misses: no payload, nothing placed, all -1
    spy.clear()
    r = _run_mode(server, monkeypatch, "zmtp", True, "none", {}, [b"a", b"b"])
    assert r[0] == [-1, -1] and spy == [False]


def test_short_readonly_and_odd_buffers_fail_alike(server, monkeypatch, spy):
    v = bytes(range(256)) * 1024            # 256 KiB
    errors = {}
    for transport, into in MODES:
        _mode(monkeypatch, transport, into)
        with Client(server.address, transport="tcp", timeout=10) as c:
            c.put_batch([b"a", b"b"], [v, v])
            got = []
            for outs in ([bytearray(len(v)), bytearray(len(v) - 1)],      # short
                         [bytearray(len(v)), bytes(len(v))],              # read-only
                         [bytearray(len(v)), np.zeros(2 * len(v), np.uint8)[::2]]):
                try:
                    got.append(c.get_batch_into([b"a", b"b"], outs))
                except Exception as exc:
                    got.append((type(exc).__name__, str(exc)))
                got.append(bytes(outs[0][:10]))
            # a 2-D array and a uint32 array: byte views of the right size
            outs2 = [np.zeros((512, 512), np.uint8), np.zeros(len(v) // 4, np.uint32)]
            got.append(c.get_batch_into([b"a", b"b"], outs2))
            got.append([o.tobytes() == v for o in outs2])
        errors[transport, into] = got
    assert errors[("zmtp", True)] == errors[("zmtp", False)] == errors[("libzmq", False)]
    assert errors[("zmtp", True)][-2:] == [[len(v)] * 2, [True, True]]


def test_a_value_over_several_block_runs(monkeypatch, spy):
    """Free space scattered (every other 64 KiB block freed): a 640 KiB value is laid
    over several runs and sent as one frame per run (counts of 0 after a 1)."""
    srv = ServerProcess(prealloc_size=1 / 64)
    try:
        seen_counts: list[list[int]] = []
        real = F.placed

        def placed(frames, counts, sizes):
            seen_counts.append(list(counts))
            return real(frames, counts, sizes)
        rng = np.random.default_rng(5)
        big = rng.integers(0, 255, 640 << 10, dtype=np.uint8).tobytes()
        results = []
        for n, (transport, into) in enumerate(MODES):
            _mode(monkeypatch, transport, into)
            monkeypatch.setattr(F, "placed", placed)
            with Client(srv.address, transport="tcp", timeout=10) as c:
                fill = [b"f%d-%d" % (n, i) for i in range(250)]
                c.put_batch(fill, [bytes([i]) * (60 << 10) for i in range(250)])
                c.delete(fill[::2])
                c.put_batch([b"big%d" % n, b"small%d" % n], [big, b"tiny"])
                outs = [bytearray(len(big) + 3), np.zeros(10, np.uint8),
                        bytearray(61 << 10)]
                got = c.get_batch_into([b"big%d" % n, b"small%d" % n, fill[1]], outs)
                results.append((got, _bytes_of(outs)))
                c.delete(fill[1::2] + [b"big%d" % n, b"small%d" % n])
        assert results[0] == results[1] == results[2]
        assert results[0][0] == [len(big), 4, 60 << 10]
        assert results[0][1][0][:len(big)] == big
        # the server did split the value (else this test tests nothing)
        assert any(0 in cs for cs in seen_counts), seen_counts
    finally:
        srv.stop()


# ------------------------------------------------------------------ fake servers


def _get_reply(s: socket.socket, sizes: list[int], counts: list[int],
               payload: list[bytes]) -> int:
    msg = _read_message(s)
    _, _, rid, _, _ = decode_request(msg[0])
    s.sendall(_frames([encode_reply(0, rid, {"sizes": sizes, "counts": counts}),
                       *payload]))
    return rid


def test_channel_places_frames_and_the_switch_turns_it_off(monkeypatch):
    a, b = bytes(range(256)) * 1200, b"\x07" * 70_000

    def script(s: socket.socket) -> None:
        _accept(s)
        for _ in range(2):
            _get_reply(s, [len(a), -1, len(b)], [1, 1], [a, b])
        time.sleep(0.3)

    fake = FakeServer(script)
    ch = _channel(fake, timeout=5)
    try:
        for on in (True, False):
            monkeypatch.setattr(chmod, "INTO", on)
            outs = [bytearray(len(a) + 1), None, np.zeros(len(b), np.uint8)]
            _, st, body, frames = ch.request(Op.GET, {"keys": [b"a", b"x", b"b"]},
                                             into=F.into(outs))
            if on:
                assert frames == [len(a), len(b)]
                assert F.placed(frames, body["counts"], body["sizes"])
                assert bytes(outs[0][:len(a)]) == a and outs[2].tobytes() == b
                assert outs[0][-1] == 0
            else:
                assert frames == [a, b] and not F.placed(frames, [1, 1], body["sizes"])
                assert outs[0] == bytearray(len(a) + 1)
            outs[0].extend(b"x")        # no buffer is still held (BufferError if so)
    finally:
        ch.close()
        fake.close()


def test_a_server_that_dies_mid_reply(monkeypatch):
    """Half the first value, then the server closes: ServerUnavailable (no success, no
    hang past the timeout), the connection dropped, the buffers released."""
    monkeypatch.setattr(chmod, "INTO", True)
    v = b"\x01" * (1 << 20)

    def script(s: socket.socket) -> None:
        _accept(s)
        msg = _read_message(s)
        _, _, rid, _, _ = decode_request(msg[0])
        data = _frames([encode_reply(0, rid, {"sizes": [len(v), len(v)],
                                              "counts": [1, 1]}), v, v])
        s.sendall(data[:len(data) // 3])
        time.sleep(0.1)
        s.close()

    fake = FakeServer(script)
    ch = _channel(fake, timeout=1.0)
    ch.bound_replies(64 << 20)      # (as after a HELLO: a 1 MiB value is within it)
    outs = [bytearray(len(v)), bytearray(len(v))]
    try:
        t = time.monotonic()
        with pytest.raises(ServerUnavailable):
            ch.request(Op.GET, {"keys": [b"a", b"b"]}, into=F.into(outs))
        assert time.monotonic() - t < 10
        assert ch._sock is None
        assert outs[1] == bytearray(len(v))         # nothing of the second value
        for o in outs:
            o.extend(b"x")                          # released
    finally:
        ch.close()
        fake.close()


def test_a_reply_that_stalls_past_the_deadline_lands_nothing_later(monkeypatch):
    """Header and a part of the value, then a stall until the call gave up (its
    timeout), then the rest: the call raised and closed the connection, so the late
    bytes never reach the caller's buffer (which it may reuse at once)."""
    import threading

    monkeypatch.setattr(chmod, "INTO", True)
    v = b"\x02" * (1 << 20)
    gave_up = threading.Event()
    sent_rest: list[bool] = []

    def script(s: socket.socket) -> None:
        _accept(s)
        msg = _read_message(s)
        _, _, rid, _, _ = decode_request(msg[0])
        data = _frames([encode_reply(0, rid, {"sizes": [len(v)], "counts": [1]}), v])
        s.sendall(data[:300_000])
        gave_up.wait(30)
        try:
            s.sendall(data[300_000:])
            sent_rest.append(True)
        except OSError:
            sent_rest.append(False)

    fake = FakeServer(script)
    ch = _channel(fake, timeout=0.5)
    ch.bound_replies(64 << 20)      # (as after a HELLO: a 1 MiB value is within it)
    out = bytearray(len(v))
    try:
        with pytest.raises(ServerUnavailable):
            ch.request(Op.GET, {"keys": [b"a"]}, into=F.into([out]))
        assert ch._sock is None
        got_then = bytes(out)
        assert got_then.count(2) < len(v)
        out.extend(b"x")                            # released
        gave_up.set()
        fake.th.join(10)
        time.sleep(0.2)
        assert bytes(out[:len(v)]) == got_then      # no late byte landed
    finally:
        gave_up.set()
        ch.close()
        fake.close()


def test_layouts_that_do_not_match_the_sizes(monkeypatch):
    """A hostile reply: frames larger than the sizes, frames that do not add up to them,
    counts that do not fit: no frame is placed unless its length is the one the layout
    gives it (checked before its first byte is written: debt23 item 6; before, a frame
    shorter than the rest of the sizes was placed, and the buffers written, before
    placed() refused the reply). placed() or unpack() says FrameLayoutError, and
    through the client a ProtocolError."""
    monkeypatch.setattr(chmod, "INTO", True)

    def script(s: socket.socket) -> None:
        _accept(s)
        _get_reply(s, [10, 10], [1, 1], [b"A" * 30, b"B" * 5])       # too long, then short
        _get_reply(s, [10, 10], [2], [b"C" * 5, b"D" * 15])          # 2 frames, 1 count
        _get_reply(s, [10, 10], [1, 1], [b"E" * 10])                 # one frame short
        _get_reply(s, [10, 10], [1, 1], [b"F" * 10, b"G" * 7])       # the second short
        time.sleep(0.3)

    fake = FakeServer(script)
    ch = _channel(fake, timeout=5)
    try:
        outs = [bytearray(b"\xa5" * 12), bytearray(b"\xa5" * 12)]
        _, _, body, frames = ch.request(Op.GET, {"keys": [b"a", b"b"]}, into=F.into(outs))
        assert frames == [b"A" * 30, b"B" * 5]          # neither placed
        with pytest.raises(F.FrameLayoutError):
            F.unpack(frames, body["counts"], body["sizes"])
        assert outs == [b"\xa5" * 12, b"\xa5" * 12]
        _, _, body, frames = ch.request(Op.GET, {"keys": [b"a", b"b"]}, into=F.into(outs))
        assert frames == [b"C" * 5, b"D" * 15]
        with pytest.raises(F.FrameLayoutError):
            F.unpack(frames, body["counts"], body["sizes"])
        assert outs == [b"\xa5" * 12, b"\xa5" * 12]
        _, _, body, frames = ch.request(Op.GET, {"keys": [b"a", b"b"]}, into=F.into(outs))
        assert frames == [10]                           # (where its layout has it)
        with pytest.raises(F.FrameLayoutError):
            F.placed(frames, body["counts"], body["sizes"])
        assert outs == [b"E" * 10 + b"\xa5" * 2, b"\xa5" * 12]
        outs = [bytearray(b"\xa5" * 12), bytearray(b"\xa5" * 12)]
        _, _, body, frames = ch.request(Op.GET, {"keys": [b"a", b"b"]}, into=F.into(outs))
        assert frames == [10, b"G" * 7]                 # the first fits, the second not
        with pytest.raises(F.FrameLayoutError):
            F.placed(frames, body["counts"], body["sizes"])
        assert outs == [b"F" * 10 + b"\xa5" * 2, b"\xa5" * 12]
    finally:
        ch.close()
        fake.close()


def test_a_stray_reply_first_is_not_placed(monkeypatch):
    monkeypatch.setattr(chmod, "INTO", True)
    a = b"\x03" * 200_000

    def script(s: socket.socket) -> None:
        _accept(s)
        msg = _read_message(s)
        _, _, rid, _, _ = decode_request(msg[0])
        s.sendall(_frames([encode_reply(0, rid + 7, {"sizes": [len(a)], "counts": [1]}),
                           b"\x09" * len(a)])
                  + _frames([encode_reply(0, rid, {"sizes": [len(a)], "counts": [1]}), a]))
        time.sleep(0.3)

    fake = FakeServer(script)
    ch = _channel(fake, timeout=5)
    strays: list[int] = []
    ch.on_stray = lambda rid, st, body: strays.append(rid)
    try:
        out = bytearray(len(a))
        rid, _, _, frames = ch.request(Op.GET, {"keys": [b"a"]}, into=F.into([out]))
        assert frames == [len(a)] and bytes(out) == a and strays == [rid + 7]
    finally:
        ch.close()
        fake.close()


def test_conn_into_declines_unusual_plans():
    """Conn.recv's into: a plan it cannot take (a read-only buffer, a size past its
    buffer, a size that is not an int) places nothing; the message is as without it."""
    for plan in (([bytes(8)], [4]), ([bytearray(2)], [4]), ([bytearray(8)], ["4"]),
                 ([bytearray(8)], [1 << 70]), ([bytearray(8)], [4, 4])):
        a, b = socket.socketpair()
        try:
            zt = _zmtp.Conn(a.detach())
            b.sendall(_frames([b"hdr", b"abcd"]))
            msg = zt.recv(1000, lambda h, p=plan: p)
            assert msg == [b"hdr", b"abcd"], plan
            assert not zt.end_into()
            zt.close()
        finally:
            b.close()
    # and one it takes: the frame comes back as its length
    a, b = socket.socketpair()
    try:
        zt = _zmtp.Conn(a.detach())
        out = bytearray(6)
        b.sendall(_frames([b"hdr", b"abcd"]))
        assert zt.recv(1000, lambda h: ([None, out], [-1, 4])) == [b"hdr", 4]
        assert out == bytearray(b"abcd\x00\x00")
        # a message whose payload is not whole: end_into closes the connection
        b.sendall(_frames([b"hdr", b"abcd"])[:-2])
        assert zt.recv(50, lambda h: ([out], [4])) is None
        assert zt.end_into() and zt.closed
        out.extend(b"x")
    finally:
        b.close()


class _NoBuffer:
    """An output without the buffer protocol (as a torch tensor): a view makes one."""

    def __init__(self, n: int) -> None:
        self.arr = np.zeros(n, np.uint8)


def test_conn_into_takes_a_view_of_an_output_without_the_buffer_protocol():
    for with_view in (False, True):
        a, b = socket.socketpair()
        try:
            zt = _zmtp.Conn(a.detach())
            out = _NoBuffer(6)
            b.sendall(_frames([b"hdr", b"abcd"]))
            plan = ([out], [4], (lambda o: memoryview(o.arr)) if with_view else None)
            msg = zt.recv(1000, lambda h: plan)
            if with_view:
                assert msg == [b"hdr", 4] and out.arr.tobytes() == b"abcd\x00\x00"
            else:
                assert msg == [b"hdr", b"abcd"] and not out.arr.any()
            # a view that raises: nothing placed
            b.sendall(_frames([b"hdr", b"efgh"]))
            msg = zt.recv(1000, lambda h: ([out], [4], lambda o: 1 / 0))
            assert msg == [b"hdr", b"efgh"]
            zt.close()
        finally:
            b.close()


def test_into_plans_only_a_plain_ok_reply():
    outs = [bytearray(4), bytearray(4)]
    plan = F.into(outs)
    assert plan(0, {"sizes": [4, -1], "counts": [1]}) == (outs, [4, -1], None, [1])
    assert plan(0, {"sizes": [4, -1]}) is None                 # no counts: no layout
    assert plan(1, {"sizes": [4, -1]}) is None                 # not OK
    assert plan(0, {"sizes": [4, -2]}) is None                 # refused: QuotaExceeded
    assert plan(0, {"sizes": [4]}) is None                     # not one per key
    assert plan(0, {"sizes": (4, 4)}) is None and plan(0, {}) is None
    assert not F.placed([b"ab"], [1], [2]) and not F.placed([], [], [-1, -1])
    assert F.placed([3, 1], [1, 0], [4, -1])                   # one value, two runs
    for frames, counts, sizes in (([3, 2], [1, 0], [4]), ([4], [1, 0], [4]),
                                  ([2, 2], [2, 0], [2, 2]), ([4, b"x"], [1, 1], [4, 1]),
                                  ([4], [0], [4]), ([4], ["1"], [4])):
        with pytest.raises(F.FrameLayoutError):
            F.placed(frames, counts, sizes)
