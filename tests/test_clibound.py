"""A client bounds what a server may send it in one reply (issue 13's "a malformed or
hostile message ... nothing crashes"): before HELLO 1 MiB, after it the pool's size plus
the metadata of the largest batch (kvshm.limits.Limits.reply_bound). A reply past it is a
ProtocolError at its frame header on the ZMTP transport, with nothing allocated for it;
on libzmq (ZMQ_MAXMSGSIZE) the connection is dropped and the wait ends in time.

Before this, a frame header announcing 2**62 bytes was received as long as bytes came
(memory grew with them), and several frames each under any bound added up unchecked.
"""

from __future__ import annotations

import os
import resource
import socket
import struct
import sys
import threading
import time

import numpy as np
import pytest
import zmq

import kvshm.zmq_ctrl.channel as chmod
from kvshm.client import Client
from kvshm.errors import ProtocolError, ServerUnavailable
from kvshm.limits import HELLO_REPLY_BOUND, REPLY_META_MIN, Limits
from kvshm.zmq_ctrl.channel import Channel
from kvshm.zmq_ctrl.protocol import Op, decode_request, encode_reply

sys.path.insert(0, os.path.dirname(__file__))
from servers import ServerProcess  # noqa: E402
from test_zmtp import FakeServer, _accept, _frames, _read_message  # noqa: E402

needs_zmtp = pytest.mark.skipif(not chmod.ZMTP, reason="KVSHM_ZMTP=0 or _zmtp not built")


def _header(rid: int, body: dict) -> bytes:
    return encode_reply(0, rid, body)


def _rid(s: socket.socket) -> int:
    msg = _read_message(s)
    return decode_request(msg[0])[2]


def _maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_limits_reply_bound_and_list_page() -> None:
    lim = Limits(max_key_bytes=4096, max_batch=1_000_000)
    assert lim.reply_meta() == max(REPLY_META_MIN, 64 * 1_000_000)
    assert lim.reply_bound(1 << 30) == (1 << 30) + lim.reply_meta()
    # a LIST page of max-length keys fits within the metadata bound
    n = lim.list_page(10_000_000)
    assert 1 <= n and n * (4096 + 8) <= lim.reply_meta()
    assert lim.list_page(10) == 10
    assert Limits(max_key_bytes=64, max_batch=5).list_page(100) == 5


@needs_zmtp
def test_a_frame_past_the_bound_is_refused_at_its_header() -> None:
    """After bound_replies(4 MiB): a reply whose value frame says 8 GiB is a
    ProtocolError at once, the server still sending; nothing like 8 GiB (nor the
    64 MiB it goes on sending) is allocated."""
    sent = threading.Event()

    def hostile(s: socket.socket) -> None:
        _accept(s)
        rid = _rid(s)
        hdr = _header(rid, {"sizes": [8 << 30]})
        s.sendall(bytes([1, len(hdr)]) + hdr + b"\x02" + struct.pack(">Q", 8 << 30))
        try:
            for _ in range(64):
                s.sendall(b"\0" * (1 << 20))
        except OSError:
            sent.set()              # (the client closed: what it must do)
        time.sleep(0.2)

    fake = FakeServer(hostile)
    ch = Channel(fake.endpoint, 5.0)
    assert ch.zmtp
    ch.bound_replies(4 << 20)
    before = _maxrss_kib()
    t0 = time.monotonic()
    try:
        with pytest.raises(ProtocolError, match="past this connection's bound"):
            ch.request(Op.GET, {"keys": [b"k"]})
        took = time.monotonic() - t0
        assert ch._sock is None
    finally:
        ch.close()
        fake.close()
    assert took < 4.0               # at the header, not at the 5 s timeout
    assert _maxrss_kib() - before < 48 * 1024


@needs_zmtp
def test_frames_each_under_the_bound_add_up() -> None:
    """Three 512 KiB frames of one message against a 1 MiB bound: refused at the third
    frame's header (the bound is the message's, its frames together)."""
    def script(s: socket.socket) -> None:
        _accept(s)
        rid = _rid(s)
        part = b"x" * (512 << 10)
        s.sendall(_frames([_header(rid, {"sizes": [len(part)] * 3}), part, part, part]))
        time.sleep(0.5)

    fake = FakeServer(script)
    ch = Channel(fake.endpoint, 3.0)
    ch.bound_replies(1 << 20)
    try:
        with pytest.raises(ProtocolError, match="past this connection's bound"):
            ch.request(Op.GET, {"keys": [b"a", b"b", b"c"]})
    finally:
        ch.close()
        fake.close()


@needs_zmtp
def test_before_hello_one_mib_and_the_next_connection_is_served() -> None:
    """A channel that has had no HELLO takes at most HELLO_REPLY_BOUND; after the
    refusal its next request makes a new connection and is answered."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)
    endpoint = f"tcp://127.0.0.1:{lst.getsockname()[1]}"
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            for big in (True, False):
                s, _ = lst.accept()
                with s:
                    _accept(s)
                    rid = _rid(s)
                    if big:
                        hdr = _header(rid, {"sizes": [HELLO_REPLY_BOUND + 1]})
                        s.sendall(bytes([1, len(hdr)]) + hdr + b"\x02"
                                  + struct.pack(">Q", HELLO_REPLY_BOUND + 1))
                        time.sleep(0.3)
                    else:
                        s.sendall(_frames([_header(rid, {"found": [True]})]))
                        time.sleep(0.3)
        except BaseException as exc:   # pragma: no cover - reported below
            errors.append(exc)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    ch = Channel(endpoint, 3.0)
    try:
        assert ch.reply_bound == HELLO_REPLY_BOUND
        with pytest.raises(ProtocolError, match="bound of 1048576 bytes"):
            ch.request(Op.GET, {"keys": [b"k"]})
        _rid_, st, body, _ = ch.request(Op.EXISTS, {"keys": [b"k"]})
        assert st == 0 and body["found"] == [True]
    finally:
        ch.close()
        th.join(10)
        lst.close()
    assert not errors


def test_libzmq_sockets_made_after_hello_carry_maxmsgsize() -> None:
    """On libzmq the bound is per frame (ZMQ_MAXMSGSIZE) on sockets made after
    bound_replies; a frame past it drops the connection and the wait ends by the
    timeout as ServerUnavailable, the value never delivered."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    ch = Channel(f"tcp://127.0.0.1:{port}", 1.5)
    ch.zmtp = False
    ch.bound_replies(64 << 10)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(50):
                continue
            ident, req = router.recv_multipart()
            rid = decode_request(req)[2]
            router.send_multipart([ident, _header(rid, {"sizes": [1 << 20]}),
                                   b"v" * (1 << 20)])

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        sock = ch._socket()
        assert sock.getsockopt(zmq.MAXMSGSIZE) == 64 << 10
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailable):
            ch.request(Op.GET, {"keys": [b"k"]})
        assert time.monotonic() - t0 < 10
    finally:
        stop.set()
        th.join(10)
        ch.close()
        router.close(0)


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_real_server_bounds_by_its_pool_and_large_replies_still_work(transport: str
                                                                       ) -> None:
    """HELLO raises the bound to the pool's size plus the metadata bound; a 4 MiB value,
    a batch of them and a LIST page still come back whole."""
    with ServerProcess() as srv:
        with Client(srv.address, transport=transport, timeout=10) as c:
            v = np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8)
            c.put(b"big", v.tobytes())
            assert c._chan.reply_bound == c._session.limits.reply_bound(c._session.capacity)
            assert c._chan.reply_bound > HELLO_REPLY_BOUND
            assert bytes(c.get(b"big")) == v.tobytes()
            keys = [b"k%d" % i for i in range(8)]
            c.put_batch(keys, [v.tobytes()] * 8)
            got = c.get_batch(keys)
            assert all(bytes(g) == v.tobytes() for g in got)
            assert sorted(c.list_keys(b"k")) == sorted(keys)
