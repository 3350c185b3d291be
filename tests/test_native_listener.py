"""kvshm's own ZMTP listener (kvshm/zmq_ctrl/listener.py; ``kvshm serve --listener native``).

Two kinds of test: the listener alone, in this process, driven by raw ZMTP peers over
plain sockets (handshake, framing, bounds, routing ids, peer credentials), each pump of
it a ``poll_in`` + ``recv_message`` until what the test waits for is seen; and a server
process under ``--listener native`` with the real clients (kvshm.Client over the ZMTP
channel and over a libzmq DEALER, tcp and ipc), hostile peers, and a descriptor limit.
Waits are on what happened (a message received, a connection's end), never a sleep.
"""

from __future__ import annotations

import os
import resource
import socket
import struct
import tempfile
import time
from typing import Any, Callable

import pytest
import zmq

import kvshm.zmq_ctrl.channel as channel
from kvshm import Client
from kvshm.zmq_ctrl.listener import NativeListener
from servers import ServerProcess

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0
GREETING = (b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
            + b"\0" * 32)


def _ready(identity: bytes = b"", stype: bytes = b"DEALER") -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(stype)) + stype
    if identity:
        body += b"\x08Identity" + struct.pack(">I", len(identity)) + identity
    return bytes([0x04, len(body)]) + body


def _frame(data: bytes, more: bool = False) -> bytes:
    if len(data) < 256:
        return bytes([1 if more else 0, len(data)]) + data
    return bytes([3 if more else 2]) + struct.pack(">Q", len(data)) + data


def _message(*frames: bytes) -> bytes:
    return b"".join(_frame(f, i < len(frames) - 1) for i, f in enumerate(frames))


class Pump:
    """A listener bound to a free tcp port and an ipc path, pumped by the test."""

    def __init__(self, **kw: Any) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvshm-nl-")
        self.lst = NativeListener(**kw)
        self.lst.bind("tcp://127.0.0.1:0")
        self.tcp = self.lst.getsockopt_string(zmq.LAST_ENDPOINT)
        self.lst.bind(f"ipc://{self.dir}/s.sock")
        self.ipc = self.lst.getsockopt_string(zmq.LAST_ENDPOINT)
        self.got: list[list[Any]] = []

    def turn(self, ms: int = 20) -> None:
        if self.lst.poll_in(-1, None, ms) > 0:
            while True:
                m = self.lst.recv_message()
                if m is None:
                    break
                self.got.append(m)

    def until(self, pred: Callable[[], bool], what: str) -> None:
        end = time.monotonic() + WAIT_S
        while not pred():
            assert time.monotonic() < end, f"timed out waiting for {what}"
            self.turn()

    def connect(self, kind: str = "tcp") -> socket.socket:
        if kind == "tcp":
            host, port = self.tcp[len("tcp://"):].rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=WAIT_S)
        else:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(WAIT_S)
            s.connect(self.ipc[len("ipc://"):])
        s.setblocking(False)
        return s

    def recvn(self, s: socket.socket, n: int) -> bytes:
        got = b""
        end = time.monotonic() + WAIT_S
        while len(got) < n:
            assert time.monotonic() < end, "timed out reading from the listener"
            try:
                more = s.recv(n - len(got))
            except BlockingIOError:
                self.turn(5)
                continue
            if not more:
                raise EOFError("closed by the listener")
            got += more
        return got

    def recv_frame(self, s: socket.socket) -> tuple[int, bytes]:
        flags = self.recvn(s, 1)[0]
        size = (struct.unpack(">Q", self.recvn(s, 8))[0] if flags & 2
                else self.recvn(s, 1)[0])
        return flags, self.recvn(s, size)

    def closed(self, s: socket.socket) -> bool:
        """Whether the listener closed ``s`` (end of stream or reset), pumping it."""
        end = time.monotonic() + WAIT_S
        while time.monotonic() < end:
            try:
                d = s.recv(65536)
            except BlockingIOError:
                self.turn(5)
                continue
            except ConnectionResetError:
                return True
            if not d:
                return True
        return False

    def peer(self, kind: str = "tcp", identity: bytes = b"") -> socket.socket:
        s = self.connect(kind)
        s.sendall(GREETING)
        assert self.recvn(s, 64)[:1] == b"\xff"
        s.sendall(_ready(identity))
        flags, body = self.recv_frame(s)
        assert flags & 4 and body.startswith(b"\x05READY"), body
        return s

    def close(self) -> None:
        self.lst.close()
        os.rmdir(self.dir)


@pytest.fixture
def pump():
    p = Pump()
    yield p
    p.close()


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_handshake_and_frames_of_every_size_in_pieces(pump, kind):
    s = pump.peer(kind, identity=b"me")
    big = os.urandom(200_000)
    huge = os.urandom(3 << 20)
    wire = _message(b"head", b"", b"x" * 300, big, huge) + _message(b"second")
    # a byte at a time for the first 600 bytes, then the rest as it goes
    for i in range(600):
        s.sendall(wire[i:i + 1])
        pump.turn(0)
    rest = memoryview(wire)[600:]
    while rest:
        try:
            n = s.send(rest)
            rest = rest[n:]
        except BlockingIOError:
            pump.turn(5)
    pump.until(lambda: len(pump.got) == 2, "two messages")
    m = pump.got[0]
    assert m[0] == b"me"
    assert bytes(m[1]) == b"head" and [bytes(f) for f in m[2:]] == [b"", b"x" * 300, big, huge]
    assert type(m[2]) is bytes and type(m[4]) is bytearray
    assert bytes(pump.got[1][1]) == b"second" and len(pump.got[1]) == 2
    # a reply of several frames, one zero-copy (tracked) and large
    tr = pump.lst.send_message([b"me", b"r0", b"y" * 300, memoryview(big)], 2)
    assert pump.recv_frame(s) == (1, b"r0")
    assert pump.recv_frame(s) == (3, b"y" * 300)
    assert pump.recv_frame(s) == (2, big)
    pump.until(lambda: tr.done, "the tracked reply written")
    s.close()


def test_a_peer_without_identity_gets_one_and_ids_are_not_handed_over(pump):
    a = pump.peer(identity=b"client-1")
    b = pump.connect()
    b.sendall(GREETING + _ready(b"client-1"))
    assert pump.closed(b), "a second connection under a connected peer's id was served"
    c = pump.peer()
    a.sendall(_message(b"from-a"))
    c.sendall(_message(b"from-c"))
    pump.until(lambda: len(pump.got) == 2, "both messages")
    ids = {bytes(m[1]): m[0] for m in pump.got}
    assert ids[b"from-a"] == b"client-1"
    assert ids[b"from-c"] and ids[b"from-c"] != b"client-1"
    assert pump.lst.counts.get("id_taken") == 1
    # the first keeps its id: a reply reaches it
    pump.lst.send_message([b"client-1", b"ok"])
    assert pump.recv_frame(a) == (0, b"ok")
    for s in (a, b, c):
        s.close()


def test_a_peer_whose_end_is_not_read_yet_does_not_hold_its_id(pump):
    a = pump.peer(identity=b"again")
    # its end not seen by the listener's poll (out of its epoll set), then closed
    fd = next(fd for fd, c in pump.lst._conns.items() if c.ident == b"again")
    pump.lst._ep.unregister(fd)
    a.close()
    b = pump.connect()
    b.sendall(GREETING + _ready(b"again"))
    assert pump.recvn(b, 64)[:1] == b"\xff"
    flags, body = pump.recv_frame(b)
    assert flags & 4 and body.startswith(b"\x05READY")
    b.sendall(_message(b"back"))
    pump.until(lambda: pump.got, "the message of the id's new connection")
    assert pump.got[0][0] == b"again" and not pump.lst.counts.get("id_taken")
    b.close()


@pytest.mark.parametrize("bad, why", [
    (b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 64, "bad_greeting"),
    (GREETING[:10] + b"\x02\x00" + GREETING[12:], "bad_greeting"),        # ZMTP 2
    (GREETING[:12] + b"CURVE".ljust(20, b"\0") + GREETING[32:], "bad_mechanism"),
    (GREETING + _ready(stype=b"PUB"), "bad_ready"),
    (GREETING + _frame(b"data before READY"), "bad_ready"),
    (GREETING + _ready() + b"\xf0garbage", "bad_frame"),
])
def test_a_malformed_handshake_or_frame_closes_only_that_connection(pump, bad, why):
    good = pump.peer()
    s = pump.connect()
    s.sendall(bad)
    assert pump.closed(s), f"not closed: {why}"
    assert pump.lst.counts.get(why) == 1, pump.lst.counts
    good.sendall(_message(b"still"))
    pump.until(lambda: pump.got, "the good peer's message")
    assert bytes(pump.got[0][1]) == b"still"
    s.close()
    good.close()


def test_a_stalled_handshake_blocks_no_one_and_is_closed_at_its_time():
    p = Pump(handshake_s=0.5)
    try:
        stalled = p.connect()
        stalled.sendall(GREETING[:5])       # and nothing more
        p.turn(0)
        good = p.peer()
        good.sendall(_message(b"served"))
        p.until(lambda: p.got, "the other peer's message")
        assert p.closed(stalled)
        assert p.lst.counts.get("handshake_timeout") == 1
        stalled.close()
        good.close()
    finally:
        p.close()


def test_a_peer_that_does_not_read_is_cut_at_the_outbound_bound():
    p = Pump(max_out_bytes=4 << 20, max_out_messages=64)
    try:
        s = p.peer(identity=b"sleepy")
        chunk = b"z" * (1 << 20)
        for i in range(1000):       # the kernel's buffers fill, then the queue, then cut
            p.lst.send_message([b"sleepy", chunk])
            if p.lst.connections == 0:
                break
        assert p.lst.connections == 0, "a peer that reads nothing was never cut"
        assert p.lst.counts.get("unread_output") == 1
        s.close()
    finally:
        p.close()


def test_an_unended_message_is_bounded_for_an_untrusted_connection():
    p = Pump(untrusted_message_bytes=1 << 20, max_message_bytes=8 << 20)
    try:
        trusted: set[int] = set()
        p.lst.trust = lambda fd, ident: fd in trusted
        s = p.peer()
        frame = b"\x03" + struct.pack(">Q", 256 << 10) + b"\0" * (256 << 10)
        sent = 0
        try:
            for _ in range(64):
                while True:
                    try:
                        s.sendall(frame)
                        break
                    except BlockingIOError:
                        p.turn(5)
                sent += 1
                p.turn(0)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert p.closed(s)
        assert p.lst.counts.get("message_too_large") == 1
        assert sent < 64
        # a trusted connection takes more, up to max_message_bytes
        t = p.peer()
        fd = next(iter(p.lst._conns))
        trusted.add(fd)
        t.setblocking(True)
        t.sendall(frame * 12 + _frame(b"end"))      # 3 MiB, ended
        t.setblocking(False)
        p.until(lambda: p.got, "the trusted peer's message")
        assert len(p.got[0]) == 2 + 12
        s.close()
        t.close()
    finally:
        p.close()


def test_a_frame_over_the_frame_bound_closes_the_connection():
    p = Pump(max_frame_bytes=1000)
    try:
        s = p.peer()
        s.sendall(b"\x02" + struct.pack(">Q", 1 << 40))   # declared, never sent
        assert p.closed(s)
        assert p.lst.counts.get("frame_too_large") == 1
        s.close()
    finally:
        p.close()


def test_the_header_names_the_connections_own_descriptor_and_peer_credentials(pump):
    s = pump.peer("ipc")
    s.sendall(_message(b"who"))
    pump.until(lambda: pump.got, "the message")
    h = pump.got[0][1]
    fd = h.get(zmq.SRCFD)
    d = socket.socket(fileno=os.dup(fd))
    try:
        pid, uid, gid = struct.unpack("3i", d.getsockopt(socket.SOL_SOCKET,
                                                         socket.SO_PEERCRED, 12))
    finally:
        d.close()
    assert (pid, uid, gid) == (os.getpid(), os.getuid(), os.getgid())
    assert h.get("User-Id") == ""
    assert bytes(h.buffer) == b"who"
    with pytest.raises(zmq.ZMQError):
        h.get("No-Such-Property")
    s.close()


def test_accept_with_no_descriptor_free_backs_off_and_accepts_later(pump):
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare = []
    try:
        # every descriptor taken (by this process: the listener's accept sees EMFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, old[1]))
        try:
            while True:
                spare.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        os.close(spare.pop())       # one for the peer's own socket
        s = socket.socket(socket.AF_UNIX)
        os.close(spare.pop())       # ... and one the test's connect may need
        s.settimeout(WAIT_S)
        s.connect(pump.ipc[len("ipc://"):])
        pump.turn(0)
        pump.until(lambda: pump.lst.counts.get("accept_no_fd", 0) >= 1, "an EMFILE")
    finally:
        for fd in spare:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, old)
    s.setblocking(False)
    s.sendall(GREETING)
    assert pump.recvn(s, 64)[:1] == b"\xff"         # accepted once a descriptor is free
    s.close()


# ------------------------------------------------------------------- a server process


def _client_rounds(c: Client) -> None:
    c.put(b"k", b"v")
    assert c.get(b"k") == b"v"
    big = os.urandom(3 << 20)
    c.put(b"big", big)
    assert c.get(b"big") == big
    keys = [f"b{i}".encode() for i in range(50)]
    vals = [os.urandom(1000 + i) for i in range(50)]
    c.put_batch(keys, vals)
    assert c.get_batch(keys) == vals
    assert c.exists(b"k")
    # a reply of several values, small (packed) and large (zero-copy)
    mixed = [b"k", b"big", b"b0", b"nope"]
    assert c.get_batch(mixed) == [b"v", big, vals[0], None]
    c.delete(b"big")
    with pytest.raises(KeyError):
        c.get(b"big")


@pytest.mark.parametrize("zmtp", [True, False], ids=["zmtp", "libzmq"])
def test_the_clients_over_tcp_and_ipc(zmtp, monkeypatch):
    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")
    monkeypatch.setattr(channel, "ZMTP", zmtp)
    with ServerProcess(listener="native") as srv:
        assert srv.ipc
        for addr in (srv.address, srv.ipc):
            c = Client(addr, transport="tcp", timeout=20)
            try:
                _client_rounds(c)
                st = c.stats()
                assert st["listener"]["kind"] == "native"
                assert not st["error_kinds"].get("internal"), st["error_kinds"]
            finally:
                c.close()
        assert srv.alive()


def test_the_server_stays_up_through_hostile_peers_and_an_emfile():
    with ServerProcess("--hello-timeout", "1", listener="native") as srv:
        c = Client(srv.address, transport="tcp", timeout=20)
        try:
            c.put(b"k", b"v")
            host, port = srv.address.rsplit(":", 1)
            for bad in (b"\0" * 100, GREETING[:12] + b"PLAIN".ljust(20, b"\0") + GREETING[32:],
                        GREETING + _ready() + b"\xff" * 20):
                s = socket.create_connection((host, int(port)), timeout=WAIT_S)
                s.sendall(bad)
                try:
                    while s.recv(65536):
                        pass
                except ConnectionResetError:
                    pass
                s.close()
            pid = srv.proc.pid
            old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
            resource.prlimit(pid, resource.RLIMIT_NOFILE,
                             (len(os.listdir(f"/proc/{pid}/fd")), old[1]))
            try:
                u = socket.socket(socket.AF_UNIX)
                u.connect(srv.ipc[len("ipc://"):])
                t = socket.create_connection((host, int(port)), timeout=WAIT_S)
                assert c.get(b"k") == b"v"      # served while it cannot accept
            finally:
                resource.prlimit(pid, resource.RLIMIT_NOFILE, old)
            for s in (u, t):        # accepted once descriptors are free, then cut (no HELLO)
                s.settimeout(WAIT_S)
                s.sendall(GREETING)
                try:
                    got = s.recv(64)
                    while s.recv(65536):
                        pass
                except ConnectionResetError:
                    got = b"\xff"
                assert got[:1] == b"\xff"
                s.close()
            assert c.get(b"k") == b"v"
            closed = c.stats()["listener"]["closed"]
            assert closed.get("bad_greeting") and closed.get("bad_mechanism"), closed
            assert closed.get("bad_frame") and closed.get("accept_no_fd"), closed
            assert srv.alive(), srv.stderr_text
        finally:
            c.close()


def test_a_bad_listener_name_is_refused():
    with pytest.raises(RuntimeError, match="listener"):
        ServerProcess(env={"KVSHM_LISTENER": "nope"})


def test_a_burst_of_tiny_messages_is_parsed_as_the_loop_takes_them(pump):
    from kvshm.zmq_ctrl.listener import READY_MAX

    s = pump.peer()
    n = 3 * READY_MAX + 7
    wire = b"".join(_message(str(i).encode()) for i in range(n))
    rest = memoryview(wire)
    got: list[bytes] = []
    most = 0
    end = time.monotonic() + WAIT_S
    while len(got) < n:
        assert time.monotonic() < end, f"{len(got)} of {n} messages"
        if rest:
            try:
                rest = rest[s.send(rest):]
            except BlockingIOError:
                pass
        if pump.lst.poll_in(-1, None, 5) > 0:
            while True:
                m = pump.lst.recv_message()
                most = max(most, len(pump.lst._ready))
                if m is None:
                    break
                got.append(bytes(m[1]))
    assert got == [str(i).encode() for i in range(n)]
    assert most <= READY_MAX
    s.close()


def test_a_ping_is_answered_with_its_context_and_other_commands_are_ignored(pump):
    s = pump.peer()
    ping = b"\x04PING" + b"\x00\x64" + b"ctx-1"
    sub = b"\x09SUBSCRIBE" + b"topic"
    s.sendall(bytes([0x04, len(ping)]) + ping + bytes([0x04, len(sub)]) + sub
              + _message(b"after"))
    assert pump.recv_frame(s) == (0x04, b"\x04PONGctx-1")
    pump.until(lambda: pump.got, "the message after the commands")
    assert bytes(pump.got[0][1]) == b"after"
    s.close()
