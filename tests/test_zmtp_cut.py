"""The ZMTP client (``channel.ZMTP``, kvshm.zmq_ctrl._zmtp) whose connection is cut by
something between it and a live server (a TCP relay closing it) sees the close at once.

Before: a close seen while a reply was awaited made the wait go on to the client's whole
timeout (``Channel._zlost``), so a cut connection cost ~20 s instead of a reconnect.

Semantics (as the libzmq path's, which never sends a request twice either):
- cut between calls: the next call finds the connection closed, makes a new one (a
  HELLO: the session moves over) and is served;
- cut while a request waits for its reply: ServerUnavailable at once (the request may
  have been applied: it is not sent again); the call after it reconnects and is served.

The waits are bounded by thread joins far below the client's 60 s timeout, never timed
asserts on speed.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest

from kvshm import Client
from kvshm.errors import ServerUnavailable
from servers import ServerProcess
from test_break24 import _Proxy

LISTENERS = ["libzmq", "native"]
CLIENT_TIMEOUT = 60.0       # the client's own: the bug waits this out
BOUND = 15.0                # what each step may take here (far below CLIENT_TIMEOUT)


class _HoldProxy(_Proxy):
    """:class:`_Proxy` that can hold the bytes of one direction (``hold("up")``: client
    to server, ``hold("down")``: server to client) instead of relaying them; ``held``
    is set once some bytes were held back."""

    def __init__(self, upstream: str) -> None:
        self.holding: str | None = None
        self.held = threading.Event()
        super().__init__(upstream)

    def hold(self, direction: str) -> None:
        self.held.clear()
        self.holding = direction

    def _pump(self, a: Any, b: Any) -> None:        # type: ignore[override]
        import socket
        with self.lock:
            up = any(a is c for c, _ in self.every)  # a: the client's end
        direction = "up" if up else "down"
        try:
            while True:
                d = a.recv(65536)
                if not d:
                    break
                if self.holding == direction:
                    self.held.set()                 # dropped with the cut
                    continue
                b.sendall(d)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _within(fn: Callable[[], Any], bound: float = BOUND) -> Any:
    """fn() in a thread; its result or exception, failing when it takes over ``bound``
    seconds (the client's own timeout is CLIENT_TIMEOUT)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:                # noqa: BLE001 (handed back)
            out.append(("exc", exc))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(bound)
    assert not th.is_alive(), f"the call did not end within {bound} s (a cut connection " \
                              f"waited for the client's {CLIENT_TIMEOUT:g} s timeout)"
    return out[0]


def _client(srv: ServerProcess, px: _Proxy, monkeypatch: Any) -> Client:
    import kvshm.zmq_ctrl.channel as channel
    from kvshm.security import find_token
    from kvshm.zmq_ctrl.channel import endpoint_of
    monkeypatch.setattr(channel, "ZMTP", True)
    c = Client(px.address, transport="tcp", timeout=CLIENT_TIMEOUT,
               token=find_token(endpoint_of(srv.address)))
    assert c._chan.zmtp
    return c


@pytest.mark.timeout(180)
@pytest.mark.parametrize("listener", LISTENERS)
def test_cut_between_calls_the_next_call_reconnects(listener, monkeypatch):
    with ServerProcess(listener=listener) as srv:
        px = _HoldProxy(srv.address)
        c = _client(srv, px, monkeypatch)
        try:
            c.put(b"k", b"v" * 100)
            assert c.get(b"k") == b"v" * 100
            before = c._chan.reconnects
            px.cut()
            assert _within(lambda: c.get(b"k")) == ("ok", b"v" * 100)
            assert c._chan.reconnects > before
            assert _within(lambda: c.put(b"k2", b"w" * 100))[0] == "ok"
            assert _within(lambda: c.get(b"k2")) == ("ok", b"w" * 100)
            # a cut before a put (the general path too: a batch)
            px.cut()
            assert _within(lambda: c.put(b"k3", b"x" * 5000))[0] == "ok"
            px.cut()
            assert _within(lambda: c.get_batch([b"k", b"k3"])) == \
                ("ok", [b"v" * 100, b"x" * 5000])
            assert srv.alive()
        finally:
            c.close()
            px.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("listener", LISTENERS)
@pytest.mark.parametrize("direction", ["up", "down"])
@pytest.mark.parametrize("op", ["get", "put", "put_batch"])
def test_cut_while_a_call_waits_raises_at_once_then_reconnects(listener, direction, op,
                                                               monkeypatch):
    """``up``: the request never reached the server; ``down``: the server applied it
    and its reply was lost. Either way ServerUnavailable at once, nothing sent twice,
    and the next call is served on a new connection."""
    with ServerProcess(listener=listener) as srv:
        px = _HoldProxy(srv.address)
        c = _client(srv, px, monkeypatch)
        try:
            c.put(b"k", b"v" * 100)
            px.hold(direction)
            calls = {"get": lambda: c.get(b"k"),
                     "put": lambda: c.put(b"n", b"n" * 100),
                     "put_batch": lambda: c.put_batch([b"n", b"m"],
                                                      [b"n" * 100, b"m" * 9000])}

            def cut_when_held() -> None:
                assert px.held.wait(BOUND)
                px.hold("none")
                px.cut()

            cutter = threading.Thread(target=cut_when_held, daemon=True)
            cutter.start()
            got = _within(calls[op])
            cutter.join(BOUND)
            assert got[0] == "exc" and isinstance(got[1], ServerUnavailable), got
            # the next calls: a new connection, served
            assert _within(lambda: c.get(b"k")) == ("ok", b"v" * 100)
            if op != "get":
                # applied once when the server had it (down), never when it had not (up)
                found = _within(lambda: c.exists(b"n"))
                assert found == ("ok", direction == "down"), found
            assert _within(lambda: c.put(b"k2", b"w" * 100))[0] == "ok"
            assert _within(lambda: c.get(b"k2")) == ("ok", b"w" * 100)
            assert srv.alive()
        finally:
            c.close()
            px.close()
