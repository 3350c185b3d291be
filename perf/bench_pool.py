#!/usr/bin/env python
"""Pool copy throughput against numpy.copyto of the same sizes, measured in the same run.

Moves ``--count`` values of each ``--sizes`` into and out of a Pool, four ways:

- ``write_many`` / ``read_many_into``: one buffer per value;
- ``scatter`` / ``gather``: the values as pieces of one contiguous buffer;

and, as the baseline, ``numpy.copyto`` of each value into / out of a plain numpy buffer of
the pool's size (a Python loop of ``count`` copies, what a user without kvshm would write).
The cases run interleaved, one round of all of them per repetition (after one warm-up
round), so that a load change on a shared machine hits them alike; GB/s is the median over
the repetitions, and the ratio is the median of the per-round ratios to the baseline.

Targets (issue 2): >= 0.85x the baseline at 1 MiB values, >= 0.7x at 64 KiB.

Usage::

    python perf/bench_pool.py                  # 256 x 1 MiB and 256 x 64 KiB, 9 reps
    python perf/bench_pool.py --sizes 4K,1M --count 128 --reps 15 --check
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable

import numpy as np

from kvshm import Pool

TARGETS = {1 << 20: 0.85, 64 << 10: 0.70}  # value size -> min ratio vs numpy.copyto


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20}
    t = text.strip().upper()
    num = t.rstrip("KMIB")
    return int(num) * units[t[len(num):]]


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KiB"


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_size(size: int, count: int, reps: int) -> list[tuple[str, str, float, float]]:
    """Rows (direction, method, GB/s, ratio to numpy) for ``count`` values of ``size``."""
    total = size * count
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, total, dtype=np.uint8)  # values, back to back
    dst = np.zeros(total, dtype=np.uint8)
    plain = np.zeros(total, dtype=np.uint8)  # the baseline's "pool": ordinary memory
    srcs = [src[i * size : (i + 1) * size] for i in range(count)]
    dsts = [dst[i * size : (i + 1) * size] for i in range(count)]
    plains = [plain[i * size : (i + 1) * size] for i in range(count)]
    offsets = np.arange(count, dtype=np.int64) * size
    sizes = np.full(count, size, dtype=np.int64)

    def numpy_write() -> None:
        for p, s in zip(plains, srcs):
            np.copyto(p, s)

    def numpy_read() -> None:
        for d, p in zip(dsts, plains):
            np.copyto(d, p)

    name = f"kvshm-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    rows = []
    with Pool.create(name, total, block_size=min(size, 1 << 20)) as pool:
        cases: list[tuple[str, str, Callable[[], object]]] = [
            ("write", "numpy.copyto", numpy_write),
            ("write", "write_many", lambda: pool.write_many(offsets, srcs)),
            ("write", "scatter", lambda: pool.scatter(src, offsets, sizes)),
            ("read", "numpy.copyto", numpy_read),
            ("read", "read_many_into", lambda: pool.read_many_into(offsets, dsts)),
            ("read", "gather", lambda: pool.gather(offsets, sizes, dst)),
        ]
        for _, _, fn in cases:  # warm-up: page faults, caches, lazy imports
            fn()
        times: list[list[float]] = [[] for _ in cases]
        for _ in range(reps):
            for i, (_, _, fn) in enumerate(cases):
                times[i].append(timed(fn))
        for i, (direction, method, _) in enumerate(cases):
            base = next(j for j, c in enumerate(cases) if c[:2] == (direction, "numpy.copyto"))
            ratio = statistics.median(b / t for b, t in zip(times[base], times[i]))
            rows.append((direction, method, total / statistics.median(times[i]) / 1e9, ratio))
        check = np.empty(size, dtype=np.uint8)  # the copies moved the right bytes
        pool.read_into(int(offsets[-1]), check)
        assert np.array_equal(check, srcs[-1]) and np.array_equal(dst, src)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,64K", help="value sizes, e.g. 1M,64K,4K")
    ap.add_argument("--count", type=int, default=256, help="values per size (default 256)")
    ap.add_argument("--reps", type=int, default=9, help="timed repetitions (median reported)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)

    print(f"# kvshm Pool vs numpy.copyto, {args.count} values per size, median of "
          f"{args.reps} reps, python {sys.version.split()[0]}, numpy {np.__version__}")
    print(f"{'value':>8}  {'dir':<5}  {'method':<15}  {'GB/s':>7}  {'vs numpy':>8}  target")
    missed = []
    for size in (parse_size(s) for s in args.sizes.split(",")):
        rows = bench_size(size, args.count, args.reps)
        target = TARGETS.get(size)
        for direction, method, gbs, ratio in rows:
            verdict = ""
            if target is not None and method != "numpy.copyto":
                ok = ratio >= target
                verdict = f">= {target:.2f}x {'ok' if ok else 'MISSED'}"
                if not ok:
                    missed.append(f"{fmt_size(size)} {method}")
            print(f"{fmt_size(size):>8}  {direction:<5}  {method:<15}  {gbs:7.2f}  "
                  f"{ratio:7.2f}x  {verdict}")
    if missed:
        print(f"# targets missed: {', '.join(missed)}")
    return 1 if missed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
