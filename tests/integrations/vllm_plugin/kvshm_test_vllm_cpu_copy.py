"""Test-only vLLM plugin: the CPU stand-in for the offload worker's device <-> host copy.

Loaded by vLLM itself in every one of its processes (engine core, TP workers) as a
``vllm.general_plugins`` entry point: ``kvshm_test_vllm_cpu_copy-0.0.dist-info`` next to
this file declares it, and only processes started with this folder on ``PYTHONPATH``
(``test_vllm_e2e.py``'s engines) see it. Never installed, never imported by kvshm.

What it replaces, and only that: vLLM refuses its offload worker on a CPU platform
(``CPUOffloadingSpec.get_worker`` raises unless the platform is CUDA-alike or XPU, and
``SingleDirectionOffloadingHandler`` copies with CUDA streams and events). So
:func:`stand_in_for_the_device_copy` (1) lets ``get_worker`` build the worker on CPU and
(2) replaces the handler, the device <-> host copy of each transfer direction, with
:class:`CpuCopyHandler`: the same block-id to chunk-row mapping for the direct layout,
done with synchronous ``memmove``s.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from typing import Any

COUNTS = {"loaded_blocks": 0, "stored_blocks": 0}


def _record() -> None:
    """Write this process's counts where the engine script reads them (one file per
    process: with TP > 1 the copies run in the worker processes)."""
    d = os.environ.get("KVSHM_TEST_COUNTS_DIR")
    if d:
        tmp = os.path.join(d, f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(COUNTS, f)
        os.replace(tmp, os.path.join(d, f"{os.getpid()}.json"))


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
        _record()
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


def register() -> None:
    """vLLM general plugin (run in every vLLM process): the stand-in below."""
    stand_in_for_the_device_copy()


def stand_in_for_the_device_copy() -> None:
    from vllm.v1.kv_offload.cpu import gpu_worker, spec

    gpu_worker.SingleDirectionOffloadingHandler = CpuCopyHandler  # type: ignore[misc]

    def get_worker(self: Any, kv_caches: Any) -> Any:    # without the platform check
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    spec.CPUOffloadingSpec.get_worker = get_worker  # type: ignore[method-assign]
