#!/usr/bin/env python3
"""Batch EXISTS / MATCH_PREFIX (/ GET) over TCP: keys/s, and CPU per key on both ends.

    python perf/bench_batchq.py [--keys 100000] [--reps 5] [--modes 0,1] [--pyspy DIR]

For each mode (the value of ``KVSHM_BATCHPATH`` given to a fresh server and to the
client's process: 0 = the Python paths, 1 = the C batch paths of
:mod:`kvshm.zmq_ctrl._batchq`), one TCP client
puts ``--keys`` keys of 64 bytes, then times ``exists_batch``, ``match_prefix`` and
``get_batch`` of all of them ``--reps`` times. Printed per op: the median keys/s (wall),
the server's CPU microseconds per key (``/proc/PID/stat``, all its threads) and this
client's (``time.process_time``), with the load average. ``--pyspy DIR`` records the
server (and writes the raw profiles there) during the exists/match_prefix reps.
"""

from __future__ import annotations

import argparse
import json
import signal
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

from _common import cpu_seconds  # noqa: E402
from servers import ServerProcess  # noqa: E402

PYSPY = "/work/main/.venv/bin/py-spy"


def run(mode: str, n: int, reps: int, pyspy: str | None) -> dict[str, list[float]]:
    import kvshm

    keys = [f"batch-{i:012d}".encode() for i in range(n)]
    vals = [bytes([i & 0xff]) * 64 for i in range(n)]
    pool = max(0.0625, round((2.5 * n * 4096 + (32 << 20)) / 2**30, 4))
    out: dict[str, list[float]] = {}
    with ServerProcess("--block-size", "4", "--max-batch", str(max(n, 100000)),
                       prealloc_size=pool, env={"KVSHM_BATCHPATH": mode}) as srv:
        pid = srv.pid
        with kvshm.Client(srv.address, transport="tcp", timeout=120) as c:
            c.put_batch(keys, vals)
            spy = None
            if pyspy:
                spy = subprocess.Popen([PYSPY, "record", "-p", str(pid), "-d", "30", "-f",
                                        "raw", "-o", os.path.join(pyspy, f"srv{mode}.txt"),
                                        "-r", "300", "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            ops: dict[str, Callable[[], Any]] = {"exists": lambda: c.exists_batch(keys),
                   "match_prefix": lambda: c.match_prefix(keys),
                   "get": lambda: c.get_batch(keys)}
            for name, f in ops.items():
                if name == "get" and spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait()
                    spy = None
                for _ in range(reps):
                    s0, c0, t0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
                    r = f()
                    t1, c1, s1 = time.perf_counter(), time.process_time(), cpu_seconds(pid)
                    if name == "exists" and not all(r):
                        raise RuntimeError("exists_batch missed keys")
                    if name == "match_prefix" and r != n:
                        raise RuntimeError(f"match_prefix {r} != {n}")
                    out.setdefault(name, []).append(n / (t1 - t0))
                    out.setdefault(name + "_srv_us", []).append((s1 - s0) / n * 1e6)
                    out.setdefault(name + "_cli_us", []).append((c1 - c0) / n * 1e6)
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default="0,1")
    ap.add_argument("--pyspy", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run(a.child, a.keys, a.reps, a.pyspy)))
        return 0
    for mode in a.modes.split(","):
        la0 = os.getloadavg()[0]
        # a process per mode: the client's end reads KVSHM_BATCHPATH at import too
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--keys",
               str(a.keys), "--reps", str(a.reps)] + (["--pyspy", a.pyspy] if a.pyspy else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env={**os.environ, "KVSHM_BATCHPATH": mode}).stdout
        r = json.loads(out.strip().splitlines()[-1])
        la1 = os.getloadavg()[0]
        print(f"KVSHM_BATCHPATH={mode}  (load {la0:.2f} -> {la1:.2f})")
        for op in ("exists", "match_prefix", "get"):
            # CPU: the mean over all reps (/proc/PID/stat ticks are 10 ms: ~0.1 us a key
            # of one 100 k-key request)
            print(f"  {op:13s} {statistics.median(r[op]) / 1e6:6.2f} M keys/s   server "
                  f"{statistics.fmean(r[op + '_srv_us']):.3f} us CPU/key   client "
                  f"{statistics.fmean(r[op + '_cli_us']):.3f} us CPU/key")
    return 0


if __name__ == "__main__":
    sys.exit(main())
