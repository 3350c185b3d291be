#!/usr/bin/env python3
"""The shared index's batch lookups alone: ``IndexReader.exists_batch`` / ``match_prefix``
on a table this process writes (no server, no client), beside a Python dict membership
test of the same keys, in ns/key of this thread's CPU time.

    python perf/batch_lookup_driver.py [--keys 100000] [--reps 15] [--only exists|match]
                                       [--quick] [--breakdown]

The keys and table are bench_small's "local batch" ones: --keys 18-byte keys
(``batch-%012d``) in a table sized for a 4 KiB-block pool of 2.5 x --keys blocks, then as
many 40-byte hex keys added to the same table (it grows). Prints median / best of --reps
per figure. Small enough to run under ``valgrind --tool=callgrind`` (instruction counts do
not depend on the machine's load, the timings do): e.g. ``--toggle-collect=
'__pyx_f_5kvshm_9_shmindex_11IndexReader__batch'`` counts only the lookups.

``--breakdown`` says where 40-byte keys lose to 18-byte ones (issue 13): four tables
(18-byte keys alone, 40-byte keys alone, and bench_small's: the 18-byte keys, then the
40-byte keys added to the same table), each measured key set's displacement (slots
past its home: read from the segment) and ``exists_batch`` ns/key, the tables taking
turns each rep; then the 40-byte keys of the shared table by displacement (0, 1, 2 or
more), each cohort in the keys' order. Separates key length (the first two), table size
and placement (the last two: the same table).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import struct
import sys
import time
import uuid

from kvshm import Pool
from kvshm._shmindex import (HEADER_SIZE, SLOT_KEY_OFFSET, SLOT_META_OFFSET, SLOT_SIZE,
                              IndexReader, IndexWriter, default_slots, key_hash)

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


def keysets(n: int) -> tuple[list[bytes], list[bytes]]:
    """bench_small's 18-byte and 40-byte (hex) keys."""
    return ([f"batch-{i:012d}".encode() for i in range(n)],
            [b"%040x" % (i * 0x9E3779B97F4A7C15 % (1 << 160)) for i in range(n)])


def displacements(w: IndexWriter, r: IndexReader, keys: list[bytes]) -> list[int]:
    """Slots past its home each key lies at (linear probing), read from the segment
    (keys of up to SLOT_DATA - 8 bytes in one run: in the slot itself)."""
    h = r.header
    n, base = h["nslots"], h["base"]
    if h["old_nslots"]:
        raise RuntimeError("a growth is under way: no displacement to read")
    fd = os.open("/dev/shm/" + w.name.lstrip("/"), os.O_RDONLY)
    try:
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    out = []
    try:
        for k in keys:
            i = (key_hash(k) * n) >> 64
            for d in range(n):
                off = HEADER_SIZE + (base + i) * SLOT_SIZE
                kl = (struct.unpack_from("<Q", m, off + SLOT_META_OFFSET)[0] >> 48) & 0xFF
                if kl == len(k) and m[off + SLOT_KEY_OFFSET:off + SLOT_KEY_OFFSET + kl] == k:
                    out.append(d)
                    break
                i = i + 1 if i + 1 < n else 0
            else:
                raise RuntimeError(f"key {k!r} is not in the table")
    finally:
        m.close()
    return out


def breakdown(n: int, reps: int) -> None:
    k18, k40 = keysets(n)
    blocks = int((2.5 * n * BS + (32 << 20)) // BS)
    made: list[tuple[Pool, IndexWriter, IndexReader]] = []

    def table(sets: list[list[bytes]]) -> tuple[IndexWriter, IndexReader]:
        name = f"kvshm-lookdrv-{uuid.uuid4().hex[:8]}"
        pool = Pool.create(name, blocks * BS, BS)
        try:
            w = IndexWriter.create(name + "-index", name + "-reads", default_slots(blocks),
                                   epoch=7, block_size=BS, num_blocks=blocks, token=pool.token)
        except BaseException:
            pool.close()
            pool.unlink()
            raise
        r = IndexReader(w.name, w.reads_name, pool, 7)
        made.append((pool, w, r))
        r.batch_threads = 1
        for ks in sets:
            for i, k in enumerate(ks):
                w.publish(k, 64, ((i % 64, 1),))
        return w, r

    try:
        t18, t40, both = table([k18]), table([k40]), table([k18, k40])
        cases = {"18 alone": (t18, k18), "40 alone": (t40, k40),
                 "18 in 18+40": (both, k18), "40 in 18+40": (both, k40)}
        disp = {c: displacements(w, r, ks) for c, ((w, r), ks) in cases.items()}
        d40 = disp["40 in 18+40"]
        cohorts = {f"displaced {lab}": [k for k, d in zip(k40, d40) if ok(d)] for lab, ok in
                   (("0", lambda d: d == 0), ("1", lambda d: d == 1), ("2+", lambda d: d >= 2))}
        runs = {c: (r, ks) for c, ((w, r), ks) in cases.items()}
        runs.update({c: (both[1], ks) for c, ks in cohorts.items() if ks})
        res: dict[str, list[float]] = {c: [] for c in runs}
        for rep in range(reps):
            for c, (r, ks) in (runs.items() if rep % 2 == 0 else reversed(runs.items())):
                t = time.thread_time()
                out = r.exists_batch(ks)
                dt = time.thread_time() - t
                if not (isinstance(out, list) and all(out)):
                    raise RuntimeError(f"{c}: exists missed keys that are there")
                res[c].append(dt / len(ks) * 1e9)
        print(f"where 40-byte keys lose: exists_batch ns/key of CPU time (median / best of "
              f"{reps}, the cases in turns), {n} keys a set")
        for c, ((w, r), ks) in cases.items():
            d, h = disp[c], r.header
            print(f"  {c:12s} table {h['nslots']:8d} slots, {h['live']:7d} live: displacement "
                  f"mean {statistics.mean(d):4.2f}, at home {d.count(0) / len(d):4.0%}, 1 "
                  f"{d.count(1) / len(d):4.0%}, 2+ {sum(x >= 2 for x in d) / len(d):4.0%};  "
                  f"exists {statistics.median(res[c]):6.1f} / {min(res[c]):6.1f}")
        print("  the 40-byte keys of 18+40 by displacement (each cohort in the keys' order):")
        for c, ks in cohorts.items():
            if ks:
                print(f"    {c:13s} {len(ks):7d} keys  exists {statistics.median(res[c]):6.1f} / "
                      f"{min(res[c]):6.1f}")
    finally:
        for pool, w, r in made:
            r.close()
            w.unlink()
            pool.close()
            pool.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", choices=("exists", "match"))
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (for tests)")
    ap.add_argument("--breakdown", action="store_true",
                    help="key length vs table size vs displacement (see the module's doc)")
    args = ap.parse_args(argv)
    if args.quick:
        args.keys, args.reps = 3000, 2
    n = args.keys
    if args.breakdown:
        breakdown(n, args.reps)
        return 0
    blocks = int((2.5 * n * BS + (32 << 20)) // BS)
    name = f"kvshm-lookdrv-{uuid.uuid4().hex[:8]}"
    pool = Pool.create(name, blocks * BS, BS)
    w = r = None
    try:
        w = IndexWriter.create(name + "-index", name + "-reads", default_slots(blocks), epoch=7,
                               block_size=BS, num_blocks=blocks, token=pool.token)
        k18, k40 = keysets(n)
        sets = [("18-byte", k18), ("40-byte", k40)]
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
