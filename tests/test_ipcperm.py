"""An ipc:// endpoint the client may not connect to (EACCES) is a clear error at once, not
the whole timeout's wait ending in "no reply" (both client transports: ZMTP and libzmq).

The client runs in a child process that drops to uid ``nobody`` (the suite runs as root,
for whom every permission check passes). A path that does not exist yet (a server still
starting) keeps waiting, as before: the timeout, not a permission error.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys
import tempfile

import pytest

from tests.servers import unique_shm_name

_CHILD = r"""
import json, os, sys, time
from kvshm.errors import ServerUnavailable
from kvshm.zmq_ctrl import channel as ch
from kvshm.zmq_ctrl.protocol import Op
uid = int(sys.argv[1])      # (after the imports: the interpreter may live under /root)
os.setgid(uid); os.setuid(uid)
ch.ZMTP = sys.argv[3] == "zmtp"
c = ch.Channel(sys.argv[2], float(sys.argv[4]))
t0 = time.monotonic()
try:
    c.request(Op.STATS, {})
    out = {"ok": True}
except ServerUnavailable as exc:
    out = {"error": type(exc).__name__, "msg": str(exc)}
out["s"] = time.monotonic() - t0
out["zmtp"] = c.zmtp
c.close()
print(json.dumps(out))
"""


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user 'nobody'")


def _run(uid: int, endpoint: str, transport: str, timeout: float) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", _CHILD, str(uid), endpoint, transport,
                        str(timeout)], capture_output=True, text=True, timeout=60, env=env,
                       cwd="/")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def guarded() -> tuple[str, str]:
    """A listening Unix socket in a directory only root may search (mode 0700)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a path another uid may not reach")
    d = tempfile.mkdtemp(prefix=f"kvshm-perm-{unique_shm_name()[1:]}-")
    os.chmod(d, 0o700)
    path = os.path.join(d, "svc.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(8)
    try:
        yield d, path
    finally:
        s.close()
        os.unlink(path)
        os.rmdir(d)


@pytest.mark.parametrize("transport", ["zmtp", "libzmq"])
def test_permission_denied_is_said_at_once(guarded: tuple[str, str], transport: str) -> None:
    _, path = guarded
    out = _run(_nobody(), "ipc://" + path, transport, 20.0)
    assert out.get("error") == "ServerUnavailable", out
    assert "permission denied" in out["msg"].lower(), out
    assert path in out["msg"], out
    assert out["s"] < 10.0, out         # not the 20 s timeout (bounded by POLL_S slices)
    assert out["zmtp"] == (transport == "zmtp")


@pytest.mark.parametrize("transport", ["zmtp", "libzmq"])
def test_socket_file_not_writable_is_denied(transport: str) -> None:
    """The directory searchable, the socket file itself root's, mode 0600."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    d = tempfile.mkdtemp(prefix="kvshm-perm2-")
    os.chmod(d, 0o755)
    path = os.path.join(d, "svc.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(8)
    os.chmod(path, 0o600)
    try:
        out = _run(_nobody(), "ipc://" + path, transport, 20.0)
    finally:
        s.close()
        os.unlink(path)
        os.rmdir(d)
    assert out.get("error") == "ServerUnavailable", out
    assert "permission denied" in out["msg"].lower(), out
    assert out["s"] < 10.0, out


@pytest.mark.parametrize("transport", ["zmtp", "libzmq"])
def test_missing_path_still_waits_for_the_timeout(transport: str) -> None:
    """No such path (yet): the wait is the timeout's, its message the usual one."""
    d = tempfile.mkdtemp(prefix="kvshm-perm3-")
    os.chmod(d, 0o777)
    try:
        out = _run(_nobody() if os.geteuid() == 0 else os.geteuid(),
                   "ipc://" + os.path.join(d, "not-yet.sock"), transport, 1.0)
    finally:
        os.rmdir(d)
    assert out.get("error") == "ServerUnavailable", out
    assert "permission" not in out["msg"].lower(), out
    assert "no reply" in out["msg"], out
    assert out["s"] >= 0.9, out
