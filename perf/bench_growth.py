#!/usr/bin/env python
"""The shared index's growth policy (kvshm._shmindex.GROWTH): table bytes per key, publish
CPU per key, and lock-free lookup rates, for several policies in turn in one run.

For each ``--keys`` count and each policy (``--policies``, "AT,BY" sixteenths each: growth
from AT/16 full by BY/16), ``--pairs`` times, in turn (the order reversed every other
time): a table sized as a server sizes it for a pool of that many 4 KiB blocks (no
server, no pool bytes written) takes the keys (40 bytes, ``publish_runs`` in batches of
``--batch``, as a server's PUT of a batch), then ``IndexReader.exists_batch`` (1,024-key
batches, half present, shuffled) and ``match_prefix`` (64-key requests, all present) run
over them. Reported per policy and count (medians): slots, load (live / slots), table
bytes per key (slots x SLOT_SIZE / keys, and the segment's allocated bytes / keys), publish CPU
ns per key (this thread's CPU time; growth steps included) and lookups in M keys/s by
this thread's CPU time (median of ``--reps``), with the load average. The load a count
lands on depends on where the last growth fell: run several counts. No timed asserts:
a report.

    python perf/bench_growth.py --keys 1000000 2000000 --policies 11,8 13,8 13,4
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import uuid
from array import array

from kvshm import Pool
from kvshm._shmindex import SLOT_SIZE, IndexReader, IndexWriter, default_slots

BS = 4096


def key_of(i: int) -> bytes:
    return b"%040x" % (int(i) * 0x9E3779B97F4A7C15 % (1 << 160))


def cpu_rate(fn, n: int, reps: int) -> float:
    xs = []
    for _ in range(reps):
        c0 = time.thread_time()
        fn()
        xs.append(n / max(time.thread_time() - c0, 1e-9))
    return statistics.median(xs)


def one(n: int, growth: tuple[int, int], keys: list[bytes], mixed: list[list[bytes]],
        reqs: list[list[bytes]], batch: int, reps: int) -> dict[str, float]:
    name = f"kvshm-growth-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    pool = Pool.create(name, n * BS, BS, populate=False)
    w = IndexWriter.create(name + "-index", name + "-reads", default_slots(n), epoch=1,
                           block_size=BS, num_blocks=n, growth=growth)
    r = IndexReader(w.name, w.reads_name, pool, 1)
    try:
        c0 = time.thread_time()
        for lo in range(0, n, batch):
            ks = keys[lo:lo + batch]
            m = len(ks)
            w.publish_runs(ks, array("q", [8]) * m, array("q", range(lo, lo + m)),
                           array("q", [1]) * m)
        pub_ns = (time.thread_time() - c0) * 1e9 / n
        assert w.live == n and w.unpublished == 0
        st = os.stat("/dev/shm/" + w.name.lstrip("/"))
        out = {"slots": w.nslots, "load": n / w.nslots,
               "table_b_per_key": w.nslots * SLOT_SIZE / n,
               "alloc_b_per_key": st.st_blocks * 512 / n, "publish_ns": pub_ns,
               "sync_finishes": w.sync_finishes, "growths": w.rebuilds}
        hits = 0
        for b in mixed:
            got = r.exists_batch(b)
            assert got is not None
            hits += got.count(True)
        assert hits == sum(len(b) for b in mixed) // 2, hits

        def ex() -> None:
            for b in mixed:
                r.exists_batch(b)

        def mp() -> None:
            for q in reqs:
                r.match_prefix(q)

        out["exists_mkeys_s"] = cpu_rate(ex, sum(map(len, mixed)), reps) / 1e6
        out["prefix_mkeys_s"] = cpu_rate(mp, 64 * len(reqs), reps) / 1e6
        return out
    finally:
        r.close()
        w.unlink()
        pool.close()
        pool.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--policies", nargs="+", default=["11,8", "13,8", "13,4"])
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lookups", type=int, default=200_000, help="keys per lookup pass")
    args = ap.parse_args()
    pols: list[tuple[int, int]] = []
    for p in args.policies:
        at, by = (int(x) for x in p.split(","))
        pols.append((at, by))
    for n in args.keys:
        keys = [key_of(i) for i in range(n)]
        rnd = random.Random(1)
        h = min(n, args.lookups) // 2
        pick = rnd.sample(range(n), h)
        mix = [keys[i] for i in pick] + [b"x" + keys[i][1:] for i in pick]
        rnd.shuffle(mix)
        mixed = [mix[i:i + 1024] for i in range(0, len(mix), 1024)]
        reqs = [[keys[j] for j in rnd.sample(range(n), 64)] for _ in range(h // 32)]
        res: dict[tuple[int, int], list[dict[str, float]]] = {p: [] for p in pols}
        for k in range(args.pairs):
            for p in (pols if k % 2 == 0 else pols[::-1]):
                res[p].append(one(n, p, keys, mixed, reqs, args.batch, args.reps))
        print(f"{n} keys of 40 bytes, load average {os.getloadavg()[0]:.1f} "
              f"({args.pairs} runs each, alternated; medians)")
        for p in pols:
            rs = res[p]
            med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
            print(f"  growth {p[0]}/16 by {p[1]}/16: {int(med['slots'])} slots, load "
                  f"{med['load']:.3f}, table {med['table_b_per_key']:.1f} B/key "
                  f"(allocated {med['alloc_b_per_key']:.1f}), publish "
                  f"{med['publish_ns']:.0f} ns CPU/key ({int(med['growths'])} growths, "
                  f"{int(med['sync_finishes'])} finished at once), exists_batch "
                  f"{med['exists_mkeys_s']:.2f} M keys/s CPU (half hit), match_prefix "
                  f"{med['prefix_mkeys_s']:.2f}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
