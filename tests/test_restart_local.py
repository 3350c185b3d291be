"""A same-host client on the server's ipc endpoint notices a gone or replaced server at once.

Before: a local client says its liveness-proof HELLO on the server's ipc endpoint and stays
there. A server restarted on the same port binds a new ipc directory (and a SIGKILLed one
leaves its socket file and pool segment behind), so the client's next request waited its
full timeout on the dead endpoint before it raised ServerUnavailable. Now the client checks
what the kernel proves (the ipc socket path gone or another inode; the pool segment's
flock no longer held) before a send after an idle spell and while it waits: a restart
between requests is transparent and a server dying mid-request raises ServerUnavailable
at once.

The clients use a 60 s timeout and the tests a 40 s pytest timeout, so the old behaviour
fails by the pytest timeout; the sync channel's own counters (``timeouts``) say in
addition that no wait ran to its end.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import threading
import time
from typing import Any

import pytest

import kvshm
from kvshm.aio import AsyncClient
from kvshm.errors import ServerUnavailable
from servers import ServerProcess

pytestmark = pytest.mark.timeout(40)

TIMEOUT = 60.0     # far longer than the test may take: only the fix passes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _forget(srv: ServerProcess) -> None:
    """What a killed server leaves: its segments and its private ipc directory."""
    srv.kill()
    srv.remove_segment()
    if srv.ipc:
        shutil.rmtree(os.path.dirname(srv.ipc[len("ipc://"):]), ignore_errors=True)


def _wait(pred: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _restart(srv: ServerProcess, port: int, kill: bool) -> ServerProcess:
    if kill:
        srv.kill()          # leaves the socket file and the (unlocked) pool segment
    else:
        srv.stop()
    return ServerProcess(service_port=port)


# ---------------------------------------------------------------- sync


@pytest.mark.parametrize("kill", [False, True], ids=["graceful", "sigkill"])
def test_sync_restart_on_same_port_is_transparent(kill):
    port = _free_port()
    srv = ServerProcess(service_port=port)
    srv2 = None
    try:
        with kvshm.Client(srv.address, transport="shm", timeout=TIMEOUT) as c:
            c.put(b"before", b"v1")
            assert c._chan.endpoint == srv.ipc        # the case of the bug: on ipc
            srv2 = _restart(srv, port, kill)
            time.sleep(0.3)   # idle past the channel's check interval (as between calls)
            c.put(b"after", b"v2")                    # served by the new server
            assert c.get(b"after") == b"v2"
            assert not c.exists(b"before")            # ... which is a new one
            assert c._chan.endpoint == srv2.ipc       # and on its ipc endpoint again
            assert c._chan.timeouts == 0
            assert c._chan.gone >= 1                  # noticed, not waited out
    finally:
        _forget(srv)
        if srv2 is not None:
            srv2.stop()
            srv2.remove_segment()


def test_sync_server_killed_mid_request_raises_at_once():
    srv = ServerProcess()
    try:
        with kvshm.Client(srv.address, transport="shm", timeout=TIMEOUT) as c:
            c.put(b"k", b"v")
            assert c._chan.endpoint == srv.ipc
            chan = c._chan
            sent = chan.sent
            srv.proc.send_signal(signal.SIGSTOP)      # the request goes out, unanswered
            out: list[BaseException | None] = []

            def call() -> None:
                try:
                    c.stats()
                    out.append(None)
                except BaseException as exc:
                    out.append(exc)

            t = threading.Thread(target=call)
            t.start()
            _wait(lambda: chan.sent > sent, "the request was not sent")
            srv.kill()
            t.join(30)
            assert not t.is_alive(), "the request still waits on a dead server"
            assert isinstance(out[0], ServerUnavailable), out
            assert chan.timeouts == 0
            assert chan.gone == 1
    finally:
        _forget(srv)


def test_sync_server_killed_between_requests_raises_at_once():
    srv = ServerProcess()
    try:
        with kvshm.Client(srv.address, transport="shm", timeout=TIMEOUT) as c:
            c.put(b"k", b"v")
            assert c._chan.endpoint == srv.ipc
            srv.kill()
            time.sleep(0.3)
            with pytest.raises(ServerUnavailable, match="gone"):
                c.stats()
            assert c._chan.timeouts == 0
    finally:
        _forget(srv)


# ---------------------------------------------------------------- async


@pytest.mark.parametrize("kill", [False, True], ids=["graceful", "sigkill"])
def test_async_restart_on_same_port_is_transparent(kill):
    port = _free_port()
    srv = ServerProcess(service_port=port)
    box: dict[str, ServerProcess] = {}

    async def main() -> None:
        async with AsyncClient(srv.address, transport="shm", timeout=TIMEOUT) as c:
            await c.put(b"before", b"v1")
            assert c._conn is not None and c._conn.endpoint == srv.ipc
            box["srv2"] = await asyncio.get_running_loop().run_in_executor(
                None, _restart, srv, port, kill)
            await asyncio.sleep(0.3)
            await c.put(b"after", b"v2")
            assert await c.get(b"after") == b"v2"
            assert not await c.exists(b"before")
            assert c._conn is not None and c._conn.endpoint == box["srv2"].ipc

    try:
        asyncio.run(main())
    finally:
        _forget(srv)
        if "srv2" in box:
            box["srv2"].stop()
            box["srv2"].remove_segment()


def test_async_server_killed_mid_request_raises_at_once():
    srv = ServerProcess()

    async def main() -> None:
        async with AsyncClient(srv.address, transport="shm", timeout=TIMEOUT) as c:
            await c.put(b"k", b"v")
            assert c._conn is not None and c._conn.endpoint == srv.ipc
            srv.proc.send_signal(signal.SIGSTOP)
            task = asyncio.ensure_future(c.stats())
            await asyncio.sleep(0.3)                  # sent, waiting for the reply
            assert not task.done()
            srv.kill()
            with pytest.raises(ServerUnavailable):
                await asyncio.wait_for(task, 30)

    try:
        asyncio.run(main())
    finally:
        _forget(srv)


def test_async_server_killed_between_requests_raises_at_once():
    srv = ServerProcess()

    async def main() -> None:
        async with AsyncClient(srv.address, transport="shm", timeout=TIMEOUT) as c:
            await c.put(b"k", b"v")
            assert c._conn is not None and c._conn.endpoint == srv.ipc
            srv.kill()
            await asyncio.sleep(0.3)
            with pytest.raises(ServerUnavailable, match="gone"):
                await asyncio.wait_for(c.stats(), 30)

    try:
        asyncio.run(main())
    finally:
        _forget(srv)


# ---------------------------------------------------------------- the watch itself

_HOLDER = """
import fcntl, os, sys, time
fd = os.open("/dev/shm/" + sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_watch_tells_the_old_servers_lock_from_a_new_one_of_the_same_name(tmp_path):
    """The flock is tested on the segment the watch opened: a new holder of a segment of
    the same name (a server restarted with the same --shm-name) does not answer for the
    old one. An ipc socket removed or bound again is seen too; ``listening`` tells a
    refused connect from an accepted one."""
    import subprocess
    import sys

    from kvshm.zmq_ctrl.serverwatch import ServerWatch, listening
    from servers import unique_shm_name

    name = unique_shm_name("watch-")
    procs: list[subprocess.Popen[str]] = []

    def holder() -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", _HOLDER, name], stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        return p

    sock_path = str(tmp_path / "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(sock_path)
        srv.listen(1)
        first = holder()
        w = ServerWatch(name, "ipc://" + sock_path)
        assert w.gone() is None
        assert listening("ipc://" + sock_path)
        first.kill()
        first.wait(10)
        assert "no longer locked" in (w.gone() or "")
        os.unlink("/dev/shm/" + name)
        holder()                                 # same name, new segment, new holder
        assert "no longer locked" in (w.gone() or "")
        w.close()
        w2 = ServerWatch(name, "ipc://" + sock_path)   # the new one: alive
        assert w2.gone() is None
        srv.close()
        os.unlink(sock_path)
        assert "is gone" in (w2.gone() or "")
        assert not listening("ipc://" + sock_path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(sock_path)                      # another socket at the path
        assert "another server's" in (w2.gone() or "")
        w2.close()
        port = _free_port()
        assert not listening(f"tcp://127.0.0.1:{port}")
    finally:
        srv.close()
        for p in procs:
            p.kill()
            p.wait(10)
            if p.stdout is not None:
                p.stdout.close()
        try:
            os.unlink("/dev/shm/" + name)
        except FileNotFoundError:
            pass
