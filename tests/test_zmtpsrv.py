"""The native listener's compiled framing (kvshm/zmq_ctrl/_zmtpsrv.pyx): ZMTP frames read
and parsed in C, replies framed and written in C, the same bytes and messages as the
wire format says, however the peer's bytes are cut into reads.

Driven through :class:`kvshm.zmq_ctrl.listener.NativeListener` (tests/test_native_listener.py's
``Pump``) over real sockets; each wait is on what happened, never a sleep.
"""

from __future__ import annotations

import random
import socket
import struct

import pytest

from test_native_listener import Pump, _message

from kvshm.zmq_ctrl import _zmtpsrv  # noqa: E402


@pytest.fixture
def pump():
    p = Pump()
    yield p
    p.close()


def test_the_listeners_connections_are_the_compiled_ones(pump):
    s = pump.peer(identity=b"cy")
    c = next(iter(pump.lst._conns.values()))
    assert type(c) is _zmtpsrv.Conn
    s.sendall(_message(b"h", b"v"))
    pump.until(lambda: pump.got, "the message")
    assert type(pump.got[0][1]) is _zmtpsrv.Header
    s.close()


def _wire(rng: random.Random) -> tuple[bytes, list[list[bytes]]]:
    """Messages of short and long frames, MORE, empty frames and commands between them."""
    ping = b"\x04PING" + b"\x00\x10" + b"c"
    msgs: list[list[bytes]] = []
    wire = b""
    for i in range(40):
        frames = [f"h{i}".encode()]
        for _ in range(rng.randrange(0, 4)):
            size = rng.choice([0, 1, 255, 256, 300, 4096, 65535, 65536, 70000])
            frames.append(bytes([i & 0xFF]) * size)
        msgs.append(frames)
        wire += _message(*frames)
        if i % 7 == 3:
            wire += bytes([0x04, len(ping)]) + ping
    return wire, msgs


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_messages_cut_anywhere_into_reads_come_out_whole(pump, seed):
    """The same stream sent in chunks of 1 byte to 100 KB (a frame header split between
    reads, a large frame begun in one read and ended in another): the same messages,
    frames of 64 KiB and more as bytearray, smaller as bytes."""
    rng = random.Random(seed)
    wire, msgs = _wire(rng)
    s = pump.peer(identity=b"cut")
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(wire)
    while view:
        k = rng.choice([1, 2, 3, 9, 10, 100, 4000, 70000, 100000])
        chunk = view[:k]
        while chunk:
            try:
                chunk = chunk[s.send(chunk):]
            except BlockingIOError:
                pump.turn(5)
        view = view[k:]
        pump.turn(0)
    pump.until(lambda: len(pump.got) == len(msgs), "every message")
    for m, want in zip(pump.got, msgs):
        assert m[0] == b"cut"
        assert [bytes(f) for f in m[1:]] == want
        for f in m[2:]:
            assert type(f) is (bytearray if len(f) >= 65536 else bytes)
    s.close()


def test_replies_are_framed_as_zmtp_says(pump):
    """Short (< 256) and long sizes, MORE on all but the last, zero-copy parts tracked,
    a part of a multi-byte itemsize sent as its bytes."""
    import array

    s = pump.peer(identity=b"rx")
    big = bytearray(b"z" * 70000)
    words = array.array("I", [1, 2, 3])
    pump.lst.send_message([b"rx", b"a"])
    tr = pump.lst.send_message([b"rx", b"", b"y" * 300, memoryview(big), words], 2)
    assert pump.recv_frame(s) == (0, b"a")
    assert pump.recv_frame(s) == (1, b"")
    assert pump.recv_frame(s) == (3, b"y" * 300)
    assert pump.recv_frame(s) == (3, bytes(big))
    assert pump.recv_frame(s) == (0, words.tobytes())
    tr.wait(5)
    assert tr.done
    s.close()


def test_a_part_without_a_buffer_raises_and_sends_nothing(pump):
    s = pump.peer(identity=b"nb")
    with pytest.raises(TypeError):
        pump.lst.send_message([b"nb", b"ok", "not a buffer"])
    pump.lst.send_message([b"nb", b"after"])
    assert pump.recv_frame(s) == (0, b"after")
    s.close()


def test_a_reply_the_kernel_takes_in_part_is_finished_from_the_queue(pump):
    """A peer that reads late: replies larger than its socket buffers are queued
    (partly written), then written in order as it reads."""
    s = pump.peer(identity=b"slow")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c = next(iter(pump.lst._conns.values()))
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sent = [bytes([i]) * (3000 + 1000 * i) for i in range(20)]
    for d in sent:
        pump.lst.send_message([b"slow", d])
    assert c.out, "nothing was queued"
    for d in sent:
        assert pump.recv_frame(s) == ((2 if len(d) >= 256 else 0), d)
    pump.until(lambda: not c.out, "the queue written")
    assert c.out_bytes == 0 and c.out_msgs == 0
    s.close()


def test_a_long_size_of_2_63_or_more_is_too_large(pump):
    s = pump.peer(identity=b"huge")
    s.sendall(b"\x02" + struct.pack(">Q", (1 << 63) + 5) + b"x")
    assert pump.closed(s)
    assert pump.lst.counts.get("frame_too_large") == 1, pump.lst.counts
    s.close()


def test_the_inner_inproc_router_is_served_beside_connections(pump):
    """The inner libzmq ROUTER (``inproc://``: the management port's own client) is
    received from only when its descriptor was readable (or a send on it may have taken
    a message in): its messages still come, between and after a connection's, and its
    replies go back."""
    import zmq

    name = f"inproc://zmtpsrv-{id(pump)}"
    pump.lst.bind(name)
    d = pump.lst.context.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(name)
    try:
        s = pump.peer(identity=b"tcp")
        for i in range(20):
            s.sendall(_message(b"t%d" % i))
            d.send(b"i%d" % i)
            want = {b"t%d" % i, b"i%d" % i}
            pump.until(lambda: want <= {bytes(m[1]) for m in pump.got}, f"both messages {i}")
            inner = next(m for m in pump.got if bytes(m[1]) == b"i%d" % i)
            pump.lst.send_message([inner[0], b"r%d" % i])
            assert d.poll(10_000) and d.recv() == b"r%d" % i
            pump.got.clear()
        # a message to the inner socket alone, the connections quiet
        d.send(b"alone")
        pump.until(lambda: pump.got, "the inner socket's message")
        assert bytes(pump.got[0][1]) == b"alone"
        s.close()
    finally:
        d.close(0)


def test_mangled_streams_close_or_deliver_and_the_listener_keeps_serving():
    """Valid streams with random bytes flipped, cut or inserted (flags, sizes, bodies),
    from peers trusted and not: each connection either delivers messages or is closed,
    nothing crashes, and a well-behaved peer is served after them all."""
    rng = random.Random(13)
    p = Pump(untrusted_message_bytes=200_000, max_message_bytes=1 << 20)
    try:
        delivered = 0
        for i in range(200):
            p.lst.trust = (lambda fd, ident: True) if i % 2 else (lambda fd, ident: False)
            wire, _msgs = _wire(rng)
            b = bytearray(wire[:rng.randrange(1, min(len(wire), 300_000))])
            for _ in range(rng.randrange(1, 6)):
                at = rng.randrange(len(b))
                op = rng.randrange(3)
                if op == 0:
                    b[at] = rng.randrange(256)
                elif op == 1:
                    del b[at:at + rng.randrange(1, 12)]
                else:
                    b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 12)))
            s = p.peer(identity=b"m%d" % i)
            view = memoryview(bytes(b))
            while view:
                try:
                    view = view[s.send(view[:rng.choice([1, 7, 500, 65536])]):]
                except BlockingIOError:
                    p.turn(1)
                except (BrokenPipeError, ConnectionResetError):
                    break
            p.turn(0)
            s.close()
            delivered += len(p.got)
            p.got.clear()
        p.until(lambda: p.lst.connections == 0, "every mangled connection closed")
        # both ends of the parser were reached: messages delivered, protocol errors
        assert delivered > 100 and sum(p.lst.counts.values()) > 20, (delivered, p.lst.counts)
        s = p.peer(identity=b"after")
        s.sendall(_message(b"hello", b"x" * 70_000))
        p.until(lambda: p.got, "the well-behaved peer's message")
        assert [bytes(f) for f in p.got[0][1:]] == [b"hello", b"x" * 70_000]
        s.close()
    finally:
        p.close()
