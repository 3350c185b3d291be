#!/usr/bin/env python3
"""Layer-wise prefill: how much of the KV transfer hides behind the model's compute.

    python perf/bench_layerwise.py [--layers 32] [--pages 64] [--reps 9]
                                   [--compute-ratio 1.0] [--compute matmul|sleep]

A prefill of ``--layers`` layers, each producing a paged KV tensor
``[2, num_blocks, 16, 8, 128]`` fp16 (64 KiB pages) of which ``--pages`` pages are
stored (``put_pages``, one scatter into the pool per layer). The model's compute is
simulated on the CPU by float32 matmuls (BLAS pinned to one thread, standing in for the
GPU), sized so one layer's compute takes ``--compute-ratio`` times one layer's transfer.
This busy compute needs a core of its own while the transfer thread needs another: on a
machine whose cores are taken by other work the overlap is bounded by the CPU left.
``--compute sleep`` models a GPU instead (the CPU is free while a layer computes).

Three timings, back to back in each repetition:

* transfer alone: the layers stored one after the other, nothing else running (T);
* compute alone: the layers' compute, nothing else running (C);
* overlapped: compute layer i, hand it to a :class:`~kvshm.layerwise.LayerWriter`, go on
  with layer i+1; ``wait()`` at the end (O).

Hidden fraction = (T + C - O) / T: 1.0 when the whole transfer ran during compute. The
last layer's transfer has nothing left to hide behind, so the best possible is about
(layers - 1) / layers. Issue 5 target: >= 0.8 with 32 layers. Printed: the median over
--reps of each repetition's fraction, and the fraction of the fastest run of each kind
(other work on a shared machine only adds time).
"""

from __future__ import annotations

import os

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")        # the simulated GPU is one core

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import kvshm  # noqa: E402
from kvshm.layerwise import LayerWriter  # noqa: E402
from servers import ServerProcess  # noqa: E402

PAGE_SHAPE = (16, 8, 128)         # tokens, KV heads, head size: 64 KiB per fp16 page


class Compute:
    """A layer's worth of CPU work: ``reps`` float32 matmuls of 192 x 192."""

    def __init__(self, kind: str = "matmul") -> None:
        rng = np.random.default_rng(0)
        self.a = rng.standard_normal((192, 192)).astype(np.float32)
        self.b = rng.standard_normal((192, 192)).astype(np.float32)
        self.reps = 1
        self.kind = kind
        self.seconds = 0.0

    def one(self) -> None:
        if self.kind == "sleep":             # a GPU computing: the CPU is free
            time.sleep(self.seconds)
            return
        x = self.a
        for _ in range(self.reps):
            x = x @ self.b
            x *= 1e-3                        # keep the values finite
        self.sink = x

    def calibrate(self, seconds: float) -> None:
        """Choose ``reps`` so that one() takes about ``seconds``."""
        self.seconds = seconds
        self.reps = 50
        t = time.perf_counter()
        for _ in range(5):
            self.one()
        per = (time.perf_counter() - t) / (5 * 50)
        self.reps = max(1, round(seconds / per))


def parallelism(comp: Compute, seconds: float = 0.2) -> float:
    """How many cores this process gets for two busy threads right now: numpy memcpy in
    one and the matmul compute in the other (both release the GIL). 2.0 on an idle
    2-core machine; 1.0 when other work leaves one core, and then no overlap of busy
    compute and copies is possible, whatever the library does."""
    import threading

    src = np.ones(4 << 20, np.uint8)
    dst = np.empty_like(src)
    kind, comp.kind = comp.kind, "matmul"
    try:
        def n_copies(n: int) -> None:
            for _ in range(n):
                np.copyto(dst, src)

        t = time.perf_counter()
        n = 0
        while time.perf_counter() - t < seconds:
            np.copyto(dst, src)
            n += 1
        t_copy = time.perf_counter() - t
        t = time.perf_counter()
        m = 0
        while time.perf_counter() - t < seconds:
            comp.one()
            m += 1
        t_comp = time.perf_counter() - t
        th = threading.Thread(target=n_copies, args=(n,))
        t = time.perf_counter()
        th.start()
        for _ in range(m):
            comp.one()
        th.join()
        both = time.perf_counter() - t
    finally:
        comp.kind = kind
    return (t_copy + t_comp) / both


def run_transfer(c: kvshm.Client, keys: list[list[str]], kvs: list[np.ndarray],
                 ids: list[int]) -> float:
    t = time.perf_counter()
    for layer, kv in enumerate(kvs):
        c.put_pages(keys[layer], kv, ids)
    return time.perf_counter() - t


def run_compute(comp: Compute, layers: int) -> float:
    t = time.perf_counter()
    for _ in range(layers):
        comp.one()
    return time.perf_counter() - t


def run_overlapped(c: kvshm.Client, comp: Compute, keys: list[list[str]],
                   kvs: list[np.ndarray], ids: list[int]) -> float:
    t = time.perf_counter()
    with LayerWriter(c, keys) as w:
        for layer, kv in enumerate(kvs):
            comp.one()                      # layer i computes (writes kvs[i] on a GPU)
            w.write(layer, kv, ids)         # hand it over, go on with layer i + 1
    return time.perf_counter() - t          # leaving the block waited for all layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pages", type=int, default=64, help="pages stored per layer")
    ap.add_argument("--blocks", type=int, default=256, help="pages in each layer's tensor")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--compute-ratio", type=float, default=1.0,
                    help="one layer's compute time / one layer's transfer time")
    ap.add_argument("--compute", choices=["matmul", "sleep"], default="matmul",
                    help="busy CPU compute (default), or a sleep standing for a GPU")
    ap.add_argument("--pool-gib", type=float, default=0.75)
    args = ap.parse_args()

    rng = np.random.default_rng(1)
    kvs = [rng.standard_normal((2, args.blocks, *PAGE_SHAPE)).astype(np.float16)
           for _ in range(args.layers)]
    ids = sorted(rng.choice(args.blocks, args.pages, replace=False).tolist())
    page_bytes = 2 * int(np.prod(PAGE_SHAPE)) * 2
    layer_bytes = args.pages * page_bytes
    comp = Compute(args.compute)
    print(f"{args.layers} layers x {args.pages} pages of {page_bytes // 1024} KiB = "
          f"{layer_bytes / 2**20:.1f} MiB per layer, "
          f"{args.layers * layer_bytes / 2**20:.0f} MiB in all; compute={args.compute}; "
          f"cpus={os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    with ServerProcess(prealloc_size=args.pool_gib) as srv, \
            kvshm.Client(srv.address, transport="shm", timeout=30) as c:
        def keys_for(rep: int, what: str) -> list[list[str]]:
            return [[f"{what}{rep}/L{layer}/p{p}" for p in ids]
                    for layer in range(args.layers)]

        # warm up (page faults, connections), then size the compute
        run_transfer(c, keys_for(0, "warm"), kvs, ids)
        c.purge()
        t_layer = statistics.median(
            run_transfer(c, keys_for(i, "cal"), kvs, ids) / args.layers for i in range(3))
        c.purge()
        comp.calibrate(t_layer * args.compute_ratio)
        print(f"cores available to two busy threads now: {parallelism(comp):.2f} "
              "(2.00 = both cores free; near 1 = no room for overlap of busy work)")
        rows = []
        for rep in range(args.reps):
            t = run_transfer(c, keys_for(rep, "t"), kvs, ids)
            c.purge()
            cc = run_compute(comp, args.layers)
            o = run_overlapped(c, comp, keys_for(rep, "o"), kvs, ids)
            c.purge()
            rows.append((t, cc, o, (t + cc - o) / t))
            print(f"  rep {rep}: transfer {t * 1e3:7.1f} ms  compute {cc * 1e3:7.1f} ms  "
                  f"overlapped {o * 1e3:7.1f} ms  hidden {rows[-1][3]:.2f}")
        c.flush()
        assert c.stats()["pinned"] == 0
    t, cc, o, h = (statistics.median(r[i] for r in rows) for i in range(4))
    print(f"median: transfer alone {t * 1e3:.1f} ms ({args.layers * layer_bytes / t / 1e9:.2f}"
          f" GB/s), compute alone {cc * 1e3:.1f} ms, overlapped {o * 1e3:.1f} ms")
    print(f"hidden fraction (T + C - O) / T = {h:.2f}  (median of the reps; best possible "
          f"about {(args.layers - 1) / args.layers:.2f}; target >= 0.80)")
    # Other work on the machine only ever adds time: the fastest run of each kind is the
    # least disturbed one.
    tb, cb, ob = (min(r[i] for r in rows) for i in range(3))
    print(f"best runs: transfer {tb * 1e3:.1f} ms, compute {cb * 1e3:.1f} ms, overlapped "
          f"{ob * 1e3:.1f} ms -> hidden {(tb + cb - ob) / tb:.2f}")


if __name__ == "__main__":
    main()
