"""`kvshm replay` that can disagree with its reference (issue 16) and its private temporary
directories (issue 12).

- The value pattern depends on key and position: a copy reordered inside a block fails.
- Chunk mode (``--chunk-tokens N``): partial last chunks, keys chained per block, hit
  rates by keys and by bytes beside an exact LRU of equal capacity (value bytes) and one
  charged whole blocks; the store can disagree with the first and says so.
- A key is a hit only when read and verified: a key lost between match_prefix and the
  read, or read with wrong bytes, is not (a fake backend makes both happen on purpose).
- With an SSD tier the pool's evictions are set beside an LRU of the pool's capacity.
- Stale replay directories: only this user's, only when no live replay holds the lock;
  a name chosen by someone else never crashes the replay.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from kvshm import cli
from kvshm.replay import ReplayOptions, run_replay
from kvshm.replay.runner import Replayer
from kvshm.replay.scratch import ScratchDir, remove_stale
from kvshm.replay.workload import Workload, WorkloadError
from kvshm.trace import check_blocks, fill_blocks, load_requests, poison_blocks, simulate_lru

SUBPROCESS_TIMEOUT = 120


# ---------------------------------------------------------------------- value pattern

def test_a_copy_reordered_inside_a_block_is_caught() -> None:
    ids = np.array([7, 8], dtype=np.uint64)
    rows = np.empty((2, 4096 // 8), dtype=np.uint64)
    fill_blocks(rows, ids)
    assert check_blocks(rows, ids).all()
    # every 8-byte word of a block differs from every other word of it
    assert len(set(rows[0].tolist())) == rows.shape[1]
    # ... and from the word at the same place of the other block
    assert (rows[0] != rows[1]).all()
    swapped = rows.copy()
    swapped[0, :256], swapped[0, 256:] = rows[0, 256:].copy(), rows[0, :256].copy()
    assert check_blocks(swapped, ids).tolist() == [False, True]     # two halves swapped
    one = rows.copy()
    one[1, [3, 4]] = one[1, [4, 3]]                                  # two words swapped
    assert check_blocks(one, ids).tolist() == [True, False]
    # a value shorter than a row is the first words of the row
    short = np.empty((1, 100), dtype=np.uint64)
    fill_blocks(short, ids[:1])
    assert np.array_equal(short[0], rows[0, :100])
    poison_blocks(short, ids[:1])
    assert not check_blocks(short, ids[:1]).any()


# ---------------------------------------------------------------------- keys and sizes

def test_chunk_keys_and_partial_sizes() -> None:
    one = Workload(4096)
    assert one.keys([5, 6], 700) == ([5, 6], 4096)          # one-block mode: lengths unused
    wl = Workload(4096, chunk_tokens=256)                      # 8 bytes a token
    assert (wl.entry_bytes, wl.token_bytes) == (2048, 8)
    keys, last = wl.keys([5, 6], 512 + 300)                    # block 6 holds 300 tokens
    assert len(keys) == 2 + 2 and len(set(keys)) == 4
    assert last == (300 - 256) * 8 and wl.size_of(keys[-1]) == last
    assert [wl.size_of(k) for k in keys[:-1]] == [2048] * 3
    assert wl.prefix_bytes(4, last, 4) == 3 * 2048 + last
    assert wl.prefix_bytes(4, last, 2) == 2 * 2048
    # the same block in another request (a shared prefix) has the same keys
    assert wl.keys([5, 9], 1024)[0][:2] == keys[:2]
    # a tail that ends on a chunk boundary has no partial chunk
    keys2, last2 = wl.keys([5, 6], 512 + 256)
    assert len(keys2) == 3 and last2 == 2048
    vllm = Workload(65536, chunk_tokens=16)
    assert len(vllm.keys([1], 512)[0]) == 32 and vllm.entry_bytes == 2048
    with pytest.raises(WorkloadError):
        wl.keys([5, 6], 1500)                                  # more tokens than blocks


def test_sized_lru_counts_what_each_key_costs() -> None:
    sizes = {1: 3, 2: 1, 3: 1, 4: 2}
    r = simulate_lru([[1, 2], [3, 4], [1]], capacity=5, cost=sizes.__getitem__)
    # [1, 2]: 4 held. [3, 4]: 3 -> 5 held; 4 -> 7 > 5: evicts 1 (3), 4 held. [1] misses:
    # 1 -> 7 held, evicts 2 (6) and 3 (5).
    assert r.per_request == [0, 0, 0] and r.evictions == 3
    r = simulate_lru([[1, 2], [1]], capacity=5, cost=sizes.__getitem__)
    assert r.per_request == [0, 1]
    with pytest.raises(ValueError):
        simulate_lru([[1]], capacity=2, cost=sizes.__getitem__)


def test_bundled_trace_has_lengths_that_fit_its_blocks() -> None:
    reqs, lengths = load_requests(limit=200)
    wl = Workload(65536, chunk_tokens=16)
    partial = 0
    for ids, n in zip(reqs, lengths):
        keys, last = wl.keys(ids, n)
        assert n is not None and len(keys) == -(-n // 16)
        partial += last != wl.entry_bytes
    assert partial > 100                # the last chunk is rarely full


# ---------------------------------------------------------------------- hits are verified

class _Fake:
    """A backend that holds what was written, and can lose or reorder what it returns."""

    transport = "fake"

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.lose: set[bytes] = set()
        self.reorder: set[bytes] = set()

    def match(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.data:
            n += 1
        return n

    def read_into(self, keys: list[bytes], outs: list[memoryview]) -> list[int]:
        sizes = []
        for k, out in zip(keys, outs):
            v = self.data.get(k)
            if v is None or k in self.lose:
                sizes.append(-1)
                continue
            if k in self.reorder:             # the two halves swapped: same bytes
                h = len(v) // 2
                v = v[h:] + v[:h]
            out[:len(v)] = v
            sizes.append(len(v))
        return sizes

    def write(self, keys: list[bytes], values: list[memoryview]) -> None:
        for k, v in zip(keys, values):
            self.data[k] = bytes(v)


def test_lost_and_reordered_blocks_are_not_hits() -> None:
    be = _Fake()
    wl = Workload(4096, chunk_tokens=512)
    r = Replayer(be, wl, b"p/")
    r.run([(0, [1, 2, 3], 3 * 512 - 100)])     # writes 3 keys, the last partial
    assert len(be.data) == 3 and len(be.data[b"p/%d" % wl.keys([1, 2, 3], 1436)[0][2]]) \
        == 4096 - 100 * 8
    sh = r.run([(1, [1, 2, 3], 3 * 512 - 100)])
    assert sh.hits == [3] and sh.matched == [3] and sh.mismatches == 0 and sh.lost == 0
    assert sh.hit_bytes == [2 * 4096 + 4096 - 800] == sh.req_bytes
    keys = [b"p/%d" % k for k in wl.keys([1, 2, 3], 1436)[0]]
    be.lose.add(keys[1])                       # matched, gone when read
    sh = r.run([(2, [1, 2, 3], 1436)])
    assert sh.matched == [3] and sh.hits == [1] and sh.lost == 1 and sh.mismatches == 0
    assert sh.hit_bytes == [4096]
    be.lose.clear()
    be.reorder.add(keys[0])                    # right bytes in the wrong order
    sh = r.run([(3, [1, 2, 3], 1436)])
    assert sh.hits == [0] and sh.mismatches == 1 and "not its bytes" in sh.first_mismatches[0]


# ---------------------------------------------------------------------- real replays

def _hand_trace(tmp_path: object) -> str:
    path = os.path.join(str(tmp_path), "t.jsonl")
    with open(path, "w") as f:
        for ids in ([1], [2], [1]):
            f.write(json.dumps({"hash_ids": ids, "input_length": 512}) + "\n")
    return path


def test_chunk_mode_can_disagree_with_the_exact_lru(shm_name: str, tmp_path: object) -> None:
    # 4096 bytes per 512 tokens: chunks of 16 tokens are 128 bytes, each in a 4 KiB block.
    # A pool of 40 blocks holds 40 chunks; an ideal cache of the same 160 KiB holds 1280.
    # Request 1 (32 chunks), request 2 (32) evicts 24 of request 1, request 3 asks for
    # block 1 again: the store misses its first chunk, the exact LRU of equal capacity
    # hits all 32, the LRU charged whole blocks misses as the store does.
    r = run_replay(ReplayOptions(trace=_hand_trace(tmp_path), block_bytes=4096,
                                 chunk_tokens=16, pool_gib=40 * 4096 / 2**30,
                                 progress=False, shm_name=shm_name))
    s = r.summary
    assert s["mismatches"] == 0 and s["errors"] == 0, s
    assert s["mode"] == "chunks" and s["blocks"] == 96 and s["bytes"] == 96 * 128
    assert s["hit_rate"] == 0.0 and s["lru_blocks_hit_rate"] == 0.0
    assert s["lru_hit_rate"] == pytest.approx(32 / 96)
    assert s["lru_byte_hit_rate"] == pytest.approx(32 / 96)
    assert "equality is expected only in the one-block mode" in s["lru_expected"]
    assert s["evictions"] == s["lru_evictions"] == 24 + 32


def test_chunk_mode_bundled_trace_checks_every_byte(shm_name: str) -> None:
    s = run_replay(ReplayOptions(requests=300, block_bytes=64 * 1024, chunk_tokens=256,
                                 pool_gib=64 / 1024, progress=False, shm_name=shm_name)
                   ).summary
    assert s["mismatches"] == 0 and s["errors"] == 0, s
    assert s["blocks_read"] > 0 and s["hits"] > 0 and s["lost"] == 0
    assert s["entry_bytes"] == 32 * 1024 and s["block_size"] == 32 * 1024
    # partial last chunks: fewer bytes than full chunks would be
    assert s["bytes"] < s["blocks"] * s["entry_bytes"]
    assert s["bytes_written"] + s["hit_bytes"] >= s["bytes"] * 0.99
    assert 0 < s["byte_hit_rate"] <= s["bound_byte_hit_rate"] <= 1
    assert 0 < s["hit_rate"] <= s["bound_hit_rate"] <= 1
    assert s["lru_blocks_hit_rate"] is not None


def test_partial_last_block_read_back_exactly(shm_name: str, tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "p.jsonl")
    with open(path, "w") as f:
        for _ in range(2):
            f.write(json.dumps({"hash_ids": [1, 2], "input_length": 700}) + "\n")
    s = run_replay(ReplayOptions(trace=path, block_bytes=4096, chunk_tokens=512,
                                 pool_gib=1 / 1024, progress=False, shm_name=shm_name)
                   ).summary
    tail = (700 - 512) * 8
    assert s["mismatches"] == 0 and s["errors"] == 0
    assert s["bytes_written"] == s["bytes_read"] == 4096 + tail
    assert s["hit_rate"] == s["byte_hit_rate"] == 0.5 == s["lru_hit_rate"]


def test_ssd_replay_compares_pool_evictions_with_the_pool_lru(shm_name: str,
                                                              tmp_path: object) -> None:
    r = run_replay(ReplayOptions(requests=800, block_bytes=16 * 1024, pool_gib=1 / 256,
                                 ssd_gib=1 / 32, ssd_path=os.path.join(str(tmp_path), "d"),
                                 progress=False, shm_name=shm_name))
    s = r.summary
    assert s["mismatches"] == 0 and s["errors"] == 0
    assert s["pool_bytes"] == 4 << 20 and s["ssd_bytes"] == 32 << 20
    # like with like: pool evictions vs an LRU of the pool's capacity; what left both
    # tiers vs an LRU of pool + SSD
    pool_lru = simulate_lru(load_requests(limit=800)[0], (4 << 20) // (16 * 1024))
    assert s["lru_evictions"] == pool_lru.evictions
    assert abs(s["evictions"] - s["lru_evictions"]) <= 0.02 * s["lru_evictions"]
    assert s["dropped"] is not None and s["lru_dropped"] is not None
    assert s["dropped"] < s["evictions"]           # the SSD tier kept most of them
    assert abs(s["dropped"] - s["lru_dropped"]) <= 0.05 * s["lru_dropped"] + 10
    assert "close, not equal" in s["lru_expected"]


def test_cli_chunk_tokens_and_sizes_with_units(shm_name: str, tmp_path: object) -> None:
    cmd = [sys.executable, "-m", "kvshm", "replay", "--trace", _hand_trace(tmp_path),
           "--block-bytes", "4KiB", "--chunk-tokens", "16", "--pool-gib", "160KiB",
           "--shm-name", shm_name]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert p.returncode == 0, p.stderr
    assert "96 chunks of 16 tokens (128 bytes each, the last of a request partial" in p.stdout
    assert "equality is expected only in the one-block mode" in p.stdout
    assert "by bytes" in p.stdout and "charged whole blocks as the store is" in p.stdout


@pytest.mark.parametrize("args, flag", [
    (["--chunk-tokens", "32"], "--chunk-tokens"),
    (["--chunk-tokens", "16", "--block-bytes", "6000"], "--block-bytes"),
    (["--pool-gib", "lots"], "--pool-gib"),
    (["--address", "127.0.0.1:99999"], "--address"),
])
def test_bad_replay_flags(args: list[str], flag: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        cli.main(["replay", "--requests", "10", *args])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "Traceback" not in err
    if flag == "--address":
        assert "port 99999 is out of range" in err


# ---------------------------------------------------------------------- scratch directories

def test_stale_replay_dirs_only_ours_and_only_unlocked(tmp_path: object) -> None:
    base = str(tmp_path)
    live = ScratchDir("handoff", base=base)          # held by this (live) process
    child = subprocess.run([sys.executable, "-c",
                            "import sys; from kvshm.replay.scratch import ScratchDir; "
                            f"d = ScratchDir('handoff', base={base!r}); print(d.path); "
                            "sys.stdout.flush(); import os; os._exit(9)"],
                           capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    dead = child.stdout.strip()                       # its process died without cleaning up
    assert os.path.isdir(dead) and os.path.exists(os.path.join(dead, ".lock"))
    odd = os.path.join(base, "kvshm-replay-99999999999999999999-x")   # crashed main's
    os.mkdir(odd)
    os.symlink("/", os.path.join(base, "kvshm-replay-1-link"))
    assert remove_stale(base) == [dead]
    assert os.path.isdir(live.path) and os.path.isdir(odd)
    live.close()
    assert not os.path.exists(live.path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_root_never_removes_another_users_replay_dir(tmp_path: object) -> None:
    base = str(tmp_path)
    other = os.path.join(base, "kvshm-replay-handoff-other")
    os.mkdir(other)
    open(os.path.join(other, ".lock"), "w").close()   # unlocked: stale, were it ours
    os.chown(other, 65534, 65534)
    assert remove_stale(base) == []
    assert os.path.isdir(other)
    shutil.rmtree(other)


def test_replay_with_clients_leaves_no_dir_and_removes_a_stale_one(
        shm_name: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    base = str(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", base)     # this replay's $TMPDIR
    child = subprocess.run([sys.executable, "-c",
                            "from kvshm.replay.scratch import ScratchDir; import os; "
                            f"print(ScratchDir('handoff', base={base!r}).path, flush=True); "
                            "os._exit(9)"],
                           capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    stale = child.stdout.strip()
    assert os.path.isdir(stale)
    s = run_replay(ReplayOptions(requests=100, block_bytes=4096, pool_gib=16 / 1024,
                                 clients=2, progress=False, shm_name=shm_name)).summary
    assert s["mismatches"] == 0 and s["errors"] == 0
    assert [n for n in os.listdir(base) if n.startswith("kvshm-replay-")] == []
