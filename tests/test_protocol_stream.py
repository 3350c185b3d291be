"""protocol.RequestDecoder and ReplyEncoder: the one-go codec's results, a slice at a time."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.zmq_ctrl.protocol import (
    PROTOCOL_VERSION,
    DecodeError,
    ReplyEncoder,
    RequestDecoder,
    Status,
    decode_request,
    encode_reply,
    encode_request,
)


def _stream_decode(frame: bytes, budget: int) -> Any:
    d = RequestDecoder(frame)
    for _ in range(10**6):
        r = d.step(budget)
        if r is not None:
            return r
    raise AssertionError("never done")


def _both(frame: bytes, budget: int) -> tuple[Any, Any]:
    try:
        a: Any = decode_request(frame)
    except DecodeError:
        a = DecodeError
    try:
        b: Any = _stream_decode(frame, budget)
    except DecodeError:
        b = DecodeError
    return a, b


CASES = [
    encode_request(7, 1, 7, {"keys": [b"k%d" % i for i in range(5000)], "sizes": list(range(5000)),
                             "x": {"a": 1}, "n": 5, "e": [], "nest": [[1, 2], {"a": b"b"}]}),
    b"", b"\xc1", b"\x95\x01", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
    msgpack.packb([1, 2, 3]), msgpack.packb({"a": 1}), msgpack.packb([1, "a", 1, 1, {}]),
    msgpack.packb([1, 1, 1.5, 1, {}]), msgpack.packb([1, 1, 1, 1, [1]]),
    msgpack.packb([1, 1, 1, 1, {}]) + b"x", msgpack.packb([1, 1, 1, 1, {1: 2}]),
    msgpack.packb([1, 1, 1, 1, {"a": {1: 2}}]), msgpack.packb([1, 1, 1, 1, {"a": [{1: 2}]}]),
    msgpack.packb([1, 1, 1, 1, {"k": [1, 2, 3]}])[:-1], msgpack.packb([1, 1, True, 1, {}]),
    msgpack.packb([1, 1, 1, 1, {"k": "\u00e9"}]).replace(b"\xc3\xa9", b"\xff\xfe"),
    msgpack.packb([1, 1, 1, 1, {"a": [1, 2]}]) + b"\x00",
    b"\x95\x01\x01\x01\x01\xdf\xff\xff\xff\xff",          # map32 claiming 4 G entries
    b"\x95\x01\x01\x01\x01\x81\xa1a\xdd\xff\xff\xff\xff",  # array32 claiming 4 G items
]


@pytest.mark.parametrize("frame", CASES)
@pytest.mark.parametrize("budget", [1, 3, 4096, 10**7])
def test_decoder_matches_decode_request(frame: bytes, budget: int) -> None:
    a, b = _both(frame, budget)
    assert a == b


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(1, 50))
def test_decoder_on_junk(junk: bytes, budget: int) -> None:
    frame = b"\x95\x01\x07\x01\x07\x81\xa4keys\xdc\x00\x10" + junk
    a, b = _both(frame, budget)
    assert a == b


_values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
                       | st.binary(max_size=8) | st.text(max_size=8),
                       lambda c: st.lists(c, max_size=4), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=6), st.lists(_values, max_size=40) | _values,
                       max_size=5), st.integers(1, 40))
def test_encoder_byte_for_byte(body: dict[str, Any], budget: int) -> None:
    e = ReplyEncoder(Status.OK, 77, body)
    r = None
    for _ in range(10**5):
        r = e.step(budget)
        if r is not None:
            break
    assert r == encode_reply(Status.OK, 77, body)
    assert _stream_decode(encode_request(3, 1, 2, body), budget) == (
        PROTOCOL_VERSION, 3, 1, 2, body)


@pytest.mark.parametrize("n", [0, 15, 16, 65535, 65536, 65537, 200_000])
def test_encoder_array_sizes(n: int) -> None:
    body = {"offsets": list(range(n)), "st": [0] * 3}
    for budget in (1000, 65536, 10**7):
        e = ReplyEncoder(Status.OK, 5, body)
        r = None
        while r is None:
            r = e.step(budget)
        assert r == encode_reply(Status.OK, 5, body)
