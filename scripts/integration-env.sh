#!/usr/bin/env bash
# Create (or reuse) the virtual environment the engine-integration tests run in:
# CPU torch, LMCache, SGLang and vLLM, next to kvshm's runtime dependencies.
#
#   scripts/integration-env.sh            # create or reuse; prints what it did
#   KVSHM_INTEGRATION_VENV=/path scripts/integration-env.sh
#   KVSHM_INTEGRATION_REBUILD=1 scripts/integration-env.sh   # start from scratch
#
# Then (from the repository root, after `pip install -e .` built kvshm in place):
#   PYTHONPATH=$PWD "$KVSHM_INTEGRATION_VENV/bin/python" -m pytest tests/integrations -m integration
#
# kvshm itself is NOT installed into this venv: the tests import it from the checkout
# (PYTHONPATH), with the compiled extensions that `pip install -e .` built in place.
#
# Order matters: torch 2.13.0 (CPU build) goes in first and a constraints file keeps it
# there, so nothing pulls a CUDA torch (several GB). sglang, vllm and xgrammar are
# installed with --no-deps (their wheels pin a newer CUDA torch, and xgrammar's
# dependencies pull a 1 GB triton); the few small packages their import chains need are
# listed below. SGLang's bare `import triton` is met by a test-only stub in
# tests/integrations/stubs (not installed here).
#
# Idempotent (scripts/lib/venv.sh): a marker file in the venv holds the sha256 of this
# script, scripts/lib/venv.sh and the Python version; when it matches, the venv is reused
# as is (a build that stopped halfway has no marker and is started again). Concurrent runs
# wait on a lock file next to the venv. Any failure exits non-zero and names the step.
set -euo pipefail

venv=${KVSHM_INTEGRATION_VENV:-/root/.cache/kvshm-ci/integration-venv}
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
marker="$venv/.kvshm-integration-env"

# ------------------------------------------------------------------ pinned versions
TORCH_VERSION=2.13.0
LMCACHE_VERSION=0.5.6
SGLANG_VERSION=0.5.23
VLLM_VERSION=0.33.0
XGRAMMAR_VERSION=0.2.8        # the version vllm 0.33.0 pins
# kvshm's runtime dependencies (pyproject.toml) and the test tools
KVSHM_DEPS=(numpy pyzmq posix_ipc msgpack prometheus_client xxhash tqdm
            pytest pytest-timeout redis)
# what `import sglang.srt.mem_cache.hicache_storage` / `...storage.backend_factory` needs
# on top of LMCache's dependencies
# (and, for the host pool and cache controller classes the tests build, the model-config
# modules they import: dill, sentencepiece, compressed-tensors, gguf)
SGLANG_DEPS=(orjson pybase64 pillow ipython dill sentencepiece compressed-tensors gguf)
# what vLLM's scheduler-side offloading stack (kv_offload.*, the offloading connector)
# needs on top of LMCache's dependencies
VLLM_DEPS=(cbor2 openai-harmony openai pillow pybase64 cloudpickle uvloop
           partial-json-parser "llguidance>=1.7,<1.8" "apache-tvm-ffi==0.1.11")

KV_TAG=integration-env
# shellcheck source=scripts/lib/venv.sh
. "$here/lib/venv.sh"
log() { kv_log "$@"; }
die() { kv_die "$@"; }

command -v "$py" >/dev/null 2>&1 || die "no $py (set PYTHON to a Python 3.10+ interpreter)"
hash=$(recipe_hash "$py" "$here/integration-env.sh")
venv_lock "$venv"

start=$(date +%s)
reuse_or_new "$py" "$venv" "$marker" "$hash" KVSHM_INTEGRATION_REBUILD torch lmcache sglang vllm    # exits when reused
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

cons="$venv/kvshm-constraints.txt"
echo "torch==$TORCH_VERSION" > "$cons"

# 1. CPU torch, first (scripts/lib/venv.sh: a local CPU wheel or the PyTorch CPU index)
torch_cpu "$venv" "$cons" "torch==$TORCH_VERSION"

# 2. LMCache (pulls its own dependencies; torch stays by the constraint)
step "lmcache==$LMCACHE_VERSION" "${pip[@]}" install -q -c "$cons" "lmcache==$LMCACHE_VERSION"

# 3. SGLang and vLLM without their dependency pins, then the small packages their
#    import chains need
step "sglang==$SGLANG_VERSION vllm==$VLLM_VERSION xgrammar==$XGRAMMAR_VERSION (--no-deps)" \
    "${pip[@]}" install -q --no-deps "sglang==$SGLANG_VERSION" "vllm==$VLLM_VERSION" \
    "xgrammar==$XGRAMMAR_VERSION"
step "engine import dependencies" "${pip[@]}" install -q -c "$cons" \
    "${SGLANG_DEPS[@]}" "${VLLM_DEPS[@]}"

# 4. kvshm's runtime dependencies and the test tools
step "kvshm runtime dependencies + pytest" "${pip[@]}" install -q -c "$cons" "${KVSHM_DEPS[@]}"
log "(pip's warnings that sglang/vllm want other versions are expected: they are installed"
log " with --no-deps, and only the modules the tests import are checked, below)"

# 5. check: torch still the CPU build, and each engine interface the tests use imports.
#    SGLang (with the triton stub) and vLLM in separate interpreters: torch caches whether
#    triton is importable, and vLLM's import chain must see that it is not.
check() {
    env LMCACHE_LOG_LEVEL=WARNING VLLM_LOGGING_LEVEL=WARNING "$@" >/dev/null 2>"$venv/.check.err" \
        || { cat "$venv/.check.err" >&2; return 1; }
}
step "import check: lmcache" check "$venv/bin/python" -c \
    "import torch, lmcache.v1.storage_backend.connector.base_connector; assert torch.version.cuda is None"
step "import check: sglang (with the test-only triton and torchvision stubs)" check \
    "$venv/bin/python" -c "import sys, vllm.v1.kv_offload.tiering.base, vllm.v1.kv_offload.tiering.spec, vllm.v1.kv_offload.factory
sys.path.insert(0, '$here/../tests/integrations/stubs')   # after vLLM, as the tests do
import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.storage.backend_factory
import sglang.srt.mem_cache.pool_host.mha, sglang.srt.managers.cache_controller"
step "import check: vllm" check "$venv/bin/python" -c \
    "import vllm.v1.kv_offload.tiering.spec, vllm.v1.kv_offload.tiering.base"
rm -f "$venv/.check.err"
venv_versions "$venv" torch lmcache sglang vllm xgrammar | sed 's/^/integration-env:   /'

echo "$hash" > "$marker"
log "built $venv in $(( $(date +%s) - start )) s ($(du -sh "$venv" | cut -f1))"
