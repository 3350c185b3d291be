"""The client's own ZMTP 3.x transport (kvshm.zmq_ctrl._zmtp, Channel on tcp/ipc):
the same results as libzmq against a real server, its failure paths against a real
server and against fake (hostile) peers written here from the ZMTP 3.0/3.1 spec."""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

import kvshm.zmq_ctrl.channel as chmod
from kvshm.client import Client
from kvshm.errors import (AuthenticationFailed, KeyNotFound, KvshmError, ProtocolError,
                          ServerUnavailable)
from kvshm.zmq_ctrl import _zmtp
from kvshm.zmq_ctrl.channel import NOT_SENT, Channel
from kvshm.zmq_ctrl.protocol import Op, decode_request, encode_reply

sys.path.insert(0, os.path.dirname(__file__))
from servers import ServerProcess  # noqa: E402

pytestmark = pytest.mark.skipif(not chmod.ZMTP, reason="KVSHM_ZMTP=0 or _zmtp not built")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(prealloc_size=1 / 8)
    yield srv
    srv.stop()


def _ops(c: Client, tag: str) -> list[Any]:
    """The one-key and batch ops, each outcome (a value, or the error's class name)."""
    out: list[Any] = []
    rng = np.random.default_rng(7)
    sizes = (0, 1, 200, 255, 256, 4096, 65535, 65536, 300_000, 3 << 20)
    for n in sizes:
        v = rng.integers(0, 255, n, dtype=np.uint8).tobytes()
        k = f"{tag}-{n}".encode()
        c.put(k, v)
        out.append(c.get(k) == v)
        buf = bytearray(n + 3)
        out.append(c.get_into(k, buf))
        out.append(bytes(buf[:n]) == v)
        out.append(c.exists(k))
        small = bytearray(max(0, n - 1))
        try:
            out.append(c.get_into(k, small) if n else "empty")
        except Exception as exc:    # (a buffer too small: the same error both ways)
            out.append(type(exc).__name__)
    long_key = (tag + "-L").encode().ljust(4000, b"L")   # (a header over 255 bytes)
    c.put(long_key, b"long")
    out.append(c.get(long_key))
    for f in (lambda: c.get(f"{tag}-missing".encode()),
              lambda: c.get_into(f"{tag}-missing".encode(), bytearray(4))):
        try:
            out.append(f())
        except KeyNotFound as exc:
            out.append(type(exc).__name__)
    out.append(c.exists(f"{tag}-missing".encode()))
    keys = [f"{tag}-b{i}".encode() for i in range(300)]
    vals = [bytes([i % 256]) * (i * 37 % 5000) for i in range(300)]
    c.put_batch(keys, vals)
    out.append(c.get_batch(keys + [f"{tag}-nob".encode()]) == vals + [None])
    out.append(c.exists_batch([keys[0], f"{tag}-nob".encode(), keys[-1]]))
    c.put(f"{tag}-sum".encode(), b"x" * 1000, checksum=True)
    out.append(c.get(f"{tag}-sum".encode(), verify=True) == b"x" * 1000)
    return out


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_ops_equal_with_zmtp_on_and_off(server, monkeypatch, transport):
    results = {}
    for on in (True, False):
        monkeypatch.setattr(chmod, "ZMTP", on)
        with Client(server.address, transport=transport, timeout=10) as c:
            assert c._chan.zmtp is on
            assert isinstance(c._chan._sock, _zmtp.Conn) is on
            results[on] = _ops(c, f"{transport}-{on}")
            if on and transport == "tcp":
                assert c._chan.fast > 0         # the one-key path read in C
    assert results[True] == results[False]


def test_curve_and_inproc_endpoints_stay_on_libzmq(monkeypatch):
    monkeypatch.setattr(chmod, "ZMTP", True)
    assert Channel("tcp://127.0.0.1:1", 1).zmtp
    assert Channel("ipc:///tmp/x", 1).zmtp
    assert not Channel("inproc://x", 1).zmtp
    assert not Channel("tcp://127.0.0.1:1", 1, socket_setup=lambda s: None).zmtp
    monkeypatch.setattr(chmod, "ZMTP", False)
    assert not Channel("tcp://127.0.0.1:1", 1).zmtp


def test_restart_between_calls_and_killed_mid_request(monkeypatch):
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    srv = ServerProcess(service_port=port, prealloc_size=1 / 64)
    srv2 = None
    try:
        with Client(srv.address, transport="tcp", timeout=3) as c:
            c.put(b"k", b"v1")
            rid = c._chan.routing_id
            srv.stop()
            srv2 = ServerProcess(service_port=port, prealloc_size=1 / 64,
                                 shm_name=srv.shm_name + "-b")
            # the next call reconnects; the session logic says HELLO to the new server
            with pytest.raises(KeyNotFound):
                c.get(b"k")
            assert c._chan.routing_id != rid    # (a new HELLO: a new "socket")
            c.put(b"k", b"v2")
            assert c.get(b"k") == b"v2"
            # killed while the request is queued there: ServerUnavailable, no hang
            os.kill(srv2.pid, signal.SIGSTOP)
            err: list[BaseException] = []

            def call() -> None:
                try:
                    c.get(b"k")
                except BaseException as exc:
                    err.append(exc)

            th = threading.Thread(target=call)
            th.start()
            time.sleep(0.3)
            srv2.kill()
            th.join(20)
            assert not th.is_alive() and len(err) == 1
            assert isinstance(err[0], ServerUnavailable), err
    finally:
        srv.kill()
        if srv2 is not None:
            srv2.kill()
            srv2.remove_segment()


def test_server_down_at_first_call_times_out():
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    ch = Channel(f"tcp://127.0.0.1:{port}", 0.5)
    with pytest.raises(ServerUnavailable, match="within 0.5 s"):
        ch.request(Op.EXISTS, {"keys": [b"k"]})


def test_a_forked_child_makes_its_own_connection(server):
    with Client(server.address, transport="tcp", timeout=5) as c:
        c.put(b"fk", b"parent")
        chan = c._chan
        fd = chan._sock.fileno()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                            # the child
            code = 1
            try:
                os.close(r)
                try:
                    c.get(b"fk")                # a client of the parent's: refused
                except KvshmError:
                    pass
                rid_before = chan.routing_id
                # the channel itself never uses the parent's connection
                _, st, body, _ = chan.request(Op.EXISTS, {"keys": [b"fk"]})
                assert chan._sock.fileno() != fd or chan.routing_id != rid_before
                assert chan.routing_id != rid_before
                with Client(server.address, transport="tcp", timeout=5) as c2:
                    assert c2.get(b"fk") == b"parent"
                    c2.put(b"fk2", b"child")
                code = 0
            finally:
                os.write(w, bytes([code]))
                os._exit(code)
        os.close(w)
        assert os.read(r, 1) == b"\x00"
        os.close(r)
        assert os.waitpid(pid, 0)[1] == 0
        # the parent's connection is as it was
        assert chan._sock.fileno() == fd
        assert c.get(b"fk2") == b"child" and c.get(b"fk") == b"parent"


# ----------------------------------------------------------------- fake ZMTP peers

def _greeting(mechanism: bytes = b"NULL") -> bytes:
    return (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + mechanism.ljust(20, b"\x00")
            + b"\x01" + b"\x00" * 31)


def _command(name: bytes, body: bytes) -> bytes:
    data = bytes([len(name)]) + name + body
    if len(data) <= 255:
        return bytes([0x04, len(data)]) + data
    return b"\x06" + struct.pack(">Q", len(data)) + data


def _ready(socket_type: bytes = b"ROUTER") -> bytes:
    name = b"Socket-Type"
    return _command(b"READY", bytes([len(name)]) + name + struct.pack(">I", len(socket_type))
                    + socket_type)


def _frames(parts: list[bytes]) -> bytes:
    out = b""
    for i, p in enumerate(parts):
        more = 1 if i < len(parts) - 1 else 0
        if len(p) <= 255:
            out += bytes([more, len(p)]) + p
        else:
            out += bytes([more | 2]) + struct.pack(">Q", len(p)) + p
    return out


def _read_exact(s: socket.socket, n: int) -> bytes:
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError
        b += c
    return b


def _read_frame(s: socket.socket) -> tuple[int, bytes]:
    fl = _read_exact(s, 1)[0]
    n = struct.unpack(">Q", _read_exact(s, 8))[0] if fl & 2 else _read_exact(s, 1)[0]
    return fl, _read_exact(s, n)


def _read_message(s: socket.socket) -> list[bytes]:
    parts = []
    while True:
        fl, body = _read_frame(s)
        parts.append(body)
        if not fl & 1:
            return parts


def _accept(s: socket.socket) -> dict[bytes, bytes]:
    """The server's side of the handshake; returns the client's READY properties."""
    s.sendall(_greeting())
    g = _read_exact(s, 64)
    assert g[0] == 0xFF and g[9] == 0x7F and g[10] == 3 and g[12:16] == b"NULL"
    fl, body = _read_frame(s)
    assert fl & 4 and body[1:6] == b"READY"
    s.sendall(_ready())
    return _zmtp._parse_props(body[6:])


class FakeServer:
    """A TCP listener whose first connection runs ``script(sock)`` in a thread."""

    def __init__(self, script: Callable[[socket.socket], None]) -> None:
        self.lst = socket.socket()
        self.lst.bind(("127.0.0.1", 0))
        self.lst.listen(4)
        self.endpoint = f"tcp://127.0.0.1:{self.lst.getsockname()[1]}"
        self.error: BaseException | None = None
        self.conns: list[socket.socket] = []
        self.th = threading.Thread(target=self._run, args=(script,), daemon=True)
        self.th.start()

    def _run(self, script: Callable[[socket.socket], None]) -> None:
        try:
            s, _ = self.lst.accept()
            self.conns.append(s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            script(s)
        except (EOFError, ConnectionError, OSError):
            pass
        except BaseException as exc:
            self.error = exc

    def close(self) -> None:
        self.th.join(10)
        for s in self.conns:
            s.close()
        self.lst.close()
        assert not self.th.is_alive()
        if self.error is not None:
            raise self.error


def _reply_to(s: socket.socket, body: dict[str, Any] | None = None, extra: list[bytes] = []
              ) -> int:
    msg = _read_message(s)
    _, _, rid, _, _ = decode_request(msg[0])
    s.sendall(_frames([encode_reply(0, rid, body if body is not None else {"found": [True]}),
                       *extra]))
    return rid


def _channel(fake: FakeServer, timeout: float = 2.0) -> Channel:
    ch = Channel(fake.endpoint, timeout)
    assert ch.zmtp
    return ch


def test_handshake_carries_the_routing_id_and_dealer_type():
    got: dict[bytes, bytes] = {}

    def script(s: socket.socket) -> None:
        got.update(_accept(s))
        _reply_to(s)
        time.sleep(0.2)

    fake = FakeServer(script)
    ch = _channel(fake)
    try:
        _, st, body, _ = ch.request(Op.EXISTS, {"keys": [b"k"]})
        assert st == 0 and body == {"found": [True]}
        assert got[b"socket-type"] == b"DEALER" and got[b"identity"] == ch.routing_id
        assert len(ch.routing_id) == 16
    finally:
        ch.close()
        fake.close()


def test_a_reply_split_across_many_segments_and_a_ping():
    """Every byte of the reply in its own TCP segment (NODELAY, a pause between), a PING
    command before it: the PONG comes back with its context, the reply is whole."""
    pong: list[bytes] = []

    def script(s: socket.socket) -> None:
        _accept(s)
        for _ in range(2):
            msg = _read_message(s)
            _, _, rid, _, _ = decode_request(msg[0])
            s.sendall(_command(b"PING", b"\x00\x0aCTX"))
            fl, body = _read_frame(s)
            assert fl & 4
            pong.append(body)
            data = _frames([encode_reply(0, rid, {"sizes": [300], "counts": [1]}),
                            bytes(range(256)) + bytes(44)])
            for i in range(len(data)):
                s.send(data[i:i + 1])
                time.sleep(0.0005)
        time.sleep(0.2)

    fake = FakeServer(script)
    ch = _channel(fake, timeout=10)
    try:
        _, st, body, frames = ch.request(Op.GET, {"keys": [b"k"]})
        assert st == 0 and frames == [bytes(range(256)) + bytes(44)]
        out = bytearray(400)
        r = ch.call1(_zmtp.GET1_INTO, int(Op.GET), b"k", None, None, out, ch.new_id(), 0)
        assert r is not NOT_SENT
        assert r == 300 and bytes(out[:300]) == bytes(range(256)) + bytes(44)
        assert pong == [b"\x04PONGCTX"] * 2
    finally:
        ch.close()
        fake.close()


def _expect(script: Callable[[socket.socket], None], exc: type[BaseException],
            match: str, timeout: float = 2.0) -> float:
    fake = FakeServer(script)
    ch = _channel(fake, timeout)
    t = time.monotonic()
    try:
        with pytest.raises(exc, match=match):
            ch.request(Op.EXISTS, {"keys": [b"k"]})
        assert ch._sock is None     # (nothing of that connection is used again)
        return time.monotonic() - t
    finally:
        ch.close()
        fake.close()


def test_a_peer_that_is_not_zmtp():
    def script(s: socket.socket) -> None:
        s.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 64)
        time.sleep(0.5)
    _expect(script, ProtocolError, "not a ZeroMQ peer")


def test_a_zmtp_2_peer():
    def script(s: socket.socket) -> None:
        s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x01\x01" + b"\x00" * 52)
        time.sleep(0.5)
    _expect(script, ProtocolError, "ZMTP 1.1, not 3")


def test_a_curve_server_is_an_authentication_failure():
    def script(s: socket.socket) -> None:
        s.sendall(_greeting(b"CURVE"))
        time.sleep(0.5)
    _expect(script, AuthenticationFailed, "needs CURVE")


def test_an_error_command_in_the_handshake():
    def script(s: socket.socket) -> None:
        s.sendall(_greeting())
        _read_exact(s, 64)
        _read_frame(s)
        s.sendall(_command(b"ERROR", bytes([6]) + b"denied"))
        time.sleep(0.5)
    _expect(script, AuthenticationFailed, "denied")


def test_an_error_command_after_the_handshake():
    def script(s: socket.socket) -> None:
        _accept(s)
        _read_message(s)
        s.sendall(_command(b"ERROR", bytes([4]) + b"gone"))
        time.sleep(0.5)
    _expect(script, ServerUnavailable, "gone")


def test_an_unknown_command_and_bad_flags():
    def unknown(s: socket.socket) -> None:
        _accept(s)
        _read_message(s)
        s.sendall(_command(b"SUBSCRIBE", b"x"))
        time.sleep(0.5)
    _expect(unknown, ProtocolError, "unexpected ZMTP command")

    def flags(s: socket.socket) -> None:
        _accept(s)
        _read_message(s)
        s.sendall(b"\x10\x01x")
        time.sleep(0.5)
    _expect(flags, ProtocolError, "bad ZMTP frame flags")


def test_a_huge_frame_length_allocates_only_what_arrives():
    """A frame declared 1 MiB - 1 bytes long (within the bound of a channel before
    HELLO), 10 bytes sent, then the peer hangs: the wait ends at the deadline (no hang);
    memory for at most FIRST_ALLOC bytes. 2**62: past the bound, a ProtocolError at once
    (tests/test_clibound.py); 2**63: a ProtocolError at once."""
    import resource

    def huge(s: socket.socket) -> None:
        _accept(s)
        _read_message(s)
        s.sendall(b"\x02" + struct.pack(">Q", (1 << 20) - 1) + b"0123456789")
        time.sleep(1.5)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _expect(huge, ServerUnavailable, "within 1 s", timeout=1.0)
    grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grew_kib < 64 * 1024

    def past(s: socket.socket) -> None:
        _accept(s)
        _read_message(s)
        s.sendall(b"\x02" + struct.pack(">Q", 1 << 62) + b"0123456789")
        time.sleep(1.5)
    _expect(past, ProtocolError, "past this connection's bound")

    def too_huge(s: socket.socket) -> None:
        _accept(s)
        _read_message(s)
        s.sendall(b"\x02" + struct.pack(">Q", 1 << 63))
        time.sleep(0.5)
    _expect(too_huge, ProtocolError, "2\\*\\*63")

    def huge_command(s: socket.socket) -> None:
        _accept(s)
        _read_message(s)
        s.sendall(b"\x06" + struct.pack(">Q", 1 << 40))
        time.sleep(0.5)
    _expect(huge_command, ProtocolError, "command of")


def test_closed_mid_frame_and_before_the_reply():
    def mid(s: socket.socket) -> None:
        _accept(s)
        _read_message(s)
        s.sendall(b"\x00\x40" + b"half")
        s.close()
    # the close ends the wait at once (tests/test_zmtp_cut.py), not at the deadline
    t = _expect(mid, ServerUnavailable, "closed the connection before the reply", timeout=1.0)
    assert t < 10

    def before(s: socket.socket) -> None:
        _accept(s)
        s.close()
    _expect(before, ServerUnavailable, "within 1 s|cannot send|closed the connection",
            timeout=1.0)


def test_a_send_respects_the_deadline():
    """A peer that takes the handshake and then reads nothing: a 64 MiB request cannot
    be written whole; the send ends with ServerUnavailable at the deadline (libzmq's
    send would block once its queue is full)."""
    def script(s: socket.socket) -> None:
        _accept(s)
        time.sleep(3)

    fake = FakeServer(script)
    ch = _channel(fake, timeout=1.0)
    try:
        t = time.monotonic()
        with pytest.raises(ServerUnavailable, match="cannot send"):
            ch.request(Op.PUT, {"keys": [b"k"]}, [bytes(64 << 20)])
        assert time.monotonic() - t < 10
        assert ch._sock is None
    finally:
        ch.close()
        fake.close()


def test_a_stray_reply_before_the_own_and_many_frames():
    strays: list[int] = []

    def script(s: socket.socket) -> None:
        _accept(s)
        msg = _read_message(s)
        assert len(msg) == 1 + 3000 and msg[1:] == [bytes([i % 256]) * (i % 300)
                                                   for i in range(3000)]
        _, _, rid, _, _ = decode_request(msg[0])
        s.sendall(_frames([encode_reply(0, rid + 50, {"found": [False]})])
                  + _frames([encode_reply(0, rid, {"n": 3000})]
                            + [bytes([i % 256]) * (i % 300) for i in range(3000)]))
        time.sleep(0.3)

    fake = FakeServer(script)
    ch = _channel(fake, timeout=5)
    ch.on_stray = lambda rid, st, body: strays.append(rid)
    try:
        frames = [bytes([i % 256]) * (i % 300) for i in range(3000)]
        rid, st, body, got = ch.request(Op.PUT, {"keys": [b"k"]}, frames)
        assert body == {"n": 3000} and got == frames and strays == [rid + 50]
    finally:
        ch.close()
        fake.close()


def test_header_bytes_equal_the_libzmq_path():
    """What call1 puts on the wire is what _zmqc.call1 sends (and encode_request)."""
    from kvshm.zmq_ctrl import _zmqc
    from kvshm.zmq_ctrl.protocol import encode_request
    seen: list[list[bytes]] = []

    def script(s: socket.socket) -> None:
        _accept(s)
        for _ in range(3):
            seen.append(_read_message(s))
            _, _, rid, _, _ = decode_request(seen[-1][0])
            s.sendall(_frames([encode_reply(0, rid, {"st": [0]})]))
        time.sleep(0.2)

    fake = FakeServer(script)
    ch = _channel(fake, timeout=5)
    try:
        key = b"k" * 300
        ch.call1(_zmtp.PUT1, int(Op.PUT), key, b"v" * 1000, 12345, None, 7, 3)
        ch.call1(_zmtp.PUT1, int(Op.PUT), b"s", b"", None, None, 8, 3)
        ch.call1(_zmtp.EXISTS1, int(Op.EXISTS), key, None, None, None, 9, 3)
        assert seen[0] == [_zmqc.encode1(int(Op.PUT), 7, 3, key, 1000, 12345), b"v" * 1000]
        assert seen[1] == [_zmqc.encode1(int(Op.PUT), 8, 3, b"s", 0, None), b""]
        assert seen[2] == [encode_request(Op.EXISTS, 9, 3, {"keys": [key]})]
    finally:
        ch.close()
        fake.close()


def test_sends_made_while_the_server_is_down_go_first_once_it_is_up():
    """send() (a write-behind PLACE) while nothing listens is queued, as libzmq queues
    on a connecting socket; the next request's connection carries it first."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))                  # bound, not listening: refused
    ep = f"tcp://127.0.0.1:{lst.getsockname()[1]}"
    ch = Channel(ep, 5.0)
    seen: list[list[bytes]] = []
    try:
        ch.send(Op.EXISTS, {"keys": [b"q"]}, req_id=41)
        assert ch.zmtp and ch._sock is None and len(ch._zpending) == 1
        lst.listen(1)

        def serve() -> None:
            s, _ = lst.accept()
            with s:
                _accept(s)
                for _ in range(2):
                    seen.append(_read_message(s))
                    _, _, rid, _, _ = decode_request(seen[-1][0])
                    s.sendall(_frames([encode_reply(0, rid, {"found": [rid == 41]})]))
                time.sleep(0.2)

        th = threading.Thread(target=serve, daemon=True)
        th.start()
        strays: list[int] = []
        ch.on_stray = lambda rid, st, body: strays.append(rid)
        _, st, body, _ = ch.request(Op.EXISTS, {"keys": [b"r"]}, req_id=42)
        assert body == {"found": [False]} and strays == [41]
        assert [decode_request(m[0])[2] for m in seen] == [41, 42]
        th.join(10)
    finally:
        ch.close()
        lst.close()
