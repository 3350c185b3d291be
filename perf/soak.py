#!/usr/bin/env python3
"""Soak: many client processes of mixed put/get/delete against one server, bounded.

    python perf/soak.py [--clients 8] [--seconds 60] [--pool-gib 0.5] [--tcp-clients 2]
                        [--block-kib 64]
    python perf/soak.py --store-only [--puts 3000] [--pool-gib 0.5] [--block-kib 64]

Values are 4 KiB to 4 MiB (log-uniform), each self-describing (writer, sequence, size,
xxh64 of the body) and stored with ``checksum=True``; every read is verified both ways.
The key space is several times the pool, so the pool stays full and eviction runs all
the time. Reports ops/s, p50/p99 latency, evictions, corrupt reads (must be 0),
unexpected errors (must be 0), pool usage after warm-up beside the share of the pool lost
to fragmentation (the free blocks when an ALLOC had to evict: with values of several runs
an ALLOC evicts only when fewer blocks are free than it needs), the server's peak RSS beside
the pool size, and the final accounting check (used blocks == blocks of live entries).
Loopback only; stops by itself.

``--store-only`` drives a Store in this process instead (no sockets, no clients): the same
mixed puts, readers pinning a few keys at a time, once with values in one run each and no
entries moved (as before values had extents) and once in up to 8 runs with moves, and
prints pool usage, the share
free at evictions and puts/s of both, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import struct
import sys
import threading
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import xxhash  # noqa: E402

import kvshm  # noqa: E402
from servers import ServerProcess  # noqa: E402

_HEAD = struct.Struct("<IIIQ")   # writer, seq, size, xxh64(body)


def make_value(wid: int, seq: int, size: int) -> bytes:
    body = random.Random(wid * 7_919 + seq).randbytes(size - _HEAD.size)
    return _HEAD.pack(wid, seq, size, xxhash.xxh64_intdigest(body)) + body


def value_ok(v: bytes) -> bool:
    if len(v) < _HEAD.size:
        return False
    wid, seq, size, h = _HEAD.unpack_from(v)
    return size == len(v) and xxhash.xxh64_intdigest(memoryview(v)[_HEAD.size:]) == h


def worker(wid: int, address: str, transport: str, seconds: float, nkeys: int,
           out: mp.Queue) -> None:
    rng = random.Random(wid)
    lat: list[float] = []
    stats: dict[str, Any] = {"puts": 0, "gets": 0, "deletes": 0, "hits": 0, "misses": 0, "corrupt": 0,
             "errors": 0, "error_samples": []}
    seq = 0
    try:
        with kvshm.Client(address, transport=transport, timeout=30) as c:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                op = rng.random()
                t = time.perf_counter()
                try:
                    if op < 0.45:
                        n = rng.randint(1, 4)
                        keys = [f"k{rng.randrange(nkeys)}" for _ in range(n)]
                        keys = list(dict.fromkeys(keys))
                        vals = []
                        for _ in keys:
                            size = int(math.exp(rng.uniform(math.log(4096),
                                                            math.log(4 << 20))))
                            seq += 1
                            vals.append(make_value(wid, seq, size))
                        c.put_batch(keys, vals, checksum=True)
                        stats["puts"] += len(keys)
                    elif op < 0.95:
                        keys = list(dict.fromkeys(f"k{rng.randrange(nkeys)}"
                                                  for _ in range(rng.randint(1, 6))))
                        got = c.get_batch(keys, verify=True)
                        stats["gets"] += len(keys)
                        for v in got:
                            if v is None:
                                stats["misses"] += 1
                            else:
                                stats["hits"] += 1
                                if not value_ok(v):
                                    stats["corrupt"] += 1
                    else:
                        stats["deletes"] += c.delete([f"k{rng.randrange(nkeys)}"])
                except kvshm.CorruptValue as exc:
                    stats["corrupt"] += 1
                    stats["error_samples"].append(repr(exc))
                except kvshm.KvshmError as exc:
                    stats["errors"] += 1
                    if len(stats["error_samples"]) < 5:
                        stats["error_samples"].append(repr(exc))
                lat.append(time.perf_counter() - t)
    except Exception:
        stats["errors"] += 1
        stats["error_samples"].append(traceback.format_exc())
    lat.sort()
    stats["lat"] = lat[:: max(1, len(lat) // 20000)]
    stats["ops"] = len(lat)
    out.put(stats)


def store_only(args: argparse.Namespace) -> int:
    """Pool usage of one-run vs multi-run placement on a Store alone (see the docstring)."""
    from kvshm.store import Store, StoreConfig
    from kvshm.zmq_ctrl.protocol import Limits
    from servers import unique_shm_name

    bs = args.block_kib << 10
    size = int(args.pool_gib * 2**30) // bs * bs
    src = memoryview(bytes(4 << 20))
    rows = []
    for name, runs, compact in (("one run", 1, False), ("up to 8 runs", 8, True)):
        pool = kvshm.Pool.create(unique_shm_name("soak-"), size, bs)
        try:
            st = Store(pool, StoreConfig(limits=Limits(max_batch=100_000), max_extents=runs,
                                         compact=compact))
            rng = random.Random(1)
            usage: list[float] = []
            t = time.perf_counter()
            for i in range(args.puts):
                key = b"k%d" % rng.randrange(args.keys)
                n = int(math.exp(rng.uniform(math.log(4096), math.log(4 << 20))))
                st.put([key], [src[:n]])
                if rng.random() < 0.3:     # a reader pins 3 keys for 8 puts
                    st.lookup(b"r", i, [b"k%d" % rng.randrange(args.keys) for _ in range(3)])
                    if i >= 8:
                        st.release(b"r", [i - 8])
                if i > args.puts // 3:
                    usage.append(st.alloc.num_used / st.alloc.num_blocks)
            dt = time.perf_counter() - t
            c = st.stats(verify=True)
            assert c["accounting_ok"], c
            rows.append((name, args.puts / dt, sum(usage) / len(usage),
                         c["free_blocks_at_evictions"]
                         / max(1, c["alloc_evictions"]) / c["num_blocks"],
                         c["evictions"], c["split_values"], c["relocations"]))
        finally:
            pool.close()
            pool.unlink()
    print(f"Store alone: {args.puts} puts of 4 KiB-4 MiB (log-uniform), "
          f"{size >> 20} MiB pool, {bs >> 10} KiB blocks")
    print(f"{'placement':14s} {'puts/s':>8s} {'usage':>6s} {'free@evict':>10s} "
          f"{'evictions':>9s} {'split':>6s} {'moved':>6s}")
    for r in rows:
        print(f"{r[0]:14s} {r[1]:8.0f} {r[2]:6.3f} {r[3]:10.3f} {r[4]:9d} {r[5]:6d} "
              f"{r[6]:6d}")
    print(f"ratio (8 runs / 1 run): usage {rows[1][2] / rows[0][2]:.3f}, "
          f"puts/s {rows[1][1] / rows[0][1]:.2f}")
    return 0


def rss_peak(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tcp-clients", type=int, default=2,
                    help="how many of the clients use TCP (the rest shm)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--pool-gib", type=float, default=0.5)
    ap.add_argument("--keys", type=int, default=3000, help="key space (shared by all)")
    ap.add_argument("--block-kib", type=int, default=64, help="the server's block size")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--store-only", action="store_true",
                    help="a Store in this process, one-run vs multi-run placement")
    ap.add_argument("--puts", type=int, default=3000, help="puts of --store-only")
    args = ap.parse_args()
    if args.store_only:
        return store_only(args)

    ctx = mp.get_context("spawn")
    with ServerProcess("--block-size", str(args.block_kib), prealloc_size=args.pool_gib,
                       ready_timeout=60) as srv:
        q: mp.Queue = ctx.Queue()
        procs = [ctx.Process(target=worker,
                             args=(i, srv.address, "tcp" if i < args.tcp_clients else "shm",
                                   args.seconds, args.keys, q))
                 for i in range(args.clients)]
        usage: list[float] = []
        stop = threading.Event()

        def sample() -> None:
            with kvshm.Client(srv.address, transport="tcp") as mon:
                warm = time.monotonic() + min(10.0, args.seconds / 3)
                while not stop.wait(0.5):
                    if time.monotonic() > warm:
                        usage.append(mon.stats()["usage"])

        t0 = time.monotonic()
        for p in procs:
            p.start()
        mon_t = threading.Thread(target=sample, daemon=True)
        mon_t.start()
        results = []
        try:
            for _ in procs:
                results.append(q.get(timeout=args.seconds + 120))
        finally:
            stop.set()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
            mon_t.join(10)
        wall = time.monotonic() - t0
        with kvshm.Client(srv.address) as c:
            st = c.stats(verify=True)
        peak = rss_peak(srv.pid)

    lat = sorted(x for r in results for x in r["lat"])
    ops = sum(r["ops"] for r in results)
    report = {
        "clients": args.clients, "seconds": round(wall, 1), "ops": ops,
        "ops_per_s": round(ops / args.seconds),
        "p50_ms": round(lat[len(lat) // 2] * 1e3, 2) if lat else None,
        "p99_ms": round(lat[int(len(lat) * 0.99)] * 1e3, 2) if lat else None,
        "puts": sum(r["puts"] for r in results), "gets": sum(r["gets"] for r in results),
        "deletes": sum(r["deletes"] for r in results),
        "hits": sum(r["hits"] for r in results), "misses": sum(r["misses"] for r in results),
        "block_bytes": st["block_size"],
        "evictions": st["evictions"],
        "alloc_evictions": st["alloc_evictions"],
        "fragmented_evictions": st["fragmented_evictions"],
        "split_values": st.get("split_values"),
        "relocations": st.get("relocations"),
        "relocated_bytes": st.get("relocated_bytes"),
        # share of the pool free (unusable for the value) when an ALLOC had to evict
        "free_share_at_evictions": (round(st["free_blocks_at_evictions"]
                                          / (st["alloc_evictions"] * st["num_blocks"]), 3)
                                    if st["alloc_evictions"] else 0.0),
        "corrupt_reads": sum(r["corrupt"] for r in results),
        "unexpected_errors": sum(r["errors"] for r in results),
        "error_samples": [s for r in results for s in r["error_samples"]][:5],
        "usage_min_after_warmup": round(min(usage), 3) if usage else None,
        "usage_mean_after_warmup": round(sum(usage) / len(usage), 3) if usage else None,
        "pool_bytes": st["capacity_bytes"],
        "server_peak_rss_bytes": peak,
        "server_rss_over_pool_mib": round((peak - st["capacity_bytes"]) / 2**20, 1),
        "accounting_ok": st["accounting_ok"], "pending_at_end": st["pending"],
        "pinned_at_end": st["pinned"],
    }
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k:28s} {v}")
    ok = (report["corrupt_reads"] == 0 and report["unexpected_errors"] == 0
          and report["accounting_ok"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
