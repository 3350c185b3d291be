"""What the vLLM end-to-end tests share (``test_vllm_e2e.py``, ``test_vllm_pd.py``): the
tiny random-weight Llama written at test time, the prompts, and the environment of a
vLLM engine child process. Imports no engine (``transformers``/``torch`` on call)."""

from __future__ import annotations

import os
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BLOCK = 32                   # the CPU attention backend wants a multiple of 32
PROMPT_TOKENS = 600          # 18 full blocks (576 tokens) can come from kvshm
TIMEOUT = float(os.environ.get("KVSHM_VLLM_E2E_TIMEOUT", "900"))


def write_tiny_llama(d: Path) -> str:
    """A 2-layer Llama (4 heads of 32, 2 KV heads, vocab 1024) with seeded random
    weights, float32, written as safetensors into ``d``; returns its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(d, safe_serialization=True)
    return str(d)


def make_prompts(n: int = 2, tokens: int = PROMPT_TOKENS, seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, 1000) for _ in range(tokens)] for _ in range(n)]


def engine_env(tp: int = 1, **extra: str) -> dict[str, str]:
    """Environment of a vLLM engine child: this checkout and the test-only CPU plugin
    (``vllm_plugin/``) on PYTHONPATH, a 1 GiB CPU KV cache, the engine core in the
    child's own process, quiet logs; with ``tp`` > 1 one core per worker."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE / "vllm_plugin")]),
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false", **extra)
    if tp > 1:           # one core per worker (vLLM's automatic binding wants NUMA nodes)
        n = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % n) for i in range(tp))
    return env
