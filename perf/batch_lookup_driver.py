#!/usr/bin/env python3
"""The shared index's batch lookups alone: ``IndexReader.exists_batch`` / ``match_prefix``
on a table this process writes (no server, no client), beside a Python dict membership
test of the same keys, in ns/key of this thread's CPU time.

    python perf/batch_lookup_driver.py [--keys 100000] [--reps 15] [--only exists|match]
                                       [--quick]

The keys and table are bench_small's "local batch" ones: --keys 18-byte keys
(``batch-%012d``) in a table sized for a 4 KiB-block pool of 2.5 x --keys blocks, then as
many 40-byte hex keys added to the same table (it grows). Prints median / best of --reps
per figure. Small enough to run under ``valgrind --tool=callgrind`` (instruction counts do
not depend on the machine's load, the timings do): e.g. ``--toggle-collect=
'__pyx_f_5kvshm_9_shmindex_11IndexReader__batch'`` counts only the lookups.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid

from kvshm import Pool
from kvshm._shmindex import IndexReader, IndexWriter, default_slots

BS = 4096


def run(r: IndexReader, keys: list[bytes], reps: int, only: str | None) -> dict[str, list[float]]:
    d = dict.fromkeys(keys, 0)
    res: dict[str, list[float]] = {}
    for _ in range(reps):
        for label, fn in (("dict", lambda: [k in d for k in keys]),
                          ("exists", lambda: r.exists_batch(keys)),
                          ("match", lambda: r.match_prefix(keys))):
            if only and label not in ("dict", only):
                continue
            t = time.thread_time()
            out = fn()
            dt = time.thread_time() - t
            if label == "match" and out != len(keys):
                raise RuntimeError(f"match_prefix said {out} of {len(keys)}")
            if label != "match" and not (isinstance(out, list) and all(out)):
                raise RuntimeError(f"{label} missed keys that are there")
            res.setdefault(label, []).append(dt / len(keys) * 1e9)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", choices=("exists", "match"))
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (for tests)")
    args = ap.parse_args(argv)
    if args.quick:
        args.keys, args.reps = 3000, 2
    n = args.keys
    blocks = int((2.5 * n * BS + (32 << 20)) // BS)
    name = f"kvshm-lookdrv-{uuid.uuid4().hex[:8]}"
    pool = Pool.create(name, blocks * BS, BS)
    w = r = None
    try:
        w = IndexWriter.create(name + "-index", name + "-reads", default_slots(blocks), epoch=7,
                               block_size=BS, num_blocks=blocks, token=pool.token)
        sets = [("18-byte", [f"batch-{i:012d}".encode() for i in range(n)]),
                ("40-byte", [b"%040x" % (i * 0x9E3779B97F4A7C15 % (1 << 160)) for i in range(n)])]
        print(f"batch lookups of {n} keys, one thread, ns/key of CPU time (median / best of "
              f"{args.reps})")
        for label, keys in sets:
            for i, k in enumerate(keys):
                w.publish(k, 64, ((i % 64, 1),))
            if r is None:
                r = IndexReader(w.name, w.reads_name, pool, 7)
                r.batch_threads = 1
            res = run(r, keys, args.reps, args.only)
            h = r.header
            print(f"  {label} keys (table {h['nslots']} slots, {h['live']} live): " + "  ".join(
                f"{k} {statistics.median(v):6.1f} / {min(v):6.1f}" for k, v in res.items()))
    finally:
        if r is not None:
            r.close()
        if w is not None:
            w.unlink()
        pool.close()
        pool.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
