"""An ipc:// endpoint the client may not connect to (EACCES) is a clear error at once, not
the whole timeout's wait ending in "no reply" (both client transports: ZMTP and libzmq).

The client runs in a child process without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH
(``setpriv``: the suite runs as root, for whom every permission check passes otherwise;
it stays uid 0, so the interpreter under /root still loads), against paths owned by
``nobody``. A path that does not exist yet (a server still
starting) keeps waiting, as before: the timeout, not a permission error.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
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


#: a child without the capabilities that let root past permission checks
_UNPRIVILEGED = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
                 "--inh-caps=-all", "--"]


def _child(script: str, *args: str) -> dict:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to make a path this uid may "
                    "not reach")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([*_UNPRIVILEGED, sys.executable, "-c", script, "-", *args],
                       capture_output=True, text=True, timeout=60, env=env, cwd="/")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def _run(endpoint: str, transport: str, timeout: float) -> dict:
    return _child(_CHILD, endpoint, transport, str(timeout))


@pytest.fixture
def guarded() -> tuple[str, str]:
    """A listening Unix socket in a directory only root may search (mode 0700)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a path another uid may not reach")
    d = tempfile.mkdtemp(prefix=f"kvshm-perm-{unique_shm_name()[1:]}-")
    path = os.path.join(d, "svc.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(8)
    os.chown(d, _nobody(), -1)
    os.chmod(d, 0o700)
    try:
        yield d, path
    finally:
        s.close()
        os.unlink(path)
        os.rmdir(d)


@pytest.mark.parametrize("transport", ["zmtp", "libzmq"])
def test_permission_denied_is_said_at_once(guarded: tuple[str, str], transport: str) -> None:
    _, path = guarded
    out = _run("ipc://" + path, transport, 20.0)
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
    os.chown(path, _nobody(), -1)
    os.chmod(path, 0o600)
    try:
        out = _run("ipc://" + path, transport, 20.0)
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
        out = _run("ipc://" + os.path.join(d, "not-yet.sock"), transport, 1.0)
    finally:
        os.rmdir(d)
    assert out.get("error") == "ServerUnavailable", out
    assert "permission" not in out["msg"].lower(), out
    assert "no reply" in out["msg"], out
    assert out["s"] >= 0.9, out


_ACHILD = r"""
import asyncio, json, os, sys, time
from kvshm.aio import AsyncClient
from kvshm.errors import ServerUnavailable

async def main():
    c = AsyncClient(sys.argv[2], transport="tcp", timeout=float(sys.argv[3]))
    t0 = time.monotonic()
    try:
        await c.exists(b"k")
        out = {"ok": True}
    except ServerUnavailable as exc:
        out = {"error": type(exc).__name__, "msg": str(exc)}
    out["s"] = time.monotonic() - t0
    await c.close()
    return out
print(json.dumps(asyncio.run(main())))
"""


def test_async_client_permission_denied_is_said_at_once(guarded: tuple[str, str]) -> None:
    _, path = guarded
    out = _child(_ACHILD, "ipc://" + path, "20")
    assert out.get("error") == "ServerUnavailable", out
    assert "permission denied" in out["msg"].lower(), out
    assert out["s"] < 10.0, out
