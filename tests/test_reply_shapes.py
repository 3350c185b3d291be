"""GET and LOOKUP replies whose sizes, places, counts or sums do not fit the keys asked
(a bad or hostile server): the client raises ProtocolError, never returns other bytes,
never raises IndexError, never crashes or hangs, and goes on with the next request.

The server is a raw ZeroMQ ROUTER in a thread of the test that answers HELLO as a server
does and every other request with the next scripted reply. For LOOKUP (the one-sided
shm path) its HELLO names a pool the test made, so the client maps it and reads values
at the places the reply gives.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import msgpack
import pytest
import zmq

from kvshm import Client, Pool, segments
from kvshm.errors import ProtocolError
from kvshm.limits import Limits
from kvshm.zmq_ctrl.protocol import Op, decode_request, encode_reply

pytestmark = pytest.mark.timeout(120)

BS = 4096
POOL_BYTES = 16 * BS


class FakeServer:
    """A ROUTER on a free tcp port: HELLO answered (``pool`` named in it, local once
    the client says it holds its liveness proof), every GET and LOOKUP answered with
    the next of :meth:`script`'s replies ``(status, body, frames)`` (none scripted: no
    answer), any other request with an empty OK; what came is in ``requests`` as
    ``(op, req_id, body)``."""

    def __init__(self, pool: Pool | None = None) -> None:
        self.pool = pool
        self.replies: "queue.Queue[tuple[int, dict[str, Any], list[bytes]]]" = queue.Queue()
        self.requests: list[tuple[int, int, dict[str, Any]]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.address = ""
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()
        assert self._ready.wait(20), "the fake server did not bind"

    def script(self, *replies: tuple[int, dict[str, Any], list[bytes]]) -> None:
        for r in replies:
            self.replies.put(r)

    def _hello(self, body: dict[str, Any]) -> dict[str, Any]:
        pool = self.pool
        info: dict[str, Any] = {"name": "/kvshm-no-such-pool", "size": POOL_BYTES,
                                "block_size": BS, "token_digest": b"\0" * 16}
        if pool is not None:
            info = {"name": pool.name, "size": pool.size, "block_size": BS,
                    "token_digest": segments.token_digest(pool.token)}
        return {"version": 2, "pool": info, "limits": Limits().to_wire(),
                "lease_timeout": 10.0, "server": {"pid": 1, "host": "fake"},
                "max_message": 1 << 26, "epoch": 77, "session": 5,
                "local": pool is not None and bool(body.get("proof"))}

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            port = s.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"127.0.0.1:{port}"
            self._ready.set()
            while not self._stop.is_set():
                if not s.poll(50):
                    continue
                msg = s.recv_multipart()
                ident, head = msg[0], msg[1]
                _, op, rid, _, body = decode_request(head)
                if op == Op.HELLO:
                    s.send_multipart([ident, encode_reply(0, rid, self._hello(body))])
                    continue
                self.requests.append((op, rid, body))
                if op not in (Op.GET, Op.LOOKUP):   # BYE, a RELEASE of its own: done
                    s.send_multipart([ident, encode_reply(0, rid, {})])
                    continue
                try:
                    st, rbody, frames = self.replies.get_nowait()
                except queue.Empty:
                    continue        # unscripted: no answer (the client's timeout says)
                s.send_multipart([ident, encode_reply(st, rid, rbody), *frames])
        except BaseException as exc:        # reported by close()
            self.error = exc
            self._ready.set()
        finally:
            s.close(0)

    def close(self) -> None:
        self._stop.set()
        self._th.join(10)
        assert not self._th.is_alive()
        if self.error is not None:
            raise self.error


@pytest.fixture
def tcp_fake():
    fake = FakeServer()
    c = Client(fake.address, transport="tcp", timeout=5)
    try:
        yield fake, c
    finally:
        c.close()
        fake.close()


# the GET replies of a bad server for the keys asked (the operation's own checks of the
# caller's arguments pass): each a ProtocolError
GET_CASES: dict[str, tuple[Any, tuple[int, dict[str, Any], list[bytes]]]] = {
    # fewer sizes than keys: the second key's answer missing (was: one value for two)
    "sizes_short": (lambda c: c.get_batch([b"a", b"b"]),
                    (0, {"sizes": [1], "counts": [1]}, [b"x"])),
    # more sizes than keys: the first key would read "x", another key's bytes' start
    "sizes_long": (lambda c: c.get_batch([b"a"]),
                   (0, {"sizes": [1, 1], "counts": [2]}, [b"xy"])),
    "sizes_long_into": (lambda c: c.get_batch_into([b"a"], [bytearray(4)]),
                        (0, {"sizes": [1, 1], "counts": [2]}, [b"xy"])),
    "sizes_long_one": (lambda c: c.get(b"a"), (0, {"sizes": [1, 1], "counts": [2]}, [b"xy"])),
    "sizes_none": (lambda c: c.get_batch([b"a"]), (0, {"sizes": None}, [])),
    "sizes_dict": (lambda c: c.get_batch([b"a"]), (0, {"sizes": {"0": 1}}, [])),
    "no_sizes": (lambda c: c.get_batch([b"a", b"b"]), (0, {}, [])),
    "size_str": (lambda c: c.get_batch([b"a", b"b"]),
                 (0, {"sizes": ["1", -1], "counts": [1]}, [b"x"])),
    "size_bool": (lambda c: c.get_batch([b"a", b"b"]),
                  (0, {"sizes": [True, -1], "counts": [1]}, [b"x"])),
    "size_float": (lambda c: c.get_batch([b"a", b"b"]),
                   (0, {"sizes": [1.0, -1], "counts": [1]}, [b"x"])),
    "size_negative": (lambda c: c.get_batch([b"a", b"b"]), (0, {"sizes": [-7, -1]}, [])),
    "size_huge": (lambda c: c.get_batch([b"a", b"b"]),
                  (0, {"sizes": [2**64 - 1, -1], "counts": [1]}, [b"x"])),
    "size_past_pool": (lambda c: c.get_batch([b"a", b"b"]),
                       (0, {"sizes": [POOL_BYTES + 1, -1], "counts": [1]},
                        [b"x" * (POOL_BYTES + 1)])),
    "counts_int": (lambda c: c.get_batch([b"a", b"b"]),
                   (0, {"sizes": [1, 1], "counts": 2}, [b"xy"])),
    "counts_int_into": (lambda c: c.get_batch_into([b"a", b"b"], [bytearray(2)] * 2),
                        (0, {"sizes": [1, 1], "counts": 2}, [b"xy"])),
    "frames_short": (lambda c: c.get_batch([b"a", b"b"]),
                     (0, {"sizes": [1, 3], "counts": [2]}, [b"xy"])),
    "sums_short": (lambda c: c.get_batch([b"a", b"b"], verify=True),
                   (0, {"sizes": [1, 1], "counts": [2], "sums": [1]}, [b"xy"])),
    "sums_str": (lambda c: c.get_batch([b"a"], verify=True),
                 (0, {"sizes": [1], "counts": [1], "sums": ["1"]}, [b"x"])),
}


@pytest.mark.parametrize("case", sorted(GET_CASES))
def test_a_get_reply_that_does_not_fit_the_keys_is_a_protocol_error(tcp_fake, case):
    fake, c = tcp_fake
    fn, reply = GET_CASES[case]
    fake.script(reply)
    with pytest.raises(ProtocolError):
        fn(c)
    # the client goes on: a well-formed reply is read as ever
    fake.script((0, {"sizes": [2, -1], "counts": [1]}, [b"ok"]))
    assert c.get_batch([b"a", b"b"]) == [b"ok", None]


# ------------------------------------------------------------------ LOOKUP (shm)

@pytest.fixture
def shm_fake(shm_name):
    pool = Pool.create(shm_name, POOL_BYTES, BS)
    fake = FakeServer(pool)
    c = None
    try:
        pool.write(0, b"0123456789")
        pool.write(POOL_BYTES - 4, b"WXYZ")
        c = Client(fake.address, transport="shm", timeout=5)
        assert c._session.transport_name == "shm"
        yield fake, c, pool
    finally:
        if c is not None:
            c.close()
        fake.close()
        pool.close()
        pool.unlink()


LOOKUP_CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "sizes_short": (lambda c: c.get_batch([b"a", b"b"]), {"offsets": [0, -1], "sizes": [3]}),
    "sizes_long": (lambda c: c.get_batch([b"a"]), {"offsets": [0, 3], "sizes": [3, 3]}),
    "offsets_short": (lambda c: c.get_batch([b"a", b"b"]),
                      {"offsets": [0], "sizes": [3, 3]}),
    "offsets_long_into": (lambda c: c.get_batch_into([b"a"], [bytearray(8)]),
                          {"offsets": [0, 4], "sizes": [3]}),
    "no_offsets": (lambda c: c.get(b"a"), {"sizes": [3]}),
    "offsets_none": (lambda c: c.get(b"a"), {"offsets": None, "sizes": [3]}),
    "size_str": (lambda c: c.get(b"a"), {"offsets": [0], "sizes": ["3"]}),
    "size_negative": (lambda c: c.get(b"a"), {"offsets": [0], "sizes": [-9]}),
    "offset_negative": (lambda c: c.get(b"a"), {"offsets": [-4096], "sizes": [3]}),
    "offset_past_pool": (lambda c: c.get(b"a"), {"offsets": [POOL_BYTES], "sizes": [1]}),
    "value_past_pool": (lambda c: c.get(b"a"), {"offsets": [POOL_BYTES - 4], "sizes": [8]}),
    "value_past_pool_into": (lambda c: c.get_into(b"a", bytearray(8)),
                             {"offsets": [POOL_BYTES - 4], "sizes": [8]}),
    "offset_str": (lambda c: c.get(b"a"), {"offsets": ["0"], "sizes": [3]}),
    "offset_bool": (lambda c: c.get(b"a"), {"offsets": [True], "sizes": [3]}),
    "offset_huge": (lambda c: c.get(b"a"), {"offsets": [2**64 - 1], "sizes": [3]}),
    "extents_short": (lambda c: c.get(b"a"), {"offsets": [[[0, 2], [4, 1]]], "sizes": [5]}),
    "extents_empty": (lambda c: c.get(b"a"), {"offsets": [[]], "sizes": [1]}),
    "extent_one_item": (lambda c: c.get(b"a"), {"offsets": [[[0]]], "sizes": [1]}),
    "extent_past_pool": (lambda c: c.get(b"a"),
                         {"offsets": [[[0, 2], [POOL_BYTES - 1, 2]]], "sizes": [4]}),
    "extent_negative": (lambda c: c.get(b"a"), {"offsets": [[[-8, 8]]], "sizes": [4]}),
    "sums_short": (lambda c: c.get_batch([b"a", b"b"], verify=True),
                   {"offsets": [0, 3], "sizes": [3, 3], "sums": [1]}),
}


@pytest.mark.parametrize("case", sorted(LOOKUP_CASES))
def test_a_lookup_reply_that_does_not_fit_the_keys_or_the_pool_is_a_protocol_error(
        shm_fake, case):
    fake, c, pool = shm_fake
    fn, body = LOOKUP_CASES[case]
    fake.script((0, body, []))
    with pytest.raises(ProtocolError):
        fn(c)
    op, rid, _ = fake.requests[-1]
    assert op == Op.LOOKUP
    # the client goes on, and the refused LOOKUP's pins are released (piggybacked on
    # the next request): a well-formed reply is read as ever, at its places
    fake.script((0, {"offsets": [0, [[3, 2], [POOL_BYTES - 4, 4]], -1],
                     "sizes": [3, 6, -1]}, []))
    assert c.get_batch([b"a", b"b", b"c"]) == [b"012", b"34WXYZ", None]
    assert rid in fake.requests[-1][2].get("release", ())
