"""The prepared GPU check: kvshm's CUDA paths on a GPU host, in one command.

    python perf/gpu_check.py [--size-mib 256] [--reps 5] [--page-kib 256]

What it does, all in one run, and prints (one line per figure, then a JSON summary):

1. raw DMA: a kvshm pool (``kvshm.Pool``, a fresh POSIX shm segment of ``--size-mib``)
   registered with ``cudaHostRegister`` (``kvshm.cuda.register_pool``); GPU -> pool and
   pool -> GPU GB/s through ``kvshm.cuda.copy_to_pool`` / ``copy_from_pool``, against the
   baseline measured in the same run: ``cudaMemcpy`` between the same GPU tensor and a
   pinned host tensor (``torch.empty(..., pin_memory=True)``), same bytes, same reps;
   every copy byte-checked;
2. paged put/get on CUDA tensors through a real ``kvshm serve`` (started here, free
   port, unique segment, stopped at the end): ``Client.put_pages`` of a CUDA KV tensor
   ``[2, pages, 16, 8, 128]`` bf16, then ``get_pages_into`` a zeroed CUDA tensor, pages
   in another order, byte-checked (``torch.equal``), with GB/s.

It installs nothing and reaches no network. Without CUDA (``torch.cuda.is_available()``
false, or no torch) it measures nothing and exits with status 2 and a message saying so.
Exit status 1: a check failed (bytes differ, a copy raised).

This script has NOT run on a GPU: it was written on a machine without one, where only the
no-CUDA exit is tested (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import uuid
from typing import Any

NO_CUDA_EXIT = 2


def _cuda_or_exit() -> Any:
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed here: no CUDA, nothing measured",
              file=sys.stderr)
        sys.exit(NO_CUDA_EXIT)
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, "
              f"torch.version.cuda={torch.version.cuda}, torch.cuda.is_available() is "
              f"False): nothing measured", file=sys.stderr)
        sys.exit(NO_CUDA_EXIT)
    return torch


def _timed(torch: Any, fn: Any, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (synchronized)."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def raw_dma(torch: Any, size: int, reps: int) -> dict[str, float]:
    from kvshm import cuda
    from kvshm._pool import Pool

    name = f"/kvshm-gpucheck-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    pool = Pool.create(name, size)
    try:
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
        back = torch.zeros_like(src)
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        offs, sizes = [0], [size]
        cuda.register_pool(pool)

        t_to = _timed(torch, lambda: cuda.copy_to_pool(pool, src, offs, sizes, [0]), reps)
        t_from = _timed(torch, lambda: cuda.copy_from_pool(pool, offs, sizes, back, [0]),
                        reps)
        if not torch.equal(src, back):
            raise AssertionError("pool -> GPU bytes differ from GPU -> pool bytes")
        mv = pool.view(0, size, readonly=True)
        held = bytes(mv[:1 << 20])          # the first MiB, copied out (no view kept)
        mv.release()
        if held != bytes(src[:1 << 20].cpu().numpy()):
            raise AssertionError("the pool does not hold the GPU bytes")
        b_to = _timed(torch, lambda: pinned.copy_(src, non_blocking=True), reps)
        b_from = _timed(torch, lambda: back.copy_(pinned, non_blocking=True), reps)
        if not torch.equal(src, back):
            raise AssertionError("pinned baseline bytes differ")
        cuda.unregister_pool(pool)
    finally:
        pool.unlink()
        pool.close()
    gb = size / 1e9
    return {"gpu_to_pool_GBps": gb / t_to, "pool_to_gpu_GBps": gb / t_from,
            "gpu_to_pinned_GBps": gb / b_to, "pinned_to_gpu_GBps": gb / b_from,
            "gpu_to_pool_vs_pinned": b_to / t_to, "pool_to_gpu_vs_pinned": b_from / t_from}


def _serve(size_mib: int) -> tuple[subprocess.Popen[bytes], str]:
    name = f"/kvshm-gpucheck-srv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "kvshm", "serve", "--service-port", "0", "--prealloc-size",
           str(size_mib / 1024), "--shm-name", name, "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    m = re.search(r"service tcp://([^,]+):(\d+)", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"kvshm serve did not start: {line!r}")
    return proc, f"{m.group(1)}:{m.group(2)}"


def paged(torch: Any, size_mib: int, reps: int) -> dict[str, float]:
    import kvshm

    page_shape = (16, 8, 128)                    # tokens x KV heads x head dim, bf16
    page_bytes = 2 * 16 * 8 * 128 * 2
    pages = max(4, min(512, (size_mib << 20) // (3 * page_bytes)))
    kv = torch.randn((2, pages, *page_shape), dtype=torch.bfloat16, device="cuda")
    out = torch.zeros_like(kv)
    ids = list(range(pages))
    rev = ids[::-1]
    keys = [f"gpucheck/{i}" for i in ids]
    proc, address = _serve(size_mib)
    try:
        with kvshm.Client(address, transport="shm") as c:
            t_put = _timed(torch, lambda: c.put_pages(keys, kv, ids), reps)
            t_get = _timed(torch, lambda: c.get_pages_into(keys[::-1], out, rev), reps)
            if not torch.equal(out, kv):
                raise AssertionError("paged get_pages_into bytes differ from put_pages")
            if not all(c.get_pages_into(keys, out, ids)):
                raise AssertionError("a stored page is missing")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    gb = pages * page_bytes / 1e9
    return {"pages": pages, "page_bytes": page_bytes, "put_pages_GBps": gb / t_put,
            "get_pages_GBps": gb / t_get}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256, help="bytes per copy (MiB)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch = _cuda_or_exit()
    dev = torch.cuda.get_device_name(0)
    print(f"gpu_check: {dev}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    res: dict[str, Any] = {"device": dev, "torch": torch.__version__}
    try:
        res["raw"] = raw_dma(torch, args.size_mib << 20, args.reps)
        for k, v in res["raw"].items():
            print(f"gpu_check: raw {k}: {v:.2f}")
        res["paged"] = paged(torch, args.size_mib, args.reps)
        for k, v in res["paged"].items():
            print(f"gpu_check: paged {k}: {v:.2f}" if isinstance(v, float)
                  else f"gpu_check: paged {k}: {v}")
    except Exception as exc:     # a check failed: say which, exit 1
        print(f"gpu_check: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(json.dumps(res))
        return 1
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
