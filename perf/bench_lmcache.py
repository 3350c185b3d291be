#!/usr/bin/env python3
"""The same KV chunks through LMCache into kvshm, LMCache's lm-server and Redis, side by side.

    PYTHONPATH=$PWD $KVSHM_INTEGRATION_VENV/bin/python perf/bench_lmcache.py \\
        [--chunks 32] [--reps 5] [--layers 4 --heads 8 --dim 64] [--skip-redis] [--skip-lm]

Runs in the integration venv (``scripts/integration-env.sh``: LMCache 0.5.6, CPU torch).
Every target goes through LMCache's own ``RemoteBackend`` exactly as the engine uses it:

``kvshm``
    the kvshm plugin (``kvshm.integrations.lmcache.KvshmConnector``) against a ``kvshm
    serve`` child; the shared-memory mover (same host).
``lm-server``
    ``remote_url: lm://`` against ``python -m lmcache.v1.server HOST PORT cpu``.
``redis``
    ``remote_url: redis://`` (LMCache's RedisConnector, redis-py asyncio) against a
    ``redis-server`` child (no persistence).

Chunks: bf16 ``[2, layers, 256, heads*dim]`` (KV_2LTD), 2 MiB with the defaults, random
data, fresh keys every repetition (nothing is skipped as already present). Per target:
``put`` = ``batched_submit_put_task`` of all chunks until LMCache reports every write done;
``get`` = ``batched_get_blocking`` of all chunks (checked bit-exact once); ``get1`` =
``get_blocking`` one chunk at a time; ``contains`` = ``batched_contains`` of all keys
(median of 20 calls, per key); ``exists`` = ``contains`` of one key (median call). Figures are medians of --reps
repetitions after one warm-up. Each target runs in its own child process (LMCache keeps
global state, and RedisConnector.close() deadlocks in 0.5.6, so the Redis child exits
without closing); the ratios are kvshm's advantage (higher is better for kvshm).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

import _common  # noqa: E402
from _common import free_port, stop, wait_port  # noqa: E402

CHUNK = 256
COLUMNS = [("put", "MiB/s", True), ("get", "MiB/s", True), ("get1", "MiB/s", True),
           ("contains", "us/key", False), ("exists", "us/call", False)]


# --------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> dict:
    """One target, in this process: returns the medians."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    import asyncio
    import threading

    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    L, H, D, N = args.layers, args.heads, args.dim, args.chunks
    chunk_bytes = 2 * L * CHUNK * H * D * 2
    cpu_gb = max(0.25, 3 * N * chunk_bytes / 2 ** 30)
    kw: dict = dict(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=cpu_gb,
                    remote_serde="naive", blocking_timeout_secs=60)
    plugin = None
    if args.worker == "kvshm":
        plugin = "kvshm"
        kw.update(remote_storage_plugins=["kvshm"], extra_config={
            "remote_storage_plugin.kvshm.module_path": "kvshm.integrations.lmcache",
            "remote_storage_plugin.kvshm.class_name": "KvshmConnector",
            "remote_storage_plugin.kvshm.url": args.address,
            "remote_storage_plugin.kvshm.transport": "shm"})
    elif args.worker == "lm-server":
        kw.update(remote_url=f"lm://{args.address}")
    elif args.worker == "redis":
        kw.update(remote_url=f"redis://{args.address}")
    config = LMCacheEngineConfig.from_defaults(**kw)
    md = LMCacheMetadata(model_name="bench-model", world_size=1, local_world_size=1,
                         worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                         kv_shape=(L, 2, CHUNK, H, D), chunk_size=CHUNK)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cpu = LocalCPUBackend(config, md, dst_device="cpu")
    be = RemoteBackend(config, md, loop, cpu, dst_device="cpu", plugin_name=plugin)
    if be.connection is None:
        raise RuntimeError(f"LMCache made no connection for {args.worker}")
    shapes, dtypes = md.get_shapes(), md.get_dtypes()
    g = torch.Generator().manual_seed(0)
    objs, refs = [], []
    for _ in range(N):
        o = cpu.allocate(shapes, dtypes, MemoryFormat.KV_2LTD)
        ref = torch.randn(shapes[0], generator=g).to(torch.bfloat16)
        o.tensor.copy_(ref)
        objs.append(o)
        refs.append(ref)
    mib = N * chunk_bytes / 2 ** 20
    out: dict[str, list[float]] = {c: [] for c, _, _ in COLUMNS}

    for rep in range(args.reps + 1):
        keys = [CacheEngineKey("bench-model", 1, 0, (rep << 20) + i, torch.bfloat16)
                for i in range(N)]
        done = threading.Semaphore(0)
        t0 = time.perf_counter()
        be.batched_submit_put_task(keys, objs, on_complete_callback=lambda k: done.release())
        for _ in keys:
            if not done.acquire(timeout=120):
                raise RuntimeError("puts did not complete")
        t_put = time.perf_counter() - t0
        if be.batched_contains(keys) != N:
            raise RuntimeError(f"{args.worker}: not every chunk is there after the put")
        calls = []
        for _ in range(20):
            t0 = time.perf_counter()
            n = be.batched_contains(keys)
            calls.append(time.perf_counter() - t0)
            assert n == N
        t_contains = statistics.median(calls) / N
        calls = []
        for k in keys * max(1, 64 // N):
            t0 = time.perf_counter()
            be.contains(k)
            calls.append(time.perf_counter() - t0)
        t_exists = statistics.median(calls)
        t0 = time.perf_counter()
        got = be.batched_get_blocking(keys)
        t_get = time.perf_counter() - t0
        if rep == 0:
            for x, r in zip(got, refs):
                if x is None or not torch.equal(x.tensor, r):
                    raise RuntimeError(f"{args.worker}: a chunk came back wrong")
        for x in got:
            if x is not None:
                x.ref_count_down()
        t0 = time.perf_counter()
        for k in keys:
            x = be.get_blocking(k)
            if x is None:
                raise RuntimeError(f"{args.worker}: get_blocking missed")
            x.ref_count_down()
        t_get1 = time.perf_counter() - t0
        if rep == 0:
            continue               # warm-up
        out["put"].append(mib / t_put)
        out["get"].append(mib / t_get)
        out["get1"].append(mib / t_get1)
        out["contains"].append(t_contains * 1e6)
        out["exists"].append(t_exists * 1e6)
    res = {c: statistics.median(v) for c, v in out.items()}
    res["chunk_mib"] = chunk_bytes / 2 ** 20
    if args.worker != "redis":          # RedisConnector.close() deadlocks (0.5.6)
        be.close()
    return res


# --------------------------------------------------------------------------- orchestration


def run_worker(target: str, address: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", target, "--address", address,
           "--chunks", str(args.chunks), "--reps", str(args.reps), "--layers", str(args.layers),
           "--heads", str(args.heads), "--dim", str(args.dim)]
    env = {**os.environ, "LMCACHE_LOG_LEVEL": "ERROR",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{target} worker failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--skip-redis", action="store_true")
    ap.add_argument("--skip-lm", action="store_true")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        res = worker(args)
        print("RESULT " + json.dumps(res), flush=True)
        os._exit(0)             # LMCache leaves non-daemon threads behind

    from servers import ServerProcess

    chunk_bytes = 2 * args.layers * CHUNK * args.heads * args.dim * 2
    total = (args.reps + 1) * args.chunks * chunk_bytes
    results: dict[str, dict] = {}
    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="kvshm-bench-lmcache-")
    tmps = [tmp]
    srv = ServerProcess(prealloc_size=max(0.25, 1.5 * total / 2 ** 30))
    try:
        results["kvshm"] = run_worker("kvshm", srv.address, args)
        if not args.skip_lm:
            port = free_port()
            p = subprocess.Popen([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1",
                                  str(port), "cpu"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, cwd=tmp,
                                 env={**os.environ, "LMCACHE_LOG_LEVEL": "ERROR"})
            procs.append(p)
            wait_port(port, p, "lm-server")
            results["lm-server"] = run_worker("lm-server", f"127.0.0.1:{port}", args)
        if not args.skip_redis:
            try:
                p, port, rdir = _common.start_redis(maxmemory=0)    # 0: no limit
            except FileNotFoundError as exc:
                print(f"{exc}: Redis skipped")
            else:
                procs.append(p)
                tmps.append(rdir)
                results["redis"] = run_worker("redis", f"127.0.0.1:{port}", args)
    finally:
        for p in procs:
            stop(p)
        srv.stop()
        srv.remove_segment()
        for d in tmps:
            shutil.rmtree(d, ignore_errors=True)

    k = results["kvshm"]
    print(f"\nLMCache 0.5.6 RemoteBackend, {args.chunks} chunks of {k['chunk_mib']:.2f} MiB "
          f"(bf16 [2, {args.layers}, {CHUNK}, {args.heads * args.dim}]), median of "
          f"{args.reps}, one host, {os.cpu_count()} CPUs")
    head = f"{'target':<11}" + "".join(f"{c + ' ' + u:>18}" for c, u, _ in COLUMNS)
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        print(f"{name:<11}" + "".join(f"{r[c]:>18.1f}" for c, _, _ in COLUMNS))
    for name, r in results.items():
        if name == "kvshm":
            continue
        ratios = [(k[c] / r[c]) if higher else (r[c] / k[c]) for c, _, higher in COLUMNS]
        print(f"{'kvshm/' + name:<11}" + "".join(f"{x:>17.2f}x" for x in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
