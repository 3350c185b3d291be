#!/usr/bin/env python3
"""AsyncClient with many batch gets in flight against the sync Client, same run.

    python perf/bench_async.py [--inflight 32] [--batches 2000] [--reps 5]
                               [--transport shm] [--uvloop] [--shapes 16x65536,...]

For each batch shape (keys x value size) it times ``--batches`` calls of
``get_batch_into`` made one after the other by a sync :class:`kvshm.Client`, and the same
number made by ``--inflight`` coroutines sharing one :class:`kvshm.AsyncClient` (each
coroutine reads into its own buffers). Prints batches/s, GB/s and the ratio
async / sync (issue 5 target: >= 0.9x with 32 in flight). Runs alternate sync and async;
each figure is the median of --reps runs. The server is a separate `kvshm serve`
process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import kvshm  # noqa: E402
from servers import ServerProcess  # noqa: E402

SHAPES = [(16, 65536), (8, 4096), (4, 1 << 20)]   # keys per batch, bytes per value
GROUPS = 64                                       # distinct key sets read in turn


def put_groups(c: kvshm.Client, nkeys: int, size: int) -> list[list[str]]:
    groups = []
    rng = np.random.default_rng(0)
    for g in range(GROUPS):
        keys = [f"bench/{nkeys}x{size}/g{g}/k{j}" for j in range(nkeys)]
        c.put_batch(keys, [rng.integers(0, 256, size, dtype=np.uint8) for _ in keys])
        groups.append(keys)
    return groups


def out_sets(n: int, nkeys: int, size: int) -> list[list[np.ndarray]]:
    """``n`` sets of output buffers, touched (no page faults in the timed part). Both
    sides use the same sets: the sync loop goes round them, each coroutine has one."""
    return [[np.ones(size, np.uint8) for _ in range(nkeys)] for _ in range(n)]


def run_sync(c: kvshm.Client, groups: list[list[str]], outs: list[list[np.ndarray]],
             batches: int) -> float:
    t = time.perf_counter()
    for i in range(batches):
        c.get_batch_into(groups[i % GROUPS], outs[i % len(outs)])
    return time.perf_counter() - t


async def run_async(c: kvshm.AsyncClient, groups: list[list[str]],
                    outs: list[list[np.ndarray]], batches: int, inflight: int) -> float:
    async def worker(w: int) -> None:
        for i in range(w, batches, inflight):
            await c.get_batch_into(groups[i % GROUPS], outs[w])

    t = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(inflight)))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inflight", type=int, default=32)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--uvloop", action="store_true", help="run the async side on uvloop")
    ap.add_argument("--pool-gib", type=float, default=0.5)
    ap.add_argument("--copy-threads", type=int, default=None,
                    help="AsyncClient copy_threads (default: the client's)")
    ap.add_argument("--copy-threshold", type=int, default=None,
                    help="AsyncClient copy_threshold in bytes (default: the client's)")
    ap.add_argument("--shapes", default=None,
                    help="batch shapes as KEYSxBYTES,... (default 16x65536,8x4096,4x1048576)")
    args = ap.parse_args()

    shapes = SHAPES
    if args.shapes:
        shapes = []
        for sh in args.shapes.split(","):
            n, size = (int(x) for x in sh.split("x"))
            shapes.append((n, size))
    opts = {}
    if args.copy_threads is not None:
        opts["copy_threads"] = args.copy_threads
    if args.copy_threshold is not None:
        opts["copy_threshold"] = args.copy_threshold
    new_loop: Callable[[], asyncio.AbstractEventLoop]
    if args.uvloop:
        import uvloop

        new_loop = uvloop.new_event_loop
    else:
        new_loop = asyncio.new_event_loop

    print(f"transport={args.transport} inflight={args.inflight} batches={args.batches} "
          f"reps={args.reps} loop={'uvloop' if args.uvloop else 'asyncio'} "
          f"cpus={os.cpu_count()}")
    print(f"{'batch':>14} {'sync b/s':>10} {'async b/s':>10} {'sync GB/s':>10} "
          f"{'async GB/s':>10} {'ratio':>6}")
    with ServerProcess(prealloc_size=args.pool_gib) as srv, \
            kvshm.Client(srv.address, transport=args.transport) as sc:
        loop = new_loop()
        ac = kvshm.AsyncClient(srv.address, transport=args.transport, timeout=30, **opts)
        try:
            loop.run_until_complete(ac.connect())
            for nkeys, size in shapes:
                sc.purge()
                groups = put_groups(sc, nkeys, size)
                outs = out_sets(args.inflight, nkeys, size)
                batches = args.batches if size < (1 << 20) else args.batches // 4
                run_sync(sc, groups, outs, batches // 10)                       # warm up
                loop.run_until_complete(run_async(ac, groups, outs, batches // 10,
                                                  args.inflight))
                ts, ta = [], []
                for _ in range(args.reps):
                    ts.append(run_sync(sc, groups, outs, batches))
                    ta.append(loop.run_until_complete(
                        run_async(ac, groups, outs, batches, args.inflight)))
                s, a = statistics.median(ts), statistics.median(ta)
                nbytes = batches * nkeys * size
                print(f"{nkeys:>4} x {size:>7} {batches / s:>10.0f} {batches / a:>10.0f} "
                      f"{nbytes / s / 1e9:>10.2f} {nbytes / a / 1e9:>10.2f} "
                      f"{s / a:>6.2f}")
            sc.flush()
            st = loop.run_until_complete(ac.stats())
            assert st["pinned"] == 0, st
        finally:
            loop.run_until_complete(ac.close())
            loop.close()


if __name__ == "__main__":
    main()
