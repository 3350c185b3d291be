"""Peer stores a replay can drive: LMCache's lm-server (``--backend lmcache``) and
Mooncake Store (``--backend mooncake``), each from its own venv built by
``scripts/peers-env.sh`` (cached under ``$KVSHM_PEERS_CACHE``, default
``/root/.cache/kvshm-peers``), its servers started here on free loopback ports.

The replay talks to a client process running in the peer's venv
(:mod:`kvshm.replay.peer_client`): one JSON line each way per operation on its
stdin/stdout; the values sit in a staging file in /dev/shm that both map, so the peer reads
into (and writes from) a caller's buffer with its best path, and the replay copies a value
once between that buffer and its own (outside the peer, inside the timed region).

Capacity, said in the summary (``capacity_note``):

- lm-server (``python -m lmcache.v1.server HOST PORT cpu``) keeps every value: its CPU
  backend has no evictor and no size limit. Its hit rate is an unbounded cache's, not
  comparable with the exact LRU of the replay's capacity.
- Mooncake's capacity is the segment its holder process mounts: the replay's pool bytes.
  Its master evicts when the segment is 90 % full (a ratio of objects, by lease), not an
  exact LRU, and refuses a put it has no room for: refused writes are counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import tempfile
from typing import Any, Iterator, Sequence

from kvshm.replay.options import ReplayError
from kvshm.replay.servers import Child, die_with_parent, free_port

__all__ = ["PEERS", "VENV_OF", "peers_cache", "peer_python", "venv_python",
           "PeerUnavailable", "start_lm_server", "start_mooncake", "PeerBackend", "peer_servers"]

#: --backend name -> the venv of scripts/peers-env.sh that holds it
VENV_OF = {"lmcache": "lmcache", "mooncake": "mooncake"}
PEERS = tuple(VENV_OF)
CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_client.py")

CAPACITY_NOTE = {
    "lmcache": ("lm-server's capacity cannot be set: its CPU backend keeps every value (no "
                "evictor, no size limit), so its hit rate is an unbounded cache's and NOT "
                "comparable with the exact LRU of this capacity"),
    "mooncake": ("Mooncake's segment is the pool's bytes; its master evicts at 90 % full "
                 "(5 % of objects, by lease), not an exact LRU, and refuses puts it has no "
                 "room for"),
}


class PeerUnavailable(ReplayError):
    """The peer's venv is missing (the message names scripts/peers-env.sh)."""


def peers_cache() -> str:
    return os.environ.get("KVSHM_PEERS_CACHE", "/root/.cache/kvshm-peers")


def venv_python(name: str, cache: str | None = None) -> str:
    """The python of scripts/peers-env.sh's venv ``name`` under ``cache`` (default
    :func:`peers_cache`), or :class:`PeerUnavailable` naming the script (and the reason
    its last build left in ``<name>.failed``). Used by the replay and perf/bench_peers."""
    cache = cache or peers_cache()
    venv = os.path.join(cache, name)
    py = os.path.join(venv, "bin", "python")
    if not (os.path.exists(os.path.join(venv, ".kvshm-peer-env")) and os.path.exists(py)):
        why = ""
        failed = os.path.join(cache, name + ".failed")
        if os.path.exists(failed):
            with open(failed) as f:
                why = "; its last build: " + f.read().strip()[:300]
        raise PeerUnavailable(f"no venv at {venv}; build it with scripts/peers-env.sh "
                              f"{name} (or set KVSHM_PEERS_CACHE){why}")
    return py


def peer_python(backend: str, cache: str | None = None) -> str:
    """The python of the ``--backend``'s venv, or :class:`PeerUnavailable`."""
    try:
        return venv_python(VENV_OF[backend], cache)
    except PeerUnavailable as exc:
        raise PeerUnavailable(f"--backend {backend}: {exc}") from None


def start_lm_server(py: str) -> tuple[Child, int]:
    """``python -m lmcache.v1.server 127.0.0.1 PORT cpu`` from the lmcache venv."""
    port = free_port()
    child = Child([py, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
                  re.compile(r"Server started at"), "lm-server", timeout=120,
                  env={**os.environ, "LMCACHE_LOG_LEVEL": "INFO"})
    return child, port


def start_mooncake(py: str, segment: int, workdir: str) -> tuple[list[Child], dict[str, Any]]:
    """``mooncake_master`` (with its HTTP metadata server) and a holder process that
    mounts ``segment`` bytes; returns the children and the client's spec."""
    exe = os.path.join(os.path.dirname(py), "mooncake_master")
    if not os.path.exists(exe):
        raise PeerUnavailable(f"no mooncake_master in {os.path.dirname(py)} (rebuild it: "
                              "KVSHM_PEERS_REBUILD=1 scripts/peers-env.sh mooncake)")
    rpc, meta, metrics = free_port(), free_port(), free_port()
    master = Child([exe, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
                    "--enable_http_metadata_server=true", f"--http_metadata_server_port={meta}",
                    "--http_metadata_server_host=127.0.0.1", f"--metrics_port={metrics}",
                    "--metrics_host=127.0.0.1", "--rpc_thread_num=2",
                    "--enable_metric_reporting=false"],
                   re.compile(r"Master admin server started|admin server started"),
                   "mooncake_master", timeout=60, cwd=workdir)
    spec = {"master": f"127.0.0.1:{rpc}", "metadata": f"http://127.0.0.1:{meta}/metadata",
            "segment": int(segment), "local_buffer": 32 << 20}
    try:
        holder = Child([py, CLIENT, "mooncake-holder", json.dumps(spec)],
                       re.compile(r"^ready$"), "mooncake segment holder", timeout=60,
                       cwd=workdir, stdin=True)
    except BaseException:
        master.stop()
        raise
    return [holder, master], spec


class PeerBackend:
    """The replay's backend interface (:mod:`kvshm.replay.backends`) over a client
    process in the peer's venv (:mod:`kvshm.replay.peer_client`)."""

    transport = "tcp"

    def __init__(self, backend: str, py: str, spec: dict[str, Any], timeout: float,
                 workdir: str) -> None:
        self.name = backend
        self.timeout = timeout
        self.refused = 0
        self.refused_codes: dict[str, int] = {}
        self.proc = subprocess.Popen(
            [py, CLIENT, "lm-server" if backend == "lmcache" else "mooncake",
             json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(os.path.join(workdir, "client.log"), "wb"), text=True, cwd=workdir,
            preexec_fn=die_with_parent, env={**os.environ, "LMCACHE_LOG_LEVEL": "WARNING"})
        self._log = os.path.join(workdir, "client.log")
        hello = self._recv()
        self.read_path = hello["read_path"]
        fd, self.stage_path = tempfile.mkstemp(prefix="kvshm-replay-peer-", dir="/dev/shm")
        os.close(fd)
        self.stage: Any = None
        self.stage_size = 0

    def _recv(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait(10)
            with open(self._log, "rb") as f:
                tail = f.read().decode(errors="replace").strip().splitlines()[-3:]
            raise ReplayError(f"{self.name} client exited ({rc}): {' | '.join(tail)}")
        r = json.loads(line)
        if isinstance(r, dict) and "error" in r:
            raise RuntimeError(f"{self.name}: {r['error']}")
        return r

    def _call(self, *msg: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._recv()

    def _room(self, n: int) -> Any:
        if n > self.stage_size:
            import numpy as np

            size = max(n, 2 * self.stage_size, 1 << 20)
            with open(self.stage_path, "r+b") as f:
                f.truncate(size)
            self.stage = None
            self.stage = np.memmap(self.stage_path, dtype=np.uint8, mode="r+", shape=(size,))
            self.stage_size = size
            self._call("map", self.stage_path, size)
        return self.stage

    @staticmethod
    def _keys(keys: Sequence[bytes]) -> list[str]:
        return [k.decode() for k in keys]

    def match(self, keys: Sequence[bytes]) -> int:
        return int(self._call("match", self._keys(keys))["n"])

    def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int]:
        caps = [o.nbytes for o in outs]
        offs, o = [], 0
        for c in caps:
            offs.append(o)
            o += -(-c // 64) * 64
        st = self._room(o)
        sizes = self._call("get", self._keys(keys), offs, caps)["sizes"]
        mv = memoryview(st)
        for out, off, n in zip(outs, offs, sizes):
            if n > 0:
                out[:n] = mv[off:off + n]
        return [int(n) for n in sizes]

    def write(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> None:
        sizes = [v.nbytes for v in values]
        offs, o = [], 0
        for n in sizes:
            offs.append(o)
            o += -(-n // 64) * 64
        st = self._room(o)
        mv = memoryview(st)
        for v, off, n in zip(values, offs, sizes):
            mv[off:off + n] = v
        r = self._call("put", self._keys(keys), offs, sizes)
        self.refused += int(r["refused"])
        for c, k in r["codes"].items():
            self.refused_codes[c] = self.refused_codes.get(c, 0) + k

    def counts(self) -> dict[str, int | None]:
        return {"evictions": 0 if self.name == "lmcache" else None, "dropped": None}

    def delete(self, keys: Sequence[bytes]) -> int:
        return 0      # the servers are the replay's own, stopped at the end

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call("quit")
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.stage = None
        with contextlib.suppress(OSError):
            os.unlink(self.stage_path)


@contextlib.contextmanager
def peer_servers(backend: str, pool_bytes: int, timeout: float
                 ) -> Iterator[PeerBackend]:
    """Start the peer's server(s) and its client; stop all of them at the end."""
    py = peer_python(backend)
    workdir = tempfile.mkdtemp(prefix=f"kvshm-replay-{backend}-")
    children: list[Child] = []
    be: PeerBackend | None = None
    try:
        if backend == "lmcache":
            child, port = start_lm_server(py)
            children.append(child)
            spec: dict[str, Any] = {"port": port}
        else:
            kids, spec = start_mooncake(py, pool_bytes, workdir)
            children += kids
        be = PeerBackend(backend, py, spec, timeout, workdir)
        yield be
    finally:
        if be is not None:
            be.close()
        for c in children:
            c.stop()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
