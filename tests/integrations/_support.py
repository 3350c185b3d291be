"""Helpers the integration tests share (no engine imports)."""

from __future__ import annotations

import socket
import time
from typing import Any, Callable

from servers import ServerProcess


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def stop_server(srv: ServerProcess) -> None:
    """Stop a test server, once it surely serves.

    A SIGTERM that lands between the server's ready line and the start of its loop is
    lost (the loop sets its running flag when it starts), so say HELLO first.
    """
    if srv.alive():
        import kvshm

        try:
            kvshm.Client(srv.address, timeout=5).close()
        except kvshm.KvshmError:
            pass
    srv.stop()
    srv.remove_segment()


def wait_for(pred: Callable[[], Any], timeout: float = 15.0, what: str = "condition",
             interval: float = 0.02) -> Any:
    """Poll ``pred`` until it returns a true value (returned); fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def server_exists_counter(c: Any) -> list[int]:
    """Counts the EXISTS requests the ``kvshm.Client`` ``c`` sends to the server from now
    on (its session's ``op_simple`` wrapped); returns the live count, ``[n]``."""
    n = [0]
    s = c._session
    real = s.op_simple

    def op_simple(op: Any, *a: Any, **kw: Any) -> Any:
        if getattr(op, "name", "") == "EXISTS":
            n[0] += 1
        return real(op, *a, **kw)
    s.op_simple = op_simple
    return n
