"""Placement cost: weighted rendezvous owners of 10 k keys over 64 nodes (kvshm.cluster._hrw).

Prints the best of ``--repeat`` runs for equal pool sizes, 4 sizes and 64 distinct sizes,
one and two owners per key, per key and with stripes of 32, beside a baseline measured in
the same run: hashing the same keys with Python's built-in ``hash`` in a list
comprehension (the cheapest thing a pure-Python placement would do once per key, before
any per-node work).

    python perf/bench_cluster.py [--keys 10000] [--nodes 64] [--repeat 50]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvshm.cluster import _hrw


def best(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    out = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=50)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    keys = [rng.bytes(40) for _ in range(a.keys)]
    m = a.nodes
    seeds = np.array([_hrw.hash_key(f"node-{j}".encode()) for j in range(m)], np.uint64)
    base = best(lambda: [hash(k) for k in keys], a.repeat)
    print(f"{a.keys} keys x {m} nodes; baseline (Python hash per key) {base * 1e3:.3f} ms")
    for name, w in (("equal sizes", np.ones(m)), ("4 sizes", 1.0 + np.arange(m) % 4),
                    (f"{m} sizes", 1.0 + np.arange(m))):
        for stripe in (1, 32):
            for rep in (1, 2):
                t = best(lambda: _hrw.owners(keys, seeds, w, stripe, rep), a.repeat)
                print(f"  {name:12s} stripe {stripe:2d} owners {rep}: {t * 1e3:7.3f} ms "
                      f"({t / base:.2f}x the baseline)")


if __name__ == "__main__":
    main()
