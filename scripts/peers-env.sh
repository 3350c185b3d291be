#!/usr/bin/env bash
# Create (or reuse) one virtual environment per peer store that perf/bench_peers.py runs
# beside kvshm: Redis's client, LMCache (its lm-server, CPU torch), Mooncake Store (the
# non-CUDA build) and InfiniStore (tried; it needs an RDMA device to start).
#
#   scripts/peers-env.sh                    # all peers: redis lmcache mooncake infinistore
#   scripts/peers-env.sh redis mooncake     # only these
#   KVSHM_PEERS_CACHE=/path scripts/peers-env.sh
#   KVSHM_PEERS_REBUILD=1 scripts/peers-env.sh lmcache    # start that venv from scratch
#
# Venvs live under ${KVSHM_PEERS_CACHE:-/root/.cache/kvshm-peers}/<peer>. A marker file
# <peer>/.kvshm-peer-env holds the sha256 of this peer's pinned requirements and the Python
# version; when it matches, the venv is reused as is (a build that stopped halfway has no
# marker and is built again). Concurrent runs wait on <peer>.lock next to the venv.
# A peer that cannot be installed leaves <peer>.failed (one line: the step and pip's last
# error line) so the benchmark can print why its row is unavailable; the script goes on
# with the other peers and exits 1 if any failed. Redis's server is Debian's
# `redis-server` (apt-get install redis-server), not something pip installs; its absence
# is reported, not fatal.
set -uo pipefail

cache=${KVSHM_PEERS_CACHE:-/root/.cache/kvshm-peers}
py=${PYTHON:-python3}

# ------------------------------------------------------------------ pinned versions
declare -A REQS=(
    [redis]="redis==7.1.0 hiredis numpy"
    [lmcache]="torch==2.13.0 lmcache==0.5.6 numpy"
    [mooncake]="mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy"
    [infinistore]="torch==2.13.0 infinistore numpy"
)
# what `python -c` must import for the venv to count as built
declare -A CHECK=(
    [redis]="import redis, numpy"
    [lmcache]="import torch, numpy, lmcache.v1.server, lmcache.v1.protocol; assert torch.version.cuda is None"
    [mooncake]="import numpy; from mooncake.store import MooncakeDistributedStore"
    [infinistore]="import numpy, infinistore"
)
ALL=(redis lmcache mooncake infinistore)

KV_TAG=peers-env
# shellcheck source=scripts/lib/venv.sh
. "$(dirname "$0")/lib/venv.sh"
log() { kv_log "$@"; }

command -v "$py" >/dev/null 2>&1 || { echo "peers-env: ERROR: no $py" >&2; exit 2; }
mkdir -p "$cache" || { echo "peers-env: ERROR: cannot create $cache" >&2; exit 2; }
peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=("${ALL[@]}")

build() {  # build PEER: returns 0 when the venv is ready; writes PEER.failed otherwise
    local peer=$1 venv="$cache/$1" marker="$cache/$1/.kvshm-peer-env" failed="$cache/$1.failed"
    local reqs=${REQS[$peer]} hash
    hash=$( { echo "$reqs"; echo "${CHECK[$peer]}"; "$py" --version 2>&1; } | sha256sum | cut -d' ' -f1)
    if marker_ok "$venv" "$marker" "$hash" && [ -z "${KVSHM_PEERS_REBUILD:-}" ]; then
        log "$peer: reusing $venv"
        return 0
    fi
    rm -f "$failed"
    local t0; t0=$(date +%s)
    log "$peer: creating $venv ($reqs)"
    if ! venv_new "$py" "$venv" >"$cache/$peer.log" 2>&1; then
        echo "$peer: ${KV_ERR:-python -m venv failed}: $(tail -1 "$cache/$peer.log")" > "$failed"
        return 1
    fi
    # shellcheck disable=SC2086
    if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check $reqs \
            >>"$cache/$peer.log" 2>&1; then
        echo "pip install $reqs failed: $(grep -E 'ERROR|error' "$cache/$peer.log" | tail -1)" > "$failed"
        return 1
    fi
    if ! "$venv/bin/python" -c "${CHECK[$peer]}" >>"$cache/$peer.log" 2>&1; then
        echo "installed but does not import: $(tail -1 "$cache/$peer.log")" > "$failed"
        return 1
    fi
    echo "$hash" > "$marker"
    log "$peer: built in $(( $(date +%s) - t0 )) s ($(du -sh "$venv" | cut -f1))"
}

rc=0
for peer in "${peers[@]}"; do
    if [ -z "${REQS[$peer]:-}" ]; then
        echo "peers-env: ERROR: unknown peer '$peer' (known: ${ALL[*]})" >&2; rc=2; continue
    fi
    (
        venv_lock "$cache/$peer"
        build "$peer"
    )
    if [ $? -ne 0 ]; then
        log "$peer: UNAVAILABLE: $(cat "$cache/$peer.failed" 2>/dev/null \
            || echo "see the error above")"
        rc=1
    fi
done
if printf '%s\n' "${peers[@]}" | grep -qx redis && ! command -v redis-server >/dev/null 2>&1; then
    log "redis: no redis-server on PATH (apt-get install redis-server); the Redis row will be unavailable"
fi
exit $rc
