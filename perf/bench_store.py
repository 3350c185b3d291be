#!/usr/bin/env python3
"""Store throughput beside its baselines, all measured in the same run.

    python perf/bench_store.py [--reps 5] [--pool-gib 1.5] [--skip-redis]

Prints GB/s of put_batch, get_batch_into (into caller buffers) and get_batch (fresh
bytes objects) of 256 x 1 MiB and 256 x 64 KiB through the shm and TCP movers, beside
numpy memcpy of the same bytes, a raw TCP socket on loopback (one process sends, another
receives into a reused buffer), and Redis (redis-server, redis-py, pipelined SET / MGET
of the same values). Like is compared with like: Redis MGET allocates fresh bytes for
every value, so it is compared with kvshm's get_batch (fresh bytes), never with
get_batch_into; memcpy and the raw socket write into reused buffers, so they are compared
with get_batch_into. Every value read is checked. Then exists/match_prefix keys per
second on 10,000-key batches, single-key get latency p50/p99, and the server's CPU time
while idle. Targets (issue 3): shm >= 0.7x memcpy for 1 MiB values; TCP >= 0.6x the raw
socket; both >= 3x Redis; exists/match_prefix >= 1 M keys/s; an idle server uses no CPU.
Each figure is the median of --reps runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import _common  # noqa: E402
import kvshm  # noqa: E402
from _common import cpu_seconds, stop  # noqa: E402
from servers import ServerProcess  # noqa: E402


def median_rate(fn, nbytes: int, reps: int, before=None, check=None) -> float:
    """GB/s: the median over reps of nbytes / seconds of fn(). before() runs ahead of each
    rep and check() after it, both outside the clock; a check that returns False raises
    AssertionError naming the rep (every rep's reads are checked, not only the last)."""
    rates = []
    for rep in range(reps):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t) / 1e9)
        if check is not None:
            assert check(), f"rep {rep}: the values read back are not the values written"
    return statistics.median(rates)


def bench_memcpy(n: int, size: int, reps: int) -> float:
    src = [np.random.randint(0, 255, size, dtype=np.uint8) for _ in range(n)]
    dst = np.empty(n * size, np.uint8)

    def run() -> None:
        for i, s in enumerate(src):
            np.copyto(dst[i * size:(i + 1) * size], s)

    run()
    return median_rate(run, n * size, reps)


def _sink(port: int, total: int, chunk: int) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    buf = bytearray(chunk)
    mv = memoryview(buf)
    while True:
        got = 0
        while got < total:
            r = s.recv_into(mv, min(chunk, total - got))
            if not r:
                return
            got += r
        s.sendall(b"k")


def bench_raw_socket(n: int, size: int, reps: int) -> float:
    """Loopback TCP: this process sends n*size bytes, a child process receives them."""
    total = n * size
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    port = ls.getsockname()[1]
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"from bench_store import _sink; _sink({port}, {total}, {size})")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        conn, _ = ls.accept()
        data = [np.random.randint(0, 255, size, dtype=np.uint8) for _ in range(n)]

        def run() -> None:
            for d in data:
                conn.sendall(d.data)
            conn.recv(1)

        run()
        rate = median_rate(run, total, reps)
        conn.close()
    finally:
        ls.close()
        child.wait(10)
    return rate


def bench_kvshm(address: str, transport: str, n: int, size: int, reps: int
                ) -> tuple[float, float, float]:
    keys = [f"bench-{size}-{i}" for i in range(n)]
    vals = [np.random.randint(0, 255, size, dtype=np.uint8) for _ in range(n)]
    outs = [np.empty(size, np.uint8) for _ in range(n)]
    with kvshm.Client(address, transport=transport, timeout=60) as c:
        assert c.transport == transport, c.transport
        c.put_batch(keys, vals)
        put = median_rate(lambda: c.put_batch(keys, vals), n * size, reps)
        c.get_batch_into(keys, outs)
        assert all(np.array_equal(a, b) for a, b in zip(vals, outs))

        def clear() -> None:              # so a rep that writes nothing cannot pass
            for o in outs:
                o.fill(0)

        get = median_rate(lambda: c.get_batch_into(keys, outs), n * size, reps, clear,
                          lambda: all(np.array_equal(a, b) for a, b in zip(vals, outs)))
        want = [v.tobytes() for v in vals]
        got: list = []

        def fresh() -> None:
            got[:] = c.get_batch(keys)

        fresh()
        assert got == want, "get_batch returned other bytes"
        get_fresh = median_rate(fresh, n * size, reps, got.clear, lambda: got == want)
        c.purge()
    return put, get, get_fresh


def start_redis(maxmemory: int) -> tuple[subprocess.Popen | None, Any, str | None]:
    """redis-server (perf/_common.py) and a redis-py client of it; (None, None, None)
    without redis-server on PATH."""
    import redis

    try:
        proc, port, d = _common.start_redis(maxmemory)
    except FileNotFoundError:
        return None, None, None
    r = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            r.ping()
            return proc, r, d
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                stop(proc)
                raise
            time.sleep(0.02)   # accepting already; a PING answers once it is loaded


def bench_redis(r, n: int, size: int, reps: int) -> tuple[float, float]:
    keys = [f"bench-{size}-{i}" for i in range(n)]
    vals = [np.random.randint(0, 255, size, dtype=np.uint8).tobytes() for _ in range(n)]

    def put() -> None:
        p = r.pipeline(transaction=False)
        for k, v in zip(keys, vals):
            p.set(k, v)
        p.execute()

    got: list = []

    def get() -> None:
        got[:] = r.mget(keys)

    put()
    p = median_rate(put, n * size, reps)
    g = median_rate(get, n * size, reps, got.clear, lambda: got == vals)
    r.flushall()
    return p, g


def bench_queries(address: str, reps: int) -> tuple[float, float, float, float]:
    keys = [f"q-{i}" for i in range(10_000)]
    with kvshm.Client(address, transport="shm", timeout=60) as c:
        for i in range(0, 10_000, 2_500):
            c.put_batch(keys[i:i + 2_500], [b"v"] * 2_500)
        ex = []
        mp = []
        for _ in range(reps):
            t = time.perf_counter()
            assert all(c.exists_batch(keys))
            ex.append(10_000 / (time.perf_counter() - t))
            t = time.perf_counter()
            assert c.match_prefix(keys) == 10_000
            mp.append(10_000 / (time.perf_counter() - t))
        lat = []
        out = bytearray(4096)
        c.put("lat", b"l" * 4096)
        for _ in range(2000):
            t = time.perf_counter()
            c.get_into("lat", out)
            lat.append(time.perf_counter() - t)
        lat.sort()
        c.purge()
    return (statistics.median(ex), statistics.median(mp), lat[len(lat) // 2] * 1e6,
            lat[int(len(lat) * 0.99)] * 1e6)


def parser() -> argparse.ArgumentParser:
    """The command line: --reps, --pool-gib (a size with a unit, a plain number GiB, as
    `kvshm serve --prealloc-size` and `kvshm replay --pool-gib` take it), --skip-redis."""
    from kvshm.cliargs import gib_size_t

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5,
                    help="runs of each figure; the median is printed (default 5)")
    ap.add_argument("--pool-gib", type=gib_size_t, default=1.5, metavar="SIZE",
                    help="the server's pool and Redis's maxmemory: 1.5GiB, 512MiB; a plain "
                         "number is GiB (default 1.5)")
    ap.add_argument("--skip-redis", action="store_true",
                    help="no Redis columns (they print nan)")
    return ap


def main() -> None:
    args = parser().parse_args()
    shapes = [(256, 1 << 20), (256, 64 << 10)]
    rows = []
    load0 = os.getloadavg()[0]
    with ServerProcess(prealloc_size=args.pool_gib) as srv:
        redis_proc, r, rdir = ((None, None, None) if args.skip_redis
                               else start_redis(int(args.pool_gib * 2**30)))
        try:
            for n, size in shapes:
                label = f"{n} x {size // 1024} KiB"
                mem = bench_memcpy(n, size, args.reps)
                raw = bench_raw_socket(n, size, args.reps)
                shm_put, shm_get, shm_fresh = bench_kvshm(srv.address, "shm", n, size, args.reps)
                tcp_put, tcp_get, tcp_fresh = bench_kvshm(srv.address, "tcp", n, size, args.reps)
                rp, rg = (bench_redis(r, n, size, args.reps) if r is not None
                          else (float("nan"),) * 2)
                rows.append((label, mem, raw, shm_put, shm_get, shm_fresh, tcp_put, tcp_get,
                             tcp_fresh, rp, rg))
            ex, mp, p50, p99 = bench_queries(srv.address, args.reps)
            t0 = cpu_seconds(srv.pid)
            time.sleep(2.0)
            idle = cpu_seconds(srv.pid) - t0
        finally:
            stop(redis_proc)
            if rdir:
                shutil.rmtree(rdir, ignore_errors=True)

    print(f"\nkvshm store benchmark (median of {args.reps}; GB/s = 1e9 bytes/s; "
          f"{os.cpu_count()} CPUs, load average {load0:.1f} -> {os.getloadavg()[0]:.1f})\n")
    hdr = ("values", "memcpy", "raw tcp", "shm put", "shm into", "shm fresh", "tcp put",
           "tcp into", "tcp fresh", "redis set", "redis mget")
    print(f"{hdr[0]:>14}  " + "  ".join(f"{h:>10}" for h in hdr[1:]))
    for row in rows:
        print(f"{row[0]:>14}  " + "  ".join(f"{v:10.2f}" for v in row[1:]))
    print("(into = get_batch_into, caller buffers; fresh = get_batch, new bytes objects;"
          " redis mget = fresh bytes)")
    print("\nratios, like with like (target)")
    for (label, mem, raw, sp, sg, sf, tp, tg, tf, rp, rg) in rows:
        print(f"  {label}: shm put/memcpy {sp / mem:.2f}  shm get_batch_into/memcpy {sg / mem:.2f}"
              f"   (>= 0.7 for 1 MiB)")
        print(f"  {label}: tcp put/raw {tp / raw:.2f}  tcp get_batch_into/raw {tg / raw:.2f}"
              "   (>= 0.6)")
        print(f"  {label}: put vs redis SET: shm {sp / rp:.1f}x tcp {tp / rp:.1f}x;  "
              f"get_batch (fresh bytes) vs redis MGET (fresh bytes): shm {sf / rg:.1f}x "
              f"tcp {tf / rg:.1f}x   (>= 3)")
    print(f"\nexists       {ex / 1e6:.2f} M keys/s on 10,000-key batches (>= 1)")
    print(f"match_prefix {mp / 1e6:.2f} M keys/s on 10,000-key batches (>= 1)")
    print(f"single-key get_into (4 KiB, shm): p50 {p50:.0f} us, p99 {p99:.0f} us")
    print(f"idle server CPU over 2 s: {idle:.3f} s (target 0)")


if __name__ == "__main__":
    main()
