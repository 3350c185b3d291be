"""Real kvshm server processes for tests: free ports, unique segments, readiness, cleanup.

``ServerProcess`` runs ``python -m kvshm serve`` with ``--service-port 0`` and
``--manage-port 0`` (the kernel picks free ports, no race), a segment name under the test
prefix, and waits for the ready line on stdout (never a sleep). ``stop()`` sends SIGTERM,
waits, kills on timeout, and checks that the segment is gone.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

TEST_PREFIX = "kvshm-test-"
_READY = re.compile(r"kvshm ready: service tcp://(?P<host>[^,]+):(?P<port>\d+)"
                    r"(?:, ipc (?P<ipc>[^,]+))?(?:, manage http://[^:]+:(?P<mport>\d+))?")


def raw_hello(sock: Any, address: str, token: bytes | None = None) -> dict[str, Any]:
    """Say HELLO on a raw DEALER socket connected to ``address`` (nonce, and the door
    and operator tokens found as a client of the same user finds them); returns the
    reply body (``epoch``, ``session``)."""
    import msgpack

    from kvshm.security import find_operator_token, find_token
    from kvshm.zmq_ctrl.channel import endpoint_of
    from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op, decode_reply

    if token is None:
        token = find_token(endpoint_of(address))
    body: dict[str, Any] = {"nonce": os.urandom(16)}
    if token is not None:
        body["token"] = token
    op = find_operator_token(endpoint_of(address))
    if op is not None:
        body["operator_token"] = op
    sock.send(msgpack.packb([PROTOCOL_VERSION, Op.HELLO, 0, 0, body], use_bin_type=True))
    assert sock.poll(5000), "no reply to HELLO"
    st, _, reply = decode_reply(sock.recv_multipart()[0])
    assert st == 0, reply
    return reply


def bearer(address: str, operator: bool = False) -> dict[str, str]:
    """The management port's Authorization header for the server at ``address`` (its
    door token, or with ``operator`` its operator token for POST /purge, found as a
    client of the same user finds it)."""
    from kvshm.security import find_operator_token, find_token
    from kvshm.zmq_ctrl.channel import endpoint_of

    tok = (find_operator_token if operator else find_token)(endpoint_of(address))
    assert tok is not None, f"no token file for {address}"
    return {"Authorization": f"Bearer {tok.hex()}"}


def unique_shm_name(tag: str = "") -> str:
    return f"{TEST_PREFIX}{os.getpid()}-{tag}{uuid.uuid4().hex[:8]}"


def shm_segments(prefix: str) -> list[str]:
    """Names (without leading ``/``) of the segments in /dev/shm that start with ``prefix``."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:  # no /dev/shm: nothing can leak there
        return []


def segment_exists(name: str) -> bool:
    return os.path.exists("/dev/shm/" + name.lstrip("/"))


def _dump_stacks(pid: int) -> str:
    """Python stacks of a hung process, when py-spy is installed (a debugging aid)."""
    import shutil

    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        return ""
    r = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                       timeout=30)
    return "\nstacks:\n" + r.stdout + r.stderr


class ServerProcess:
    """A ``kvshm serve`` child process.

    Parameters
    ----------
    *flags : str
        Extra command-line flags (``"--prealloc-size", "0.125"``, ...).
    service_port : int
        0 (default) for a free port, or a fixed one (to restart on the same port).
    ready_timeout : float
        Seconds to wait for the ready line.
    listener : str, optional
        ``--listener`` (``"libzmq"``, ``"native"``); None: the server's default (which
        ``$KVSHM_LISTENER`` in the environment of the test run chooses).
    """

    def __init__(self, *flags: str, service_port: int = 0, prealloc_size: float = 0.125,
                 shm_name: str | None = None, ready_timeout: float = 30.0,
                 env: dict[str, str] | None = None,
                 launcher: list[str] | None = None, listener: str | None = None) -> None:
        self.shm_name = shm_name or unique_shm_name()
        if listener is not None:
            flags = (*flags, "--listener", listener)
        cmd = [*(launcher or [sys.executable, "-m", "kvshm"]), "serve", "--service-port", str(service_port),
               "--manage-port", "0", "--prealloc-size", str(prealloc_size),
               "--shm-name", self.shm_name, "--log-level", "WARNING", *flags]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, **(env or {})},
                                     start_new_session=True)
        self._err_chunks: list[bytes] = []
        self._drain: threading.Thread | None = None
        self.ready_line = ""
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.kill()
            raise
        # Drain stderr all along: a chatty server must never block on a full pipe.
        self._drain = threading.Thread(target=self._drain_stderr, daemon=True)
        self._drain.start()

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for chunk in iter(lambda: self.proc.stderr.read1(65536), b""):  # type: ignore[union-attr]
            self._err_chunks.append(chunk)

    @property
    def stderr_text(self) -> str:
        """What the server wrote to stderr so far (complete once it stopped)."""
        return b"".join(self._err_chunks).decode(errors="replace")

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"server not ready within {timeout}s: {self.cmd}")
            if not sel.select(left):
                continue
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"server exited ({self.proc.wait()}) before ready: {err}")
            buf += chunk
        sel.close()
        self.ready_line = buf.split(b"\n", 1)[0].decode()
        m = _READY.search(self.ready_line)
        if not m:
            raise RuntimeError(f"unexpected ready line: {self.ready_line!r}")
        self.host = m.group("host")
        self.port = int(m.group("port"))
        self.ipc = m.group("ipc")
        self.manage_port = int(m.group("mport")) if m.group("mport") else None
        self.address = f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal the server and wait; kill it if it does not exit in time.

        Returns the exit status. Raises AssertionError if it had to be killed.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                stacks = _dump_stacks(self.proc.pid)
                self.kill()
                raise AssertionError(f"server did not exit within {timeout}s of {sig}"
                                     f"{stacks}")
        self._collect()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the server (a crash): its segment stays until cleanup."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        self._collect()

    def _collect(self) -> None:
        if self._drain is not None:
            self._drain.join(10)
        elif self.proc.stderr is not None and not self.proc.stderr.closed:
            self._err_chunks.append(self.proc.stderr.read())
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None and not f.closed:
                f.close()

    def remove_segment(self) -> None:
        """Unlink the segments a killed server left (as `kvshm ctl cleanup` would): the
        pool and its shared index with its reads ring."""
        for suffix in ("", "-index", "-reads"):
            try:
                os.unlink("/dev/shm/" + self.shm_name.lstrip("/") + suffix)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.alive():
            self.stop()
        self.remove_segment()
