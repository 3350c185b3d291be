#!/usr/bin/env python
"""The shared index (kvshm/_shmindex.pyx): batch exists / match_prefix keys per second in
one process, and single-key exists / match_prefix of 64 keys on a local client, lock-free
vs through the server (its round trip), measured in the same run.

Part 1, the table alone (no server): ``--keys`` keys of ``--key-bytes`` bytes published
into a table sized as a server sizes it (2 slots per pool block) for a pool of
``--keys`` 4 KiB blocks; ``IndexReader.exists_batch`` over batches of ``--batch`` keys
(half present, shuffled) and ``match_prefix`` over 64-key requests, in keys/s; the
baseline is ``IndexWriter.publish`` (what the server does per key) and a Python
``dict`` membership test of the same keys (``[k in d for k in batch]``); the same lookups
one key at a time (``IndexReader.fast_batch`` off, ``KVSHM_NO_FAST_BATCH_READS``) follow.

Part 2, a real server: ``Client.exists``, ``Client.exists_batch`` of 64 keys and
``Client.match_prefix`` of 64 keys, on a local client vs a client made with
``KVSHM_NO_LOCAL_READS=1`` (the round trip), p50 in microseconds and the speed-up.

Targets (issue 13): batch exists / match_prefix >= 20 M keys/s in one process;
single-key exists / match_prefix of 64 keys >= 10x faster than the round trip.

Usage::

    python perf/bench_shmindex.py                       # 200,000 keys of 40 bytes
    python perf/bench_shmindex.py --keys 1000000 --batch 4096
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import uuid

from kvshm import Pool
from kvshm._shmindex import SLOT_SIZE, IndexReader, IndexWriter, default_slots

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

BS = 4096


CPU_RATES: dict[int, float] = {}


def rate(fn, nkeys: int, reps: int) -> float:
    """Median keys/s by the wall clock; the median by this thread's CPU time (which a
    loaded machine disturbs less) is left in CPU_RATES[id(fn)]."""
    best, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        best.append(nkeys / (time.perf_counter() - t0))
        cpu.append(nkeys / max(time.thread_time() - c0, 1e-9))
    CPU_RATES[id(fn)] = statistics.median(cpu)
    return statistics.median(best)


def p50_us(fn, n: int) -> float:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        xs.append(time.perf_counter_ns() - t0)
    xs.sort()
    return xs[len(xs) // 2] / 1000.0


def part_table(args: argparse.Namespace) -> None:
    name = f"kvshm-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    nblocks = max(64, args.keys)
    pool = Pool.create(name, nblocks * BS, BS, populate=False)
    w = IndexWriter.create(name + "-index", name + "-reads", default_slots(nblocks),
                           epoch=1, block_size=BS, num_blocks=nblocks)
    r = IndexReader(w.name, w.reads_name, pool, 1)
    try:
        rnd = random.Random(1)
        keys = [f"model@1@{i:016x}@{rnd.getrandbits(48):012x}".encode()[:args.key_bytes]
                .ljust(args.key_bytes, b"k") for i in range(args.keys)]
        absent = [b"x" + k[1:] for k in keys]
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            w.publish(k, 100, ((i, 1),))
        pub = args.keys / (time.perf_counter() - t0)
        mixed = keys[: args.keys // 2] + absent[: args.keys // 2]
        rnd.shuffle(mixed)
        batches = [mixed[i:i + args.batch] for i in range(0, len(mixed), args.batch)]
        d = dict.fromkeys(keys)

        def exists_all() -> None:
            for b in batches:
                r.exists_batch(b)

        def dict_all() -> None:
            for b in batches:
                [k in d for k in b]

        reqs = [keys[i:i + 64] for i in range(0, len(keys) - 64, 64)]

        def prefix_all() -> None:
            for q in reqs:
                r.match_prefix(q)

        assert sum(list(r.exists_batch(b) or ()).count(True) for b in batches) == len(mixed) // 2
        assert all(r.match_prefix(q) == 64 for q in reqs[:100])
        ex = rate(exists_all, len(mixed), args.reps)
        ex_c = CPU_RATES[id(exists_all)]
        dc = rate(dict_all, len(mixed), args.reps)
        dc_c = CPU_RATES[id(dict_all)]
        mp = rate(prefix_all, 64 * len(reqs), args.reps)
        mp_c = CPU_RATES[id(prefix_all)]
        r.fast_batch = False                 # KVSHM_NO_FAST_BATCH_READS's path, this run
        ex_slow = rate(exists_all, len(mixed), args.reps)
        ex_slow_c = CPU_RATES[id(exists_all)]
        mp_slow = rate(prefix_all, 64 * len(reqs), args.reps)
        mp_slow_c = CPU_RATES[id(prefix_all)]
        r.fast_batch = True
        print(f"table: {args.keys} keys of {args.key_bytes} B, {w.nslots} slots "
              f"({w.nslots * SLOT_SIZE >> 20} MiB)")
        print(f"  publish (server, per key)        {pub / 1e6:7.2f} M keys/s")
        print(f"  exists_batch ({args.batch}/batch, half hit) {ex / 1e6:7.2f} M keys/s "
              f"(target >= 20); python dict {dc / 1e6:.2f} M keys/s -> {ex / dc:.2f}x")
        print(f"  match_prefix (64 keys, all hit)  {mp / 1e6:7.2f} M keys/s (target >= 20)")
        print(f"  one key at a time (KVSHM_NO_FAST_BATCH_READS): exists_batch "
              f"{ex_slow / 1e6:.2f}, match_prefix {mp_slow / 1e6:.2f} M keys/s -> fast/slow "
              f"{ex / ex_slow:.2f}x, {mp / mp_slow:.2f}x")
        print(f"  by CPU time of this thread (M keys/s): exists_batch {ex_c / 1e6:.2f} "
              f"(one at a time {ex_slow_c / 1e6:.2f}), match_prefix {mp_c / 1e6:.2f} (one at "
              f"a time {mp_slow_c / 1e6:.2f}), python dict {dc_c / 1e6:.2f}; load average "
              f"{os.getloadavg()[0]:.1f}")
    finally:
        r.close()
        w.unlink()
        pool.close()
        pool.unlink()


def part_client(args: argparse.Namespace) -> None:
    srv = _common.small_server()
    try:
        local, remote = _common.local_and_remote(srv.address)
        keys = [f"req-{i:04d}-0123456789abcdef0123".encode() for i in range(64)]
        local.put_batch(keys, [b"v"] * 64)
        cases = {
            "exists (1 key)": lambda c: c.exists(keys[7]),
            "exists_batch (64)": lambda c: c.exists_batch(keys),
            "match_prefix (64)": lambda c: c.match_prefix(keys),
        }
        print(f"client, p50 us over {args.calls} calls (local: no message; server: round trip)")
        for label, fn in cases.items():
            fn(local), fn(remote)
            lo, rm = [], []
            for _ in range(3):              # interleaved rounds
                lo.append(p50_us(lambda: fn(local), args.calls))
                rm.append(p50_us(lambda: fn(remote), args.calls))
            a, b = statistics.median(lo), statistics.median(rm)
            print(f"  {label:<20} local {a:8.2f}  server {b:8.2f}  -> {b / a:6.1f}x "
                  "(target >= 10)")
        local.close()
        remote.close()
    finally:
        srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=200_000)
    ap.add_argument("--key-bytes", type=int, default=40)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    part_table(args)
    part_client(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
