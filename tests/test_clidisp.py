"""The one-key request path in C of a remote client (Channel.call1 over _zmqc.send1/recv1).

What it packs equals what msgpack packs; the usual replies are read in C (counted by
``Channel.fast``); every other reply is handed back whole and read by the Python path, so
crafted replies on the wire (a proxy in front of a real server answers some requests
itself) give the same results and errors as the general path; a stalled or killed server
still ends a call in ServerUnavailable within the timeout.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
import zmq

from kvshm import Client
from kvshm.errors import KeyNotFound, ProtocolError, ServerUnavailable
from kvshm.security import find_token
from kvshm.zmq_ctrl import _zmqc
from kvshm.zmq_ctrl import channel as chmod
from kvshm.zmq_ctrl.channel import endpoint_of
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, Status, encode_reply, encode_request
from servers import ServerProcess


@pytest.fixture(scope="module")
def server():
    with ServerProcess(prealloc_size=1 / 16) as s:
        yield s


# --------------------------------------------------------------------------- packing


def test_encode1_packs_what_msgpack_packs():
    rng = random.Random(13)
    ints = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
    for _ in range(3000):
        rid = rng.choice(ints + [rng.getrandbits(rng.randint(1, 64))])
        epoch = rng.choice(ints + [rng.getrandbits(rng.randint(1, 64))])
        key = rng.randbytes(rng.choice([1, 31, 32, 255, 256, 4096]))
        size = rng.choice(ints[:8] + [rng.getrandbits(16)])
        csum = rng.choice([None, rng.getrandbits(64), 0, 2**64 - 1])
        body: dict[str, Any] = {"keys": [key]}
        if csum is not None:
            body["sums"] = [csum]
        body["sizes"] = [size]
        body["counts"] = [1]
        assert _zmqc.encode1(Op.PUT, rid, epoch, key, size, csum) == \
            encode_request(Op.PUT, rid, epoch, body)
        for op in (Op.GET, Op.EXISTS):
            assert _zmqc.encode1(op, rid, epoch, key) == \
                encode_request(op, rid, epoch, {"keys": [key]})


# --------------------------------------------------------------------------- recv1 alone


@pytest.fixture
def pair():
    ctx = zmq.Context.instance()
    r = ctx.socket(zmq.ROUTER)
    d = ctx.socket(zmq.DEALER)
    r.linger = d.linger = 0
    port = r.bind_to_random_port("tcp://127.0.0.1")
    d.setsockopt(zmq.RCVTIMEO, 50)
    d.connect(f"tcp://127.0.0.1:{port}")
    d.send(b"hi")
    ident, _ = r.recv_multipart()
    yield d, lambda *parts: r.send_multipart([ident, *parts])
    d.close(0)
    r.close(0)


def _reply(status: int, rid: int, body: dict[str, Any]) -> bytes:
    return encode_reply(status, rid, body)


def test_recv1_reads_the_usual_replies(pair):
    d, answer = pair
    answer(_reply(0, 7, {"st": [0]}))
    assert _zmqc.recv1(d, _zmqc.PUT1, 7) == 0
    answer(_reply(0, 2**40, {"found": [True]}))
    assert _zmqc.recv1(d, _zmqc.EXISTS1, 2**40) is True
    answer(_reply(0, 9, {"found": [False]}))
    assert _zmqc.recv1(d, _zmqc.EXISTS1, 9) is False
    answer(_reply(0, 300, {"sizes": [5], "counts": [1]}), b"hello")
    assert _zmqc.recv1(d, _zmqc.GET1, 300) == b"hello"
    answer(_reply(0, 301, {"sizes": [5], "counts": [1], "sums": [2**64 - 1]}), b"world")
    out = bytearray(8)
    assert _zmqc.recv1(d, _zmqc.GET1_INTO, 301, out) == 5 and out == b"world\0\0\0"
    for body in ({"sizes": [-1], "counts": []}, {"sizes": [-1]}):
        answer(_reply(0, 302, body))
        assert _zmqc.recv1(d, _zmqc.GET1, 302) == -1
    t = time.monotonic()
    assert _zmqc.recv1(d, _zmqc.GET1, 303) is _zmqc.AGAIN     # one slice, no reply
    assert time.monotonic() - t < 5


@pytest.mark.parametrize("kind,parts,out", [
    (_zmqc.PUT1, [_reply(0, 8, {"st": [0]})], None),                     # another id
    (_zmqc.PUT1, [_reply(0, 7, {"st": [7]})], None),                     # per-key refusal
    (_zmqc.PUT1, [_reply(9, 7, {"error": "no"})], None),                 # status
    (_zmqc.PUT1, [_reply(0, 7, {"st": [0], "commit_failed": [3]})], None),
    (_zmqc.PUT1, [_reply(0, 7, {"st": [0]}), b"extra"], None),
    (_zmqc.PUT1, [_reply(0, 7, {"st": [0]}) + b"\x00"], None),           # trailing byte
    (_zmqc.PUT1, [msgpack.packb([3, 0, 7, {"st": [0]}])], None),         # version
    (_zmqc.PUT1, [b"\xc1garbled"], None),
    (_zmqc.PUT1, [b""], None),
    (_zmqc.EXISTS1, [_reply(0, 7, {"found": [1]})], None),               # not a bool
    (_zmqc.GET1, [_reply(0, 7, {"sizes": [5], "counts": [1]}), b"abc"], None),
    (_zmqc.GET1, [_reply(0, 7, {"sizes": [5], "counts": [1]})], None),
    (_zmqc.GET1, [_reply(0, 7, {"sizes": [3], "counts": [1]}), b"abc", b"d"], None),
    (_zmqc.GET1, [_reply(0, 7, {"sizes": [3], "counts": [1, 0]}), b"abc"], None),
    (_zmqc.GET1, [_reply(0, 7, {"sizes": [-2]})], None),
    (_zmqc.GET1, [_reply(0, 7, {"sizes": [-1], "counts": [1]}), b"x"], None),
    (_zmqc.GET1, [_reply(0, 7, {"sizes": ["3"], "counts": [1]}), b"abc"], None),
    (_zmqc.GET1, [_reply(0, 7, {"sizes": [3], "sizes2": [1], "counts": [1]}), b"abc"], None),
    (_zmqc.GET1_INTO, [_reply(0, 7, {"sizes": [5], "counts": [1]}), b"abcde"],
     bytearray(4)),                                                      # out too small
])
def test_recv1_hands_back_any_other_reply(pair, kind, parts, out):
    d, answer = pair
    answer(*parts)
    before = None if out is None else bytes(out)
    got = _zmqc.recv1(d, kind, 7, out)
    assert type(got) is list and got == parts       # the whole message, as it came
    if out is not None:
        assert bytes(out) == before                 # untouched
    answer(_reply(0, 8, {"st": [0]}))               # the socket reads on as before
    assert _zmqc.recv1(d, _zmqc.PUT1, 8) == 0


# --------------------------------------------------------------------------- a client


def test_the_c_path_is_taken_and_counted(server):
    with Client(server.address, transport="tcp", timeout=5) as c:
        chan = c._chan
        f0, s0 = chan.fast, chan.sent
        v = np.arange(4096, dtype=np.uint8)
        c.put(b"cd-a", v)
        c.put("cd-b", b"str key")
        assert c.get(b"cd-a") == v.tobytes()
        out = np.zeros(5000, np.uint8)
        assert c.get_into("cd-a", out) == 4096 and (out[:4096] == v).all()
        assert c.exists(b"cd-b") is True and c.exists(b"cd-none") is False
        with pytest.raises(KeyNotFound):
            c.get(b"cd-none")
        with pytest.raises(KeyNotFound):
            c.get_into(b"cd-none", out)
        assert chan.fast - f0 == 8 and chan.sent - s0 == 8
        # the general path for what C does not send: zero-copy values, checksums, verify
        big = np.ones(1 << 17, np.uint8)
        c.put(b"cd-big", big)
        c.put(b"cd-sum", b"x" * 100, checksum=True)
        assert c.get(b"cd-sum", verify=True) == b"x" * 100
        assert chan.fast - f0 == 8
        assert c.get(b"cd-sum") == b"x" * 100           # (a stored sum rides along)
        assert c.get(b"cd-big") == big.tobytes()        # a large hit is read in C too
        out = np.zeros(1 << 17, np.uint8)
        assert c.get_into(b"cd-big", out) == 1 << 17 and out.all()
        assert chan.fast - f0 == 11


class _Proxy:
    """A ROUTER in front of a real server: it forwards every request, except those of
    one-key requests for keys starting with ``crafted``, which it answers with the next
    of :attr:`replies` (``(status, body, frames)``, or a callable ``(rid) -> parts`` or
    a list of such messages), or drops when :attr:`replies` holds None."""

    def __init__(self, backend: str) -> None:
        ctx = zmq.Context.instance()
        self.front = ctx.socket(zmq.ROUTER)
        self.front.linger = 0
        self.port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.back = ctx.socket(zmq.DEALER)
        self.back.linger = 0
        self.back.connect(backend)
        self.replies: list[Any] = []
        self.crafted = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        ident = b""
        while not self._stop.is_set():
            for sock, _ in poller.poll(20):
                if sock is self.back:
                    self.front.send_multipart([ident, *self.back.recv_multipart()])
                    continue
                ident, header, *frames = self.front.recv_multipart()
                _, op, rid, _, body = msgpack.unpackb(header)
                keys = body.get("keys") or [b""]
                if op in (Op.PUT, Op.GET, Op.EXISTS) and keys[0].startswith(b"crafted"):
                    self.crafted += 1
                    r = self.replies.pop(0)
                    if r is None:
                        continue                    # a stalled server
                    parts = r(rid) if callable(r) else [encode_reply(r[0], rid, r[1]), *r[2]]
                    for msg in parts if type(parts[0]) is list else [parts]:
                        self.front.send_multipart([ident, *msg])
                else:
                    self.back.send_multipart([header, *frames])

    def close(self) -> None:
        self._stop.set()
        self._t.join(5)
        self.front.close(0)
        self.back.close(0)


@pytest.fixture
def proxied(server):
    p = _Proxy(endpoint_of(server.address))
    tok = find_token(endpoint_of(server.address))
    c = Client(f"127.0.0.1:{p.port}", transport="tcp", timeout=2, token=tok)
    try:
        yield c, p
    finally:
        c.close()
        p.close()


def _outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        r = fn()
    except Exception as exc:        # noqa: BLE001 - compared, not swallowed
        return type(exc).__name__, str(exc)
    return "ok", repr(r)


K = b"crafted-k"

REPLIES: dict[str, tuple[Callable[[Client], Any], Any]] = {
    "put_ok": (lambda c: c.put(K, b"v"), (0, {"st": [0]}, [])),
    "put_refused": (lambda c: c.put(K, b"v"), (Status.INVALID_REQUEST, {"error": "no"}, [])),
    "put_unknown_status": (lambda c: c.put(K, b"v"), (99, {}, [])),
    "put_pool_full": (lambda c: c.put(K, b"v"), (0, {"st": [Status.POOL_FULL]}, [])),
    "put_quota": (lambda c: c.put(K, b"v"), (0, {"st": [Status.QUOTA_EXCEEDED]}, [])),
    "put_no_st": (lambda c: c.put(K, b"v"), (0, {}, [])),
    "put_empty_st": (lambda c: c.put(K, b"v"), (0, {"st": []}, [])),
    "get_ok": (lambda c: c.get(K), (0, {"sizes": [3], "counts": [1]}, [b"abc"])),
    "get_refused": (lambda c: c.get(K), (Status.INTERNAL, {"error": "bug"}, [])),
    "get_not_found_status": (lambda c: c.get(K), (Status.NOT_FOUND, {"error": "gone"}, [])),
    "get_quota": (lambda c: c.get(K), (0, {"sizes": [-2]}, [])),
    "get_no_sizes": (lambda c: c.get(K), (0, {}, [])),
    "get_short_frame": (lambda c: c.get(K), (0, {"sizes": [5], "counts": [1]}, [b"abc"])),
    "get_long_frame": (lambda c: c.get_into(K, bytearray(9)),
                       (0, {"sizes": [5], "counts": [1]}, [b"abcdefg"])),
    "get_small_out": (lambda c: c.get_into(K, bytearray(2)),
                      (0, {"sizes": [5], "counts": [1]}, [b"abcde"])),
    "get_no_frame": (lambda c: c.get(K), (0, {"sizes": [5], "counts": [1]}, [])),
    "get_miss_with_frame": (lambda c: c.get(K), (0, {"sizes": [-1], "counts": [1]}, [b"x"])),
    "get_bad_size": (lambda c: c.get(K), (0, {"sizes": ["5"], "counts": [1]}, [b"abcde"])),
    "get_two_sizes": (lambda c: c.get(K), (0, {"sizes": [1, 1], "counts": [2]}, [b"ab"])),
    "get_runs": (lambda c: c.get(K), (0, {"sizes": [5], "counts": [1, 0]}, [b"ab", b"cde"])),
    "get_runs_into": (lambda c: c.get_into(K, bytearray(5)),
                      (0, {"sizes": [5], "counts": [1, 0]}, [b"ab", b"cde"])),
    "get_no_counts": (lambda c: c.get(K), (0, {"sizes": [3]}, [b"abc"])),
    "get_miss": (lambda c: c.get(K), (0, {"sizes": [-1], "counts": []}, [])),
    "get_miss_no_counts": (lambda c: c.get_into(K, bytearray(3)), (0, {"sizes": [-1]}, [])),
    "exists_ok": (lambda c: c.exists(K), (0, {"found": [True]}, [])),
    "exists_refused": (lambda c: c.exists(K), (Status.UNAUTHORIZED, {"error": "x"}, [])),
    "exists_no_found": (lambda c: c.exists(K), (0, {}, [])),
    "exists_int_found": (lambda c: c.exists(K), (0, {"found": [1]}, [])),
    "garbled": (lambda c: c.exists(K), lambda rid: [b"\xc1\xc1 not msgpack"]),
    "trailing_bytes": (lambda c: c.put(K, b"v"),
                       lambda rid: [encode_reply(0, rid, {"st": [0]}) + b"\x00"]),
    "other_version": (lambda c: c.put(K, b"v"),
                      lambda rid: [msgpack.packb([PROTOCOL_VERSION + 1, 0, rid, {"st": [0]}])]),
    "short_header": (lambda c: c.put(K, b"v"), lambda rid: [msgpack.packb([2, 0, rid])]),
}


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_crafted_replies_on_the_wire_equal_the_general_path(proxied, case, monkeypatch):
    c, p = proxied
    fn, reply = REPLIES[case]
    p.replies = [reply]
    c.exists(b"hello-first")                # (HELLO through the proxy, to the server)
    f0 = c._chan.fast
    fast = _outcome(lambda: fn(c))
    took_c = c._chan.fast - f0
    c._session.need_hello = False if c._chan._sock is not None else True
    monkeypatch.setattr(c._chan, "call1", lambda *a: chmod.NOT_SENT)
    p.replies = [reply]
    slow = _outcome(lambda: fn(c))
    assert p.crafted == 2 and not p.replies
    assert fast == slow
    # C reads only the usual replies; a garbled reply is a clear error
    assert took_c == (1 if case.endswith("_ok") or case in ("get_miss", "get_miss_no_counts")
                      else 0)
    if case in ("garbled", "trailing_bytes", "other_version", "short_header"):
        assert fast[0] == "ProtocolError" and "bad reply" in fast[1]


def test_stray_replies_are_skipped(proxied):
    """A reply to another request id (one abandoned earlier) before this one's own."""
    c, p = proxied
    strays: list[int] = []
    c._chan.on_stray = lambda rid, st, body: strays.append(rid)
    c.exists(b"hello-first")
    f0 = c._chan.fast
    p.replies = [lambda rid: [[encode_reply(0, rid + 1000, {"found": [True]})],
                              [encode_reply(0, rid, {"found": [False]})]]]
    assert c.exists(K) is False             # its own reply, not the stray True
    assert c._chan.fast - f0 == 1 and len(strays) == 1


def test_stalled_server_gives_server_unavailable_in_time(proxied):
    c, p = proxied
    c.exists(b"hello-first")
    c._chan.timeout = 0.5
    for op in (lambda: c.put(K, b"v"), lambda: c.get(K), lambda: c.exists(K),
               lambda: c.get_into(K, bytearray(4))):
        p.replies = [None]
        t = time.monotonic()
        with pytest.raises(ServerUnavailable, match="within 0.5 s"):
            op()
        assert 0.45 < time.monotonic() - t < 2.0
        assert c._session.need_hello and c._chan._sock is None
        assert c.exists(b"after") is False          # a fresh socket, HELLO again


def test_killed_server_gives_server_unavailable_in_time():
    srv = ServerProcess(prealloc_size=1 / 32)
    try:
        with Client(srv.address, transport="tcp", timeout=1) as c:
            c.put(b"k", b"v")
            f0 = c._chan.fast
            os.kill(srv.pid, signal.SIGSTOP)        # the request goes, no reply comes
            result: list[Any] = []

            def call() -> None:
                t = time.monotonic()
                try:
                    c.get(b"k")
                    result.append("no error")
                except ServerUnavailable as exc:
                    result.append((time.monotonic() - t, str(exc)))

            th = threading.Thread(target=call)
            th.start()
            time.sleep(0.2)                         # mid-call
            srv.kill()
            th.join(10)
            assert not th.is_alive()
            elapsed, msg = result[0]
            # the kill closes the connection: the client sees it at once (ZMTP: since
            # tests/test_zmtp_cut.py's fix, "closed the connection before the reply"),
            # or its 1 s timeout runs out (libzmq's DEALER reconnects silently)
            assert elapsed < 3.0 and ("within 1 s" in msg or "closed the connection" in msg), msg
            assert c._chan.fast == f0 and c._session.need_hello
    finally:
        srv.kill()
        srv.remove_segment()      # (a SIGKILLed server cannot remove its own)


def test_without_zmqc_pyzmq_carries_it(server, monkeypatch):
    monkeypatch.setattr(chmod, "ZMTP", False)      # (libzmq carries it, through pyzmq)
    monkeypatch.setattr(chmod, "send_message", chmod._send_pyzmq)
    monkeypatch.setattr(chmod, "recv_message", chmod._recv_pyzmq)
    monkeypatch.setattr(chmod, "_zmqc", None)
    with Client(server.address, transport="tcp", timeout=5) as c:
        c.put(b"nz", b"v")
        assert c.get(b"nz") == b"v" and c.exists(b"nz") is True
        assert c._chan.fast == 0
