#!/usr/bin/env python3
"""A bystander's latency while another client sends requests of 100 k and 1 M keys.

    python perf/bench_bystander.py [--keys 100000,1000000] [--seconds 6] [--pool-gib 0.25]
                                   [--transport tcp] [--slice-keys 2048] [--no-baseline]

A bystander process loops single-key get_into (4 KiB) and records each call's latency; a
second process (another principal: a TCP client with the door token) sends, back to back,
requests of N keys: EXISTS, MATCH_PREFIX, and ALLOC of that many zero-byte values (each
holds a block: refused beyond its quota) followed by ABORT. The bystander goes over TCP
by default, so every call is served by the server's loop (a same-host shm client reads
through the shared index without asking the server at all: ``--transport shm`` shows
that). Printed, all from the same run: the bystander's p50/p99/max alone and under each
N, the big requests' own time, on a server that serves requests of more than
``--slice-keys`` keys in slices (other requests served between slices) and, unless
``--no-baseline``, on one that does not (``--slice-keys`` above the largest N: the whole
request holds the loop, as before slicing). Each phase runs on a fresh server; beside it
the server's longest loop turn (``stats()["loop_max_turn"]``: CPU seconds of the loop
thread, what every other client waited for whatever the scheduler did, and wall seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from servers import ServerProcess  # noqa: E402

BYSTANDER = """
    import json, sys, time, numpy as np, kvshm
    address, seconds, transport = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    c = kvshm.Client(address, transport=transport, timeout=60)
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


def bystander(address: str, seconds: float, heavy: subprocess.Popen | None,
              transport: str) -> list[float]:
    b = run(BYSTANDER, address, str(seconds), transport)
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


def loop_turn(address: str) -> dict[str, float]:
    """The server's longest loop turn so far (CPU and wall seconds), from STATS."""
    import kvshm

    with kvshm.Client(address, transport="tcp", timeout=60) as c:
        turn: dict[str, float] = c.stats()["loop_max_turn"]
        return turn


def one_server(args: argparse.Namespace, slice_keys: int, sizes: list[int], tests: str
               ) -> list[tuple[str, list[float], dict[str, list[float]], dict[str, float]]]:
    """Each phase on a fresh server, so its longest loop turn is that phase's."""
    rows: list[tuple[str, list[float], dict[str, list[float]], dict[str, float]]] = []
    for n in [0, *sizes]:
        with ServerProcess("--max-batch", str(max(sizes)), "--block-size", "4",
                           "--slice-keys", str(slice_keys),
                           prealloc_size=args.pool_gib) as srv:
            if n == 0:
                lat = bystander(srv.address, args.seconds / 2, None, args.transport)
                rows.append(("alone", lat, {}, loop_turn(srv.address)))
                continue
            h = run(HEAVY, srv.address, str(n), tests, str(args.seconds))
            assert h.stdout is not None
            assert h.stdout.readline().strip() == "ready"
            lat = bystander(srv.address, args.seconds, h, args.transport)
            took = json.loads(h.stdout.readline())
            h.wait(600)
            rows.append((f"{n:,} keys", lat, took, loop_turn(srv.address)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="100000,1000000",
                    help="sizes of the big requests, comma-separated (default 100000,1000000)")
    ap.add_argument("--seconds", type=float, default=6.0,
                    help="seconds of each loaded phase (default 6)")
    ap.add_argument("--pool-gib", type=float, default=0.25, help="pool GiB (default 0.25)")
    ap.add_argument("--transport", default="tcp", choices=("tcp", "shm"),
                    help="the bystander's transport (default tcp: through the loop)")
    ap.add_argument("--slice-keys", type=int, default=2048,
                    help="the server's --slice-keys (default 2048, the server's default)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the server without slices")
    args = ap.parse_args()
    sizes = [int(x) for x in args.keys.split(",")]
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
    servers = [(f"slices of {args.slice_keys:,} keys", args.slice_keys)]
    if not args.no_baseline:
        servers.append(("no slices (baseline)", max(sizes) + 1))
    ms = 1e3
    print(f"bystander get_into 4 KiB ({args.transport}); big requests from another client "
          f"({args.seconds:g} s per phase); load average {os.getloadavg()[0]:.1f} at start")
    for title, sk in servers:
        rows = one_server(args, sk, sizes, tests)
        alone = rows[0][1]
        print(f"server with {title}:")
        for name, lat, took, turn in rows:
            print(f"  {name:<16} n={len(lat):>7,}  p50 {pct(lat, .5) * ms:7.3f} ms  "
                  f"p99 {pct(lat, .99) * ms:7.3f} ms  max {max(lat) * ms:8.1f} ms  "
                  f"p99/alone {pct(lat, .99) / pct(alone, .99):5.1f}x  "
                  f"longest loop turn: cpu {turn['cpu_s'] * ms:6.1f} ms, "
                  f"wall {turn['wall_s'] * ms:6.1f} ms, longest gc {turn['gc_s'] * ms:5.1f} ms "
                  f"(generation {turn.get('gc_generation', -1)})")
            for op, ts in took.items():
                if ts:
                    print(f"      {op:<12} median {statistics.median(ts) * ms:7.0f} ms "
                          f"({len(ts)} requests)")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
