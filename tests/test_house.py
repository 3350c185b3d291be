"""The house (issue 16) and the SSD scratch files of a killed server (issue 12).

- Rough edges a newcomer hit: a taken management port names the port and the flag; a
  port out of range says so; every flag with a default shows it in its help; sizes take
  units everywhere (one parser, :mod:`kvshm.units`), plain numbers keep each flag's unit.
- ``import kvshm`` in an engine process imports neither the server, the store, the
  management port nor prometheus_client.
- The import rules of docs/ARCHITECTURE.md: no cycles, and each layer imports only the
  layers it may.
- ``kvshm ctl cleanup`` removes the SSD scratch files of a server killed with SIGKILL,
  and never the files of a live server or of an ``--ssd-persist`` directory.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvshm import cli
from kvshm.units import GiB, KiB, MiB, format_size, parse_size
from servers import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 60


# ---------------------------------------------------------------------- sizes

@pytest.mark.parametrize("text, unit, want", [
    ("64KiB", 1, 64 * KiB), ("64K", 1, 64 * KiB), ("64kb", 1, 64 * KiB),
    ("0.5GiB", 1, GiB // 2), ("1.5 G", 1, 3 * GiB // 2), ("512MiB", GiB, 512 * MiB),
    ("4096", 1, 4096), ("4096B", GiB, 4096), ("1", GiB, GiB), ("64", KiB, 64 * KiB),
    ("0.25", GiB, GiB // 4), ("1e3", 1, 1000), ("2TiB", 1, 2 << 40), (3, KiB, 3 * KiB),
])
def test_parse_size(text: str, unit: int, want: int) -> None:
    assert parse_size(text, unit) == want


@pytest.mark.parametrize("bad", ["", "x", "-1", "1 PB", "1.2.3", "nan", "inf", "1e400",
                                 "64 KiBs", True])
def test_parse_size_refuses(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)  # type: ignore[arg-type]


def test_format_size() -> None:
    assert [format_size(n) for n in (65536, GiB, 3 * MiB, 1536, 100)] == \
        ["64KiB", "1GiB", "3MiB", "1.50KiB", "100B"]


def _serve_config(*argv: str) -> object:
    p = argparse.ArgumentParser()
    cli.add_server_flags(p)
    return cli.config_from_args(p.parse_args(list(argv)))


def test_serve_sizes_take_units_and_plain_numbers_keep_their_unit() -> None:
    plain = _serve_config("--prealloc-size", "0.5", "--block-size", "16", "--ssd-queue", "32",
                          "--ssd-size", "2", "--max-client-pending", "1048576")
    units = _serve_config("--prealloc-size", "512MiB", "--block-size", "16KiB",
                          "--ssd-queue", "32MiB", "--ssd-size", "2GiB",
                          "--max-client-pending", "1MiB")
    for c in (plain, units):
        assert (c.prealloc_size, c.block_size, c.ssd_queue, c.ssd_size,   # type: ignore[attr-defined]
                c.max_client_pending_bytes) == (0.5, 16, 32.0, 2.0, MiB)  # type: ignore[attr-defined]
        assert c.pool_bytes == GiB // 2                                    # type: ignore[attr-defined]
    d = _serve_config()
    assert (d.prealloc_size, d.block_size, d.ssd_queue) == (1.0, 64, 0.0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("argv, flag", [
    (["serve", "--block-size", "6KiB"], "--block-size"),
    (["serve", "--prealloc-size", "0"], "--prealloc-size"),
    (["serve", "--prealloc-size", "lots"], "--prealloc-size"),
    (["serve", "--ssd-size", "1 PB"], "--ssd-size"),
    (["replay", "--block-bytes", "6"], "--block-bytes"),
    (["replay", "--pool-gib", "-1GiB"], "--pool-gib"),
    (["ctl", "--address", "127.0.0.1:99999", "ping"], "--address"),
    (["ctl", "--address", "tcp://127.0.0.1:99999", "ping"], "--address"),
])
def test_bad_sizes_and_ports_name_the_flag(argv: list[str], flag: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        cli.main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "Traceback" not in err
    if "99999" in argv[2]:
        assert "port 99999 is out of range (1-65535)" in err


def test_every_flag_with_a_default_shows_it() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name in ("serve", "replay"):
        for a in sub.choices[name]._actions:
            if (a.help and a.default not in (None, False, argparse.SUPPRESS)
                    and "default" not in a.help):
                missing.append(f"{name} {a.option_strings[0]}")
    assert not missing, missing
    assert "(default 10)" in sub.choices["serve"].format_help().split("--lease-timeout")[-1]


def test_manage_port_in_use_names_the_port_and_the_flag(shm_name: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--service-port", "0",
                            "--manage-port", str(port), "--prealloc-size", "16MiB",
                            "--shm-name", shm_name, "--log-level", "WARNING"],
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 1, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert f"127.0.0.1:{port}" in last and "--manage-port" in last, last
    assert "in use" in last and "[Errno" not in last, last


# ---------------------------------------------------------------------- lazy imports

def test_import_kvshm_is_light() -> None:
    code = ("import sys, kvshm\n"
            "heavy = [m for m in ('kvshm.server', 'kvshm.store', 'kvshm.manage', "
            "'kvshm.zmq_ctrl.router', 'kvshm.tiers', 'prometheus_client', 'asyncio') "
            "if m in sys.modules]\n"
            "print(' '.join(heavy))\n"
            "import kvshm.cli; kvshm.cli.build_parser()\n"
            "print('numpy' in sys.modules)\n"
            # the server side (which may use numpy) is there on first use
            "assert kvshm.Server.__module__ == 'kvshm.server'\n"
            "assert kvshm.AsyncClient.__module__ == 'kvshm.aio'\n"
            "from kvshm import ServerConfig\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr
    heavy, numpy = p.stdout.splitlines()
    assert heavy == ""                          # nothing of the server side
    assert numpy == "False"                     # the CLI's parsers import no numpy
    with pytest.raises(AttributeError):
        import kvshm

        kvshm.NoSuchThing  # noqa: B018


# ---------------------------------------------------------------------- import rules

#: docs/ARCHITECTURE.md, "Which module may import which": the layers, low to high, and
#: what each may import (besides itself). A module in no layer (new, not yet placed) is
#: checked for cycles only.
LAYERS: dict[str, list[str]] = {
    "base": ["kvshm._[!_]*", "kvshm.errors", "kvshm.units", "kvshm.keys", "kvshm.limits",
             "kvshm.index",
             "kvshm.security", "kvshm.segments", "kvshm.trace", "kvshm.cuda"],
    "wire": ["kvshm.zmq_ctrl", "kvshm.zmq_ctrl.protocol", "kvshm.zmq_ctrl.frames",
             "kvshm.zmq_ctrl.channel"],
    "movers": ["kvshm.movers", "kvshm.localread", "kvshm.paged", "kvshm.rdma",
               "kvshm.rdma.*"],
    "client": ["kvshm.client", "kvshm.aio", "kvshm.layerwise", "kvshm.integrations",
               "kvshm.integrations.*"],
    "store": ["kvshm.tiers", "kvshm.tiers.*", "kvshm.store", "kvshm.store.*",
              "kvshm.zmq_ctrl.router",
              # the server loop's modules (ServiceLoop's mixins, kvshm.zmq_ctrl.router)
              "kvshm.zmq_ctrl.dispatch", "kvshm.zmq_ctrl.handling", "kvshm.zmq_ctrl.ops_write",
              "kvshm.zmq_ctrl.ops_read", "kvshm.zmq_ctrl.ops_admin", "kvshm.zmq_ctrl.sessions",
              "kvshm.zmq_ctrl.parked", "kvshm.zmq_ctrl.slices", "kvshm.zmq_ctrl.sends",
              "kvshm.zmq_ctrl.fastpaths", "kvshm.zmq_ctrl.sockets",
              "kvshm.zmq_ctrl.loopstate"],
    "server": ["kvshm.server", "kvshm.manage"],
    "tools": ["kvshm.cliargs", "kvshm.cli", "kvshm.__main__", "kvshm.replay",
              "kvshm.replay.*"],
}
MAY_IMPORT: dict[str, set[str]] = {
    "base": {"base"},
    "wire": {"base", "wire"},
    "movers": {"base", "wire", "movers"},
    "client": {"base", "wire", "movers", "client"},
    "store": {"base", "wire", "store"},            # the store knows no client, no mover
    "server": {"base", "wire", "movers", "client", "store", "server"},
    "tools": {"base", "wire", "movers", "client", "store", "server", "tools"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in (ROOT / "kvshm").rglob("*"):
        if p.suffix not in (".py", ".pyx") or "data" in p.parts:
            continue
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Every kvshm module each module imports, at module level or in a function (a lazy
    import is a dependency too), type-checking imports included; the package itself
    (``import kvshm``, for its path) and a package entered to reach its submodule are
    not edges."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        if p.suffix != ".py":
            continue
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                         for a in node.names]
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != m and n != "kvshm":
                    edges[m].add(n)
    return edges


def _layer(m: str) -> str | None:
    for name, pats in LAYERS.items():
        if any(fnmatch.fnmatchcase(m, p) for p in pats):
            return name
    return None


def test_no_import_cycles() -> None:
    edges = _imports(_modules())
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, f"modules that import each other: {cycles}"


def test_each_layer_imports_only_what_it_may() -> None:
    mods = _modules()
    edges = _imports(mods)
    bad = []
    for m, deps in sorted(edges.items()):
        lm = _layer(m)
        if lm is None:
            continue
        for d in sorted(deps):
            ld = _layer(d)
            if ld is not None and ld not in MAY_IMPORT[lm]:
                bad.append(f"{m} ({lm}) imports {d} ({ld})")
    assert not bad, bad
    # the rules are about modules that exist
    placed = [m for m in mods if _layer(m) is not None]
    assert len(placed) > 50 and "kvshm.store" in placed and "kvshm.client" in placed


def test_the_store_knows_no_wire_and_no_tier() -> None:
    """docs/ARCHITECTURE.md: kvshm.store and its parts import neither the wire protocol
    (kvshm.zmq_ctrl, the router included) nor a concrete tier (kvshm.tiers.ssd), not even
    through a module of their own that does."""
    mods = _modules()
    edges = _imports(mods)
    store = sorted(m for m in mods if m == "kvshm.store" or m.startswith("kvshm.store."))
    assert "kvshm.store.core" in store and "kvshm.store.sessions" in store

    def forbidden(d: str) -> bool:
        return (d == "kvshm.zmq_ctrl" or d.startswith("kvshm.zmq_ctrl.")
                or d == "kvshm.tiers.ssd" or d.startswith("kvshm.tiers.ssd."))

    bad = []
    for m in store:
        seen: set[str] = set()
        todo = list(edges[m])
        while todo:                 # what it reaches, directly or through other modules
            d = todo.pop()
            if d in seen:
                continue
            seen.add(d)
            if forbidden(d):
                bad.append(f"{m} reaches {d}")
            todo.extend(edges.get(d, ()))
    assert not bad, bad
    # and at run time: importing the store loads no wire module and no tier beyond what
    # `import kvshm` (the client side) loads by itself
    code = ("import sys, kvshm\n"
            "before = set(sys.modules)\n"
            "import kvshm.store\n"
            "print(' '.join(sorted(m for m in set(sys.modules) - before if m.startswith("
            "('kvshm.zmq_ctrl', 'kvshm.tiers.ssd')))))\n"
            "print('kvshm.tiers.api' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr
    loaded, api = p.stdout.split("\n")[:2]
    assert loaded == "" and api == "True", p.stdout


# ---------------------------------------------------------------------- SSD scratch files

def _ssd_files(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("kvshm-ssd")) \
        if os.path.isdir(d) else []


def test_ctl_cleanup_removes_scratch_ssd_files_of_a_killed_server(
        tmp_path: Path, shm_name: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))    # where the registry lives
    env = {"TMPDIR": str(tmp)}
    scratch, kept, persist = (str(tmp_path / n) for n in ("scratch", "live", "persist"))
    flags = ("--ssd-size", "16MiB", "--no-ipc")
    live = ServerProcess("--ssd-path", kept, *flags, prealloc_size=0.0625,
                         shm_name=shm_name + "-l", env=env)
    try:
        for path, sfx, more in ((scratch, "-s", ()), (persist, "-p", ("--ssd-persist",))):
            srv = ServerProcess("--ssd-path", path, *flags, *more, prealloc_size=0.0625,
                                shm_name=shm_name + sfx, env=env)
            srv.kill()                          # SIGKILL: no chance to clean up
            srv.remove_segment()
        assert "kvshm-ssd-0.dat" in _ssd_files(scratch)
        assert "kvshm-ssd.scratch" in _ssd_files(scratch)
        assert "kvshm-ssd-0.dat" in _ssd_files(persist)
        # --prefix: never touch the segments of other test runs on this machine
        assert cli.main(["ctl", "cleanup", "--prefix", shm_name, "--dry-run"]) == 0
        assert "would remove " + os.path.join(scratch, "kvshm-ssd-0.dat") in \
            capsys.readouterr().out
        assert "kvshm-ssd-0.dat" in _ssd_files(scratch)
        assert cli.main(["ctl", "cleanup", "--prefix", shm_name, "--ssd-path", persist]) == 0
        out = capsys.readouterr().out
        assert "removed " + os.path.join(scratch, "kvshm-ssd-0.dat") in out
        assert not os.path.exists(scratch)      # the server made it: emptied, removed
        assert "kvshm-ssd-0.dat" in _ssd_files(persist)      # --ssd-persist: kept
        assert "kvshm-ssd-0.dat" in _ssd_files(kept) and live.alive()   # in use: kept
        assert persist not in out and kept not in out
    finally:
        live.stop()
    assert not os.path.exists(kept)             # a clean stop removes its own
    assert cli.main(["ctl", "cleanup", "--prefix", shm_name]) == 0
    assert "nothing to remove" in capsys.readouterr().out
