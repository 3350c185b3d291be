# shellcheck shell=bash
# One recipe for a cached virtual environment, sourced by scripts/integration-env.sh,
# scripts/vllm-env.sh, scripts/peers-env.sh and scripts/test.sh (not run by itself):
#
# - a marker file in the venv holds the hash of the recipe that built it; a venv whose
#   marker matches is reused as is, one without (a build that stopped halfway) or with
#   another is built again;
# - a lock file next to the venv (VENV.lock): a build holds it exclusively, a reader
#   (test.sh) takes it shared, so nobody uses a venv while it is being built;
# - a failure names the step that failed (scripts/peers-env.sh also leaves it in
#   <peer>.failed for the benchmark to print).
#
# The caller sets KV_TAG (the prefix of its messages) before sourcing.

KV_LIB=${BASH_SOURCE[0]}

kv_log() { echo "${KV_TAG:-venv}: $*"; }
kv_die() { echo "${KV_TAG:-venv}: ERROR: $*" >&2; exit 1; }

# recipe_hash PY FILE...: the marker of a venv built by these files (and this library,
# which holds the build steps) with interpreter PY: sha256 of their text and `PY --version`.
recipe_hash() {
    local py=$1; shift
    { cat "$@" "$KV_LIB"; "$py" --version 2>&1; } | sha256sum | cut -d' ' -f1
}

# marker_ok VENV MARKER HASH: VENV is complete and was built by the recipe HASH.
marker_ok() {
    [ -f "$2" ] && [ "$(cat "$2")" = "$3" ] && [ -x "$1/bin/python" ]
}

# venv_lock VENV [shared]: hold VENV.lock on fd 9 until this (sub)shell exits, exclusive
# (a builder) or shared (a reader); waits for a build in progress. No flock: no lock.
# A shared lock is taken only when the lock file exists (a reader never creates it).
venv_lock() {
    command -v flock >/dev/null 2>&1 || return 0
    if [ "${2:-}" = shared ]; then
        [ -e "$1.lock" ] || return 0
        { exec 9<"$1.lock"; } 2>/dev/null \
            || kv_die "cannot open the lock file $1.lock (not a readable file)"
        flock -s 9 || kv_die "cannot lock $1.lock"
    else
        mkdir -p "$(dirname "$1")" || kv_die "cannot create $(dirname "$1")"
        { exec 9>"$1.lock"; } 2>/dev/null \
            || kv_die "cannot open the lock file $1.lock (a read-only directory, or not a" \
                      "file): point the venv's variable at a writable path"
        flock 9 || kv_die "cannot lock $1.lock"
    fi
}

# venv_new PY VENV: a fresh venv at VENV made by PY, after removing a stale one. Returns 1
# with the reason in $KV_ERR when VENV is something else than a venv (left untouched) or
# `PY -m venv` fails. A build killed at any point leaves something the next run takes
# for its own: the old venv is renamed to VENV.trash-PID before it is removed (rm -rf
# removes pyvenv.cfg long before the rest of a 3 GB tree), and the new one is marked
# (VENV/.kvshm-building) before `PY -m venv` runs, which writes pyvenv.cfg only after
# making bin/ and lib/.
venv_new() {
    KV_ERR=
    local old
    for old in "$2".trash-*; do
        [ -e "$old" ] || continue
        kv_log "removing $old (left by a build that was stopped)"
        rm -rf "$old"
    done
    if [ -e "$2" ]; then
        if [ ! -f "$2/pyvenv.cfg" ] && [ ! -f "$2/.kvshm-building" ]; then
            KV_ERR="$2 exists and is not a virtual environment; not touching it"
            return 1
        fi
        kv_log "removing $2 (stale or partial: no marker, or built by another recipe)"
        mv "$2" "$2.trash-$$" || { KV_ERR="cannot move $2 aside"; return 1; }
        rm -rf "$2.trash-$$"
    fi
    kv_log "creating $2 with $("$1" --version 2>&1)"
    mkdir -p "$2" && : > "$2/.kvshm-building" || { KV_ERR="cannot create $2"; return 1; }
    "$1" -m venv "$2" || { KV_ERR="python -m venv failed"; return 1; }
}

# reuse_or_new PY VENV MARKER HASH REBUILD_VAR DIST...: when VENV was built by the recipe
# HASH (and $REBUILD_VAR is empty), say so with the versions of DIST... and EXIT 0 (the
# script is done); otherwise make a fresh VENV (venv_new) and return.
reuse_or_new() {
    local py=$1 venv=$2 marker=$3 hash=$4 rebuild=$5 versions; shift 5
    if marker_ok "$venv" "$marker" "$hash" && [ -z "${!rebuild:-}" ]; then
        versions=$(venv_versions "$venv" "$@" | tr '\n' ' ') \
            || kv_die "the venv $venv does not run; rerun with $rebuild=1"
        kv_log "reusing $venv (built by this version of the script): $versions"
        exit 0
    fi
    venv_new "$py" "$venv" || kv_die "$KV_ERR"
}

# step NAME CMD...: run CMD, time it, exit naming the step when it fails.
step() {
    local name=$1; shift
    local t0; t0=$(date +%s)
    kv_log "step: $name"
    if ! "$@"; then
        kv_die "step '$name' failed (command: $*)"
    fi
    kv_log "  done in $(( $(date +%s) - t0 )) s"
}

# torch_cpu VENV CONSTRAINTS SPEC: install SPEC (a CPU torch, e.g. torch==2.13.0+cpu) and
# numpy with pip into VENV first, so nothing later pulls a CUDA build. A wheel on a
# find-links path (pip config) is taken as is; otherwise the PyTorch CPU index
# ($KVSHM_TORCH_INDEX, default download.pytorch.org/whl/cpu). Exits when the torch that
# came is a CUDA build.
torch_cpu() {
    local venv=$1 cons=$2 spec=$3 probe=/tmp/kvshm-torch-probe-$$
    local pip=("$venv/bin/python" -m pip --disable-pip-version-check) src=()
    if ! "${pip[@]}" download --no-deps -d "$probe" "$spec" --no-index -q >/dev/null 2>&1; then
        src=(--index-url "${KVSHM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
             --extra-index-url https://pypi.org/simple)
    fi
    rm -rf "$probe"
    step "$spec (CPU)" "${pip[@]}" install -q -c "$cons" "${src[@]}" "$spec" numpy
    "$venv/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" \
        || kv_die "the torch that was installed is a CUDA build; set KVSHM_TORCH_INDEX to a CPU index"
}

# venv_versions VENV DIST...: "DIST VERSION" of each distribution installed in VENV, a line each.
venv_versions() {
    local venv=$1; shift
    "$venv/bin/python" - "$@" <<'PY'
import importlib.metadata as md, sys
for d in sys.argv[1:]:
    print(d, md.version(d))
PY
}
