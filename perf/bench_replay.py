"""kvshm against Redis on the same replay of a real trace, in one command.

Runs ``kvshm replay`` once per backend, one after the other, on the same requests with the
same block size and the same capacity (kvshm's pool; Redis's maxmemory with
allkeys-lru), each backend's server started and stopped by the replay itself, and prints
both sets of figures and the ratios::

    python perf/bench_replay.py                       # full trace, 256 KiB blocks, 4 GiB
    python perf/bench_replay.py --requests 3000 --block-bytes 64K --pool-gib 0.5

Throughput is (bytes read + bytes written) / seconds of the replay (server start-up not
counted); every block read is checked byte for byte in both runs. The two backends do
the same requests but not quite the same bytes: a backend with a lower hit rate writes
more. So two ratios are printed: GB/s (kvshm / redis) and wall time for the same requests
(redis / kvshm). Needs redis-server on PATH and the redis Python package. Exit status 1
when a replay fails or reports a mismatch or an error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIELDS = [
    ("seconds", "seconds", "{:.2f}"),
    ("gbps", "GB/s", "{:.2f}"),
    ("requests_per_s", "requests/s", "{:.0f}"),
    ("p50_ms", "p50 ms", "{:.2f}"),
    ("p99_ms", "p99 ms", "{:.2f}"),
    ("hit_rate", "hit rate %", "{:.2%}"),
    ("lru_hit_rate", "exact LRU %", "{:.2%}"),
    ("bound_hit_rate", "bound %", "{:.2%}"),
    ("evictions", "evictions", "{}"),
    ("bytes_read", "GB read", "{:.2f}"),
    ("bytes_written", "GB written", "{:.2f}"),
    ("mismatches", "mismatches", "{}"),
    ("errors", "errors", "{}"),
]


def replay(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvshm", "replay", "--json", "--no-progress",
           "--backend", backend, "--block-bytes", str(args.block_bytes),
           "--pool-gib", str(args.pool_gib), "--clients", str(args.clients)]
    if args.requests:
        cmd += ["--requests", str(args.requests)]
    if args.trace:
        cmd += ["--trace", args.trace]
    print(f"# {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    wall = time.monotonic() - t
    if p.returncode not in (0, 1) or not p.stdout.strip():
        raise SystemExit(f"bench_replay: {backend} replay failed ({p.returncode}):\n"
                         f"{p.stderr.strip()}")
    s: dict[str, Any] = json.loads(p.stdout)
    s["command_seconds"] = wall
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=None, help="first N requests (all)")
    ap.add_argument("--block-bytes", default="256K", help="block bytes (256K)")
    ap.add_argument("--pool-gib", type=float, default=4.0, help="capacity in GiB (4)")
    ap.add_argument("--clients", type=int, default=1, help="client processes (1)")
    ap.add_argument("--trace", default=None, help="trace file (the bundled one)")
    ap.add_argument("--kvshm-backend", default="kvshm", choices=["kvshm", "kvshm-tcp"],
                    help="kvshm mover to compare (kvshm = shared memory)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per replay")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)

    runs = {b: replay(b, args) for b in (args.kvshm_backend, "redis")}
    k, r = runs[args.kvshm_backend], runs["redis"]
    ratio_gbps = k["gbps"] / r["gbps"] if r["gbps"] else float("inf")
    ratio_time = r["seconds"] / k["seconds"] if k["seconds"] else float("inf")
    ok = all(s["mismatches"] == 0 and s["errors"] == 0 for s in runs.values())
    if args.json:
        print(json.dumps({"runs": runs, "ratio_gbps": ratio_gbps, "ratio_time": ratio_time,
                          "ok": ok}, sort_keys=True))
        return 0 if ok else 1
    print(f"replay of {k['requests']} requests ({k['blocks']} blocks of {k['block_bytes']} "
          f"bytes), capacity {k['capacity_bytes'] / 2**30:g} GiB = {k['capacity_blocks']} "
          f"blocks, {k['clients']} client(s)")
    names = list(runs)
    print(f"{'':14}" + "".join(f"{n:>16}" for n in names))
    for key, label, fmt in FIELDS:
        cells = []
        for n in names:
            v = runs[n][key]
            if key.startswith("bytes_"):
                v = v / 1e9
            cells.append(fmt.format(v))
        print(f"{label:14}" + "".join(f"{c:>16}" for c in cells))
    print(f"{args.kvshm_backend} / redis: {ratio_gbps:.2f}x the GB/s, "
          f"{ratio_time:.2f}x less time for the same requests")
    if not ok:
        print("FAILED: a replay reported mismatches or errors", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
