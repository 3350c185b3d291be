"""``kvshm replay``: replay a real request trace against a store and check every byte.

For each request of the trace, in order: ``match_prefix`` of its block keys, a
``get_batch_into`` of the leading blocks found (each checked byte for byte), and a
``put_batch`` of every block after the first miss. A block's bytes derive from its hash
id (:mod:`kvshm.trace`), so nothing written has to be remembered to be checked.

The same command runs an exact LRU cache and an unbounded cache over the same requests
(:func:`kvshm.trace.simulate_lru`, :func:`kvshm.trace.unbounded_hits`), so the store's hit
rate is shown beside what its eviction should reach and what no cache can beat.

Backends: ``kvshm`` (its own server, or ``--address``; bytes through shared memory),
``kvshm-tcp`` (bytes in the messages), ``redis`` (a redis-server started here with
``maxmemory`` = the same capacity and ``allkeys-lru``, or ``--address``).

With ``--address`` the replay's keys (``kvshm-replay/<run id>/<hash id>``) are deleted
at the end; a server started here is stopped, whatever happens.

``--clients K`` runs K processes (spawned); request ``i`` of the trace goes to client
``i % K`` (round robin), each client replays its share in trace order, all at once.
Left free, the clients drift thousands of requests apart (one gets more CPU than the
others) and the store then sees another access order than the trace's; so by default a
client starts request ``i`` only once every request before ``i - 4K`` has finished
(``--window``; 0 lets them run free). Requests near each other in the trace still run
at the same time: a request may miss blocks that a request just before it is still
writing (the exact LRU assumes that one finished), and writes the same blocks again.

Python use::

    from kvshm.replay import ReplayOptions, run_replay
    result = run_replay(ReplayOptions(requests=1000, block_bytes=4096, pool_gib=0.01))
    print(result.summary["hit_rate"], result.summary["lru_hit_rate"])
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import math
import os
import pickle
import queue
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

if TYPE_CHECKING:  # numpy is imported lazily: `kvshm serve` builds this parser too
    import numpy as np

__all__ = ["ReplayOptions", "ReplayResult", "ReplayError", "run_replay", "add_parser",
           "format_summary", "BACKENDS"]

log = logging.getLogger(__name__)

BACKENDS = ("kvshm", "kvshm-tcp", "redis")
GiB = 1024 ** 3
KiB = 1024
#: Consecutive failed requests after which a replay gives up (the server is gone).
MAX_CONSECUTIVE_ERRORS = 20
#: With --clients K, request i waits for every request before i - 4K (``--window``).
DEFAULT_WINDOW_PER_CLIENT = 4
#: Error and mismatch messages kept for the summary.
KEEP_FIRST = 5


class ReplayError(RuntimeError):
    """The replay could not run (a server did not start, a worker died, ...)."""


class UsageError(ValueError):
    """A bad option; ``flag`` names it (``--pool-gib``)."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


# ---------------------------------------------------------------------- options

@dataclass
class ReplayOptions:
    """What to replay and against what; the CLI flags map one to one.

    Attributes
    ----------
    trace : str or None
        Trace file (JSON lines, gzip or not); None: the bundled Mooncake trace.
    requests : int or None
        Replay only the first ``requests`` requests.
    block_bytes : int
        Bytes of one block value (>= 16, a multiple of 8).
    pool_gib : float
        Capacity in GiB of the server started here (kvshm: its pool, with
        ``block_size`` = ``block_bytes`` rounded up to 4 KiB; redis: its maxmemory).
    clients : int
        Client processes sharing the replay (request i goes to client i % clients).
    backend : str
        "kvshm" (shm mover), "kvshm-tcp" (tcp mover) or "redis".
    address : str or None
        Use this running server (``host:port``) instead of starting one.
    timeout : float
        Seconds any one reply may take.
    progress : bool
        Show a progress bar (only when stderr is a terminal).
    shm_name : str or None
        Segment name of the kvshm server started here (default: unique).
    redis_server : str or None
        The redis-server executable (default: found on PATH).
    key_prefix : bytes or None
        Prefix of every key; default ``kvshm-replay/<run id>/`` so that two replays
        against one server never see each other's blocks.
    ssd_gib : float
        kvshm server started here: an SSD tier of this many GiB below its pool (0: none);
        the exact LRU then gets the pool and the SSD tier's capacity together.
    ssd_path : str or None
        Directory of that SSD tier's files (default: a temporary directory, removed).
    """

    trace: str | None = None
    requests: int | None = None
    block_bytes: int = 64 * KiB
    pool_gib: float = 1.0
    clients: int = 1
    backend: str = "kvshm"
    address: str | None = None
    timeout: float = 30.0
    progress: bool = True
    shm_name: str | None = None
    redis_server: str | None = None
    key_prefix: bytes | None = None
    window: int | None = None
    ssd_gib: float = 0.0
    ssd_path: str | None = None

    def window_for(self, k: int) -> int | None:
        """The pacing window for k clients (None: the clients run free)."""
        if self.window is None:
            return DEFAULT_WINDOW_PER_CLIENT * k
        return self.window or None

    def validate(self) -> None:
        """Raise :class:`UsageError` naming the first bad option."""
        if type(self.block_bytes) is not int or self.block_bytes < 16 or self.block_bytes % 8:
            raise UsageError("--block-bytes",
                             f"must be a multiple of 8 bytes, >= 16, got {self.block_bytes!r}")
        if not (self.pool_gib > 0 and math.isfinite(self.pool_gib)):
            raise UsageError("--pool-gib", f"must be > 0, got {self.pool_gib!r}")
        if type(self.clients) is not int or not 1 <= self.clients <= 256:
            raise UsageError("--clients", f"must be 1..256, got {self.clients!r}")
        if self.backend not in BACKENDS:
            raise UsageError("--backend", f"must be one of {', '.join(BACKENDS)}, "
                                          f"got {self.backend!r}")
        if self.requests is not None and (type(self.requests) is not int or self.requests < 1):
            raise UsageError("--requests", f"must be >= 1, got {self.requests!r}")
        if self.window is not None and (type(self.window) is not int or self.window < 0):
            raise UsageError("--window", f"must be >= 0, got {self.window!r}")
        if not self.timeout > 0:
            raise UsageError("--timeout", f"must be > 0, got {self.timeout!r}")
        if not (self.ssd_gib >= 0 and math.isfinite(self.ssd_gib)):
            raise UsageError("--ssd-gib", f"must be >= 0, got {self.ssd_gib!r}")
        if self.ssd_gib and (self.backend == "redis" or self.address is not None):
            raise UsageError("--ssd-gib", "is for a kvshm server started here (not with "
                                          "--backend redis or --address)")
        if self.address is not None:
            _split_address(self.address, "--address")
        if self.trace is not None and not os.path.isfile(self.trace):
            raise UsageError("--trace", f"no such file: {self.trace}")
        if self.backend == "redis":
            if importlib.util.find_spec("redis") is None:
                raise UsageError("--backend", "redis needs the redis Python package: "
                                              "pip install redis")
            if self.address is None and self.redis_executable() is None:
                raise UsageError("--backend", "redis needs redis-server on PATH "
                                              "(or --redis-server PATH, or --address)")

    def redis_executable(self) -> str | None:
        if self.redis_server:
            return self.redis_server if os.access(self.redis_server, os.X_OK) else None
        return shutil.which("redis-server")

    @property
    def server_block_bytes(self) -> int:
        """Block size of a kvshm server started here: block_bytes rounded up to 4 KiB."""
        return -(-self.block_bytes // (4 * KiB)) * 4 * KiB

    @property
    def pool_bytes(self) -> int:
        """Pool bytes of a kvshm server started here (as ServerConfig.pool_bytes)."""
        bs = self.server_block_bytes
        return int(self.pool_gib * GiB) // bs * bs


def _split_address(address: str, flag: str) -> tuple[str, int]:
    a = address
    if a.startswith("tcp://"):
        a = a[len("tcp://"):]
    host, sep, port = a.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(flag, f"must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------------- child processes

def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """preexec_fn: the child gets SIGTERM if this process dies (even by SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG
    except Exception:
        pass


class _Child:
    """A server process started by the replay: waits for its ready line, keeps the tail
    of its output, and is always stopped (SIGTERM, then SIGKILL) by :meth:`stop`."""

    def __init__(self, cmd: list[str], ready: re.Pattern[str], what: str,
                 timeout: float = 60.0, cwd: str | None = None) -> None:
        self.what = what
        self.cmd = cmd
        self.tail: deque[str] = deque(maxlen=40)
        self.match: re.Match[str] | None = None
        self._drain: threading.Thread | None = None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent, cwd=cwd)
        try:
            self._wait_ready(ready, timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, ready: re.Pattern[str], timeout: float) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReplayError(f"{self.what} not ready within {timeout:.0f} s "
                                      f"({' '.join(self.cmd)}): {self.output()}")
                if not sel.select(left):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    rc = self.proc.wait()
                    if buf:
                        self.tail.append(buf.decode(errors="replace"))
                    raise ReplayError(f"{self.what} exited ({rc}) before it was ready: "
                                      f"{self.output()}")
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace").rstrip()
                    self.tail.append(line)
                    m = ready.search(line)
                    if m:
                        self.match = m
                if self.match is not None:
                    break
        if buf:
            self.tail.append(buf.decode(errors="replace"))
        self._drain = threading.Thread(target=self._drain_output, args=(fd,),
                                       name=f"{self.what} output", daemon=True)
        self._drain.start()

    def _drain_output(self, fd: int) -> None:
        rest = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            rest += chunk
            *lines, rest = rest.split(b"\n")
            for raw in lines:
                self.tail.append(raw.decode(errors="replace").rstrip())

    def output(self, n: int = 10) -> str:
        lines = [ln for ln in list(self.tail)[-n:] if ln.strip()]
        return " | ".join(lines) if lines else "(no output)"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the child's process group, wait, SIGKILL after ``timeout``. Idempotent.

        Returns the exit status (negative: killed by that signal)."""
        p = self.proc
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s of SIGTERM; killing it",
                            self.what, timeout)
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
        if self._drain is not None:
            self._drain.join(5)
            self._drain = None
        if p.stdout is not None and not p.stdout.closed:
            p.stdout.close()
        return p.returncode


_KVSHM_READY = re.compile(r"kvshm ready: service (?P<endpoint>tcp://[^,\s]+).*?"
                          r"pool (?P<pool>\S+) ")


def _start_kvshm(opts: ReplayOptions, ssd_dir: str | None = None
                 ) -> tuple[_Child, str, str]:
    """A ``kvshm serve`` child sized for the replay; returns (child, address, segment)."""
    cmd = [sys.executable, "-m", "kvshm", "serve", "--service-port", "0", "--no-manage",
           "--prealloc-size", repr(float(opts.pool_gib)),
           "--block-size", str(opts.server_block_bytes // KiB), "--log-level", "WARNING",
           # The replay is this server's only tenant, and the exact LRU it is compared
           # with may use the whole pool for one request: no per-client limits.
           "--max-client-pending", "0", "--max-client-pinned", "0"]
    if opts.shm_name:
        cmd += ["--shm-name", opts.shm_name]
    if opts.ssd_gib and ssd_dir is not None:
        cmd += ["--ssd-path", ssd_dir, "--ssd-size", repr(float(opts.ssd_gib))]
    # `python -m kvshm` must import the kvshm this process runs, not a source checkout
    # that happens to be the working directory (its compiled core may not be built).
    import kvshm

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvshm.__file__)))
    child = _Child(cmd, _KVSHM_READY, "kvshm server", cwd=root)
    assert child.match is not None
    return child, child.match.group("endpoint"), child.match.group("pool")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_REDIS_READY = re.compile(r"Ready to accept connections")


def _start_redis(exe: str, maxmemory: int, workdir: str) -> tuple[_Child, str]:
    """A redis-server on a free loopback port: no persistence, ``maxmemory`` bytes,
    ``allkeys-lru``. Returns (child, "127.0.0.1:port")."""
    last: Exception | None = None
    for _ in range(3):        # the free port may be taken before redis binds it
        port = _free_port()
        cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "yes",
               "--save", "", "--appendonly", "no", "--dir", workdir, "--logfile", "",
               "--daemonize", "no", "--maxmemory", str(maxmemory),
               "--maxmemory-policy", "allkeys-lru"]
        try:
            return _Child(cmd, _REDIS_READY, "redis-server"), f"127.0.0.1:{port}"
        except ReplayError as exc:
            last = exc
            if "in use" not in str(exc):
                break
    raise ReplayError(str(last))


# ---------------------------------------------------------------------- backends

class _KvshmBackend:
    name = "kvshm"

    def __init__(self, address: str, transport: str, timeout: float) -> None:
        from kvshm.client import Client

        self.client = Client(address, transport=transport, timeout=timeout)
        self.transport = self.client.transport
        self.match = self.client.match_prefix
        self.read_into = self.client.get_batch_into
        self.write = self.client.put_batch

    def capacity_bytes(self) -> tuple[int, int]:
        """(pool bytes + SSD tier bytes, block size): the pool's from the server's
        HELLO, its SSD tier's (if any) from STATS."""
        pool = self.client.server_info["pool"]
        ssd = self.client.stats().get("tiers", {}).get("ssd", {}).get("capacity_bytes", 0)
        return int(pool["size"]) + int(ssd), int(pool["block_size"])

    def evictions(self) -> int:
        # Blocks removed to make room, as the simulator counts them: LRU evictions, plus
        # the old copies of keys being rewritten that a full pool freed first
        # (Store._allocate); the simulator evicts those too, a little earlier.
        s = self.client.stats()
        return int(s["evictions"]) + int(s.get("replaced_early", 0))

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.client.delete(keys)

    def close(self) -> None:
        self.client.close()


class _RedisBackend:
    name = "redis"
    transport = "tcp"

    def __init__(self, address: str, timeout: float) -> None:
        import redis

        host, port = _split_address(address, "--address")
        self.r = redis.Redis(host=host, port=port, socket_timeout=timeout,
                             socket_connect_timeout=timeout)
        self.r.ping()

    def match(self, keys: Sequence[bytes]) -> int:
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)          # EXISTS does not touch the LRU clock, as MATCH_PREFIX
        n = 0
        for found in pipe.execute():
            if not found:
                break
            n += 1
        return n

    def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int]:
        sizes = []
        values: list[Any] = self.r.mget(keys)  # type: ignore[assignment]
        for v, out in zip(values, outs):
            if v is None:
                sizes.append(-1)
                continue
            if len(v) <= len(out):
                out[:len(v)] = v
            sizes.append(len(v))
        return sizes

    def write(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> None:
        self.r.mset(dict(zip(keys, values)))

    def maxmemory(self) -> int:
        try:
            conf: Any = self.r.config_get("maxmemory")
            return int(conf.get("maxmemory", 0))
        except Exception:            # CONFIG may be renamed or refused
            return 0

    def evictions(self) -> int:
        return int(self.r.info("stats")["evicted_keys"])

    def delete(self, keys: Sequence[bytes]) -> int:
        return int(self.r.unlink(*keys))

    def close(self) -> None:
        self.r.close()


@dataclass(frozen=True)
class _BackendSpec:
    backend: str
    address: str
    timeout: float

    def open(self) -> Any:
        if self.backend == "redis":
            return _RedisBackend(self.address, self.timeout)
        return _KvshmBackend(self.address, "shm" if self.backend == "kvshm" else "tcp",
                             self.timeout)


# ---------------------------------------------------------------------- one client's share

@dataclass
class _Share:
    """What one client measured: per request (in its order) and totals."""

    index: list[int] = field(default_factory=list)     # request index in the trace
    matched: list[int] = field(default_factory=list)   # leading blocks match_prefix found
    blocks: list[int] = field(default_factory=list)
    moved: list[int] = field(default_factory=list)     # bytes read + written
    latency: list[float] = field(default_factory=list)  # s; NaN for a failed request
    t_end: list[float] = field(default_factory=list)   # time.monotonic() at the end
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    lost: int = 0          # matched, then gone when read (evicted in between)
    mismatches: int = 0
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)
    first_mismatches: list[str] = field(default_factory=list)
    gave_up: str | None = None
    paced_s: float = 0.0   # seconds spent waiting for the other clients (--window)


class _Replayer:
    """Replays requests through one backend with reusable, preallocated buffers."""

    def __init__(self, backend: Any, block_bytes: int, key_prefix: bytes) -> None:
        import numpy as np

        self.np = np
        self.be = backend
        self.B = block_bytes
        self.words = block_bytes // 8
        self.prefix = key_prefix
        self._r, self._rv = self._grow(None, 64)
        self._w, self._wv = self._grow(None, 64)

    def _grow(self, old: "np.ndarray | None", n: int) -> tuple["np.ndarray", list[memoryview]]:
        rows = max(n, 2 * (0 if old is None else old.shape[0]))
        buf = self.np.empty((rows, self.words), dtype=self.np.uint64)
        return buf, [memoryview(buf[i]).cast("B") for i in range(rows)]

    def run(self, items: Sequence[tuple[int, Sequence[int]]],
            progress: Callable[[int], None] | None = None,
            pacer: "_Pacer | None" = None) -> _Share:
        from kvshm.trace import check_blocks, fill_blocks, poison_blocks

        np = self.np
        be, B, prefix = self.be, self.B, self.prefix
        sh = _Share()
        consecutive = 0
        clock, mono = time.perf_counter, time.monotonic
        for idx, ids in items:
            if pacer is not None:
                pacer.wait(idx)
            n = len(ids)
            m = rd = 0
            moved = 0
            t0 = clock()
            try:
                keys = [b"%s%d" % (prefix, h) for h in ids]
                m = be.match(keys) if n else 0
                if m:
                    if m > self._r.shape[0]:
                        self._r, self._rv = self._grow(self._r, m)
                    rows = self._r[:m]
                    ida = np.array(ids[:m], dtype=np.uint64)
                    poison_blocks(rows, ida)
                    sizes = np.asarray(be.read_into(keys[:m], self._rv[:m]), dtype=np.int64)
                    got = sizes >= 0
                    rd = int(got.argmin()) if not got.all() else m
                    sh.lost += m - rd
                    sh.blocks_read += int(got.sum())
                    nbytes = int(sizes[got].sum())
                    sh.bytes_read += nbytes
                    moved += nbytes
                    ok = check_blocks(rows, ida) & (sizes == B)
                    bad = np.flatnonzero(got & ~ok)
                    if len(bad):
                        sh.mismatches += len(bad)
                        for j in bad[:KEEP_FIRST - len(sh.first_mismatches)]:
                            sh.first_mismatches.append(
                                f"request {idx}: block {ids[j]} (key {keys[j]!r}) read "
                                f"{int(sizes[j])} bytes that are not its bytes")
                if rd < n:
                    k = n - rd
                    if k > self._w.shape[0]:
                        self._w, self._wv = self._grow(self._w, k)
                    fill_blocks(self._w[:k], np.array(ids[rd:], dtype=np.uint64))
                    be.write(keys[rd:], self._wv[:k])
                    sh.bytes_written += k * B
                    moved += k * B
            except Exception as exc:
                sh.errors += 1
                consecutive += 1
                if len(sh.first_errors) < KEEP_FIRST:
                    sh.first_errors.append(f"request {idx}: {type(exc).__name__}: {exc}")
                lat = math.nan
                if consecutive >= MAX_CONSECUTIVE_ERRORS:
                    sh.gave_up = (f"gave up after {consecutive} failed requests in a row "
                                  f"(last: {type(exc).__name__}: {exc})")
            else:
                consecutive = 0
                lat = clock() - t0
            sh.index.append(idx)
            sh.matched.append(m)
            sh.blocks.append(n)
            sh.moved.append(moved)
            sh.latency.append(lat)
            sh.t_end.append(mono())
            if pacer is not None:
                pacer.done(idx)
            if progress is not None:
                progress(1)
            if sh.gave_up:
                break
        return sh


# ---------------------------------------------------------------------- K client processes

class _Pacer:
    """Keeps K clients near trace order: request i starts only once every request
    before ``i - window`` has finished.

    ``shared[w]`` is the index of client w's next unfinished request (its requests are
    w, w + K, ...), so "every request before x has finished" is ``min(shared) >= x``.
    The client holding the minimum never waits, so the clients cannot deadlock.
    """

    def __init__(self, shared: Any, wid: int, k: int, window: int, parent: int) -> None:
        self.shared = shared
        self.wid = wid
        self.k = k
        self.window = window
        self.parent = parent
        self.waited = 0.0

    def wait(self, idx: int) -> None:
        floor = idx - self.window
        shared = self.shared
        if floor <= 0 or min(shared[:]) >= floor:
            return
        t0 = time.monotonic()
        spins = 0
        while min(shared[:]) < floor:
            spins += 1
            if spins % 5000 == 0 and os.getppid() != self.parent:
                raise SystemExit(1)
            time.sleep(0.0001 if spins < 100 else 0.0005)
        self.waited += time.monotonic() - t0

    def done(self, idx: int) -> None:
        self.shared[self.wid] = idx + self.k

    def finish(self) -> None:
        self.shared[self.wid] = 1 << 62


def _remove_stale_handoffs() -> None:
    """Remove the request hand-off directories of replays that were killed (SIGKILL
    leaves no chance to clean up): ``$TMPDIR/kvshm-replay-<pid>-*`` of dead pids."""
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for n in names:
        parts = n.split("-")
        if len(parts) < 4 or parts[:2] != ["kvshm", "replay"] or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue                      # its replay is still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(os.path.join(base, n), ignore_errors=True)


def _worker_main(wid: int, k: int, spec: _BackendSpec, requests_file: str,
                 block_bytes: int, key_prefix: bytes, q: Any, go: Any,
                 parent: int, shared: Any, window: int | None) -> None:
    """Body of one spawned client process: load its share (requests wid, wid + k, ...),
    connect, say ready, wait for go, replay."""
    _die_with_parent()
    if os.getppid() != parent:      # the parent died before prctl took hold
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the parent decides; it sends SIGTERM

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    be = None
    pacer = None if window is None else _Pacer(shared, wid, k, window, parent)
    try:
        with open(requests_file, "rb") as f:
            requests = pickle.load(f)
        items = [(i, requests[i]) for i in range(wid, len(requests), k)]
        del requests
        be = spec.open()
        q.put(("ready", wid, None))
        while not go.wait(1.0):
            if os.getppid() != parent:
                return
        last = [time.monotonic(), 0]

        def progress(n: int) -> None:
            last[1] += n
            now = time.monotonic()
            if now - last[0] >= 0.2:
                q.put(("progress", wid, last[1]))
                last[0], last[1] = now, 0

        try:
            sh = _Replayer(be, block_bytes, key_prefix).run(items, progress, pacer)
        finally:
            if pacer is not None:
                pacer.finish()      # never hold the others back, whatever happened
        if pacer is not None:
            sh.paced_s = pacer.waited
        if last[1]:
            q.put(("progress", wid, last[1]))
        be.close()
        be = None
        q.put(("done", wid, sh))
    except SystemExit:
        pass
    except BaseException:
        q.put(("fail", wid, traceback.format_exc(limit=6)))
    finally:
        if be is not None:
            with contextlib.suppress(Exception):
                be.close()


def _run_processes(spec: _BackendSpec, requests: Sequence[Sequence[int]], k: int,
                   block_bytes: int, key_prefix: bytes,
                   progress: Callable[[int], None] | None, window: int | None
                   ) -> tuple[list[_Share], float, float]:
    """Run K spawned clients, request i to client i % K. Returns shares, t_go, t_end.

    The requests go to the clients in a file, not in the spawn arguments: a child that
    dies before reading a spawn payload larger than a pipe would block ``start()``
    forever."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    go = ctx.Event()
    shared = ctx.Array("q", list(range(k)), lock=False)   # next unfinished request each
    procs = []
    shares: dict[int, _Share] = {}
    _remove_stale_handoffs()
    tmpdir = tempfile.mkdtemp(prefix=f"kvshm-replay-{os.getpid()}-")
    try:
        requests_file = os.path.join(tmpdir, "requests.pickle")
        with open(requests_file, "wb") as f:
            pickle.dump([list(r) for r in requests], f, protocol=pickle.HIGHEST_PROTOCOL)
        for w in range(k):
            p = ctx.Process(target=_worker_main, name=f"kvshm-replay-{w}", daemon=True,
                            args=(w, k, spec, requests_file, block_bytes, key_prefix, q,
                                  go, os.getpid(), shared, window))
            p.start()
            procs.append(p)
        ready: set[int] = set()
        t_go = t_done = 0.0
        suspect: dict[int, int] = {}
        while len(shares) < k:
            try:
                kind, wid, payload = q.get(timeout=0.5)
            except queue.Empty:
                for w, p in enumerate(procs):
                    if w not in shares and p.exitcode is not None:
                        suspect[w] = suspect.get(w, 0) + 1
                        if suspect[w] >= 3:     # its last message would have arrived
                            raise ReplayError(f"client process {w} died (exit status "
                                              f"{p.exitcode}) before it reported")
                continue
            if kind == "ready":
                ready.add(wid)
                if len(ready) == k:
                    t_go = time.monotonic()
                    go.set()
            elif kind == "progress":
                if progress is not None:
                    progress(payload)
            elif kind == "done":
                shares[wid] = payload
                t_done = time.monotonic()
            else:
                raise ReplayError(f"client process {wid} failed:\n{payload}")
        for p in procs:
            p.join(10)
        return [shares[w] for w in range(k)], t_go, t_done
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for p in procs:
            p.close()
        q.close()
        q.join_thread()
        shutil.rmtree(tmpdir, ignore_errors=True)


# ---------------------------------------------------------------------- the whole replay

def _delete_keys(backend: Any, requests: Sequence[Sequence[int]], prefix: bytes,
                 batch: int = 20000) -> None:
    """Delete every key the replay may have written (best effort)."""
    ids = sorted({h for r in requests for h in r})
    try:
        for i in range(0, len(ids), batch):
            backend.delete([b"%s%d" % (prefix, h) for h in ids[i:i + batch]])
    except Exception as exc:
        log.warning("could not delete the replay's keys (%s: %s)", type(exc).__name__, exc)


@dataclass
class ReplayResult:
    """A finished replay: ``summary`` (what ``--json`` prints) and per-request series
    for plots, in completion order."""

    summary: dict[str, Any]
    series: dict[str, Any]

    @property
    def ok(self) -> bool:
        """No mismatch and no error."""
        return not (self.summary["mismatches"] or self.summary["errors"])


@contextlib.contextmanager
def _signals_as_exit() -> Iterator[None]:
    """SIGTERM/SIGHUP raise SystemExit (so every ``finally`` runs) while replaying."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _shielded() -> Iterator[None]:
    """Hold off SIGINT/SIGTERM/SIGHUP while cleaning up (every wait in it is bounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class _Progress:
    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self.bar = None
        if enabled and sys.stderr is not None and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="req", desc=desc, file=sys.stderr,
                            dynamic_ncols=True, leave=False, mininterval=0.2)

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_replay(opts: ReplayOptions, requests: Sequence[Sequence[int]] | None = None
               ) -> ReplayResult:
    """Run one replay (see the module docstring) and return its figures.

    Parameters
    ----------
    opts : ReplayOptions
    requests : list of list of int, optional
        Block ids of each request; default: loaded from ``opts.trace``.

    Raises
    ------
    UsageError
        A bad option (names the flag), or a pool too small for the longest request.
    ReplayError
        A server or a client process failed to start or died.
    kvshm.trace.TraceError
        The trace cannot be read.

    Every server and process started here is stopped before this returns or raises
    (also on KeyboardInterrupt, and on SIGTERM/SIGHUP when called in the main thread).
    """
    import numpy as np

    from kvshm.trace import load_trace, simulate_lru, unbounded_hits

    opts.validate()
    if requests is None:
        requests = load_trace(opts.trace, opts.requests)
    elif opts.requests is not None:
        requests = requests[:opts.requests]
    if not requests:
        raise UsageError("--trace", "the trace has no requests")
    B = opts.block_bytes
    k = min(opts.clients, len(requests))
    prefix = opts.key_prefix if opts.key_prefix is not None else (
        b"kvshm-replay/%s/" % os.urandom(4).hex().encode())
    longest = max(len(r) for r in requests)
    owned = opts.address is None
    if owned:
        if B > opts.pool_bytes or opts.pool_bytes // opts.server_block_bytes < longest:
            raise UsageError("--pool-gib", f"a pool of {opts.pool_gib:g} GiB holds "
                             f"{opts.pool_bytes // opts.server_block_bytes} blocks of "
                             f"{B} bytes; the longest request has {longest} blocks")

    children: list[_Child] = []
    tmpdir: str | None = None
    probe: Any = None
    bar = _Progress(len(requests), opts.progress, f"replay {opts.backend}")
    try:
        with _signals_as_exit():
            segment = None
            if opts.backend == "redis":
                if owned:
                    exe = opts.redis_executable()
                    assert exe is not None
                    tmpdir = tempfile.mkdtemp(prefix="kvshm-replay-redis-")
                    child, address = _start_redis(exe, opts.pool_bytes, tmpdir)
                    children.append(child)
                else:
                    address = opts.address  # type: ignore[assignment]
            else:
                if owned:
                    ssd_dir = opts.ssd_path
                    if opts.ssd_gib and ssd_dir is None:
                        tmpdir = tempfile.mkdtemp(prefix="kvshm-replay-ssd-")
                        ssd_dir = os.path.join(tmpdir, "ssd")
                    child, address, segment = _start_kvshm(opts, ssd_dir)
                    children.append(child)
                else:
                    address = opts.address  # type: ignore[assignment]
            spec = _BackendSpec(opts.backend, address, opts.timeout)
            if k == 1:
                probe = spec.open()
            else:   # stats only: no need to map the pool here
                probe = _BackendSpec("redis" if opts.backend == "redis" else "kvshm-tcp",
                                     address, opts.timeout).open()
            # Capacity in blocks of the store actually used, for the LRU simulator.
            if opts.backend == "redis":
                mm = probe.maxmemory() if not owned else opts.pool_bytes
                cap_bytes = mm or opts.pool_bytes
                block_size = opts.server_block_bytes
                capacity = cap_bytes // block_size
            else:
                cap_bytes, block_size = probe.capacity_bytes()
                capacity = (cap_bytes // block_size) // -(-B // block_size)
            if capacity < longest:
                raise UsageError("--pool-gib" if owned else "--address",
                                 f"the store holds {capacity} blocks of {B} bytes; the "
                                 f"longest request has {longest} blocks")
            lru = simulate_lru(requests, capacity)
            bound = unbounded_hits(requests)
            ev0 = probe.evictions()
            transport = probe.transport if k == 1 else (
                "shm" if opts.backend == "kvshm" else "tcp")
            if k == 1:
                t_go = time.monotonic()
                shares = [_Replayer(probe, B, prefix).run(list(enumerate(requests)), bar)]
                t_done = time.monotonic()
            else:
                shares, t_go, t_done = _run_processes(spec, requests, k, B, prefix, bar,
                                                      opts.window_for(k))
            evictions = probe.evictions() - ev0
            if not owned:       # leave someone else's server as we found it
                _delete_keys(probe, requests, prefix)
    finally:
        with _shielded():
            bar.close()
            if probe is not None:
                with contextlib.suppress(Exception):
                    probe.close()
            for c in children:
                rc = c.stop()
                if rc not in (0, None) and rc != -signal.SIGTERM:
                    log.warning("%s exited with status %s: %s", c.what, rc, c.output())
            if segment is not None:
                from kvshm import segments

                with contextlib.suppress(OSError):
                    segments.cleanup(segment)   # only if its server died holding it
            if tmpdir is not None:
                shutil.rmtree(tmpdir, ignore_errors=True)

    # ---- merge
    def cat(name: str, dtype: Any) -> "np.ndarray":
        return np.concatenate([np.asarray(getattr(s, name), dtype=dtype) for s in shares])

    index = cat("index", np.int64)
    matched = cat("matched", np.int64)
    nblocks = cat("blocks", np.int64)
    moved = cat("moved", np.int64)
    latency = cat("latency", np.float64)
    t_end = cat("t_end", np.float64)
    order = np.argsort(t_end, kind="stable")
    skew = int(np.abs(index[order] - np.arange(len(index))).max()) if len(index) else 0
    seconds = max(t_done - t_go, 1e-9)
    blocks = int(nblocks.sum())
    hits = int(matched.sum())
    tot = {f: sum(getattr(s, f) for s in shares)
           for f in ("bytes_read", "bytes_written", "blocks_read", "lost", "mismatches",
                     "errors")}
    good = latency[~np.isnan(latency)]
    lat_ms = good * 1e3
    replayed = len(index)
    lru_hits = int(sum(lru.per_request[i] for i in index))
    bound_hits = int(sum(bound.per_request[i] for i in index))
    lru_blocks = blocks if blocks else 1
    summary: dict[str, Any] = {
        "backend": opts.backend,
        "transport": transport,
        "clients": k,
        "split": "round-robin: request i to client i % clients" if k > 1 else "one client",
        "window": opts.window_for(k) if k > 1 else None,
        "paced_seconds": sum(s.paced_s for s in shares),
        "max_order_skew": skew,
        "trace": opts.trace or "bundled:conversation_trace.jsonl.gz",
        "requests": replayed,
        "requests_asked": len(requests),
        "blocks": blocks,
        "hits": hits,
        "hit_rate": hits / blocks if blocks else 0.0,
        "lru_hit_rate": lru_hits / lru_blocks if blocks else 0.0,
        "bound_hit_rate": bound_hits / lru_blocks if blocks else 0.0,
        "lost": tot["lost"],
        "blocks_read": tot["blocks_read"],
        "mismatches": tot["mismatches"],
        "errors": tot["errors"],
        "bytes_read": tot["bytes_read"],
        "bytes_written": tot["bytes_written"],
        "seconds": seconds,
        "gbps": (tot["bytes_read"] + tot["bytes_written"]) / seconds / 1e9,
        "requests_per_s": replayed / seconds,
        "p50_ms": float(np.percentile(lat_ms, 50)) if len(lat_ms) else None,
        "p99_ms": float(np.percentile(lat_ms, 99)) if len(lat_ms) else None,
        "evictions": evictions,
        "lru_evictions": lru.evictions,
        "block_bytes": B,
        "block_size": block_size,
        "capacity_bytes": cap_bytes,
        "capacity_blocks": capacity,
        "address": None if owned else opts.address,
        "first_errors": [e for s in shares for e in s.first_errors][:KEEP_FIRST],
        "first_mismatches": [e for s in shares for e in s.first_mismatches][:KEEP_FIRST],
        "gave_up": next((s.gave_up for s in shares if s.gave_up), None),
    }
    series = {
        "index": index[order], "matched": matched[order], "blocks": nblocks[order],
        "moved": moved[order], "t_end": t_end[order] - t_go,
        "lru": np.asarray(lru.per_request, dtype=np.int64)[index[order]],
        "bound": np.asarray(bound.per_request, dtype=np.int64)[index[order]],
    }
    return ReplayResult(summary, series)


# ---------------------------------------------------------------------- output

def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def format_summary(s: dict[str, Any]) -> str:
    """The human-readable summary of a replay."""
    pct = lambda v: f"{100 * v:.2f} %"  # noqa: E731
    who = f"{s['backend']} ({s['transport']})"
    lines = [
        f"kvshm replay: {s['requests']} requests, {s['blocks']} blocks of {s['block_bytes']} "
        f"bytes, backend {who}, {s['clients']} client{'s' if s['clients'] > 1 else ''}"
        + (f" ({s['split']})" if s["clients"] > 1 else ""),
        f"  capacity   {s['capacity_bytes'] / GiB:.4g} GiB = {s['capacity_blocks']} blocks "
        f"(block size {s['block_size']} bytes)",
        f"  hit rate   {pct(s['hit_rate'])}   exact LRU {pct(s['lru_hit_rate'])}   "
        f"unbounded (bound) {pct(s['bound_hit_rate'])}",
        f"  evictions  {s['evictions']} (exact LRU {s['lru_evictions']})",
        f"  checked    {s['blocks_read']} blocks read, {s['mismatches']} mismatches, "
        f"{s['errors']} errors" + (f", {s['lost']} lost between match and read"
                                    if s["lost"] else ""),
        f"  moved      {_gb(s['bytes_read'])} read + {_gb(s['bytes_written'])} written in "
        f"{s['seconds']:.2f} s = {s['gbps']:.2f} GB/s ({s['requests_per_s']:.0f} requests/s)",
        (f"  latency    p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms per request"
         if s["p50_ms"] is not None else "  latency    n/a (no request succeeded)"),
    ]
    if s["clients"] > 1:
        pacing = (f"window {s['window']} requests, {s['paced_seconds']:.2f} s spent waiting "
                  "(all clients)" if s["window"] else "no window: clients run free")
        lines.append(f"  order      requests finished at most {s['max_order_skew']} places "
                     f"from trace order; {pacing}")
    for e in s["first_mismatches"]:
        lines.append(f"  MISMATCH   {e}")
    for e in s["first_errors"]:
        lines.append(f"  ERROR      {e}")
    if s["gave_up"]:
        lines.append(f"  STOPPED    {s['gave_up']}")
    return "\n".join(lines)


def _plot(path: str, r: ReplayResult) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s, ser = r.summary, r.series
    n = len(ser["index"])
    windows = max(1, min(100, n // 10 or 1))
    edges = np.linspace(0, n, windows + 1).astype(int)
    x, hr, lru, bound, gbps = [], [], [], [], []
    for a, b in zip(edges[:-1], edges[1:]):
        if b <= a:
            continue
        blk = max(int(ser["blocks"][a:b].sum()), 1)
        x.append(b)
        hr.append(100 * ser["matched"][a:b].sum() / blk)
        lru.append(100 * ser["lru"][a:b].sum() / blk)
        bound.append(100 * ser["bound"][a:b].sum() / blk)
        t0 = ser["t_end"][a - 1] if a > 0 else 0.0
        dt = max(float(ser["t_end"][b - 1] - t0), 1e-9)
        gbps.append(ser["moved"][a:b].sum() / dt / 1e9)
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    ax1.plot(x, hr, label=f"{s['backend']} ({100 * s['hit_rate']:.1f} %)")
    ax1.plot(x, lru, label=f"exact LRU ({100 * s['lru_hit_rate']:.1f} %)", linestyle=":")
    ax1.plot(x, bound, label=f"unbounded ({100 * s['bound_hit_rate']:.1f} %)",
             linestyle="--", alpha=0.7)
    ax1.set_ylabel("prefix hit rate (%)")
    ax1.legend(loc="best", fontsize="small")
    ax1.grid(alpha=0.3)
    ax1.set_title(f"kvshm replay: {s['backend']} ({s['transport']}), {s['clients']} "
                  f"client(s), {s['block_bytes']} B blocks, {s['capacity_blocks']} blocks")
    ax2.plot(x, gbps, color="tab:green")
    ax2.set_ylabel("throughput (GB/s)")
    ax2.set_xlabel("requests completed")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- CLI

_SIZE = re.compile(r"^\s*(\d+)\s*([kKmM]i?[bB]?|[bB])?\s*$")


def _block_bytes_t(text: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 65536, 64K)")
    v = int(m.group(1))
    unit = (m.group(2) or "").lower()
    if unit.startswith("k"):
        v *= KiB
    elif unit.startswith("m"):
        v *= KiB * KiB
    if v < 16 or v % 8:
        raise argparse.ArgumentTypeError(f"{text!r}: a block must be a multiple of 8 "
                                         "bytes, >= 16")
    return v


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``kvshm replay`` to the ``kvshm`` command's subparsers."""
    from kvshm.cli import nonneg_float, nonneg_int, pos_float, pos_int

    p = sub.add_parser(
        "replay", help="replay a request trace against a store and check every byte",
        description=(
            "Replay a KV-cache request trace: per request, match_prefix of its block keys, "
            "get_batch_into of the leading hits (checked byte for byte), put_batch of the "
            "rest. Prints the hit rate beside an exact LRU over the same capacity and the "
            "unbounded bound, the bytes moved, GB/s and latency. Exits 1 on any mismatch "
            "or error. With --clients K, request i goes to client process i % K."))
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="trace file, JSON lines with hash_ids, gzip or not (default: the "
                        "bundled Mooncake FAST'25 conversation trace)")
    p.add_argument("--requests", type=pos_int, default=None, metavar="N",
                   help="replay only the first N requests (default: all)")
    p.add_argument("--block-bytes", type=_block_bytes_t, default=64 * KiB, metavar="B",
                   help="bytes of one block value, a multiple of 8 (64K, 1M allowed; "
                        "default 65536)")
    p.add_argument("--pool-gib", type=pos_float, default=1.0, metavar="G",
                   help="capacity in GiB of the server started here: kvshm's pool (block "
                        "size = B rounded up to 4 KiB) or redis's maxmemory (default 1)")
    p.add_argument("--ssd-gib", type=nonneg_float, default=0.0, metavar="G",
                   help="kvshm server started here: an SSD tier of G GiB below the pool "
                        "(the exact LRU gets pool + SSD capacity; default 0: none)")
    p.add_argument("--ssd-path", default=None, metavar="DIR",
                   help="directory of that SSD tier's files (default: a temporary one)")
    p.add_argument("--clients", type=pos_int, default=1, metavar="K",
                   help="client processes sharing the replay, round robin (default 1)")
    p.add_argument("--window", type=nonneg_int, default=None, metavar="W",
                   help="with --clients K: request i starts only once every request before "
                        "i - W has finished, so the clients stay near trace order "
                        f"(default {DEFAULT_WINDOW_PER_CLIENT}*K; 0: the clients run free)")
    p.add_argument("--backend", choices=BACKENDS, default="kvshm",
                   help="kvshm (bytes through shared memory), kvshm-tcp (bytes in the "
                        "messages) or redis (default kvshm)")
    p.add_argument("--address", default=None, metavar="A",
                   help="host:port of a running server to use instead of starting one")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw hit rate and throughput over the replay (needs matplotlib: "
                        "pip install 'kvshm[plot]')")
    p.add_argument("--timeout", type=pos_float, default=30.0,
                   help="seconds any one reply may take (default 30)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--shm-name", default=None,
                   help="segment name of the kvshm server started here (default: unique)")
    p.add_argument("--redis-server", default=None, metavar="PATH",
                   help="redis-server executable (default: the one on PATH)")
    p.set_defaults(func=cmd_replay, parser=p)
    return p


def cmd_replay(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``kvshm replay``: exit 0 when every read matched and no request failed, 1 when
    not (or the replay could not run), 2 for a bad flag."""
    from kvshm.errors import KvshmError
    from kvshm.trace import TraceError

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("argument --plot: needs matplotlib, which is not installed "
                         "(pip install 'kvshm[plot]' or pip install matplotlib)")
        d = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(d):
            parser.error(f"argument --plot: no such directory: {d}")
    if args.ssd_path is not None and not args.ssd_gib:
        parser.error("argument --ssd-path: needs --ssd-gib (the SSD tier's size)")
    if args.shm_name is not None:
        bare = args.shm_name.lstrip("/")
        if not bare or "/" in bare or len(bare) > 250:
            parser.error(f"argument --shm-name: {args.shm_name!r} is not a valid POSIX "
                         "shared-memory name (1-250 characters, no '/')")
    opts = ReplayOptions(trace=args.trace, requests=args.requests,
                         block_bytes=args.block_bytes, pool_gib=args.pool_gib,
                         clients=args.clients, backend=args.backend, address=args.address,
                         timeout=args.timeout, progress=not args.no_progress,
                         shm_name=args.shm_name, redis_server=args.redis_server,
                         window=args.window, ssd_gib=args.ssd_gib, ssd_path=args.ssd_path)
    try:
        result = run_replay(opts)
    except KeyboardInterrupt:
        print("kvshm replay: interrupted; every server and client it started is stopped",
              file=sys.stderr)
        return 130
    except UsageError as exc:
        parser.error(str(exc))
    except TraceError as exc:
        parser.error(f"argument --trace: {exc}")
    except (ReplayError, KvshmError, OSError) as exc:
        print(f"kvshm replay: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if type(exc).__module__.startswith("redis"):
            print(f"kvshm replay: redis: {exc}", file=sys.stderr)
            return 1
        raise
    if args.json:
        print(json.dumps(result.summary, sort_keys=True))
    else:
        print(format_summary(result.summary))
    if args.plot is not None:
        _plot(args.plot, result)
        if not args.json:
            print(f"  plot       {args.plot}")
    sys.stdout.flush()
    return 0 if result.ok else 1
