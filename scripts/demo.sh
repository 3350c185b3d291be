#!/usr/bin/env bash
# kvshm quick start: install kvshm into .venv, then replay the first 3000 requests of the
# bundled production trace (Mooncake FAST'25 "conversation", see kvshm/data/README.md)
# against a kvshm server that the replay starts and stops itself.
#
#   scripts/demo.sh                      # the demo
#   scripts/demo.sh --backend redis      # extra flags go to `kvshm replay`
#
# Sizes: 64 KiB blocks and a 0.5 GiB pool (8192 blocks) against a working set of 55,287
# distinct blocks, so eviction runs all along and the hit rate shows whether it keeps the
# right blocks: it is printed beside an exact LRU over the same capacity and the hit rate
# no cache can beat. Every block read back is checked byte for byte. Needs Python >= 3.10,
# a C compiler and ~1 GiB free in /dev/shm. Measured on the shared 2-core VM while other
# jobs ran (load 8-14): 225-372 s in a fresh clone (venv, install, build, replay), 25-27 s
# again (installed already; the replay is 17-18.5 s of it).
#
# Environment: PYTHON (default python3) makes the venv; KVSHM_VENV (default .venv) is
# where. An editable install already in that venv (a development checkout) is used as
# it is, never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${KVSHM_VENV:-.venv}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "demo.sh: kvshm needs Python >= 3.10 ($PYTHON is $("$PYTHON" -V 2>&1 || echo missing))" >&2
    exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "demo.sh: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# What is installed from this checkout: the commit and any change to it (a git checkout;
# elsewhere nothing is known, and the checkout is installed every time).
stamp=""
if git rev-parse --git-dir >/dev/null 2>&1; then
    stamp=$( (git rev-parse HEAD; git status --porcelain; git diff) | sha256sum | cut -c1-32)
fi
if "$VENV/bin/python" -m pip show kvshm 2>/dev/null | grep -q '^Editable project location:'; then
    echo "demo.sh: using the editable kvshm install in $VENV"
elif [ -n "$stamp" ] && [ -x "$VENV/bin/kvshm" ] \
        && [ "$(cat "$VENV/.kvshm-demo-stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "demo.sh: kvshm from this checkout is installed in $VENV already"
else
    echo "demo.sh: installing kvshm into $VENV (builds the Cython core)"
    rm -f "$VENV/.kvshm-demo-stamp"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check .
    if [ -n "$stamp" ]; then echo "$stamp" > "$VENV/.kvshm-demo-stamp"; fi
fi

echo "demo.sh: replaying 3000 requests of the bundled trace (64 KiB blocks, 0.5 GiB pool)"
# exec: Ctrl-C goes straight to the replay, which stops its server before it exits.
exec "$VENV/bin/kvshm" replay --requests 3000 --block-bytes 65536 --pool-gib 0.5 "$@"
