#!/usr/bin/env bash
# Set up a virtual environment from this checkout and run the test suite.
#   scripts/test.sh [pytest args...]
# Environment: KVSHM_VENV (default .venv), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVSHM_VENV:-.venv}
py=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e '.[test]'
set +e
"$venv/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit "$rc"
