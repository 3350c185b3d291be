"""Placement cost: weighted rendezvous owners of 10 k keys over 64 nodes (kvshm.cluster._hrw).

For equal pool sizes, 4 sizes and 64 distinct sizes, one and two owners per key, per key
and with stripes of 32, prints the best of ``--repeat`` runs of

* ``owners``: a call on a :class:`~kvshm.cluster._hrw.Ring` whose bucket table is built
  (what a client does between view changes);
* ``direct``: the same rows computed without the table (what a call of fewer than
  ``DIRECT_BELOW`` keys does before the table is built), per key;
* ``build``: building the table (once per view change, in the view follower),

beside a baseline measured in the same run: hashing the same keys with Python's
built-in ``hash`` in a list comprehension (the cheapest thing a pure-Python placement
would do once per key, before any per-node work).

    python perf/bench_cluster.py [--keys 10000] [--nodes 64] [--repeat 30]
"""

from __future__ import annotations

import argparse
import os
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
    ap.add_argument("--repeat", type=int, default=30)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    keys = [rng.bytes(40) for _ in range(a.keys)]
    few = keys[:_hrw.DIRECT_BELOW - 1]
    m = a.nodes
    seeds = np.array([_hrw.hash_key(f"node-{j}".encode()) for j in range(m)], np.uint64)
    base = best(lambda: [hash(k) for k in keys], a.repeat)
    print(f"{a.keys} keys x {m} nodes, load average {os.getloadavg()[0]:.1f}; baseline "
          f"(Python hash per key) {base * 1e3:.3f} ms")
    for name, w in (("equal sizes", np.ones(m)), ("4 sizes", 1.0 + np.arange(m) % 4),
                    (f"{m} sizes", 1.0 + np.arange(m))):
        ring = _hrw.Ring(seeds, w)
        tb = best(lambda: _hrw.Ring(seeds, w).build(), max(1, a.repeat // 10))
        ring.build()
        print(f"  {name}: table build {tb * 1e3:.1f} ms")
        for rep in (1, 2):
            for stripe in (1, 32):
                t = best(lambda: ring.owners(keys, stripe, rep), a.repeat)
                print(f"    owners {rep} stripe {stripe:2d}: {t * 1e3:7.3f} ms "
                      f"({t / base:.2f}x the baseline)")
            d = best(lambda: _hrw.Ring(seeds, w).owners(few, 1, rep), a.repeat)
            print(f"    owners {rep} direct, per key: {d / len(few) * 1e9:6.0f} ns "
                  f"({d / len(few) / m * 1e9:.1f} ns per node)")


if __name__ == "__main__":
    main()
