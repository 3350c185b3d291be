#!/usr/bin/env python3
"""A shm client's put_batch, A/B of its put paths, beside TCP put_batch in the same run.

    python perf/bench_shmput.py [--keys 100000] [--value-bytes 64] [--reps 3]
                                [--modes shm-base,shm-packed,shm-inline,tcp]
                                [--quick] [--json FILE|-]

One server (4 KiB blocks); for each rep and mode, a fresh client puts --keys keys of
--value-bytes bytes once (warm-up), then times an overwrite of all of them and, after a
delete, a put of them as fresh keys. Modes, the switches set per call in this process:
``shm-base`` (``kvshm.client.PACKED_PUT = False``, i.e. ``KVSHM_PACKED_PUT=0``),
``shm-packed`` (the default), ``shm-inline`` (``kvshm.client.INLINE_PUT = True``, i.e.
``KVSHM_INLINE_PUT=1``), ``tcp`` (the baseline: TCP put_batch of the same keys and values
to the same server). Printed per mode and kind (medians over reps): wall M keys/s, this
process's CPU us/key (``time.process_time``) and the server's (``/proc/PID/stat``), and the
ratio of keys/s to tcp's; load average at start and end. A sample of 1,000 values is read
back after every timed put and compared (a mismatch exits 1). ``--quick``: 5,000 keys, 1 rep.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import cpu_seconds, write_json  # noqa: E402
from servers import ServerProcess  # noqa: E402

import kvshm  # noqa: E402
import kvshm.client  # noqa: E402

MODES = ("shm-base", "shm-packed", "shm-inline", "tcp")
KINDS = ("overwrite", "fresh")


def check(c: Any, keys: list[bytes], vals: list[bytes], mode: str) -> None:
    """Read a sample of the keys back (every len/1000-th) and compare the bytes."""
    idx = list(range(0, len(keys), max(1, len(keys) // 1000)))
    got = c.get_batch([keys[i] for i in idx])
    bad = [i for i, g in zip(idx, got) if g != vals[i]]
    if bad:
        raise SystemExit(f"{mode}: {len(bad)} of {len(idx)} values read back differ "
                         f"(first key {keys[bad[0]]!r})")


def one(srv: ServerProcess, mode: str, keys: list[bytes], vals: list[bytes]
        ) -> dict[str, tuple[float, float, float]]:
    """(keys/s, client us/key, server us/key) of an overwrite and a fresh put in ``mode``."""
    kvshm.client.PACKED_PUT = mode != "shm-base"
    kvshm.client.INLINE_PUT = mode == "shm-inline"
    n, out = len(keys), {}
    try:
        with kvshm.Client(srv.address, transport="tcp" if mode == "tcp" else "shm",
                          timeout=120) as c:
            c.put_batch(keys, vals)
            for kind in KINDS:
                if kind == "fresh":
                    c.delete(keys)
                c0, s0, t0 = time.process_time(), cpu_seconds(srv.pid), time.perf_counter()
                c.put_batch(keys, vals)
                t1, c1, s1 = time.perf_counter(), time.process_time(), cpu_seconds(srv.pid)
                check(c, keys, vals, mode)
                out[kind] = (n / (t1 - t0), (c1 - c0) / n * 1e6, (s1 - s0) / n * 1e6)
    finally:
        kvshm.client.PACKED_PUT, kvshm.client.INLINE_PUT = True, False
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--value-bytes", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    ap.add_argument("--quick", action="store_true", help="smoke run: 5,000 keys, 1 rep")
    ap.add_argument("--json", default=None, metavar="FILE|-")
    args = ap.parse_args()
    if args.quick:
        args.keys, args.reps = 5_000, 1
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        ap.error(f"unknown mode(s) {sorted(set(modes) - set(MODES))}")
    n = args.keys
    keys = [f"batch-{i:012d}".encode() for i in range(n)]
    vals = [i.to_bytes(8, "little") * (args.value_bytes // 8) + bytes(args.value_bytes % 8)
            for i in range(n)]
    load0 = os.getloadavg()
    print(f"put_batch of {n} keys x {args.value_bytes} B, {args.reps} reps; load "
          f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}", flush=True)
    pool = max(0.0625, round((2.5 * n * 4096 + (32 << 20)) / 2**30, 4))
    runs: dict[str, list[dict[str, tuple[float, float, float]]]] = {m: [] for m in modes}
    with ServerProcess("--block-size", "4", "--max-batch", str(max(n, 100_000)),
                       prealloc_size=pool) as srv:
        for _ in range(args.reps):
            for m in modes:
                runs[m].append(one(srv, m, keys, vals))
    res: dict[str, Any] = {"keys": n, "value_bytes": args.value_bytes, "reps": args.reps,
                           "load_start": load0, "rows": {}}
    print(f"{'mode':11s} {'kind':9s} {'M keys/s':>8s} {'cli us/key':>10s} {'srv us/key':>10s}"
          f" {'vs tcp':>6s}")
    for kind in KINDS:
        med = {m: tuple(statistics.median(r[kind][j] for r in runs[m]) for j in range(3))
               for m in modes}
        for m in modes:
            rate, cli, srv_us = med[m]
            ratio = f"{rate / med['tcp'][0]:.2f}x" if "tcp" in med else "-"
            print(f"{m:11s} {kind:9s} {rate / 1e6:8.2f} {cli:10.2f} {srv_us:10.2f} {ratio:>6s}")
            res["rows"].setdefault(m, {})[kind] = {"keys_per_s": rate, "client_us_per_key": cli,
                                                   "server_us_per_key": srv_us}
    load1 = os.getloadavg()
    res["load_end"] = load1
    print(f"load at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    if args.json:
        write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
