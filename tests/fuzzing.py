"""Hypothesis strategies and a harness for fuzzing the protocol decoder and the server.

Used by tests/test_fuzz.py (a short run) and perf/fuzz.py (a long one). The harness
runs a real Store + ServiceLoop in a thread behind an inproc endpoint, so each example
costs a few tens of microseconds, and checks that every request gets a decodable reply,
and that the server still answers and keeps exact accounting afterwards.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import msgpack
import zmq
from hypothesis import strategies as st

from kvshm import Pool
from kvshm.segments import token_digest
from kvshm.store import Store, StoreConfig
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Limits, Op, Status, decode_reply
from kvshm.zmq_ctrl.router import ServiceLoop

FIELDS = ["keys", "sizes", "counts", "sums", "commit", "abort", "release", "ratio", "verify",
          "latency", "client", "version", "transport", "rdma", "nonce", "token", "proof",
          "pid", "host", "session", "prefix", "start", "limit"]

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
           | st.floats(allow_nan=True) | st.binary(max_size=40) | st.text(max_size=12))
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=25)

# Plausible field values: the right shape with wrong contents, huge or negative numbers.
absurd_ints = st.sampled_from([2**40, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), -1, 0, 1])
field_values = st.one_of(
    values,
    absurd_ints,
    st.lists(absurd_ints, max_size=8),
    st.lists(st.integers(min_value=0, max_value=40), min_size=200, max_size=2000),
    st.lists(st.binary(min_size=0, max_size=70), max_size=12),
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=12),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=12),
    st.floats(min_value=-10, max_value=10),
)

bodies = st.dictionaries(st.sampled_from(FIELDS), field_values, max_size=5)
ops = st.one_of(st.sampled_from(list(Op)), st.integers(min_value=-(2**63),
                                                       max_value=2**64 - 1))


def _pack(v: Any) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


@st.composite
def requests(draw: Any, epoch: int) -> list[bytes]:
    """A request as frames: mostly well-formed headers with hostile bodies, sometimes
    wrong versions/epochs/shapes, sometimes raw bytes; plus random payload frames."""
    kind = draw(st.integers(min_value=0, max_value=9))
    if kind == 0:
        header = draw(st.binary(max_size=64))
    elif kind == 1:
        header = _pack(draw(values))
    elif kind == 2:
        header = _pack(draw(st.lists(values, max_size=7)))
    else:
        version = PROTOCOL_VERSION if kind > 3 else draw(st.integers(0, 2**32))
        ep = epoch if draw(st.booleans()) else draw(st.integers(0, 2**63 - 1))
        rid = draw(st.integers(min_value=-(2**63), max_value=2**63 - 1))
        header = _pack([version, draw(ops), rid, ep, draw(bodies)])
        if kind == 9:      # truncated
            header = header[: draw(st.integers(0, max(0, len(header) - 1)))]
    payload = draw(st.lists(st.binary(max_size=300), max_size=3))
    return [header, *payload]


class FuzzServer:
    """A Store and its ServiceLoop serving inproc in a background thread."""

    def __init__(self, pool_bytes: int = 4 << 20, block: int = 4096,
                 lease_timeout: float = 30.0, door_token: bytes | None = None) -> None:
        self.door_token = door_token
        self.ctx = zmq.Context()
        self.pool = Pool.create(f"kvshm-test-fuzz-{uuid.uuid4().hex[:8]}", pool_bytes, block)
        self.store = Store(self.pool, StoreConfig(lease_timeout=lease_timeout,
                                                  limits=Limits(max_key_bytes=64,
                                                                max_batch=64)))
        self.endpoint = f"inproc://fuzz-{uuid.uuid4().hex}"
        self.epoch = 12345
        hello = {"version": PROTOCOL_VERSION,
                 "pool": {"name": self.pool.name, "size": self.pool.size,
                          "block_size": self.pool.block_size,
                          "token_digest": token_digest(self.pool.token)},
                 "limits": self.store.config.limits.to_wire(), "lease_timeout": 30.0,
                 "server": {}, "ipc": None}
        self.loop = ServiceLoop(self.store, [self.endpoint], hello, self.epoch,
                                context=self.ctx, door_token=door_token,
                                operator_token=b"o" * 32 if door_token else None)
        from kvshm.zmq_ctrl.ops_session import SessionOps

        SessionOps(self.loop, idle_timeout=5.0).install()     # BYE is fuzzed too
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        if door_token is not None:
            self.hello()

    def hello(self) -> dict:
        """A valid HELLO (with the door token): this socket has a session again."""
        body = {"nonce": uuid.uuid4().bytes, "token": self.door_token}
        st_, _, reply = self.send([_pack([PROTOCOL_VERSION, Op.HELLO, 0, 0, body])])
        assert st_ == Status.OK, reply
        return reply

    def send(self, frames: list[bytes], timeout_ms: int = 5000) -> tuple[int, int, dict]:
        """Send frames; return the decoded reply. AssertionError if none comes."""
        self.sock.send_multipart(frames)
        assert self.sock.poll(timeout_ms), f"no reply to {frames!r}"
        reply = self.sock.recv_multipart()
        status, rid, body = decode_reply(reply[0])
        assert status in Status._value2member_map_, status
        return status, rid, body

    def check_healthy(self) -> dict:
        """The server answers and its accounting is exact. Returns stats."""
        assert self.thread.is_alive(), "the server loop ended"
        if self.door_token is not None:
            self.hello()           # a hostile HELLO may have replaced this socket's
        st_, _, body = self.send([_pack([PROTOCOL_VERSION, Op.STATS, 1, self.epoch,
                                         {"verify": True}])])
        assert st_ == Status.OK
        stats = body["stats"]
        assert stats["accounting_ok"], stats
        return stats

    def close(self) -> None:
        self.loop.stop()
        self.thread.join(10)
        self.sock.close(0)
        self.loop.close()
        self.ctx.term()
        self.pool.close()
        self.pool.unlink()
