"""A peer's connection cut for unread replies (sends._cut) is the one its replies went
to: the server remembered only the fd number (the request's ``zmq.SRCFD``) and, once
that connection closed and the kernel gave the number to another client's connection,
shut the other client down (AF_UNIX: no check at all; TCP: only the peer's IP, the same
for every client on one host)."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from types import SimpleNamespace
from typing import Any, Iterator

import zmq

from kvshm.zmq_ctrl.dispatch import DispatchMixin
from kvshm.zmq_ctrl.sends import SendsMixin


class _Tracker:
    done = False            # a zero-copy reply the peer never reads


class _Frame:
    """A received request's header frame (libzmq message): its fd and peer."""

    def __init__(self, fd: int, peer: str) -> None:
        self._p = {zmq.SRCFD: fd, "Peer-Address": peer}

    def get(self, k: Any) -> Any:
        return self._p[k]


class _Loop(DispatchMixin, SendsMixin):
    """The loop's parts that queue a tracked reply and cut its peer."""

    def __init__(self) -> None:
        self.store = SimpleNamespace(config=SimpleNamespace(lease_timeout=1.0),
                                     sent=lambda *a: None)
        self._sending = []
        self.errors: dict[str, int] = {}
        self.latency: dict[int, list[int]] = {}
        self.latency_sum: dict[int, float] = {}
        self._handlers: dict[int, Any] = {}
        self._sends = 0                     # ServiceLoop's count of replies taken
        self._unadmitted: dict[int, Any] = {}   # no connection held (admission)
        self._admitting = False

    def _send(self, ident: bytes, header: bytes, frames: Any = (), track: bool = False):
        return _Tracker()

    def _count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def _record_latency(self, op: int, t0: float) -> None:
        pass


@contextlib.contextmanager
def unix_listener(prefix: str) -> Iterator[tuple[socket.socket, str, list[socket.socket]]]:
    """A listening AF_UNIX socket in a fresh temporary directory: ``(listener, path,
    socks)``; every socket the test appends to ``socks`` is closed at the end, the
    socket file and the directory removed."""
    d = tempfile.mkdtemp(prefix=prefix)
    path = os.path.join(d, "s")
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    socks: list[socket.socket] = [ls]
    try:
        ls.bind(path)
        ls.listen(4)
        yield ls, path, socks
    finally:
        for s in socks:
            s.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        os.rmdir(d)


def _pair(lsock: socket.socket, path: str) -> tuple[socket.socket, socket.socket]:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(path)
    s, _ = lsock.accept()
    return c, s


def _alive(client: socket.socket, server_end: socket.socket) -> bool:
    try:
        client.sendall(b"ping")
        server_end.settimeout(5.0)
        if server_end.recv(4) != b"ping":
            return False
        server_end.sendall(b"pong")
        client.settimeout(5.0)
        return client.recv(4) == b"pong"
    except OSError:
        return False


def _queue_stuck_reply(loop: _Loop, ident: bytes, frame: _Frame) -> None:
    loop._reply(ident, object(), 1, 2, 0, {}, [b"x" * 65536], {}, [1], time.perf_counter(),
                frame)
    assert loop._sending


def test_cut_leaves_a_new_connection_on_the_old_fd_number_alone() -> None:
    with unix_listener("kvshm-cutfix-") as (ls, path, socks):
        loop = _Loop()
        a_cli, a_srv = _pair(ls, path)
        socks += [a_cli, a_srv]
        fd = a_srv.fileno()
        _queue_stuck_reply(loop, b"A" * 16, _Frame(fd, ""))
        # A goes and B's connection comes on A's old fd number. (Not by closing A and
        # accepting B: the lowest free number is not A's when another thread of this
        # process opened a descriptor meanwhile, as a zmq context left by an earlier test
        # can; dup2 closes A's server end and puts B's there in one step.)
        a_cli.close()
        b_cli, b_new = _pair(ls, path)
        socks.append(b_cli)
        os.dup2(b_new.fileno(), fd)
        a_srv.detach()                       # fd is B's now: A's object must not close it
        b_new.close()
        b_srv = socket.socket(fileno=fd)
        socks.append(b_srv)
        assert b_srv.fileno() == fd          # B's connection holds A's old fd number
        loop._reap_sends(time.monotonic() + 10.0)   # A's reply is past its lease
        assert loop.errors.get("unread_replies") == 1
        assert _alive(b_cli, b_srv), "B's connection was shut down for A's replies"


def test_cut_still_shuts_down_the_peer_that_does_not_read() -> None:
    with unix_listener("kvshm-cutfix-") as (ls, path, socks):
        loop = _Loop()
        a_cli, a_srv = _pair(ls, path)
        b_cli, b_srv = _pair(ls, path)
        socks += [a_cli, a_srv, b_cli, b_srv]
        _queue_stuck_reply(loop, b"A" * 16, _Frame(a_srv.fileno(), ""))
        loop._reap_sends(time.monotonic() + 10.0)
        assert loop.errors.get("unread_replies") == 1
        a_cli.settimeout(5.0)
        assert a_cli.recv(1) == b""          # A's connection shut down: EOF
        assert _alive(b_cli, b_srv)          # B untouched
