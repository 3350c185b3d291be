"""BitmapAllocator micro-benchmarks (pytest-benchmark).

Run with::

    pytest perf/bench_bitmap.py --benchmark-only

Targets (issue 2), from Python on one core:

- ``alloc(1)`` + ``free`` pairs on a 1M-block bitmap that is 90% full: >= 2 M pairs/s,
  with the free blocks scattered at random and with the first 90% of the blocks taken;
- ``alloc_many`` of many runs: >= 10 M blocks/s.

The derived rates are in each benchmark's ``extra_info`` (``--benchmark-json``) and printed
on one line per benchmark (``-s`` shows them).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvshm import BitmapAllocator

NUM_BLOCKS = 1 << 20
PAIRS = 10_000  # alloc + free pairs per timed call
TARGET_PAIRS = 2e6
TARGET_BLOCKS = 10e6


def _report(benchmark: Any, name: str, per_call: int, unit: str, target: float) -> None:
    rate = per_call / benchmark.stats.stats.median
    benchmark.extra_info[unit] = rate
    benchmark.extra_info["target"] = target
    verdict = "ok" if rate >= target else "MISSED"
    print(f"\n{name}: {rate / 1e6:.2f} M {unit} (target {target / 1e6:.0f} M: {verdict})")


def _ninety_percent_full(layout: str) -> BitmapAllocator:
    a = BitmapAllocator(NUM_BLOCKS)
    free = NUM_BLOCKS // 10
    if layout == "first-90%":
        a.alloc_at(0, NUM_BLOCKS - free)
    else:  # every block taken, then a random 10% given back
        a.alloc_at(0, NUM_BLOCKS)
        rng = np.random.default_rng(0)
        for b in rng.choice(NUM_BLOCKS, size=free, replace=False).tolist():
            a.free(b, 1)
    assert a.num_free == free
    return a


@pytest.mark.parametrize("layout", ["scattered", "first-90%"])
def test_alloc_free_pairs_90_percent_full(benchmark: Any, layout: str) -> None:
    a = _ninety_percent_full(layout)
    alloc, free = a.alloc, a.free

    def pairs() -> None:
        for _ in range(PAIRS):
            free(alloc(1), 1)

    benchmark(pairs)
    assert a.num_free == NUM_BLOCKS // 10
    _report(benchmark, f"alloc(1)+free, 1M blocks 90% full ({layout})", PAIRS, "pairs/s",
            TARGET_PAIRS)


def _counts(kind: str) -> list[int]:
    rng = np.random.default_rng(1)
    if kind == "1-64 blocks":
        return rng.integers(1, 65, 16_384).tolist()  # ~530k blocks
    return [16] * 32_768  # 512k blocks: 1 MiB values in 64 KiB blocks


@pytest.mark.parametrize("kind", ["1-64 blocks", "16 blocks"])
def test_alloc_many_runs(benchmark: Any, kind: str) -> None:
    counts = _counts(kind)
    a = BitmapAllocator(NUM_BLOCKS)

    def setup() -> tuple[tuple[list[int]], dict[str, Any]]:
        a.reset()
        return (counts,), {}

    starts = benchmark.pedantic(a.alloc_many, setup=setup, rounds=30, iterations=1)
    assert -1 not in starts and a.num_used == sum(counts)
    _report(benchmark, f"alloc_many of {len(counts)} runs ({kind})", sum(counts), "blocks/s",
            TARGET_BLOCKS)


def test_alloc_many_runs_int64_array(benchmark: Any) -> None:
    counts = np.array(_counts("1-64 blocks"), dtype=np.int64)
    a = BitmapAllocator(NUM_BLOCKS)

    def setup() -> tuple[tuple[np.ndarray], dict[str, Any]]:
        a.reset()
        return (counts,), {}

    starts = benchmark.pedantic(a.alloc_many, setup=setup, rounds=30, iterations=1)
    assert -1 not in starts
    _report(benchmark, f"alloc_many of {len(counts)} runs (int64 array)", int(counts.sum()),
            "blocks/s", TARGET_BLOCKS)
