"""Helpers the perf/ scripts share: ports, child processes, /proc figures, Redis, echo peers.

Nothing here times anything by itself; every script measures its baselines in its own run.
Only the standard library, numpy, pyzmq and (for Redis) redis-py are imported here, and
those lazily where a script may run without them.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def write_json(res: Any, dest: str) -> None:
    """The ``--json`` output of a script: ``dest`` is a file path, or ``-`` for stdout."""
    import json

    text = json.dumps(res, indent=1, sort_keys=True)
    if dest == "-":
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text + "\n")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    """Wait until something accepts on 127.0.0.1:port; raise if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)   # the peer prints no ready line we can rely on: poll its port
    raise RuntimeError(f"{what} did not listen on {port} within {timeout} s")


def stop(proc: subprocess.Popen | None, timeout: float = 10) -> None:
    """SIGTERM, wait, SIGKILL if needed (idempotent)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU seconds so far of each thread of a process, summed by thread name
    (/proc/PID/task/*/stat): e.g. ``{"python": ..., "ZMQbg/IO/0": ...}`` for a server's loop
    thread and libzmq's I/O thread. A thread that ended is no longer counted."""
    out: dict[str, float] = {}
    tck = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue        # ended meanwhile
        name = text[text.index("(") + 1:text.rindex(")")]
        parts = text.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(parts[11]) + int(parts[12])) / tck
    return out


def proc_status(pid: int) -> dict[str, int]:
    """The kB fields of /proc/PID/status (VmRSS, RssAnon, RssShmem, ...) in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields = rest.split()
            if len(fields) == 2 and fields[1] == "kB":
                out[name] = int(fields[0]) * 1024
    return out


def rss_by_mapping(pid: int) -> dict[str, int]:
    """Resident bytes of a process per mapped path (/proc/PID/smaps; "" = anonymous)."""
    out: dict[str, int] = {}
    path = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) > 5 else ""
            elif first == "Rss:":
                out[path] = out.get(path, 0) + int(line.split()[1]) * 1024
    return out


def pct(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of already sorted values (nearest rank)."""
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[i]


def lat_stats(samples: list[float]) -> dict[str, float]:
    """p50/p99/mean in microseconds of samples in seconds."""
    s = sorted(samples)
    return {"p50_us": pct(s, 0.5) * 1e6, "p99_us": pct(s, 0.99) * 1e6,
            "mean_us": statistics.fmean(s) * 1e6, "n": len(s)}


def pattern(seed: int, size: int) -> Any:
    """A value (numpy uint8) whose every 8-byte word differs by position and by seed."""
    import numpy as np

    words = (np.arange(size // 8 + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             ^ np.uint64(seed * 0x100000001B3 + 1))
    return words.view(np.uint8)[:size].copy()


# --------------------------------------------------------------------------- Redis


def start_redis(maxmemory: int = 1 << 30, exe: str | None = None
                ) -> tuple[subprocess.Popen, int, str]:
    """Start ``redis-server`` on a free loopback port, no persistence.

    Returns (process, port, data dir). Raises FileNotFoundError without redis-server.
    """
    exe = exe or shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("no redis-server on PATH (apt-get install redis-server)")
    port = free_port()
    d = tempfile.mkdtemp(prefix="kvshm-bench-redis-")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", d, "--maxmemory", str(maxmemory),
                             "--maxmemory-policy", "allkeys-lru",
                             "--proto-max-bulk-len", str(1 << 30)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc, "redis-server", timeout=20)
    except BaseException:
        stop(proc)
        shutil.rmtree(d, ignore_errors=True)
        raise
    return proc, port, d


def redis_parser() -> str:
    """Which reply parser redis-py uses here (hiredis when installed)."""
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:  # pragma: no cover - old redis-py
        return "unknown"
    return "hiredis" if HIREDIS_AVAILABLE else "python parser"


# --------------------------------------------------------------------------- echo peers


# --------------------------------------------------------------------------- kvshm


def small_server() -> Any:
    """An in-process kvshm Server for the single-key benchmarks: a free port, no
    management port, a 16 MiB pool of 4 KiB blocks on a segment name of its own. Call
    ``stop()`` on it."""
    import uuid

    from kvshm.server import Server

    name = f"kvshm-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return Server(service_port=0, manage_port=None, prealloc_size=1 / 64, block_size=4,
                  shm_name=name).start()


def local_and_remote(address: str) -> tuple[Any, Any]:
    """Two same-host clients of ``address``: one that reads lock-free through the shared
    index (``local``), one whose every read goes through the server (made while
    ``$KVSHM_NO_LOCAL_READS``, :data:`kvshm.localread.ENV_DISABLE`, is set)."""
    from kvshm.client import Client
    from kvshm.localread import ENV_DISABLE

    local = Client(address)
    os.environ[ENV_DISABLE] = "1"
    try:
        remote = Client(address)
    except BaseException:
        local.close()
        raise
    finally:
        del os.environ[ENV_DISABLE]
    return local, remote


def zmq_echo_server(endpoint: str) -> None:
    """A bare pyzmq ROUTER that sends every message back (runs until killed).

    Prints the endpoint it bound, then one line per nothing: the parent reads the first
    line as the ready signal.
    """
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(endpoint)
    print(s.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    while True:
        s.send_multipart(s.recv_multipart(copy=False), copy=False)


def tcp_echo_server() -> None:
    """A raw-socket peer on a free loopback port (prints the port, serves one connection).

    Each message is an 8-byte little-endian length and that many bytes, read into one
    reused buffer. With the length's top bit set the reply is one byte (an ack); otherwise
    the message's bytes are sent back (an echo).
    """
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    print(ls.getsockname()[1], flush=True)
    conn, _ = ls.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(64 << 20)
    mv = memoryview(buf)
    hdr = bytearray(8)
    while True:
        if _recv_exact(conn, memoryview(hdr), 8) is None:
            return
        n = int.from_bytes(hdr, "little")
        ack = bool(n >> 63)
        n &= (1 << 63) - 1
        if _recv_exact(conn, mv, n) is None:
            return
        conn.sendall(b"k" if ack else mv[:n])


def _recv_exact(conn: socket.socket, mv: memoryview, n: int) -> int | None:
    got = 0
    while got < n:
        r = conn.recv_into(mv[got:n])
        if not r:
            return None
        got += r
    return got


def spawn_helper(func: str, *args: Any) -> tuple[subprocess.Popen, str]:
    """Run ``perf/_common.<func>(*args)`` in a child Python; returns (process, first line)."""
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import _common; "
            f"_common.{func}(*{args!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        stop(proc)
        raise RuntimeError(f"{func} child exited before it was ready")
    return proc, line
