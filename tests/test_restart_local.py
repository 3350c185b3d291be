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
