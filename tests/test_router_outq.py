"""Replies of one turn's drained requests go out together at the end of the drain
(ServiceLoop._outq, over kvshm.zmq_ctrl._zmqc): each peer still gets its replies in the
order of its requests, replies with frames (sent at once) included, and a reply that
cannot be sent is dropped and counted as before."""

from __future__ import annotations

import os
from typing import Any

import msgpack
import pytest
import zmq

from kvshm.zmq_ctrl import router as router_mod
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, Status, decode_reply

from test_router_zmqc import EPOCH, Bed


@pytest.fixture
def bed(shm_name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    if router_mod._zmqc is None:
        pytest.skip("kvshm.zmq_ctrl._zmqc is not built")
    b = Bed(shm_name, True, monkeypatch)
    yield b
    b.close()


def _head(op: int, rid: int, body: Any) -> bytes:
    return msgpack.packb([PROTOCOL_VERSION, int(op), rid, EPOCH, body], use_bin_type=True)


def _drain_replies(bed: Bed, n: int) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    for _ in range(4000):
        bed.loop.turn(5)
        while bed.sock.poll(0):
            out.append(bed.sock.recv_multipart())
        if len(out) >= n:
            return out
    raise AssertionError(f"{len(out)} of {n} replies")


def test_one_turn_many_requests_replies_in_order(bed: Bed) -> None:
    val = os.urandom(4096)
    reqs: list[list[Any]] = []
    rid = 100
    for i in range(40):
        rid += 1
        k = b"k%d" % (i // 4)
        if i % 4 == 0:
            reqs.append([_head(Op.PUT, rid, {"keys": [k], "sizes": [4096], "counts": [1]}),
                         val])
        elif i % 4 == 1:
            reqs.append([_head(Op.GET, rid, {"keys": [k]})])        # frames: sent at once
        elif i % 4 == 2:
            reqs.append([_head(Op.EXISTS, rid, {"keys": [k, b"nope"]})])
        else:
            reqs.append([b"\xc1garbage"])                          # MALFORMED, req_id 0
    for r in reqs:
        bed.sock.send_multipart(r)
    replies = _drain_replies(bed, len(reqs))
    assert len(replies) == len(reqs)
    for i, parts in enumerate(replies):
        st, got, body = decode_reply(parts[0])
        if i % 4 == 3:
            assert st == Status.MALFORMED and got == 0
            continue
        assert got == 101 + i and st == Status.OK
        if i % 4 == 0:
            assert body["st"] == [0]
        elif i % 4 == 1:
            assert body["sizes"] == [4096] and parts[1:] == [val]
        else:
            assert body["found"] == [True, False]
    assert bed.loop._outq is None


def test_queued_reply_to_a_gone_peer_is_dropped_and_counted(bed: Bed) -> None:
    bed.loop._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    bed.loop._outq = q = []
    bed.loop._send(b"\x00nobody", b"header")
    assert q == [(b"\x00nobody", b"header")]
    bed.loop._flush_out(q)
    assert q == [] and bed.loop.errors.get("send_failed") == 1
    bed.loop._outq = None
    st, _, _, _ = bed.req(Op.EXISTS, {"keys": [b"x"]})             # still serving
    assert st == Status.OK


def test_a_copied_small_get_is_settled_when_sent(bed: Bed) -> None:
    val = os.urandom(4096)
    st, _, _, _ = bed.req(Op.PUT, {"keys": [b"s"], "sizes": [4096], "counts": [1]}, [val])
    assert st == Status.OK
    st, _, body, frames = bed.req(Op.GET, {"keys": [b"s"]})
    assert st == Status.OK and frames == [val]
    assert not bed.loop._sending                    # nothing left for a later reap
    assert all(s.quota.sending == 0 for s in bed.loop.sessions())
    big = os.urandom(1 << 20)                       # zero-copy: settled when libzmq is done
    st, _, _, _ = bed.req(Op.PUT, {"keys": [b"b"]}, [big])
    st, _, body, frames = bed.req(Op.GET, {"keys": [b"b"]})
    assert st == Status.OK and frames == [big]
    for _ in range(200):
        bed.loop.turn(5)
        if not bed.loop._sending:
            break
    assert not bed.loop._sending
    assert all(s.quota.sending == 0 for s in bed.loop.sessions())
