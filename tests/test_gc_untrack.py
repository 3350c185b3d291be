"""A big request's long lists (decoded keys and sizes, PackedValues' sizes, a grant's
entries) are off the garbage collector's lists, so no young collection walks their items
(issue 13: a gen-0 pass over a 100 k-key request's young lists paused the loop).
Counts only, never time. ``KVSHM_UNTRACK=0`` (the off switch) makes the server test fail.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from kvshm._gcutil import untrack_plain
from kvshm.zmq_ctrl import protocol
from kvshm.zmq_ctrl.protocol import Op, RequestDecoder, decode_request, encode_request

from servers import unique_shm_name

HERE = os.path.dirname(os.path.abspath(__file__))
N = 20000


def test_untrack_plain_semantics() -> None:
    from kvshm._index import Entry  # noqa: F401  (a type without Py_TPFLAGS_HAVE_GC)

    lst = [b"k"] * 300 + [1, 2.0, None, True, "s"]
    assert gc.is_tracked(lst) and untrack_plain(lst) and not gc.is_tracked(lst)
    assert lst == [b"k"] * 300 + [1, 2.0, None, True, "s"]
    for bad in ([b"k", []], [b"k", (1, 2)], [type("I", (int,), {})(1)]):
        assert not untrack_plain(bad) and gc.is_tracked(bad)
    grown: list = []
    assert untrack_plain(grown) and not gc.is_tracked(grown)
    grown.extend([b"a"] * 10)
    assert untrack_plain(grown, 0) and not gc.is_tracked(grown)
    grown.append({})
    assert not untrack_plain(grown, 10) and gc.is_tracked(grown)    # tracked again


@pytest.mark.parametrize("sliced", [False, True])
def test_decoded_lists_untracked(sliced: bool) -> None:
    assert protocol._untrack is not None
    keys = [b"big-%07d" % i for i in range(N)]
    body = {"keys": keys, "sizes": list(range(N)), "short": [1, 2]}
    h = encode_request(Op.ALLOC, 7, 1, body)
    if sliced:
        d = RequestDecoder(h)
        while (r := d.step(1000)) is None:
            pass
    else:
        r = decode_request(h)
    assert r[4] == body
    assert not gc.is_tracked(r[4]["keys"]) and not gc.is_tracked(r[4]["sizes"])
    # a list with a container stays tracked (it could be in a cycle)
    odd = {"keys": keys[:500] + [[b"x"]] + keys[:500]}
    h = protocol._packb([protocol.PROTOCOL_VERSION, int(Op.EXISTS), 8, 1, odd])
    d = RequestDecoder(h)
    while (r2 := d.step(100)) is None:
        pass
    assert r2[4] == odd and gc.is_tracked(r2[4]["keys"])
    assert decode_request(h)[4] == odd and gc.is_tracked(decode_request(h)[4]["keys"])


CLIENT = """
import sys, numpy as np, msgpack, zmq, kvshm
sys.path.insert(0, sys.argv[3])
from servers import raw_hello
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, decode_reply
addr, n = sys.argv[1], int(sys.argv[2])
keys = [b"big-%07d" % i for i in range(n)]
c = kvshm.Client(addr, transport="tcp", timeout=120)
print("ready", flush=True); sys.stdin.readline()
c.put_batch(keys, [np.ones(4, np.uint8)] * n)
c.get_batch_into(keys, [np.empty(4, np.uint8) for _ in range(n)])
c.delete(keys)
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect("tcp://" + addr)
ep = raw_hello(s, addr)["epoch"]
for rid, (op, body) in enumerate([(Op.ALLOC, {"keys": keys, "sizes": [4] * n}),
                                  (Op.COMMIT, {"commit": [10]})], 10):
    s.send(msgpack.packb([PROTOCOL_VERSION, op, rid, ep, body], use_bin_type=True))
    assert s.poll(120_000)
    assert decode_reply(s.recv_multipart()[0])[0] == 0
print("done", flush=True)
"""


def test_no_young_collection_walks_a_big_request() -> None:
    """The server's young collections (forced often: threshold 5) while it serves PUT,
    GET, DELETE and ALLOC/COMMIT of 20 k keys: none finds a tracked list of >= N/2
    items of an untracked type (bytes, int, Entry) in the generations it collects."""
    from kvshm.server import Server, ServerConfig

    srv = Server(ServerConfig(service_port=0, manage_port=None, prealloc_size=0.25,
                              block_size=4, max_batch=N, slice_keys=2048,
                              shm_name=unique_shm_name())).start()
    p = subprocess.Popen([sys.executable, "-c", CLIENT, srv.address, str(N), HERE],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    seen: list[tuple[int, str, int]] = []
    collections = [0]

    def cb(phase: str, info: dict) -> None:
        if phase != "start":
            return
        collections[0] += 1
        for g in range(info["generation"] + 1):
            for o in gc.get_objects(g):
                # lists of objects of untracked types (keys, sizes, entries); a list
                # of Outcome members (a few singletons, cached) is not counted
                if (type(o) is list and len(o) >= N // 2
                        and not type(o[0]).__flags__ & (1 << 14)):    # Py_TPFLAGS_HAVE_GC
                    seen.append((info["generation"], type(o[0]).__name__, len(o)))

    saved = gc.get_threshold()
    try:
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline().strip() == "ready"
        gc.set_threshold(5, 10, saved[2])
        gc.callbacks.append(cb)
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "done"
    finally:
        if cb in gc.callbacks:
            gc.callbacks.remove(cb)
        gc.set_threshold(*saved)
        p.kill()
        p.wait(30)
        for f in (p.stdin, p.stdout):
            if f is not None:
                f.close()
        srv.stop()
    assert collections[0] > 0           # the collector did run while the requests lived
    assert seen == []
