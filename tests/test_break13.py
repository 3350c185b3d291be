"""break13: hostile ZMTP peers against the sync client's transports (findings of the
break13 review; each test failed on main before its fix).

The hostile servers run in a process of their own: a server thread in the test's process
would wait for the GIL the client's C loop holds, and the stream would stall by itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import kvshm.zmq_ctrl.channel as chmod
from kvshm.errors import ServerUnavailable
from kvshm.zmq_ctrl.channel import Channel
from kvshm.zmq_ctrl.protocol import Op

_SERVER = textwrap.dedent(r'''
    import socket, struct, sys, threading
    from kvshm.zmq_ctrl.protocol import decode_request, encode_reply
    mode, total = sys.argv[1], int(sys.argv[2])

    def exact(s, n):
        b = b""
        while len(b) < n:
            c = s.recv(n - len(b))
            if not c:
                raise EOFError
            b += c
        return b

    def frame(s):
        fl = exact(s, 1)[0]
        n = struct.unpack(">Q", exact(s, 8))[0] if fl & 2 else exact(s, 1)[0]
        return fl, exact(s, n)

    def message(s):
        parts = []
        while True:
            fl, body = frame(s)
            if fl & 4:
                continue
            parts.append(body)
            if not fl & 1:
                return parts

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(4)
    print(lst.getsockname()[1], flush=True)
    s, _ = lst.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if mode == "ping":      # (a deep queue: it never runs dry while the client reads)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 24)
    s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00")
              + b"\x01" + b"\x00" * 31)
    exact(s, 64)
    frame(s)                                    # the client's READY
    st = b"Socket-Type"
    body = b"\x05READY" + bytes([len(st)]) + st + struct.pack(">I", 6) + b"ROUTER"
    s.sendall(bytes([4, len(body)]) + body)
    _, _, rid, _, _ = decode_request(message(s)[0])

    got = [0]

    def drain():                                # PONGs (and anything else) counted
        try:
            while True:
                b = s.recv(1 << 16)
                if not b:
                    break
                got[0] += len(b)
        except OSError:
            pass
    th = threading.Thread(target=drain, daemon=True)
    th.start()
    if mode == "ping":
        ping = b"\x04\x07\x04PING\x00\x01"      # TTL 0.1 s, no context
        unit, chunk = 1, ping * 50000
    else:                                       # whole replies to another request id
        rep = encode_reply(0, rid + 1000, {"found": [True]})
        unit, chunk = 1, (bytes([0, len(rep)]) + rep) * 50000
    sent = 0
    try:
        while sent < total:
            s.sendall(chunk)
            sent += 50000
    except OSError:
        pass
    if mode == "ping":      # the PONGs (7 bytes each) say how many PINGs it read
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        th.join(30)
        sent = got[0] // 7
    print("sent", sent, flush=True)
''')


def _flood(mode: str, total: int, zmtp: bool, monkeypatch: pytest.MonkeyPatch,
           one_key: bool = False) -> int:
    """Run the hostile server (``mode`` ping / stray, ``total`` units), make one request
    with a 0.3 s timeout; returns how many units the client took: for ping the PONGs it
    sent back, for stray the replies the server got to send before the client closed the
    connection (``total``: the client took them all)."""
    monkeypatch.setattr(chmod, "ZMTP", zmtp)
    p = subprocess.Popen([sys.executable, "-c", _SERVER, mode, str(total)],
                         stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        assert p.stdout is not None
        port = int(p.stdout.readline())
        ch = Channel(f"tcp://127.0.0.1:{port}", 0.3)
        assert ch.zmtp == zmtp
        with ch.lock, pytest.raises(ServerUnavailable):
            if one_key:         # Channel.call1: the one-key path read in C
                ch.call1(3, int(Op.EXISTS), b"k", None, None, None, ch.new_id(), 0)
            else:
                ch.request(Op.EXISTS, {"keys": [b"k"]})
        ch.close()
        out = p.stdout.readline().split()
        p.wait(60)
    finally:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()
    assert out[0] == "sent"
    return int(out[1])


TOTAL = 1_000_000


@pytest.mark.parametrize("one_key", [False, True], ids=["request", "call1"])
def test_zmtp_a_ping_flood_does_not_hold_a_call_past_its_deadline(monkeypatch, one_key):
    """A server that answers a request with PINGs as fast as the client reads them: the
    call must end at its 0.3 s deadline (ServerUnavailable, the connection closed). On
    main Conn.recv went on reading while bytes were there after its slice's deadline
    (_fill reads without waiting when the deadline passed, and returns 1 when it got
    any), so Channel never saw a slice end: the call took all 1,000,000 PINGs
    (about 5 s here) and would run for as long as the server sends."""
    assert _flood("ping", TOTAL, True, monkeypatch, one_key) < TOTAL


@pytest.mark.parametrize("one_key", [False, True], ids=["request", "call1"])
@pytest.mark.parametrize("zmtp", [True, False], ids=["zmtp", "libzmq"])
def test_a_flood_of_replies_to_other_requests_does_not_hold_a_call(monkeypatch, zmtp,
                                                                    one_key):
    """Whole replies naming another request id, sent without pause: each is handed to
    on_stray and the wait goes on, but only to the call's deadline. On main both
    transports' request loops went back to receiving after a stray reply without looking
    at the deadline: the call ran for as long as the server sent."""
    assert _flood("stray", TOTAL, zmtp, monkeypatch, one_key) < TOTAL
