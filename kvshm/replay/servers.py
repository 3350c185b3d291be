"""Servers a replay starts for itself (``kvshm serve``, ``redis-server``): each waits
for its ready line, keeps the tail of its output, dies with the replay (even a SIGKILLed
one) and is always stopped by :meth:`Child.stop`."""

from __future__ import annotations

import logging
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque

from kvshm.replay.options import KiB, ReplayError, ReplayOptions

__all__ = ["Child", "die_with_parent", "start_kvshm", "start_redis", "free_port"]

log = logging.getLogger(__name__)


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """preexec_fn: the child gets SIGTERM if this process dies (even by SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG
    except Exception:
        pass


class Child:
    """A server process started by the replay: waits for its ready line, keeps the tail
    of its output, and is always stopped (SIGTERM, then SIGKILL) by :meth:`stop`."""

    def __init__(self, cmd: list[str], ready: re.Pattern[str], what: str,
                 timeout: float = 60.0, cwd: str | None = None,
                 env: dict[str, str] | None = None, stdin: bool = False) -> None:
        self.what = what
        self.cmd = cmd
        self.tail: deque[str] = deque(maxlen=40)
        self.match: re.Match[str] | None = None
        self._drain: threading.Thread | None = None
        # stdin=True: a pipe, closed first by stop() (a child that runs until EOF)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent,
                                     cwd=cwd, env=env)
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
        if p.stdin is not None and not p.stdin.closed:
            try:
                p.stdin.close()           # EOF: a child that waits for it leaves by itself
                p.wait(min(timeout, 10))
            except (OSError, subprocess.TimeoutExpired):
                pass
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


def start_kvshm(opts: ReplayOptions, ssd_dir: str | None = None
                 ) -> tuple[Child, str, str]:
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
    child = Child(cmd, _KVSHM_READY, "kvshm server", cwd=root)
    assert child.match is not None
    return child, child.match.group("endpoint"), child.match.group("pool")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_REDIS_READY = re.compile(r"Ready to accept connections")


def start_redis(exe: str, maxmemory: int, workdir: str) -> tuple[Child, str]:
    """A redis-server on a free loopback port: no persistence, ``maxmemory`` bytes,
    ``allkeys-lru``. Returns (child, "127.0.0.1:port")."""
    last: Exception | None = None
    for _ in range(3):        # the free port may be taken before redis binds it
        port = free_port()
        cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "yes",
               "--save", "", "--appendonly", "no", "--dir", workdir, "--logfile", "",
               "--daemonize", "no", "--maxmemory", str(maxmemory),
               "--maxmemory-policy", "allkeys-lru"]
        try:
            return Child(cmd, _REDIS_READY, "redis-server"), f"127.0.0.1:{port}"
        except ReplayError as exc:
            last = exc
            if "in use" not in str(exc):
                break
    raise ReplayError(str(last))
