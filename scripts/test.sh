#!/usr/bin/env bash
# Set up a virtual environment from this checkout and run the test suite.
#   scripts/test.sh [pytest args...]
# Environment: KVSHM_VENV (default .venv), PYTHON (default python3), KVSHM_WITH_TORCH=1
# (also install torch, CPU build, for the tensor tests), KVSHM_INTEGRATION_VENV (the
# engine integrations' venv from scripts/integration-env.sh; its tests run when it exists).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVSHM_VENV:-.venv}
py=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e '.[test]'
# torch CPU tensors (bf16 pages, LMCache-style buffers) are tested when torch is there;
# KVSHM_WITH_TORCH=1 installs it (CI does: its image carries the CPU wheel of 2.13.0).
if [ -n "${KVSHM_WITH_TORCH:-}" ]; then
    "$venv/bin/python" -c 'import torch' 2>/dev/null || \
        "$venv/bin/python" -m pip install -q "torch==${KVSHM_TORCH_VERSION:-2.13.0}"
fi
set +e
"$venv/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests: that is a failure" >&2
    rc=1
fi

# Engine integrations (LMCache, SGLang, vLLM) run in their own venv, made by
# scripts/integration-env.sh (.ci/run makes it; it is reused when already there).
ivenv=${KVSHM_INTEGRATION_VENV:-/root/.cache/kvshm-ci/integration-venv}
if [ -x "$ivenv/bin/python" ]; then
    echo "test.sh: engine integrations in $ivenv"
    set +e
    PYTHONPATH="$PWD" "$ivenv/bin/python" -m pytest tests/integrations -m integration -q -ra
    irc=$?
    set -e
    if [ "$irc" -eq 5 ]; then
        echo "test.sh: no integration tests collected: that is a failure" >&2
        irc=1
    fi
    [ "$rc" -eq 0 ] && rc=$irc
else
    echo "test.sh: no integration venv at $ivenv (scripts/integration-env.sh makes it);" \
         "engine integration tests not run" >&2
fi
exit "$rc"
