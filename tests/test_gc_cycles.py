"""A big request's decoded state is freed by reference counting when the request is done,
never left in a reference cycle for a young collection to free (issue 13: the
``RequestDecoder`` held its generator, whose frame held the decoder; each large header
decoded over turns kept its 100 k keys alive until the next young collection, which then
freed the ~20 requests piled up since, ~2 M objects, in one ~47 ms generation-0 pause).
Counts and references only, never time.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import types
from typing import Any

import pytest

from kvshm.zmq_ctrl import protocol
from kvshm.zmq_ctrl.protocol import Op, RequestDecoder, encode_request

from servers import unique_shm_name

HERE = os.path.dirname(os.path.abspath(__file__))
N = 20000


def _request_state() -> dict[str, int]:
    """Live objects of a request's decoded state that only a collection would free (the
    collector's view: tracked objects): decoders, their generators, slice state."""
    seen: dict[str, int] = {}
    for o in gc.get_objects():
        t = type(o)
        if t.__name__ in ("RequestDecoder", "Counted", "_Decoding", "_Parked", "_Sliced") or (
                t is types.GeneratorType and o.gi_code.co_name == "_walk"):
            seen[t.__name__] = seen.get(t.__name__, 0) + 1
    return seen


def _decode(h: bytes, budget: int) -> tuple[RequestDecoder, Any]:
    d = RequestDecoder(h)
    while (r := d.step(budget)) is None:
        pass
    return d, r


@pytest.mark.parametrize("budget", [1000, 10 ** 9])
def test_decoder_leaves_no_cycle(budget: int) -> None:
    """With the collector off, a decoded request's body is freed once the caller drops
    the decoder and the result: nothing of it is left for a collection to free."""
    keys = [b"big-%07d" % i for i in range(N)]
    h = encode_request(Op.ALLOC, 7, 1, {"keys": keys, "sizes": list(range(N))})
    was = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        d, r = _decode(h, budget)
        got = r[4]["keys"]
        assert got == keys
        before = sys.getrefcount(got)
        del d, r
        # the body dict (one reference to the list) went with the decoder
        assert sys.getrefcount(got) == before - 1
        del got
        assert _request_state() == {}
    finally:
        if was:
            gc.enable()


def test_decoder_after_done_and_on_error() -> None:
    """Once done, a step gives the same result again (as before); a bad header leaves no
    cycle either."""
    h = encode_request(Op.EXISTS, 3, 1, {"keys": [b"a"] * 300})
    d, r = _decode(h, 100)
    assert r[:4] == (protocol.PROTOCOL_VERSION, int(Op.EXISTS), 3, 1)
    assert d.step(100) == r
    del d, r
    was = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        bad = protocol._packb([protocol.PROTOCOL_VERSION, int(Op.EXISTS), "x", 1,
                               {"keys": [b"a"] * 300}])
        d2 = RequestDecoder(bad)
        with pytest.raises(protocol.DecodeError, match="req_id must be an int"):
            while d2.step(50) is None:
                pass
        with pytest.raises(protocol.DecodeError):
            d2.step(50)
        del d2
        assert _request_state() == {}
    finally:
        if was:
            gc.enable()


CLIENT = """
import sys, msgpack, zmq
sys.path.insert(0, sys.argv[3])
from servers import raw_hello
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, decode_reply
addr, n = sys.argv[1], int(sys.argv[2])
keys = [b"big-%07d" % i for i in range(n)]
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect("tcp://" + addr)
ep = raw_hello(s, addr)["epoch"]
print("ready", flush=True); sys.stdin.readline()
rid = 10
for _ in range(2):
    for op, body in [(Op.EXISTS, {"keys": keys}), (Op.MATCH_PREFIX, {"keys": keys}),
                     (Op.ALLOC, {"keys": keys, "sizes": [0] * n}), (Op.COMMIT, None)]:
        rid += 1
        if body is None:
            body = {"abort": [rid - 1]}
        s.send(msgpack.packb([PROTOCOL_VERSION, op, rid, ep, body], use_bin_type=True))
        assert s.poll(120_000)
        assert decode_reply(s.recv_multipart()[0])[0] == 0
print("done", flush=True)
"""


def test_server_requests_leave_no_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bystander benchmark's mix (EXISTS, MATCH_PREFIX, ALLOC and its ABORT of N keys,
    headers decoded over turns, served in slices) with the collector off: once the loop
    stopped, none of the requests' state (decoder, its generator, slice state) is alive,
    i.e. none was left in a cycle. (A collection would not say: the cycle's generator
    frees the rest from its finalizer, so ``collected`` and ``gc.garbage`` stay empty.)"""
    from kvshm.server import Server, ServerConfig
    from kvshm.zmq_ctrl import dispatch, router

    made: list[int] = []

    class Counted(RequestDecoder):
        __slots__ = ()

        def __init__(self, frame: Any) -> None:
            made.append(1)
            super().__init__(frame)

    monkeypatch.setattr(dispatch, "RequestDecoder", Counted)
    # the loop's own full collection (after 1 s quiet) would free a cycle before we look
    monkeypatch.setattr(router.ServiceLoop, "_full_gc", lambda self: None)
    srv = Server(ServerConfig(service_port=0, manage_port=None, prealloc_size=0.25,
                              block_size=4, max_batch=N, slice_keys=2048,
                              shm_name=unique_shm_name())).start()
    p = subprocess.Popen([sys.executable, "-c", CLIENT, srv.address, str(N), HERE],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    was = gc.isenabled()
    try:
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline().strip() == "ready"
        gc.collect()
        before = _request_state()
        gc.disable()
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "done"
        srv.stop()          # the loop's thread returned: none of its frames hold a request
        left = _request_state()
    finally:
        if was:
            gc.enable()
        p.kill()
        p.wait(30)
        for f in (p.stdin, p.stdout):
            if f is not None:
                f.close()
        srv.stop()
    assert len(made) == 2               # both ALLOCs' headers were decoded over turns
    assert before == {} and left == {}
