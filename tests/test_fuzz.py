"""Property-based fuzzing of the protocol decoder and the server's message handling.

A short run here; `python perf/fuzz.py --examples 50000` runs the same strategies long.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshm.zmq_ctrl.protocol import (
    PROTOCOL_VERSION,
    DecodeError,
    Op,
    Status,
    decode_reply,
    decode_request,
)
from fuzzing import FuzzServer, requests, values


@given(st.binary(max_size=200))
@settings(max_examples=500, deadline=None)
def test_decode_request_raises_only_decode_error(data):
    try:
        decode_request(data)
    except DecodeError:
        pass


@given(values)
@settings(max_examples=300, deadline=None)
def test_decode_any_msgpack_value(v):
    data = msgpack.packb(v, use_bin_type=True)
    for fn in (decode_request, decode_reply):
        try:
            fn(data)
        except DecodeError:
            pass


def test_huge_declared_counts_are_refused_cheaply():
    # an array header claiming 2**32-1 elements followed by nothing
    for data in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"):
        with pytest.raises(DecodeError):
            decode_request(data)


@pytest.fixture(scope="module")
def fuzz_server():
    srv = FuzzServer()
    yield srv
    srv.close()


@given(data=st.data())
@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_server_answers_every_message_and_stays_consistent(fuzz_server, data):
    frames = data.draw(requests(fuzz_server.epoch))
    fuzz_server.send(frames)
    fuzz_server.check_healthy()


def _req(op, body, rid=1, epoch=None, srv=None):
    return [msgpack.packb([PROTOCOL_VERSION, op, rid, srv.epoch if epoch is None else epoch,
                           body], use_bin_type=True)]


@pytest.mark.parametrize("body,status", [
    ({"keys": [b"a"] * 65, "sizes": [1] * 65}, Status.INVALID_REQUEST),   # batch > limit
    ({"keys": [b"a"], "sizes": [-1]}, Status.OK),                          # per-key error
    ({"keys": [b"a"], "sizes": [2**62]}, Status.OK),                       # per-key error
    ({"keys": [b"a"], "sizes": [1.5]}, Status.OK),
    ({"keys": [b"a", b"b"], "sizes": [1]}, Status.MALFORMED),
    ({"keys": [b"a"], "sizes": [1], "sums": "x"}, Status.MALFORMED),
    ({"keys": None, "sizes": None}, Status.MALFORMED),
])
def test_alloc_edge_cases(fuzz_server, body, status):
    st_, _, reply = fuzz_server.send(_req(Op.ALLOC, body, rid=77, srv=fuzz_server))
    assert st_ == status, reply
    if status == Status.OK:
        assert all(s != Status.OK for s in reply["st"])
        assert reply["offsets"] == [-1] * len(reply["offsets"])
    fuzz_server.check_healthy()


def test_settle_lists_of_unknown_or_hostile_ids(fuzz_server):
    for body in ({"commit": [2**63 - 1, -5]}, {"release": [0, 1, 2]},
                 {"abort": [-(2**63)]}, {"commit": []}):
        st_, _, _ = fuzz_server.send(_req(Op.COMMIT, body, srv=fuzz_server))
        assert st_ == Status.OK
    st_, _, reply = fuzz_server.send(_req(Op.COMMIT, {"commit": [b"x"]}, srv=fuzz_server))
    assert st_ == Status.MALFORMED
    fuzz_server.check_healthy()


@pytest.mark.parametrize("body,frames", [
    ({"keys": [b"a", b"b"], "sizes": [3, 2], "counts": [2]}, [b"abcd"]),        # short
    ({"keys": [b"a", b"b"], "sizes": [3, 2], "counts": [1]}, [b"abcde"]),       # count
    ({"keys": [b"a", b"b"], "sizes": [3, 2], "counts": [2, 1]}, [b"abcde"]),    # frames
    ({"keys": [b"a", b"b"], "sizes": [3, -2], "counts": [2]}, [b"abc"]),        # negative
    ({"keys": [b"a"], "sizes": [1], "counts": [0, 1]}, [b"", b"x"]),            # zero count
])
def test_put_packed_frames_that_do_not_add_up(fuzz_server, body, frames):
    st_, _, reply = fuzz_server.send(_req(Op.PUT, body, srv=fuzz_server) + frames)
    assert st_ == Status.INVALID_REQUEST, reply
    fuzz_server.check_healthy()


def test_put_packed_frames_round_trip(fuzz_server):
    body = {"keys": [b"p1", b"p2", b"p3"], "sizes": [3, 0, 2], "counts": [2, 1]}
    st_, _, reply = fuzz_server.send(_req(Op.PUT, body, srv=fuzz_server) + [b"abc", b"de"])
    assert st_ == Status.OK and reply["st"] == [0, 0, 0]
    st_, _, reply = fuzz_server.send(_req(Op.GET, {"keys": [b"p1", b"zz", b"p2", b"p3"]},
                                          srv=fuzz_server))
    assert st_ == Status.OK and reply["sizes"] == [3, -1, 0, 2] and reply["counts"] == [3]


def test_put_frame_mismatch_and_oversize(fuzz_server):
    st_, _, reply = fuzz_server.send(
        _req(Op.PUT, {"keys": [b"k1", b"k2"]}, srv=fuzz_server) + [b"only-one"])
    assert st_ == Status.INVALID_REQUEST
    big = b"x" * (fuzz_server.pool.size + 1)
    st_, _, reply = fuzz_server.send(_req(Op.PUT, {"keys": [b"k"]}, srv=fuzz_server) + [big])
    assert st_ == Status.OK and reply["st"] == [Status.TOO_LARGE]
    fuzz_server.check_healthy()
