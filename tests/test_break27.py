"""Findings of the last reviews left unfixed, each reproduced first:

1. The one-key GET path (``Client.get`` / ``get_into``, the C reading of the usual reply
   in ``kvshm.zmq_ctrl._zmqc.recv1`` and its Python twin in ``Client._get1``) took a
   reply whose size is past the server's pool (a frame that large did arrive): the
   batch paths refuse it (``replies.sizes_of``), the one-key path returned it. Now a
   ProtocolError, and the client goes on.

2. (What held, kept as a regression test) a reply header claiming a container of 2**32
   items (array, map) or a 4 GiB bin in a few bytes is a ProtocolError on both wires:
   msgpack's unpackb bounds every container by the frame's bytes. Not done here: a
   bound on the frame itself (libzmq's MAXMSGSIZE, the ZMTP reader) and limits sized
   from the request asked.

3. A HELLO with a session's nonce (the same client again) arriving while that
   session's large COMMIT was being settled in slices (``--slice-keys``) replaced the
   session, and the sliced settle, seeing its session closed, was abandoned: the COMMIT
   was never answered (the client waited its timeout) and the grants not yet committed
   stayed pending in the new session. Now the settle follows the session that took the
   grants over (``Session.live``) and the COMMIT is answered; the HELLO is answered at
   once as before.

For 1 the server is test_reply_shapes' FakeServer: a raw ROUTER answering HELLO as a server
does and each GET / LOOKUP with the next scripted reply; for 3 test_slices' Bed (a
Store and its ServiceLoop driven one turn at a time: the orderings are exact).
"""

from __future__ import annotations

import pytest

from kvshm import Client
from kvshm.errors import ProtocolError
from kvshm.zmq_ctrl import channel
from kvshm.zmq_ctrl.protocol import Op, encode_reply
from test_reply_shapes import POOL_BYTES, FakeServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["zmtp", "libzmq"])
def tcp_fake(request, monkeypatch):
    """A client of a FakeServer over each one-key wire: the client's own ZMTP
    (``_zmtp``) and libzmq (``_zmqc``)."""
    if request.param == "libzmq":
        monkeypatch.setattr(channel, "ZMTP", False)
    elif not channel.ZMTP:
        pytest.skip("the ZMTP transport is off (KVSHM_ZMTP=0)")
    fake = FakeServer()
    c = Client(fake.address, transport="tcp", timeout=5)
    assert c._chan.zmtp == (request.param == "zmtp")
    try:
        yield fake, c
    finally:
        c.close()
        fake.close()


BIG = POOL_BYTES + 1          # one byte past the pool the HELLO named


# one-key GET replies of a bad server whose size does not fit the pool, the frame or
# the caller's buffer: (call, reply); each is a ProtocolError (or, for a buffer too
# small for a value that fits the pool, the ValueError get_into documents)
ONE_KEY_CASES = {
    # the usual form (one frame of exactly the stated size), read by the C path
    "past_pool_get": (lambda c: c.get(b"a"),
                      (0, {"sizes": [BIG], "counts": [1]}, [b"x" * BIG])),
    "past_pool_get_into": (lambda c: c.get_into(b"a", bytearray(BIG)),
                           (0, {"sizes": [BIG], "counts": [1]}, [b"x" * BIG])),
    # past the pool and over the C path's copy threshold (a zmq Frame, Python path)
    "far_past_pool_get": (lambda c: c.get(b"a"),
                          (0, {"sizes": [1 << 17], "counts": [1]}, [b"x" * (1 << 17)])),
    "far_past_pool_get_into": (lambda c: c.get_into(b"a", bytearray(1 << 17)),
                               (0, {"sizes": [1 << 17], "counts": [1]},
                                [b"x" * (1 << 17)])),
    # a size larger than the frame that came
    "past_frame_get": (lambda c: c.get(b"a"), (0, {"sizes": [100], "counts": [1]}, [b"x"])),
    "past_frame_get_into": (lambda c: c.get_into(b"a", bytearray(100)),
                            (0, {"sizes": [100], "counts": [1]}, [b"x"])),
    # a size with no frame at all
    "no_frame_get": (lambda c: c.get(b"a"), (0, {"sizes": [10], "counts": [1]}, [])),
    "no_frame_get_into": (lambda c: c.get_into(b"a", bytearray(10)),
                          (0, {"sizes": [10], "counts": [1]}, [])),
    # a frame longer than the size stated
    "short_size_get": (lambda c: c.get(b"a"), (0, {"sizes": [1], "counts": [1]}, [b"xyz"])),
}


@pytest.mark.parametrize("case", sorted(ONE_KEY_CASES))
def test_a_one_key_get_reply_past_the_pool_or_frame_is_a_protocol_error(tcp_fake, case):
    fake, c = tcp_fake
    fn, reply = ONE_KEY_CASES[case]
    fake.script(reply)
    with pytest.raises(ProtocolError):
        fn(c)
    assert fake.requests[-1][0] == Op.GET
    # the client goes on: a well-formed reply is read as ever, by both calls
    fake.script((0, {"sizes": [2], "counts": [1]}, [b"ok"]))
    assert c.get(b"a") == b"ok"
    out = bytearray(4)
    fake.script((0, {"sizes": [2], "counts": [1]}, [b"ok"]))
    assert c.get_into(b"a", out) == 2
    assert out == b"ok\0\0"


def test_a_one_key_get_into_a_buffer_too_small_is_a_value_error_and_writes_nothing(
        tcp_fake):
    fake, c = tcp_fake
    out = bytearray(b"....")
    fake.script((0, {"sizes": [8], "counts": [1]}, [b"12345678"]))
    with pytest.raises(ValueError):
        c.get_into(b"a", out)
    assert out == b"...."
    fake.script((0, {"sizes": [2], "counts": [1]}, [b"ok"]))
    assert c.get(b"a") == b"ok"


def test_a_one_key_get_into_past_the_pool_writes_nothing_into_out(tcp_fake):
    fake, c = tcp_fake
    out = bytearray(b"." * BIG)
    fake.script((0, {"sizes": [BIG], "counts": [1]}, [b"x" * BIG]))
    with pytest.raises(ProtocolError):
        c.get_into(b"a", out)
    assert out == b"." * BIG


# ------------------------------------------------------------------ 3. HELLO mid-settle

@pytest.mark.parametrize("who", ["same", "other"])
def test_a_hello_while_the_sessions_large_commit_is_settled_in_slices_is_answered(
        shm_name, who):
    """A HELLO with the session's nonce (the same connection saying it again, as a
    client does after a timeout, or a new connection of that client) that arrives
    between the slices of its session's large COMMIT gets its reply, and the COMMIT is
    answered too."""
    from test_slices import BS as SBS, SLICE, Bed, keys_of

    bed = Bed(shm_name)
    try:
        n = 1_000
        keys = keys_of(n)
        big = bed.client()
        nonce = b"n" * 16
        bed.send(big, Op.HELLO, {"nonce": nonce})
        bed.until(big)
        assert bed.recv(big)[0] == 0
        rid = bed.send(big, Op.ALLOC, {"keys": keys, "sizes": [SBS] * n})
        bed.until(big)
        assert bed.recv(big)[2]["st"] == [0] * n
        crid = bed.send(big, Op.COMMIT, {"commit": [rid]})
        bed.turn()
        bed.turn()
        assert not bed.arrived(big)         # the commit is being settled, in slices
        again = big if who == "same" else bed.client()
        hrid = bed.send(again, Op.HELLO, {"nonce": nonce})
        got = {}
        for _ in range(10 * n // SLICE):
            bed.turn()
            for s in {big, again}:
                while bed.arrived(s):
                    st, r, body, _ = bed.recv(s)
                    got[r] = (st, body)
            if len(got) == 2:
                break
        assert hrid in got, f"the HELLO was never answered (replies: {sorted(got)})"
        assert got[hrid][0] == 0 and "epoch" in got[hrid][1]
        assert crid in got, f"the COMMIT was never answered (replies: {sorted(got)})"
        # settled in full for the session that took the grants over: every key is in
        assert got[crid][0] == 0 and "commit_failed" not in got[crid][1]
        bed.settle()
        stats = bed.store.stats(verify=True)
        assert stats["accounting_ok"]
        assert (stats["num_keys"], stats["pending"], stats["grants"]) == (n, 0, 0)
        assert all(k in bed.store.index for k in keys)
    finally:
        bed.close()


# ------------------------------------------------------------------ 2. huge claims

class RawFake(FakeServer):
    """FakeServer whose scripted GET replies are raw header frames (``bytes``, with the
    request id packed in by ``make(rid)``), to claim what msgpack cannot be asked to
    pack: an array of 2**32 items in a few bytes."""

    def _run(self) -> None:
        import zmq

        from kvshm.zmq_ctrl.protocol import decode_request

        s = zmq.Context.instance().socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            port = s.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"127.0.0.1:{port}"
            self._ready.set()
            while not self._stop.is_set():
                if not s.poll(50):
                    continue
                msg = s.recv_multipart()
                ident = msg[0]
                _, op, rid, _, body = decode_request(msg[1])
                if op == Op.HELLO:
                    s.send_multipart([ident, encode_reply(0, rid, self._hello(body))])
                    continue
                self.requests.append((op, rid, body))
                if op != Op.GET:
                    s.send_multipart([ident, encode_reply(0, rid, {})])
                    continue
                try:
                    make = self.replies.get_nowait()
                except Exception:
                    continue
                s.send_multipart([ident, *make(rid)])   # type: ignore[operator]
        except BaseException as exc:
            self.error = exc
            self._ready.set()
        finally:
            s.close(0)


def _head(rid: int, body_tail: bytes) -> bytes:
    """A reply header [2, 0, rid, {"sizes": <body_tail>}] with the raw msgpack bytes
    of the sizes' value."""
    import msgpack

    return b"\x94\x02\x00" + msgpack.packb(rid) + b"\x81\xa5sizes" + body_tail


@pytest.mark.parametrize("wire", ["zmtp", "libzmq"])
@pytest.mark.parametrize("claim", [
    b"\xdd\xff\xff\xff\xff" + b"\x01" * 8,          # an array of 2**32 - 1 sizes
    b"\x91\xc6\xff\xff\xff\xff" + b"x" * 8,         # a bin of 4 GiB
    b"\x91\xdf\xff\xff\xff\xff" + b"\x01" * 8,      # a map of 2**32 - 1 pairs
])
def test_a_reply_header_claiming_a_huge_container_is_a_protocol_error(monkeypatch, wire,
                                                                       claim):
    """What held: the header is decoded by msgpack's unpackb, which bounds every
    container by the bytes of the frame, so a claim of 2**32 items in a few bytes is
    refused before anything is allocated for it."""
    if wire == "libzmq":
        monkeypatch.setattr(channel, "ZMTP", False)
    elif not channel.ZMTP:
        pytest.skip("the ZMTP transport is off (KVSHM_ZMTP=0)")
    fake = RawFake()
    c = Client(fake.address, transport="tcp", timeout=5)
    try:
        for fn in (lambda: c.get(b"a"), lambda: c.get_batch([b"a", b"b"])):
            fake.script(lambda rid: [_head(rid, claim)])
            with pytest.raises(ProtocolError):
                fn()
        # the client goes on: a well-formed reply is read as ever
        fake.script(lambda rid: [encode_reply(0, rid, {"sizes": [2], "counts": [1]}),
                                 b"ok"])
        assert c.get(b"a") == b"ok"
    finally:
        c.close()
        fake.close()
