#!/usr/bin/env python3
"""Small operations of kvshm beside their baselines, all measured in the same run.

    python perf/bench_small.py [--quick] [--json FILE|-] [--reps 3] [--working-set-mib 128]
                               [--clients 1,2,4,8] [--seconds 2] [--batch 100000]
                               [--skip-redis] [--only local,remote,batch,bystander]
                               [--only local-batch]

Issue 13's "Speed and memory" figures. Every figure is printed beside the baseline that
does the same work in this run, and every byte read is checked (outside the timed region).

local (a shm client of a server on this host, default 64 KiB blocks)
    single-key 4 KiB ``get_into`` p50/p99 vs a bare pyzmq DEALER/ROUTER echo round trip
    (over ipc://, the endpoint a local client uses) and vs ``numpy.copyto`` of 4 KiB inside
    one Python call; ``get`` (fresh bytes) vs ``ndarray.tobytes`` of the same 4 KiB;
    single ``put`` / ``get_into`` of 64 KiB and 1 MiB over a working set of distinct values
    larger than the caches (--working-set-mib, in each direction) vs ``numpy.copyto`` of
    the same sizes over an equally large working set (MB/s of the median op);
    single-key ``exists`` and ``match_prefix`` of 64 keys (p50) vs the echo round trip;
    batch ``exists_batch`` / ``match_prefix`` of --batch keys (keys/s) vs a Python dict
    membership test of the same keys in this process, and vs the same lookups one key at
    a time (``KVSHM_NO_FAST_BATCH_READS``'s path, switched per rep in this run).
remote (TCP transport, i.e. what a client on another host gets)
    single-key requests/s with N client processes for N in --clients, 4 KiB values, put
    then get phases, beside Redis SET/GET (redis-server + redis-py, same N, same values);
    server CPU per request from /proc of the server (and of redis-server); client CPU per
    request from each client process's time.process_time (all its threads).
batch (TCP, a server with 4 KiB blocks)
    ``put_batch`` / ``get_batch`` (fresh bytes) / ``exists_batch`` of --batch keys of
    64-byte values, keys/s, beside Redis pipelined SET / MGET (fresh bytes) of the same;
    ``exists_batch`` and ``put_batch`` as one request (the default) and pipelined (``KVSHM_PIPELINE=1``),
    taking turns in this run, with the client thread's and the server process's CPU per
    key.
bystander (TCP)
    p50/p99 of a client doing single 4 KiB ``get_into`` in its own process while idle and
    while this process sends --batch-key put_batch/get_batch (alternating) to the same server.

``--only local-batch`` runs the local batch lookups alone (with their dict baseline), the
part of "local" that needs no 64 KiB-block server: a quick A/B of kvshm._shmindex's lookups.

Targets (issue 13) are printed beside the ratios; nothing here asserts them.
``--quick`` is a smoke run (tiny sizes, short phases) for tests; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import _common  # noqa: E402
import small_remote  # noqa: E402
from _common import lat_stats, pattern, spawn_helper, stop  # noqa: E402

VALUE_4K = 4096


def _now() -> float:
    return time.perf_counter()


# --------------------------------------------------------------------------- baselines


def bench_zmq_echo(endpoint: str, n: int, payload: int = 64) -> dict[str, float]:
    """Round trips of a ``payload``-byte message to a bare ROUTER echo in another process."""
    import zmq

    proc, bound = spawn_helper("zmq_echo_server", endpoint)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(bound)
        msg = b"x" * payload
        lat = []
        for i in range(n + n // 10):
            t = _now()
            s.send(msg)
            got = s.recv()
            dt = _now() - t
            if got != msg:
                raise RuntimeError("zmq echo returned other bytes")
            if i >= n // 10:            # the first tenth warms up
                lat.append(dt)
    finally:
        s.close()
        ctx.term()
        stop(proc)
    return lat_stats(lat)


def _one_call_copy(dst: np.ndarray, src: np.ndarray) -> int:
    np.copyto(dst, src)
    return src.nbytes


def bench_copy_call(n: int, size: int) -> dict[str, float]:
    """numpy.copyto of ``size`` bytes inside one Python call (the floor of get_into)."""
    src = pattern(7, size)
    dst = np.empty(size, np.uint8)
    lat = []
    for _ in range(n):
        t = _now()
        _one_call_copy(dst, src)
        lat.append(_now() - t)
    if not np.array_equal(dst, src):
        raise RuntimeError("copy baseline copied other bytes")
    return lat_stats(lat)


def bench_tobytes_call(n: int, size: int) -> dict[str, float]:
    """ndarray.tobytes of ``size`` bytes inside one Python call (the floor of get)."""
    src = pattern(7, size)

    def call(a: np.ndarray) -> bytes:
        return a.tobytes()

    lat = []
    for _ in range(n):
        t = _now()
        b = call(src)
        lat.append(_now() - t)
    if b != src.tobytes():
        raise RuntimeError("tobytes baseline produced other bytes")
    return lat_stats(lat)


# --------------------------------------------------------------------------- local


def bench_local_4k(c: Any, n: int) -> dict[str, Any]:
    want = pattern(4, VALUE_4K)
    wantb = want.tobytes()
    c.put("small-4k", want)
    out = np.empty(VALUE_4K, np.uint8)
    into, fresh = [], []
    bad = 0
    for i in range(n + n // 10):
        out[:] = 0
        t = _now()
        c.get_into("small-4k", out)
        dt = _now() - t
        if not np.array_equal(out, want):
            bad += 1
        t = _now()
        got = c.get("small-4k")
        dt2 = _now() - t
        if got != wantb:
            bad += 1
        if i >= n // 10:
            into.append(dt)
            fresh.append(dt2)
    if bad:
        raise RuntimeError(f"{bad} 4 KiB reads returned wrong bytes")
    return {"get_into": lat_stats(into), "get": lat_stats(fresh)}


def bench_single_sizes(c: Any, size: int, ws_bytes: int, reps: int) -> dict[str, Any]:
    """Single put / get_into of ``size`` over a working set of distinct values, beside
    numpy.copyto over an equally large working set (source and destination apart)."""
    n = max(4, ws_bytes // size)
    srcs = [pattern(1000 + i, size) for i in range(n)]
    outs = [np.empty(size, np.uint8) for _ in range(n)]
    keys = [f"single-{size}-{i}" for i in range(n)]
    put_t: list[float] = []
    get_t: list[float] = []
    cpy_t: list[float] = []
    c.put_batch(keys, srcs)                      # warm the pool pages and the keys
    for _ in range(reps):
        for o in outs:                           # the destination as the get pass finds it:
            o[:] = 0                             # faulted in and just written (np.empty is not)
        for i in range(n):                       # baseline pass, same order of bytes
            t = _now()
            np.copyto(outs[i], srcs[i])
            cpy_t.append(_now() - t)
        for o in outs:
            o[:1] = 0
        for i in range(n):
            t = _now()
            c.put(keys[i], srcs[i])
            put_t.append(_now() - t)
        for o in outs:
            o[:] = 0
        for i in range(n):
            t = _now()
            c.get_into(keys[i], outs[i])
            get_t.append(_now() - t)
        bad = sum(not np.array_equal(o, s) for o, s in zip(outs, srcs))
        if bad:
            raise RuntimeError(f"{bad} of {n} {size}-byte reads returned wrong bytes")
    c.delete(keys)

    def mbps(ts: list[float]) -> float:
        return size / statistics.median(ts) / 1e6

    return {"values": n, "bytes": size, "put_MBps": mbps(put_t), "get_MBps": mbps(get_t),
            "copy_MBps": mbps(cpy_t), "put_vs_copy": mbps(put_t) / mbps(cpy_t),
            "get_vs_copy": mbps(get_t) / mbps(cpy_t)}


def bench_put_behind(c: Any, size: int, ws_bytes: int, reps: int,
                     token: bytes | None = None) -> dict[str, Any]:
    """Single write-behind ``put`` (``Client(write_behind=True)``) of ``size`` over a
    working set of distinct values, beside numpy.copyto over an equally large working
    set and the plain ``put`` in the same pass; ``put_flush_MBps`` also counts the
    ``flush()`` that waits for every PLACE reply (the bytes the server holds by then);
    ``keys_per_place``: keys the server installed per PLACE message in those passes
    (puts that come quickly share one, kvshm.client.PLACE_WINDOW). Every value is read
    back through the server's index after the flush."""
    import kvshm

    n = max(4, ws_bytes // size)
    srcs = [pattern(2000 + i, size) for i in range(n)]
    outs = [np.empty(size, np.uint8) for _ in range(n)]
    keys = [f"behind-{size}-{i}" for i in range(n)]
    put_t: list[float] = []
    plain_t: list[float] = []
    cpy_t: list[float] = []
    totals: list[float] = []
    places = keys_placed = 0
    with kvshm.Client(c.address, transport="shm", timeout=60,
                      token=token) as plain:
        plain.put_batch(keys, srcs)              # warm the pool pages and the keys
        for o in outs:                           # and the copy's destination (np.empty
            o[:] = 0                             # is not faulted in; the pool is)
        for _ in range(reps):
            for i in range(n):
                t = _now()
                np.copyto(outs[i], srcs[i])
                cpy_t.append(_now() - t)
            for i in range(n):
                t = _now()
                plain.put(keys[i], srcs[i])
                plain_t.append(_now() - t)
            r0 = plain.stats()["reservations"]
            t0 = _now()
            for i in range(n):
                t = _now()
                c.put(keys[i], srcs[i])
                put_t.append(_now() - t)
            c.flush()
            totals.append(_now() - t0)
            r1 = plain.stats()["reservations"]
            places += r1["places"] - r0["places"]
            keys_placed += r1["placed_keys"] - r0["placed_keys"]
            for o in outs:
                o[:] = 0
            for i in range(n):
                plain.get_into(keys[i], outs[i])
            bad = sum(not np.array_equal(o, s) for o, s in zip(outs, srcs))
            if bad:
                raise RuntimeError(f"{bad} of {n} {size}-byte values written behind "
                                   "read back wrong")
        plain.delete(keys)

    def mbps(ts: list[float]) -> float:
        return size / statistics.median(ts) / 1e6

    flush = n * size / statistics.median(totals) / 1e6
    return {"values": n, "bytes": size, "put_MBps": mbps(put_t),
            "plain_put_MBps": mbps(plain_t), "copy_MBps": mbps(cpy_t),
            "put_flush_MBps": flush, "put_vs_copy": mbps(put_t) / mbps(cpy_t),
            "plain_put_vs_copy": mbps(plain_t) / mbps(cpy_t),
            "put_flush_vs_copy": flush / mbps(cpy_t),
            "keys_per_place": keys_placed / places if places else 0.0}


def bench_local_queries(c: Any, n: int) -> dict[str, Any]:
    keys = [f"prefix-{i:04d}".encode() for i in range(64)]
    c.put_batch(keys, [b"q" * 16] * 64)
    ex, mp = [], []
    bad = 0
    for i in range(n + n // 10):
        t = _now()
        e = c.exists(keys[i % 64])
        dt = _now() - t
        t = _now()
        m = c.match_prefix(keys)
        dt2 = _now() - t
        bad += (e is not True) + (m != 64)
        if i >= n // 10:
            ex.append(dt)
            mp.append(dt2)
    if c.match_prefix(keys[:32] + [b"prefix-missing"] + keys[32:]) != 32:
        bad += 1
    if bad:
        raise RuntimeError(f"{bad} wrong exists/match_prefix answers")
    c.delete(keys)
    return {"exists": lat_stats(ex), "match_prefix_64": lat_stats(mp)}


def bench_batch_queries(c: Any, keys: list[bytes], reps: int) -> dict[str, Any]:
    """exists_batch / match_prefix keys/s vs a dict membership test (same keys); also by
    this thread's CPU time (the lookups run in it, the GIL released or not), which a
    loaded machine disturbs less than the wall clock. Each rep also runs both with the
    shared index reader's one-key-at-a-time lookups (``fast_batch`` off, what
    ``KVSHM_NO_FAST_BATCH_READS`` selects: the A/B of kvshm._shmindex's prefetching
    lookups), interleaved with the fast ones. The first exists_batch and match_prefix of
    the client are timed apart (``*_first``: they fault in the reader's scratch buffers
    and the table's pages, a once-per-process cost); then at least 5 reps (they are
    cheap), exists and match_prefix in turn first, so neither always finds the caches
    warm from the other."""
    n = len(keys)
    d = dict.fromkeys(keys, 0)
    lr = c.session.local
    modes: list[Any] = [True, False] if lr is not None and hasattr(lr, "fast_batch") else [None]
    # the reader's thread count, and 1 vs 2 threads (kvshm._shmindex batch_threads,
    # KVSHM_BATCH_READ_THREADS) in the same run, by wall and by the process's CPU time
    threads0 = getattr(lr, "batch_threads", None) if lr is not None else None
    if threads0 is not None:
        modes += ["t1", "t2"]
    wall: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    pcpus: dict[str, list[float]] = {}
    cpu = time.thread_time

    def timed(label: str, fn: Any) -> Any:
        t, tc, pc = _now(), cpu(), time.process_time()
        r = fn()
        wall.setdefault(label, []).append(n / (_now() - t))
        cpus.setdefault(label, []).append(n / max(cpu() - tc, 1e-9))
        pcpus.setdefault(label, []).append(n / max(time.process_time() - pc, 1e-9))
        return r

    def exists(sfx: str) -> None:
        if not all(timed("exists" + sfx, lambda: c.exists_batch(keys))):
            raise RuntimeError("exists_batch missed keys that are there")

    def match(sfx: str) -> None:
        m = timed("match_prefix" + sfx, lambda: c.match_prefix(keys))
        if m != n:
            raise RuntimeError(f"match_prefix said {m} of {n}")

    try:
        exists("_first")
        match("_first")
        for rep in range(max(reps, 5)):
            found = timed("dict", lambda: [k in d for k in keys])
            assert all(found)
            for fast in modes:
                if fast in ("t1", "t2"):
                    lr.fast_batch = True
                    lr.batch_threads = int(fast[1])
                elif fast is not None:
                    lr.fast_batch = fast
                    if threads0 is not None:
                        lr.batch_threads = threads0
                sfx = {True: "", None: "", False: "_slow"}.get(fast, "_" + str(fast))
                for q in ((exists, match) if rep % 2 == 0 else (match, exists)):
                    q(sfx)
    finally:
        if modes[0] is not None:
            lr.fast_batch = True
        if threads0 is not None:
            lr.batch_threads = threads0
    med = statistics.median
    out: dict[str, Any] = {"keys": n, "threads": threads0}
    for label in wall:
        out[f"{label}_keys_per_s"] = med(wall[label])
        out[f"{label}_keys_per_cpu_s"] = med(cpus[label])
        out[f"{label}_keys_per_proc_cpu_s"] = med(pcpus[label])
    return out


# --------------------------------------------------------------------------- report


def fmt_lat(d: dict[str, float]) -> str:
    return f"p50 {d['p50_us']:8.1f} us  p99 {d['p99_us']:8.1f} us"


def report(res: dict[str, Any]) -> None:
    m = res["meta"]
    print(f"\nkvshm small-operation benchmark  ({m['mode']}; ratios are against baselines "
          f"measured in this run; {m['cpus']} CPUs, load average {m['loadavg_start']:.1f} at "
          f"start, {m['loadavg_end']:.1f} at end)\n")
    loc = res.get("local")
    if loc and "baselines" in loc:
        b = loc["baselines"]
        print("LOCAL (shm client)")
        print(f"  baseline zmq DEALER/ROUTER echo, ipc  {fmt_lat(b['zmq_echo_ipc'])}")
        print(f"  baseline numpy copyto 4 KiB + 1 call  {fmt_lat(b['copy_4k_call'])}")
        print(f"  baseline tobytes 4 KiB + 1 call       {fmt_lat(b['tobytes_4k_call'])}")
        g = loc["get_4k"]
        print(f"  kvshm get_into 4 KiB                  {fmt_lat(g['get_into'])}")
        print(f"  kvshm get 4 KiB (fresh bytes)         {fmt_lat(g['get'])}")
        r = loc["ratios"]
        print(f"    get_into p50 / echo p50   {r['get_into_vs_echo']:6.2f}   (target <= 0.25)")
        print(f"    get_into p50 / copy p50   {r['get_into_vs_copy']:6.2f}   (target <= 3)")
        print(f"    get p50 / tobytes p50     {r['get_vs_tobytes']:6.2f}")
        print("  single put / get_into, values beyond the caches (MB/s of the median op)")
        for s in loc["single"]:
            tgt = ">= 0.8" if s["bytes"] >= 1 << 20 else ">= 0.4"
            print(f"    {s['bytes'] // 1024:5d} KiB x {s['values']:5d}: put {s['put_MBps']:8.0f}"
                  f"  get {s['get_MBps']:8.0f}  numpy copy {s['copy_MBps']:8.0f}   "
                  f"put/copy {s['put_vs_copy']:.2f}  get/copy {s['get_vs_copy']:.2f}  "
                  f"(target {tgt})")
        print("  single put written behind (write_behind=True), same working sets; plain "
              "put and numpy copy in the same pass (MB/s of the median op)")
        for s in loc.get("single_behind", []):
            tgt = ">= 0.8" if s["bytes"] >= 1 << 20 else ">= 0.4"
            print(f"    {s['bytes'] // 1024:5d} KiB x {s['values']:5d}: put {s['put_MBps']:8.0f}"
                  f"  plain put {s['plain_put_MBps']:8.0f}  numpy copy {s['copy_MBps']:8.0f}"
                  f"   put/copy {s['put_vs_copy']:.2f} (target {tgt})  plain/copy "
                  f"{s['plain_put_vs_copy']:.2f}  puts+flush/copy {s['put_flush_vs_copy']:.2f}"
                  f"  keys/PLACE {s.get('keys_per_place', 0):.1f}")
        q = loc["queries"]
        print(f"  kvshm exists, 1 key                   {fmt_lat(q['exists'])}")
        print(f"  kvshm match_prefix, 64 keys           {fmt_lat(q['match_prefix_64'])}")
        print(f"    echo p50 / exists p50     {r['echo_vs_exists']:6.2f}x   "
              f"echo p50 / match_prefix p50 {r['echo_vs_match_prefix']:6.2f}x   "
              "(target: 10x faster than the 'before' round trip)")
    elif loc:
        print("LOCAL (shm client), batch lookups only (--only local-batch)")
    if loc:
        bq = loc.get("batch_queries")
        if bq:
            print(f"  batch of {bq['keys']} keys: exists_batch {bq['exists_keys_per_s'] / 1e6:.2f}"
                  f" M keys/s, match_prefix {bq['match_prefix_keys_per_s'] / 1e6:.2f} M keys/s;"
                  f" dict membership {bq['dict_keys_per_s'] / 1e6:.2f} M keys/s  (target >= 20 M)")
            print(f"    by CPU time of this thread: exists_batch "
                  f"{bq['exists_keys_per_cpu_s'] / 1e6:.2f}, match_prefix "
                  f"{bq['match_prefix_keys_per_cpu_s'] / 1e6:.2f}, dict membership "
                  f"{bq['dict_keys_per_cpu_s'] / 1e6:.2f} M keys/s (median of the reps after "
                  f"the first call)")
            print(f"    the client's first call (scratch buffers and table pages faulted in): "
                  f"exists_batch {bq['exists_first_keys_per_s'] / 1e6:.2f}, match_prefix "
                  f"{bq['match_prefix_first_keys_per_s'] / 1e6:.2f} M keys/s")
            if "exists_slow_keys_per_s" in bq:
                print(f"    one key at a time (KVSHM_NO_FAST_BATCH_READS), same run: exists_batch "
                      f"{bq['exists_slow_keys_per_s'] / 1e6:.2f} (CPU "
                      f"{bq['exists_slow_keys_per_cpu_s'] / 1e6:.2f}), match_prefix "
                      f"{bq['match_prefix_slow_keys_per_s'] / 1e6:.2f} (CPU "
                      f"{bq['match_prefix_slow_keys_per_cpu_s'] / 1e6:.2f}) M keys/s; fast/slow "
                      f"{bq['exists_keys_per_cpu_s'] / bq['exists_slow_keys_per_cpu_s']:.2f}x,"
                      f" {bq['match_prefix_keys_per_cpu_s'] / bq['match_prefix_slow_keys_per_cpu_s']:.2f}x"
                      " by CPU time")
            if "exists_t2_keys_per_s" in bq:
                print(f"    reader's batch_threads {bq['threads']}; same run, 1 vs 2 threads "
                      "(KVSHM_BATCH_READ_THREADS), M keys/s wall / by the process's CPU time:")
                for t in ("t1", "t2"):
                    print(f"      {t[1]} thread(s): exists_batch {bq[f'exists_{t}_keys_per_s'] / 1e6:.2f}"
                          f" / {bq[f'exists_{t}_keys_per_proc_cpu_s'] / 1e6:.2f}, match_prefix "
                          f"{bq[f'match_prefix_{t}_keys_per_s'] / 1e6:.2f} / "
                          f"{bq[f'match_prefix_{t}_keys_per_proc_cpu_s'] / 1e6:.2f}")
        bq40 = loc.get("batch_queries_40")
        if bq40:
            print(f"  same with 40-byte keys (hex, as bench_index's): exists_batch "
                  f"{bq40['exists_keys_per_s'] / 1e6:.2f}, match_prefix "
                  f"{bq40['match_prefix_keys_per_s'] / 1e6:.2f} M keys/s; by CPU "
                  f"{bq40['exists_keys_per_cpu_s'] / 1e6:.2f} / "
                  f"{bq40['match_prefix_keys_per_cpu_s'] / 1e6:.2f}; dict membership "
                  f"{bq40['dict_keys_per_s'] / 1e6:.2f}  (target >= 20 M)")
    rem = res.get("remote")
    if rem:
        print(f"\nREMOTE (TCP transport), single-key 4 KiB, requests/s per phase of "
              f"{res['meta']['seconds']} s; redis-py parser: {rem['redis_parser']}")
        print(f"  baseline zmq DEALER/ROUTER echo, tcp  {fmt_lat(rem['zmq_echo_tcp'])}")
        hdr = ("clients", "kvshm put", "redis set", "put/redis", "kvshm get", "redis get",
               "get/redis", "srv us/put", "srv us/get", "redis us/set", "redis us/get")
        print("  " + " ".join(f"{h:>12}" for h in hdr))
        for row in rem["rows"]:
            vals = [row["clients"], row.get("kvshm_put_rps"), row.get("redis_put_rps"),
                    row.get("put_vs_redis"), row.get("kvshm_get_rps"), row.get("redis_get_rps"),
                    row.get("get_vs_redis"), row.get("kvshm_put_cpu_us"),
                    row.get("kvshm_get_cpu_us"), row.get("redis_put_cpu_us"),
                    row.get("redis_get_cpu_us")]
            print("  " + " ".join(f"{'-':>12}" if v is None else
                                  (f"{v:12.2f}" if isinstance(v, float) and v < 100 else
                                   f"{v:12.0f}") for v in vals))
        print("  client CPU per request (us, all threads of the client processes, ZeroMQ's "
              "included): " + "; ".join(
                  f"N={row['clients']} put {row.get('kvshm_put_client_us', 0):.0f} / set "
                  f"{row.get('redis_put_client_us', 0):.0f}, get "
                  f"{row.get('kvshm_get_client_us', 0):.0f} / {row.get('redis_get_client_us', 0):.0f}"
                  for row in rem["rows"]))
        print(f"  of the kvshm server's CPU per request ({rem.get('listener', 'libzmq')} listener), "
              "libzmq's I/O thread (us, put / get; 0 under the native listener, which has none): "
              + "; ".join(f"N={row['clients']} {row.get('kvshm_put_io_us', 0):.0f} / "
                          f"{row.get('kvshm_get_io_us', 0):.0f}" for row in rem["rows"]))
        print("  (target: kvshm >= 1.0x Redis at every N; server CPU per request)")
    bat = res.get("batch")
    if bat:
        print(f"\nBATCH (TCP, 4 KiB blocks), {bat['keys']} keys of {bat['value_bytes']} bytes, "
              "keys/s")
        print(f"  kvshm put_batch {bat['put'] / 1e6:.2f} M/s (server {bat['put_cpu'] * 1e6:.2f}"
              f" us CPU/key)   get_batch (fresh bytes) {bat['get'] / 1e6:.2f} M/s (server "
              f"{bat['get_cpu'] * 1e6:.2f} us CPU/key)   exists_batch "
              f"{bat['exists'] / 1e6:.2f} M/s")
        if "exists_pipe" in bat:
            print(f"  exists_batch as one request {bat['exists'] / 1e6:.2f} M/s (CPU/key client "
                  f"{bat['exists_cpu'] * 1e6:.3f} us, server {bat['exists_srv'] * 1e6:.3f} us)"
                  f"   pipelined (KVSHM_PIPELINE=1) {bat['exists_pipe'] / 1e6:.2f} M/s "
                  f"(client {bat['exists_cpu_pipe'] * 1e6:.3f} us, server "
                  f"{bat['exists_srv_pipe'] * 1e6:.3f} us), same run, taking turns")
        if "put_pipe" in bat:
            print(f"  put_batch as one PUT {bat['put'] / 1e6:.2f} M/s   pipelined "
                  f"(KVSHM_PIPELINE=1) {bat['put_pipe'] / 1e6:.2f} M/s (server "
                  f"{bat['put_cpu_pipe'] * 1e6:.2f} us CPU/key), same run, taking turns")
        if "rset" in bat:
            print(f"  redis pipelined SET {bat['rset'] / 1e6:.2f} M/s   MGET (fresh bytes) "
                  f"{bat['rmget'] / 1e6:.2f} M/s   put/redis {bat['put_vs_redis']:.2f}  "
                  f"get_batch/MGET {bat['get_vs_redis']:.2f}")
        print("  (target: put >= 2 M keys/s, lookup >= 5 M keys/s)")
    by = res.get("bystander")
    if by:
        print(f"\nBYSTANDER (TCP, 4 KiB get_into in its own process), while another client "
              f"sends {by['batch_keys']}-key batches ({by['batches']} in {by['busy_s']:.1f} s)")
        if by["idle"]:
            print(f"  idle                                  {fmt_lat(by['idle'])}")
        if by["busy"]:
            print(f"  during batches                        {fmt_lat(by['busy'])}"
                  f"   (target p99 <= 5 ms)")
        else:
            print("  during batches: no request finished inside the busy window")
    for line in res.get("unavailable", []):
        print(f"\nunavailable: {line}")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (for tests)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON ('-': stdout)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3000, help="timed calls per latency figure")
    ap.add_argument("--working-set-mib", type=int, default=128)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per request-rate phase")
    ap.add_argument("--batch", type=int, default=100_000, help="keys in a batch")
    ap.add_argument("--skip-redis", action="store_true")
    ap.add_argument("--only", default="local,remote,batch,bystander",
                    help="comma-separated parts; local-batch: only local's batch lookups")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.iters, args.working_set_mib = 1, 100, 2
        args.clients, args.seconds, args.batch = "1,2", 0.3, 2000
    only = set(args.only.split(","))
    counts = [int(x) for x in args.clients.split(",")]

    import kvshm
    from servers import ServerProcess

    res: dict[str, Any] = {"meta": {"mode": "quick" if args.quick else "full",
                                    "reps": args.reps, "iters": args.iters,
                                    "seconds": args.seconds, "batch": args.batch,
                                    "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0],
                                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                           "unavailable": []}
    redis_proc = rport = r = rdir = None
    if not args.skip_redis and only & {"remote", "batch"}:
        try:
            import redis

            redis_proc, rport, rdir = _common.start_redis(2 << 30)
            r = redis.Redis(host="127.0.0.1", port=rport)
        except (ImportError, FileNotFoundError, RuntimeError) as exc:
            res["unavailable"].append(f"redis: {exc}")
    ws = args.working_set_mib << 20
    try:
        pool_gib = max(0.0625, (2.2 * ws + (16 << 20)) / 2**30)
        if only & {"local", "remote"}:
            with ServerProcess(prealloc_size=round(pool_gib, 4)) as srv:
                if "local" in only:
                    loc: dict[str, Any] = {}
                    ipc_dir = tempfile.mkdtemp(prefix="kvshm-bench-echo-")
                    try:
                        b = {"zmq_echo_ipc": bench_zmq_echo(f"ipc://{ipc_dir}/echo.sock",
                                                            args.iters),
                             "copy_4k_call": bench_copy_call(args.iters, VALUE_4K),
                             "tobytes_4k_call": bench_tobytes_call(args.iters, VALUE_4K)}
                    finally:
                        shutil.rmtree(ipc_dir, ignore_errors=True)
                    loc["baselines"] = b
                    from kvshm.security import find_token
                    from kvshm.zmq_ctrl.channel import endpoint_of

                    # read once: the clients of the write-behind rows come later
                    tok = find_token(endpoint_of(srv.address))
                    with kvshm.Client(srv.address, transport="shm", timeout=60) as c:
                        loc["get_4k"] = bench_local_4k(c, args.iters)
                        loc["single"] = [bench_single_sizes(c, size, ws, args.reps)
                                         for size in (64 << 10, 1 << 20)]
                        loc["queries"] = bench_local_queries(c, args.iters)
                        c.purge()
                    with kvshm.Client(srv.address, transport="shm", timeout=60,
                                      write_behind=True, token=tok) as w:
                        loc["single_behind"] = [bench_put_behind(w, size, ws, args.reps, tok)
                                                for size in (64 << 10, 1 << 20)]
                    g, q = loc["get_4k"], loc["queries"]
                    echo = b["zmq_echo_ipc"]["p50_us"]
                    loc["ratios"] = {
                        "get_into_vs_echo": g["get_into"]["p50_us"] / echo,
                        "get_into_vs_copy": g["get_into"]["p50_us"] / b["copy_4k_call"]["p50_us"],
                        "get_vs_tobytes": g["get"]["p50_us"] / b["tobytes_4k_call"]["p50_us"],
                        "echo_vs_exists": echo / q["exists"]["p50_us"],
                        "echo_vs_match_prefix": echo / q["match_prefix_64"]["p50_us"]}
                    res["local"] = loc
                if "remote" in only:
                    with kvshm.Client(srv.address, transport="tcp", timeout=60) as c:
                        kind = c.stats().get("listener", {}).get("kind", "libzmq")
                    res["remote"] = {
                        "listener": kind,
                        "redis_parser": _common.redis_parser() if r is not None else "-",
                        "zmq_echo_tcp": bench_zmq_echo("tcp://127.0.0.1:0", args.iters),
                        "rows": small_remote.bench_remote_single(
                            srv.address, srv.pid, rport,
                            redis_proc.pid if redis_proc is not None else None,
                            counts, args.seconds)}
        if only & {"batch", "bystander", "local", "local-batch"}:
            n = args.batch
            keys = [f"batch-{i:012d}".encode() for i in range(n)]
            vals = [pattern(i, 64).tobytes() for i in range(n)]
            # 4 KiB blocks; room for the batch twice (an overwrite holds old and new) + slack
            pool = max(0.0625, round((2.5 * n * 4096 + (32 << 20)) / 2**30, 4))
            with ServerProcess("--block-size", "4", prealloc_size=pool) as srv4:
                if only & {"local", "local-batch"}:
                    with kvshm.Client(srv4.address, transport="shm", timeout=120) as c:
                        c.put_batch(keys, vals)
                        res.setdefault("local", {})["batch_queries"] = bench_batch_queries(c, keys, args.reps)
                        # the same with 40-byte keys (a hex chunk hash, bench_index's keys):
                        # in layout 4 (key from byte 24) a hit reads only the slot's first
                        # cache line, as an 18-byte key's does (layout 3: both lines);
                        # the table then holds both key sets (2 x --batch keys)
                        keys40 = [b"%040x" % (i * 0x9E3779B97F4A7C15 % (1 << 160))
                                  for i in range(n)]
                        c.put_batch(keys40, vals)
                        res["local"]["batch_queries_40"] = bench_batch_queries(c, keys40,
                                                                               args.reps)
                        c.delete(keys40)
                if "batch" in only:
                    res["batch"] = small_remote.bench_batches(
                        srv4.address, srv4.pid, r,
                        redis_proc.pid if redis_proc is not None else None,
                        keys, vals, args.reps)
                if "bystander" in only:
                    res["bystander"] = small_remote.bench_bystander(srv4.address, keys, vals,
                                                                    args.seconds)
    finally:
        stop(redis_proc)
        if rdir:
            shutil.rmtree(rdir, ignore_errors=True)
    res["meta"]["loadavg_end"] = os.getloadavg()[0]
    report(res)
    if args.json:
        _common.write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
