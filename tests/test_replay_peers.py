"""`kvshm replay --backend lmcache|mooncake`: a short replay of the bundled trace against
each peer from its venv of scripts/peers-env.sh, every byte read checked. Where the venv
is absent the test asserts the clear error instead (so it never passes vacuously)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvshm.replay.peers import VENV_OF, peers_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READ_PATH = {"lmcache": "recv_into", "mooncake": "batch_get_into"}


def _venv_ok(backend: str) -> bool:
    venv = os.path.join(peers_cache(), VENV_OF[backend])
    return os.path.exists(os.path.join(venv, ".kvshm-peer-env"))


def _replay(backend: str, *extra: str, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvshm", "replay", "--backend", backend, "--requests", "50",
         "--block-bytes", "16KiB", "--pool-gib", "64MiB", "--no-progress", *extra],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, **(env or {})})


@pytest.mark.parametrize("backend", ["lmcache", "mooncake"])
def test_replay_peer(backend: str) -> None:
    if not _venv_ok(backend):
        p = _replay(backend)
        assert p.returncode == 1, p.stdout + p.stderr
        assert "scripts/peers-env.sh" in p.stderr and "Traceback" not in p.stderr
        return
    p = _replay(backend, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads(p.stdout)
    assert s["backend"] == backend
    assert s["mismatches"] == 0 and s["errors"] == 0
    assert s["requests"] == 50 and s["blocks_read"] > 0 and s["hits"] > 0
    assert READ_PATH[backend] in s["read_path"]
    assert s["capacity_note"]
    # the text summary names the backend, its read path and what its capacity means
    t = _replay(backend)
    assert t.returncode == 0, t.stdout + t.stderr
    assert f"backend {backend}" in t.stdout and READ_PATH[backend] in t.stdout
    assert "capacity!" in t.stdout and " 0 mismatches" in t.stdout
    if backend == "lmcache":
        assert "NOT comparable" in t.stdout
        # it never evicts: every block seen before is a hit, as in the unbounded cache
        assert s["hits"] == round(s["bound_hit_rate"] * s["blocks"])


@pytest.mark.parametrize("backend", ["lmcache", "mooncake"])
def test_replay_peer_missing_venv(backend: str, tmp_path: str) -> None:
    p = _replay(backend, env={"KVSHM_PEERS_CACHE": str(tmp_path)})
    assert p.returncode == 1, p.stdout + p.stderr
    assert "scripts/peers-env.sh" in p.stderr and "Traceback" not in p.stderr
    assert str(tmp_path) in p.stderr
