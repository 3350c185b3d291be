"""`kvshm replay`: the trace tools, the LRU simulator, and real replays against real servers.

Replays use the first 1000 requests of the bundled trace (27,305 block references) with
4 KiB blocks and a 16 MiB pool (4096 blocks): the pool is far smaller than the working set,
so eviction runs all along (about 21,000 evictions) and the store's LRU is compared with
the simulator's on every one of them.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvshm import cli
from kvshm.replay import ReplayOptions, run_replay
from kvshm.trace import (
    TraceError,
    check_blocks,
    fill_blocks,
    load_trace,
    poison_blocks,
    simulate_lru,
    unbounded_hits,
)

N_REQUESTS = 1000
BLOCK = 4096
POOL_GIB = 16 / 1024                 # 16 MiB = 4096 blocks of 4 KiB
SUBPROCESS_TIMEOUT = 120

JSON_KEYS = {"requests", "blocks", "hit_rate", "lru_hit_rate", "bound_hit_rate",
             "mismatches", "errors", "bytes_read", "bytes_written", "seconds", "gbps",
             "p50_ms", "p99_ms", "evictions"}


@pytest.fixture(scope="module")
def requests_() -> list[list[int]]:
    return load_trace(limit=N_REQUESTS)


def _opts(shm_name: str, **kw: object) -> ReplayOptions:
    base: dict[str, object] = dict(requests=N_REQUESTS, block_bytes=BLOCK, pool_gib=POOL_GIB,
                                   progress=False, shm_name=shm_name, timeout=30.0)
    base.update(kw)
    return ReplayOptions(**base)  # type: ignore[arg-type]


def _check_exact(s: dict[str, object]) -> None:
    assert s["mismatches"] == 0, s["first_mismatches"]
    assert s["errors"] == 0, s["first_errors"]
    assert s["requests"] == N_REQUESTS
    assert s["evictions"] > 0                       # the pool was too small: eviction ran
    assert s["bytes_read"] > 0 and s["bytes_written"] > 0
    assert abs(s["hit_rate"] - s["lru_hit_rate"]) <= 0.005, s   # 0.5 points
    assert s["bound_hit_rate"] >= s["lru_hit_rate"]


# ---------------------------------------------------------------------- simulator

def test_lru_simulator_hand_made_trace() -> None:
    trace = [[1, 2, 3],    # all miss; LRU order 1 2 3
             [1, 2, 4],    # hits 1 2 (order 3 1 2); write 4 evicts 3 -> 1 2 4
             [3, 1],       # 3 misses: write 3 evicts 1 (2 4 3); write 1 evicts 2 (4 3 1)
             [4, 3, 1],    # all hit
             [2]]          # miss; write 2 evicts 4
    r = simulate_lru(trace, capacity=3)
    assert r.per_request == [0, 2, 0, 3, 0]
    assert (r.hits, r.blocks, r.evictions) == (5, 12, 4)
    assert r.hit_rate == pytest.approx(5 / 12)
    u = unbounded_hits(trace)
    assert u.per_request == [0, 2, 2, 3, 1]
    assert (u.hits, u.blocks, u.evictions) == (8, 12, 0)

    # A block present after the first miss is refreshed by its write, not inserted again.
    r = simulate_lru([[1, 2, 3], [9, 2], [3], [1]], capacity=3)
    # [9, 2]: write 9 evicts 1 (2 3 9), write 2 refreshes it (3 9 2); [3] hits; [1] misses
    assert r.per_request == [0, 0, 1, 0]
    assert r.evictions == 2
    with pytest.raises(ValueError):
        simulate_lru([[1]], capacity=0)


def test_lru_in_shards_worked_example() -> None:
    """``shards``: one exact LRU of ``capacity`` per shard; a request's hits are still its
    leading keys present, each looked for in its own shard."""
    # odd keys on shard 1, even on shard 0; capacity 2 each
    trace = [[1, 2, 3],     # all miss: shard 1 holds 1 3, shard 0 holds 2
             [1, 2, 4],     # 1 2 hit; write 4: shard 0 holds 2 4
             [6, 1],        # 6 misses: shard 0 evicts 2 (4 6); 1 refreshed (3 1)
             [2, 1]]        # 2 misses (evicted): write 2 evicts 4 (6 2); 1 refreshed
    where = [[k % 2 for k in r] for r in trace]
    r = simulate_lru(trace, capacity=2, shards=where)
    assert r.per_request == [0, 2, 0, 0]
    assert (r.hits, r.evictions) == (2, 2)
    # one shard is the plain cache
    assert simulate_lru(trace, 2, shards=[[0] * len(q) for q in trace]).per_request == \
        simulate_lru(trace, 2).per_request
    with pytest.raises(ValueError):
        simulate_lru([[1, 2]], 2, shards=[[0]])


def test_lru_bounds_on_the_trace(requests_: list[list[int]]) -> None:
    small = simulate_lru(requests_, 1024).hit_rate
    big = simulate_lru(requests_, 1 << 20).hit_rate
    bound = unbounded_hits(requests_).hit_rate
    assert small <= big == pytest.approx(bound)    # more room never hurts LRU here


# ---------------------------------------------------------------------- trace and bytes

def test_bundled_trace_loads() -> None:
    reqs = load_trace(limit=5)
    assert len(reqs) == 5 and reqs[0][:3] == [0, 1, 2]
    assert all(isinstance(h, int) for r in reqs for h in r)


def test_trace_files_plain_gzip_and_bad(tmp_path: object) -> None:
    lines = [json.dumps({"timestamp": i, "hash_ids": [i, i + 1]}) for i in range(4)]
    plain = os.path.join(str(tmp_path), "t.jsonl")
    with open(plain, "w") as f:
        f.write("\n".join(lines) + "\n\n")
    gz = plain + ".gz"
    with gzip.open(gz, "wt") as f:
        f.write("\n".join(lines))
    assert load_trace(plain) == load_trace(gz) == [[i, i + 1] for i in range(4)]
    assert load_trace(plain, limit=2) == [[0, 1], [1, 2]]
    bad = os.path.join(str(tmp_path), "bad.jsonl")
    with open(bad, "w") as f:
        f.write(lines[0] + "\n" + json.dumps({"hash_ids": [1, "x"]}) + "\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:2"):
        load_trace(bad)


def test_block_bytes_are_checked_byte_for_byte() -> None:
    ids = np.array([0, 1, 2, 12345678901], dtype=np.uint64)
    rows = np.empty((4, BLOCK // 8), dtype=np.uint64)
    fill_blocks(rows, ids)
    assert check_blocks(rows, ids).all()
    raw = rows.view(np.uint8)
    assert len({bytes(raw[i]) for i in range(4)}) == 4          # ids never collide
    assert not check_blocks(rows, ids[::-1]).any()               # wrong place: caught
    again = rows.copy()
    fill_blocks(again, ids)
    assert np.array_equal(again, rows)                           # deterministic
    raw[2, 1000] ^= 1                                            # one bit anywhere
    assert check_blocks(rows, ids).tolist() == [True, True, False, True]
    poison_blocks(rows, ids)                                     # a copy that never came
    assert not check_blocks(rows, ids).any()


# ---------------------------------------------------------------------- real replays

def test_replay_shm_matches_exact_lru(shm_name: str) -> None:
    r = run_replay(_opts(shm_name, backend="kvshm"))
    s = r.summary
    assert s["transport"] == "shm"
    _check_exact(s)
    assert s["evictions"] == s["lru_evictions"]
    assert s["block_size"] == BLOCK and s["capacity_blocks"] == 4096
    assert s["p99_ms"] >= s["p50_ms"] > 0 and s["gbps"] > 0
    assert len(r.series["index"]) == N_REQUESTS


def test_replay_tcp_matches_exact_lru(shm_name: str) -> None:
    s = run_replay(_opts(shm_name, backend="kvshm-tcp")).summary
    assert s["transport"] == "tcp"
    _check_exact(s)


def test_replay_block_size_rounded_up(shm_name: str) -> None:
    # 6000-byte blocks: the server's block size is 8 KiB, one block per entry.
    s = run_replay(_opts(shm_name, block_bytes=6000, requests=300, pool_gib=4 / 1024)
                   ).summary
    assert s["block_size"] == 8192 and s["capacity_blocks"] == 512
    assert s["mismatches"] == 0 and s["errors"] == 0
    assert abs(s["hit_rate"] - s["lru_hit_rate"]) <= 0.005


def test_replay_two_clients_checks_every_byte(shm_name: str) -> None:
    s = run_replay(_opts(shm_name, clients=2)).summary
    assert s["clients"] == 2 and "round-robin" in s["split"]
    assert s["mismatches"] == 0, s["first_mismatches"]
    assert s["errors"] == 0, s["first_errors"]
    assert s["requests"] == N_REQUESTS
    assert s["blocks_read"] > 0 and s["bytes_read"] == s["blocks_read"] * BLOCK
    # Paced (window 4K = 8): requests finish near trace order, but neighbours run at
    # once, so the hit rate is close to the exact LRU's, not equal.
    assert s["window"] == 8 and s["max_order_skew"] <= 2 * 8
    assert abs(s["hit_rate"] - s["lru_hit_rate"]) < 0.01
    assert s["hit_rate"] <= s["bound_hit_rate"]


def test_replay_three_free_clients_over_tcp(shm_name: str) -> None:
    s = run_replay(_opts(shm_name, clients=3, window=0, backend="kvshm-tcp",
                         requests=500)).summary
    assert s["clients"] == 3 and s["window"] is None and s["transport"] == "tcp"
    assert s["mismatches"] == 0, s["first_mismatches"]
    assert s["errors"] == 0, s["first_errors"]
    assert s["requests"] == 500 and s["blocks_read"] > 0


def test_pacer_lets_the_oldest_request_go() -> None:
    from kvshm.replay.clients import Pacer as _Pacer

    shared = [0, 1, 2]                       # next unfinished request of 3 clients
    p = _Pacer(shared, wid=2, k=3, window=4, parent=os.getppid())
    p.wait(2)                                # 2 - 4 < 0: never waits
    p.done(2)
    assert shared == [0, 1, 5]
    shared[:] = [6, 4, 5]                    # every request before 4 has finished
    p.wait(8)                                # needs all before 4: goes at once
    p.finish()
    assert shared[2] == 1 << 62


def test_replay_cli_json_in_a_real_process(shm_name: str, tmp_path: object) -> None:
    cmd = [sys.executable, "-m", "kvshm", "replay", "--requests", str(N_REQUESTS),
           "--block-bytes", "4K", "--pool-gib", repr(POOL_GIB), "--json",
           "--shm-name", shm_name]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert JSON_KEYS <= set(s)
    _check_exact(s)
    assert p.stderr == ""                    # no progress bar: stderr is not a terminal


def test_replay_cli_summary_with_own_trace(shm_name: str, tmp_path: object,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = os.path.join(str(tmp_path), "tiny.jsonl")
    with open(path, "w") as f:
        for ids in ([1, 2, 3], [1, 2, 4], [3, 1], [4, 3, 1], [2]):
            f.write(json.dumps({"hash_ids": ids}) + "\n")
    rc = cli.main(["replay", "--trace", path, "--block-bytes", "4096",
                   "--pool-gib", repr(12 / 1024 / 1024), "--shm-name", shm_name])
    out = capsys.readouterr().out
    assert rc == 0, out
    # 3 blocks of 4 KiB: the hand-made trace of the simulator test, on a real store
    assert "3 blocks" in out
    assert "hit rate   41.67 %   exact LRU 41.67 %   unbounded (bound) 66.67 %" in out
    assert "evictions  4 (exact LRU 4)" in out
    assert "0 mismatches, 0 errors" in out


def test_replay_redis_backend() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    if importlib.util.find_spec("redis") is None:
        pytest.skip("the redis Python package is not installed (pip install redis)")
    s = run_replay(ReplayOptions(requests=N_REQUESTS, block_bytes=BLOCK,
                                 pool_gib=POOL_GIB, backend="redis", progress=False)).summary
    assert s["backend"] == "redis"
    assert s["mismatches"] == 0, s["first_mismatches"]
    assert s["errors"] == 0, s["first_errors"]
    assert s["blocks_read"] > 0 and s["evictions"] > 0
    assert s["hit_rate"] <= s["bound_hit_rate"]


# ---------------------------------------------------------------------- usage errors

@pytest.mark.parametrize("args, flag", [
    (["--block-bytes", "12"], "--block-bytes"),
    (["--block-bytes", "lots"], "--block-bytes"),
    (["--pool-gib", "0"], "--pool-gib"),
    (["--pool-gib", "0.00001"], "--pool-gib"),        # smaller than the longest request
    (["--clients", "0"], "--clients"),
    (["--clients", "1000"], "--clients"),
    (["--requests", "0"], "--requests"),
    (["--backend", "memcached"], "--backend"),
    (["--trace", "/nonexistent/trace.jsonl"], "--trace"),
    (["--address", "no-port"], "--address"),
    (["--window", "-1"], "--window"),
])
def test_bad_flags_exit_2_naming_the_flag(args: list[str], flag: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        cli.main(["replay", "--requests", "10", "--block-bytes", "4096", *args])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "Traceback" not in err


def test_bad_trace_content_exit_2(tmp_path: object, capsys: pytest.CaptureFixture[str]
                                  ) -> None:
    path = os.path.join(str(tmp_path), "bad.jsonl")
    with open(path, "w") as f:
        f.write("not json\n")
    with pytest.raises(SystemExit) as ei:
        cli.main(["replay", "--trace", path])
    assert ei.value.code == 2
    assert "argument --trace" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as ei:
        cli.main(["replay", "--requests", "10", "--plot", "out.png"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "argument --plot" in err and "matplotlib" in err


def test_plot_draws_a_png(shm_name: str, tmp_path: object,
                          capsys: pytest.CaptureFixture[str]) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed (pip install 'kvshm[plot]')")
    png = os.path.join(str(tmp_path), "replay.png")
    rc = cli.main(["replay", "--requests", "200", "--block-bytes", "4096",
                   "--pool-gib", repr(POOL_GIB), "--shm-name", shm_name, "--plot", png])
    assert rc == 0, capsys.readouterr()
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
