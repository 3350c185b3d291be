#!/usr/bin/env python3
"""Index memory of a kvshm server: bytes per key beyond the pool, beside a plain dict.

    python perf/bench_index.py [--keys 10000000] [--batch 100000] [--value-bytes 8]
                               [--quick] [--json FILE|-]

Starts ``kvshm serve --block-size 4`` (4 KiB blocks) with a pool just large enough for
--keys values (each value takes one block), reads the server's /proc/PID/status, puts
--keys keys of 40 bytes with tiny values in --batch-key ``put_batch`` calls (shm client),
checks every key is there and a sample of values reads back byte for byte, and reads
/proc again. Reported: server memory beyond the pool per key, as

* ``RssAnon`` delta / keys (private memory: the index, grants, Python objects), and
* (``VmRSS`` - the pool mapping's resident bytes) delta / keys ("RSS minus the pool",
  from /proc/PID/smaps: counts other shared segments the server maps, such as the shared
  index table same-host clients read, which ``RssAnon`` misses),

beside the same figure for a Python ``dict`` of the same keys mapping to a small tuple of
ints (offset, size) built in a child process in this run (what a naive Python index
costs). Target (issue 13): <= 100 bytes per key at 10 M keys.

The pool must hold keys x 4 KiB (10 M keys: 40 GiB). When /dev/shm or memory cannot hold
it, the script says how many keys fit and exits 2 (use --keys).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import _common  # noqa: E402
from _common import proc_status, rss_by_mapping  # noqa: E402

KEY_BYTES = 40
BLOCK = 4096


def key_of(i: int) -> bytes:
    """A 40-byte key that looks like a chunk hash (hex), distinct per i."""
    return b"%040x" % (int(i) * 0x9E3779B97F4A7C15 % (1 << 160))


def dict_baseline(n: int) -> dict[str, float]:
    """Run in a child: RssAnon delta per key of {key: (offset, size)} for n keys."""
    code = f"""
import json, sys
sys.path.insert(0, {HERE!r})
from _common import proc_status
from bench_index import key_of
before = proc_status(__import__('os').getpid())
d = {{}}
for i in range({n}):
    d[key_of(i)] = (i * 4096, 8)
after = proc_status(__import__('os').getpid())
print(json.dumps({{"anon": (after["RssAnon"] - before["RssAnon"]) / {n}}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=3600, check=True)
    return {"dict_bytes_per_key": json.loads(out.stdout)["anon"]}


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=10_000_000)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--value-bytes", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="20,000 keys (a smoke run for tests)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    if args.quick:
        args.keys, args.batch = 20_000, 5_000
    n = args.keys
    pool_bytes = n * BLOCK + (16 << 20)
    st = os.statvfs("/dev/shm")
    room = min(st.f_bavail * st.f_frsize, int(mem_available() * 0.7))
    if pool_bytes > room:
        fit = max(0, (room - (16 << 20)) // BLOCK)
        print(f"bench_index: {n} keys need a pool of {pool_bytes / 2**30:.1f} GiB "
              f"(one 4 KiB block per key); this machine has room for about "
              f"{room / 2**30:.1f} GiB (/dev/shm free, 70% of MemAvailable): at most "
              f"~{fit} keys here. Rerun with --keys {fit // 100_000 * 100_000 or fit}.")
        return 2

    import numpy as np

    import kvshm
    from servers import ServerProcess

    pool_gib = round(pool_bytes / 2**30, 6)
    res: dict[str, Any] = {"keys": n, "key_bytes": KEY_BYTES, "value_bytes": args.value_bytes,
                           "block_bytes": BLOCK, "pool_bytes": pool_bytes}
    with ServerProcess("--block-size", "4", "--max-batch", str(max(args.batch, 1000)),
                       prealloc_size=pool_gib, ready_timeout=300) as srv:
        with kvshm.Client(srv.address, transport="shm", timeout=300) as c:
            c.exists(b"warm-up")              # HELLO and one request: the loop's steady state
            before = proc_status(srv.pid)
            before_map = rss_by_mapping(srv.pid)
            val = bytes(range(args.value_bytes))
            t = time.perf_counter()
            for lo in range(0, n, args.batch):
                ks = [key_of(i) for i in range(lo, min(n, lo + args.batch))]
                c.put_batch(ks, [val] * len(ks))
            put_s = time.perf_counter() - t
            time.sleep(0.5)                   # let lazy frees and the idle flush settle
            after = proc_status(srv.pid)
            after_map = rss_by_mapping(srv.pid)
            st_ = c.stats()
            missing = 0
            for lo in range(0, n, args.batch):
                ks = [key_of(i) for i in range(lo, min(n, lo + args.batch))]
                missing += len(ks) - sum(c.exists_batch(ks))
            sample = [key_of(i) for i in np.random.default_rng(1).integers(0, n, 1000)]
            bad = sum(v != val for v in c.get_batch(sample))
            if missing or bad:
                raise RuntimeError(f"{missing} keys missing, {bad} sampled values wrong")
            c.purge()
    res["entries"] = st_.get("entries", st_.get("keys"))
    si = st_.get("shared_index") or {}
    res["index_max_step_s"] = si.get("max_step_s")
    res["index_max_step_slots"] = si.get("max_step_slots")
    res["index_max_step_cpu_s"] = si.get("max_step_cpu_s")
    res["index_steps"] = si.get("steps")
    res["index_steps_cpu_s"] = si.get("steps_cpu_s")
    res["index_sync_finishes"] = si.get("sync_finishes")
    res["index_rebuilds"] = si.get("rebuilds")
    res["index_slots"] = si.get("slots")
    res["put_keys_per_s"] = n / put_s
    res["anon_bytes_per_key"] = (after["RssAnon"] - before["RssAnon"]) / n
    def minus_pool(st: dict[str, int], maps: dict[str, int]) -> int:
        pool = sum(v for k, v in maps.items() if k.endswith("/" + srv.shm_name.lstrip("/")))
        return st["VmRSS"] - pool

    res["rss_minus_pool_bytes_per_key"] = (minus_pool(after, after_map)
                                           - minus_pool(before, before_map)) / n
    res["other_shared_bytes_per_key"] = (
        sum(v for k, v in after_map.items() if k.startswith("/dev/shm/")
            and not k.endswith("/" + srv.shm_name.lstrip("/")))
        - sum(v for k, v in before_map.items() if k.startswith("/dev/shm/")
              and not k.endswith("/" + srv.shm_name.lstrip("/")))) / n
    res["server_anon_before"] = before["RssAnon"]
    res["server_anon_after"] = after["RssAnon"]
    res.update(dict_baseline(n))
    res["vs_dict"] = res["anon_bytes_per_key"] / res["dict_bytes_per_key"]
    print(f"\nkvshm index memory: {n} keys of {KEY_BYTES} bytes, {args.value_bytes}-byte values, "
          f"4 KiB blocks (pool {pool_bytes / 2**30:.2f} GiB, not counted)")
    print(f"  server RssAnon        {res['anon_bytes_per_key']:8.1f} bytes/key "
          f"({before['RssAnon'] / 2**20:.0f} -> {after['RssAnon'] / 2**20:.0f} MiB)")
    print(f"  server RSS minus pool {res['rss_minus_pool_bytes_per_key']:8.1f} bytes/key "
          f"(of which other shared segments, e.g. the shared index: "
          f"{res['other_shared_bytes_per_key']:.1f})")
    print(f"  baseline Python dict {{key: (offset, size)}} {res['dict_bytes_per_key']:8.1f} "
          f"bytes/key   server/dict {res['vs_dict']:.2f}")
    print(f"  put rate while filling {res['put_keys_per_s'] / 1e6:.2f} M keys/s "
          f"({args.batch}-key batches, shm client)")
    if res["index_max_step_s"] is not None:
        print(f"  shared index: {res['index_slots']} slots, {res['index_rebuilds']} growths/"
              f"rebuilds in {res['index_steps']} steps of the store thread "
              f"({res['index_steps_cpu_s'] * 1e3:.0f} ms CPU in all); longest step "
              f"{res['index_max_step_cpu_s'] * 1e3:.3f} ms CPU, "
              f"{res['index_max_step_s'] * 1e3:.3f} ms wall, {res['index_max_step_slots']} "
              f"slots; {res['index_sync_finishes']} finished at once")
    print("  (target: <= 100 bytes/key at 10 M keys)")
    if args.json:
        _common.write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
