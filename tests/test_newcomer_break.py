"""What a newcomer (or CI) broke in the cached-venv recipe (scripts/lib/venv.sh) and in
scripts/test.sh's use of the engine venvs. Nothing is installed: the venvs here are a
few files, and `python` in them is a shell script that records how it was called."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, **env})


def _recipe_hash(script: str) -> str:
    p = _bash(f'. scripts/lib/venv.sh; recipe_hash "{sys.executable}" scripts/{script}')
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def _recording_venv(path: Path, name: str, log: Path) -> None:
    """A venv whose bin/python appends "NAME ARGS" to LOG and succeeds."""
    (path / "bin").mkdir(parents=True)
    (path / "pyvenv.cfg").write_text(f"home = {Path(sys.executable).parent}\n")
    py = path / "bin" / "python"
    py.write_text(f'#!/bin/bash\necho "{name} $*" >> "{log}"\n')
    py.chmod(0o755)


def _test_sh(tmp: Path, ivenv: Path, vvenv: Path,
             **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    log = tmp / "calls.log"
    log.touch()
    main = tmp / "main"
    if not main.exists():
        _recording_venv(main, "main", log)
    p = subprocess.run(["bash", "scripts/test.sh", "-q"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120,
                       env={**os.environ, "KVSHM_VENV": str(main), "PYTHON": sys.executable,
                            "KVSHM_INTEGRATION_VENV": str(ivenv),
                            "KVSHM_VLLM_VENV": str(vvenv), **env})
    return p, log.read_text()


def test_test_sh_never_runs_the_vllm_tests_in_a_venv_of_another_recipe(tmp_path):
    """A vLLM venv whose marker is not this checkout's recipe hash (an older
    scripts/vllm-env.sh, other pins) is stale: test.sh fails and names it, instead of
    running the end-to-end tests in it (it only checked that the marker existed)."""
    vvenv = tmp_path / "vllm"
    _recording_venv(vvenv, "vllm", tmp_path / "calls.log")
    (vvenv / ".kvshm-vllm-env").write_text("built-by-another-recipe\n")
    p, calls = _test_sh(tmp_path, tmp_path / "none", vvenv)
    assert "vllm -m pytest" not in calls, calls
    assert p.returncode != 0
    assert f"{vvenv} is partial or built by another version of scripts/vllm-env.sh" in p.stderr


def test_test_sh_fails_on_a_half_built_vllm_venv(tmp_path):
    """A vLLM venv with a python but no marker (a build killed halfway) fails the run,
    like a half-built integration venv does, instead of being skipped as absent."""
    vvenv = tmp_path / "vllm"
    _recording_venv(vvenv, "vllm", tmp_path / "calls.log")
    p, calls = _test_sh(tmp_path, tmp_path / "none", vvenv)
    assert "vllm -m pytest" not in calls
    assert p.returncode != 0
    assert f"{vvenv} is partial" in p.stderr


def test_test_sh_runs_the_vllm_tests_in_a_venv_with_the_recipe_marker(tmp_path):
    vvenv = tmp_path / "vllm"
    _recording_venv(vvenv, "vllm", tmp_path / "calls.log")
    (vvenv / ".kvshm-vllm-env").write_text(_recipe_hash("vllm-env.sh") + "\n")
    p, calls = _test_sh(tmp_path, tmp_path / "none", vvenv)
    assert "vllm -m pytest tests/integrations/test_vllm_e2e.py" in calls, p.stderr
    assert p.returncode == 0, p.stderr


def test_test_sh_with_required_engines_fails_without_the_venvs(tmp_path):
    p, calls = _test_sh(tmp_path, tmp_path / "none", tmp_path / "none2",
                        KVSHM_REQUIRE_ENGINES="1")
    assert p.returncode != 0
    assert "KVSHM_REQUIRE_ENGINES is set and there is no integration venv" in p.stderr
    assert "KVSHM_REQUIRE_ENGINES is set and there is no vLLM venv" in p.stderr
    assert "main -m pytest" in calls          # the main suite still ran


def _shim(dir_: Path, name: str, body: str) -> Path:
    dir_.mkdir(exist_ok=True)
    f = dir_ / name
    f.write_text("#!/bin/bash\n" + body)
    f.chmod(0o755)
    return f


def _fast_python(tmp: Path) -> Path:
    """A PY for venv_new whose `-m venv DIR` makes a venv without pip (seconds, not a
    minute of ensurepip on a loaded machine)."""
    return _shim(tmp / "fastpy", "python",
                 f'[ "$1" = -m ] && [ "$2" = venv ] && exec "{sys.executable}" -m venv '
                 f'--without-pip "$3"\nexec "{sys.executable}" "$@"\n')


def test_a_rebuild_killed_while_removing_the_old_venv_is_rebuilt_next_time(tmp_path):
    """The stale venv is being removed (a 3 GB venv takes seconds) when the build is
    killed; `rm -rf` had already removed pyvenv.cfg. The next run must take the
    directory for the partial venv it is, not refuse it for ever as "not a venv"."""
    venv = tmp_path / "venv"
    (venv / "lib" / "site-packages").mkdir(parents=True)
    (venv / "lib" / "site-packages" / "x.py").write_text("")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    shims = tmp_path / "shims"
    # an rm killed halfway: pyvenv.cfg of each directory it was given is gone, the rest not
    _shim(shims, "rm", 'for a in "$@"; do [ -d "$a" ] && /bin/rm -f "$a/pyvenv.cfg"; done\n'
                       'kill -9 $PPID\n')
    py = _fast_python(tmp_path)
    p = _bash(f'. scripts/lib/venv.sh; venv_new "{py}" "{venv}" || kv_die "$KV_ERR"',
              PATH=f"{shims}:{os.environ['PATH']}")
    assert p.returncode == -9 or p.returncode == 137, p.stdout + p.stderr
    py = _fast_python(tmp_path)
    p = _bash(f'. scripts/lib/venv.sh; venv_new "{py}" "{venv}" || kv_die "$KV_ERR"')
    assert p.returncode == 0, p.stdout + p.stderr
    assert (venv / "pyvenv.cfg").is_file() and (venv / "bin" / "python").exists()
    assert not (venv / "lib" / "site-packages" / "x.py").exists()
    assert sorted(q.name for q in tmp_path.iterdir() if q.name.startswith("venv")) == ["venv"]


def test_a_build_killed_inside_python_m_venv_is_rebuilt_next_time(tmp_path):
    """`python -m venv` makes bin/, lib/ before it writes pyvenv.cfg; killed in between,
    the directory has no pyvenv.cfg. It is still the venv being built, not the user's."""
    venv = tmp_path / "venv"
    fake_py = _shim(tmp_path / "py", "python",
                    f'[ "$1" = -m ] || exec "{sys.executable}" "$@"\n'
                    'mkdir -p "$3/bin" "$3/lib"; kill -9 $PPID\n')
    p = _bash(f'. scripts/lib/venv.sh; venv_new "{fake_py}" "{venv}" || kv_die "$KV_ERR"')
    assert p.returncode in (-9, 137), p.stdout + p.stderr
    assert venv.is_dir() and not (venv / "pyvenv.cfg").exists()
    py = _fast_python(tmp_path)
    p = _bash(f'. scripts/lib/venv.sh; venv_new "{py}" "{venv}" || kv_die "$KV_ERR"')
    assert p.returncode == 0, p.stdout + p.stderr
    assert (venv / "pyvenv.cfg").is_file()


def test_the_users_directory_is_still_never_touched(tmp_path):
    d = tmp_path / "mine"
    (d / "bin").mkdir(parents=True)
    (d / "precious").write_text("keep me")
    p = _bash(f'. scripts/lib/venv.sh; venv_new "{sys.executable}" "{d}" || kv_die "$KV_ERR"')
    assert p.returncode == 1
    assert "is not a virtual environment; not touching it" in p.stderr
    assert (d / "precious").read_text() == "keep me"


# ------------------------------------------------------------ benchmarks that check every read

def _perf_module(name: str):
    import importlib
    sys.path.insert(0, str(ROOT / "perf"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "perf"))


class _LazyClient:
    """A kvshm.Client stand-in (a dict) whose reads write the value only on their first
    call: what a broken mover that stops copying would do."""

    def __init__(self, *_a, **kw):
        self.transport = kw["transport"]
        self.d: dict[str, bytes] = {}
        self.reads = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def put_batch(self, keys, vals):
        self.d.update((k, bytes(v)) for k, v in zip(keys, vals))

    def get_batch_into(self, keys, outs):
        self.reads += 1
        if self.reads == 1:
            for k, o in zip(keys, outs):
                o[:] = memoryview(self.d[k])

    def get_batch(self, keys):
        return [self.d[k] for k in keys]

    def purge(self):
        self.d.clear()


def test_bench_store_checks_every_get_batch_into_rep(monkeypatch):
    """bench_store read every timed rep into the buffers the warm-up had filled and checked
    them once at the end: reads that copy nothing passed. Each rep now starts from zeroed
    buffers and is checked."""
    import pytest

    bs = _perf_module("bench_store")
    monkeypatch.setattr(bs.kvshm, "Client", _LazyClient)
    with pytest.raises(AssertionError, match="rep 0"):
        bs.bench_kvshm("127.0.0.1:1", "shm", 4, 4096, 2)


def test_bench_localread_checks_every_timed_call():
    import pytest

    bl = _perf_module("bench_localread")
    assert len(bl.timed(lambda: b"v", 5, check=b"v".__eq__)) == 5
    calls = iter([b"v", b"v", b"w"])
    with pytest.raises(RuntimeError, match="1 of 3 calls returned wrong bytes"):
        bl.timed(lambda: next(calls), 3, check=b"v".__eq__)


def test_bench_localread_compares_like_with_like():
    """`local get` returns fresh bytes: its copy baseline is a fresh bytes object
    (tobytes), not np.copyto into a reused buffer (the README's 0.84-1.36x compared
    those); `local get_into` is the one compared with the copy into a buffer."""
    p = subprocess.run([sys.executable, "perf/bench_localread.py", "--n", "300",
                        "--rounds", "1"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "local get p50 / numpy tobytes p50" in p.stdout
    assert "local get_into p50 / numpy copy p50" in p.stdout
    assert "local get p50 / numpy copy p50" not in p.stdout


# ------------------------------------------------------------ the replay says whether it agreed

def test_replay_says_in_counts_whether_the_store_equalled_the_exact_lru(tmp_path):
    """The demo printed "expected: equal" with hit rates equal to two decimals and
    "evictions 57900 (exact LRU 57902)": nothing said whether the expectation held. The
    summary now has a verdict in counts, and says NOT equal when they differ."""
    import uuid

    from kvshm.replay import ReplayOptions, format_summary, run_replay

    s = run_replay(ReplayOptions(requests=60, block_bytes=4096, pool_gib=400 * 4096 / 2**30,
                                 progress=False, shm_name=f"kvshm-test-b6-{uuid.uuid4().hex[:8]}")
                   ).summary
    assert s["mismatches"] == 0 and s["errors"] == 0
    assert s["lru_equal_expected"] is True
    text = format_summary(s)
    verdict = next(line for line in text.splitlines() if line.startswith("  verdict"))
    want_equal = s["hits"] == s["lru_hits"] and s["evictions"] == s["lru_evictions"]
    assert verdict.endswith(": equal as expected" if want_equal
                            else ": NOT equal (expected equal)"), verdict
    off = dict(s, evictions=s["lru_evictions"] + 2)
    assert "NOT equal (expected equal)" in format_summary(off)
    assert "(+2)" in format_summary(off)
    assert "equality not expected here" in format_summary(dict(s, lru_equal_expected=False))


def test_replay_says_when_the_capacity_never_filled():
    """`kvshm replay --requests 500 --chunk-tokens 64` (1 GiB default pool) evicted
    nothing: store = exact LRU = the bound by construction, and the output did not say
    so. The verdict now says the comparison tested no eviction."""
    from kvshm.replay import ReplayOptions, format_summary, run_replay
    import uuid

    s = run_replay(ReplayOptions(requests=20, block_bytes=4096, pool_gib=4096 * 4096 / 2**30,
                                 progress=False, shm_name=f"kvshm-test-b6-{uuid.uuid4().hex[:8]}")
                   ).summary
    assert s["evictions"] == 0 and s["lru_evictions"] == 0, s
    assert "nothing was evicted" in format_summary(s)
    assert "nothing was evicted" not in format_summary(dict(s, evictions=3, lru_evictions=3))


def test_bench_store_takes_sizes_with_units_and_says_its_defaults():
    """`bench_store.py --pool-gib 0.5GiB` was refused (a float only) and --help said
    nothing of its flags."""
    bs = _perf_module("bench_store")
    assert bs.parser().parse_args(["--pool-gib", "512MiB"]).pool_gib == 0.5
    assert bs.parser().parse_args(["--pool-gib", "2"]).pool_gib == 2.0
    text = bs.parser().format_help()
    assert "(default 5)" in text and "(default 1.5)" in text


def test_bench_peers_catches_a_read_that_stops_halfway():
    """bench_peers (perf/peer_clients.py) zeroed only the first 8 bytes of each buffer
    before a read into it: a read that wrote only the first half of a value passed, the
    rest still holding the previous rep's bytes (the same values, other keys)."""
    import pytest

    pc = _perf_module("peer_clients")

    class HalfReads(pc.Adapter):
        def __init__(self) -> None:
            self.d: dict[str, bytes] = {}
            self.reads = 0

            def put_batch(keys, arrays):
                self.d.update((k, bytes(a)) for k, a in zip(keys, arrays))

            def get_batch_into(keys, arrays):
                self.reads += 1
                for k, a in zip(keys, arrays):
                    v = memoryview(self.d[k])
                    n = len(v) if self.reads == 1 else len(v) // 2
                    a[:n] = v[:n]

            self.put_batch, self.get_batch_into = put_batch, get_batch_into
            self.paths = {}

    with pytest.raises(RuntimeError, match="values came back wrong"):
        pc.run_workload(HalfReads(), count=3, reps=2, lat_iters=0, sizes=((4096, "4k"),))


def test_a_lock_file_that_cannot_be_written_is_named(tmp_path):
    """A cache directory that is read-only (or a VENV.lock that is not a file) ended
    vllm-env.sh with bash's own `venv.sh: line 43: ...` and peers-env.sh with "flock: 9:
    Bad file descriptor" and "UNAVAILABLE: " (no reason). Each now names the lock file,
    and the peer's line says why. (A directory stands for the read-only case: tests may
    not mount.)"""
    venv = tmp_path / "vv"
    (tmp_path / "vv.lock").mkdir()
    p = subprocess.run(["bash", "scripts/vllm-env.sh"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120,
                       env={**os.environ, "KVSHM_VLLM_VENV": str(venv), "PYTHON": sys.executable})
    assert p.returncode == 1
    assert f"vllm-env: ERROR: cannot open the lock file {venv}.lock" in p.stderr, p.stderr
    assert not venv.exists()
    cache = tmp_path / "peers"
    (cache / "redis.lock").mkdir(parents=True)
    p = subprocess.run(["bash", "scripts/peers-env.sh", "redis"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "KVSHM_PEERS_CACHE": str(cache),
                            "PYTHON": sys.executable})
    assert p.returncode == 1
    assert f"cannot open the lock file {cache}/redis.lock" in p.stderr, p.stderr
    assert "UNAVAILABLE: see the error above" in p.stdout, p.stdout


def test_test_sh_never_runs_the_engine_tests_in_a_half_built_integration_venv(tmp_path):
    ivenv = tmp_path / "iv"
    _recording_venv(ivenv, "iv", tmp_path / "calls.log")
    p, calls = _test_sh(tmp_path, ivenv, tmp_path / "none", KVSHM_REQUIRE_ENGINES="1")
    assert "iv -m pytest" not in calls
    assert p.returncode != 0
    assert f"{ivenv} is partial or built by another version of scripts/integration-env.sh" \
        in p.stderr
    (ivenv / ".kvshm-integration-env").write_text(_recipe_hash("integration-env.sh") + "\n")
    p, calls = _test_sh(tmp_path, ivenv, tmp_path / "none")
    assert "iv -m pytest tests/integrations -m integration" in calls, p.stderr
    assert p.returncode == 0, p.stderr
