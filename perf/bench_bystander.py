#!/usr/bin/env python3
"""A bystander's latency while another client sends 1 M-key requests.

    python perf/bench_bystander.py [--keys 1000000] [--seconds 10] [--pool-gib 0.25]

One server; a bystander process loops single-key get_into (4 KiB, shm) and records each
call's latency; a second process (another principal: a TCP client with the door token)
sends, back to back, requests of --keys keys: EXISTS, MATCH_PREFIX, and ALLOC of that
many zero-byte values (each holds a block: refused beyond its quota) followed by ABORT.
Prints the bystander's p50/p99/max alone (baseline, same run) and under that load, and
the big requests' own time. The server's loop is one thread: a request of a million
keys holds it for its whole duration, so the bystander's p99 under load is about one big
request's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from servers import ServerProcess  # noqa: E402

BYSTANDER = """
    import json, sys, time, numpy as np, kvshm
    address, seconds = sys.argv[1], float(sys.argv[2])
    c = kvshm.Client(address, transport="shm", timeout=60)
    c.put("by", np.ones(4096, np.uint8))
    out = np.empty(4096, np.uint8)
    for _ in range(200):
        c.get_into("by", out)
    print("ready", flush=True)
    sys.stdin.readline()
    lat = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        c.get_into("by", out)
        lat.append(time.perf_counter() - t)
    print(json.dumps(lat), flush=True)
"""

HEAVY = """
    import json, os, sys, time, msgpack, zmq
    sys.path.insert(0, sys.argv[3])
    from servers import raw_hello
    from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, decode_reply
    address, n = sys.argv[1], int(sys.argv[2])
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{address}")
    ep = raw_hello(s, address)["epoch"]
    keys = [b"big-%07d" % i for i in range(n)]
    rid = 10
    def call(op, body):
        global rid
        rid += 1
        t = time.perf_counter()
        s.send(msgpack.packb([PROTOCOL_VERSION, op, rid, ep, body], use_bin_type=True))
        assert s.poll(600_000)
        st, _, b = decode_reply(s.recv_multipart()[0])
        assert st == 0, b
        return time.perf_counter() - t
    print("ready", flush=True)
    sys.stdin.readline()
    took = {"EXISTS": [], "MATCH_PREFIX": [], "ALLOC": []}
    end = time.monotonic() + float(sys.argv[4])
    while time.monotonic() < end:
        took["EXISTS"].append(call(Op.EXISTS, {"keys": keys}))
        took["MATCH_PREFIX"].append(call(Op.MATCH_PREFIX, {"keys": keys}))
        took["ALLOC"].append(call(Op.ALLOC, {"keys": keys, "sizes": [0] * n}))
        call(Op.COMMIT, {"abort": [rid]})
    print(json.dumps(took), flush=True)
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def bystander(address: str, seconds: float, heavy: subprocess.Popen | None) -> list[float]:
    b = run(BYSTANDER, address, str(seconds))
    assert b.stdin is not None and b.stdout is not None
    assert b.stdout.readline().strip() == "ready"
    b.stdin.write("go\n")
    b.stdin.flush()
    if heavy is not None:
        assert heavy.stdin is not None
        heavy.stdin.write("go\n")
        heavy.stdin.flush()
    lat = json.loads(b.stdout.readline())
    b.wait(60)
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--pool-gib", type=float, default=0.25)
    args = ap.parse_args()
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
    with ServerProcess("--max-batch", str(max(args.keys, 1)), "--block-size", "4",
                       prealloc_size=args.pool_gib) as srv:
        alone = bystander(srv.address, args.seconds / 2, None)
        h = run(HEAVY, srv.address, str(args.keys), tests, str(args.seconds))
        assert h.stdout is not None
        assert h.stdout.readline().strip() == "ready"
        loaded = bystander(srv.address, args.seconds, h)
        took = json.loads(h.stdout.readline())
        h.wait(600)
    ms = 1e3
    print(f"bystander get_into 4 KiB (shm), {args.keys:,}-key requests from another "
          f"client ({args.seconds:g} s)")
    for name, lat in (("alone", alone), ("under load", loaded)):
        print(f"  {name:<11} n={len(lat):>7,}  p50 {pct(lat, .5) * ms:8.3f} ms  "
              f"p99 {pct(lat, .99) * ms:8.3f} ms  max {max(lat) * ms:8.1f} ms")
    for op, ts in took.items():
        if ts:
            print(f"  {op:<12} of {args.keys:,} keys: median {statistics.median(ts) * ms:7.0f} ms"
                  f" ({len(ts)} requests)")
    print(f"  ratio p99 under load / alone: {pct(loaded, .99) / pct(alone, .99):.0f}x")


if __name__ == "__main__":
    main()
