"""The native listener's endpoints and connections' lives (kvshm.zmq_ctrl.listener):
binding ``tcp://``, ``ipc://`` and ``inproc://`` (the inner libzmq ROUTER), accepting
(never blocking; no descriptor free: the listening sockets out of the poll for
:data:`ACCEPT_BACKOFF_S`), closing a connection (its hooks, its routing id, its
queued output's trackers done) and closing everything.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import stat
import time
from typing import Any, Callable

import zmq

try:
    from kvshm.zmq_ctrl import _zmtpsrv
except ImportError:     # pragma: no cover - not built (the native listener refuses to start)
    _zmtpsrv = None  # type: ignore[assignment]
from kvshm.zmq_ctrl.listener_handshake import GREET

log = logging.getLogger("kvshm.zmq_ctrl.listener")

#: Seconds the listening sockets stay out of the poll after ``accept(2)`` found no
#: descriptor free (EMFILE, ENFILE, ENOBUFS, ENOMEM).
ACCEPT_BACKOFF_S = 0.1
_NO_FD_FREE = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_CLOSED = 3


class Endpoints:
    """Binding, accepting and closing for a
    :class:`~kvshm.zmq_ctrl.listener.NativeListener` (a mixin of it)."""

    _ctx: zmq.Context | None
    _ep: Any
    _wire: Any
    _listeners: dict[int, tuple[socket.socket, str, str | None]]
    _conns: dict[int, Any]
    _by_ident: dict[bytes, Any]
    _handshaking: Any
    _sockopts: dict[int, Any]
    _inner: zmq.Socket | None
    _inner_fd: int
    _last: str
    _accept_retry: float
    _accept_warned: float
    ipv6: bool
    handshake_s: float
    counts: dict[str, int]
    on_accept: Callable[[int], None] | None
    on_close: Callable[[int], None] | None

    def bind(self, endpoint: str) -> None:
        """Bind ``tcp://host:port`` (port 0: a free one), ``ipc://path`` or
        ``inproc://name`` (the inner libzmq ROUTER). Raises ``zmq.ZMQError`` as
        ``zmq.Socket.bind`` (EADDRINUSE, EINVAL for another scheme)."""
        if endpoint.startswith("inproc://"):
            if self._inner is None:
                if self._ctx is None:
                    self._ctx = zmq.Context.instance()
                s = self._ctx.socket(zmq.ROUTER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.ROUTER_HANDOVER, 0)
                for k, v in self._sockopts.items():
                    s.setsockopt(k, v)
                self._inner = s
                self._inner_fd = s.getsockopt(zmq.FD)
                self._ep.register(self._inner_fd, select.EPOLLIN)
            self._inner.bind(endpoint)
            self._last = self._inner.getsockopt_string(zmq.LAST_ENDPOINT)
            return
        if endpoint.startswith("tcp://"):
            hostport = endpoint[len("tcp://"):]
            host, _, port = hostport.rpartition(":")
            if host.startswith("[") and host.endswith("]"):
                host = host[1:-1]
            if host in ("*", ""):
                host = "::" if self.ipv6 else "0.0.0.0"
            fam = socket.AF_INET6 if ":" in host else socket.AF_INET
            try:
                portn = int(port)
            except ValueError:
                raise zmq.ZMQError(errno.EINVAL, f"bad port in {endpoint}") from None
            s = socket.socket(fam, socket.SOCK_STREAM)
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, portn))
                s.listen(1024)
            except OSError as exc:
                s.close()
                raise zmq.ZMQError(exc.errno or errno.EINVAL, str(exc)) from None
            name = s.getsockname()
            h = f"[{name[0]}]" if fam == socket.AF_INET6 else name[0]
            bound = f"tcp://{h}:{name[1]}"
            path = None
        elif endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://"):]
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                try:
                    if stat.S_ISSOCK(os.lstat(path).st_mode):
                        os.unlink(path)     # as libzmq: a stale socket file goes
                except FileNotFoundError:
                    pass
                s.bind(path)
                s.listen(1024)
            except OSError as exc:
                s.close()
                raise zmq.ZMQError(exc.errno or errno.EINVAL, str(exc)) from None
            bound = f"ipc://{path}"
        else:
            raise zmq.ZMQError(errno.EPROTONOSUPPORT,
                               f"the native listener serves tcp:// and ipc://, not {endpoint}")
        s.setblocking(False)
        self._listeners[s.fileno()] = (s, bound, path)
        self._ep.register(s.fileno(), select.EPOLLIN)
        self._last = bound

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _accept(self, lfd: int) -> None:
        ls, bound, path = self._listeners[lfd]
        for _ in range(64):
            try:
                s, addr = ls.accept()
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno in _NO_FD_FREE:
                    self._count("accept_no_fd")
                    now = time.monotonic()
                    if now - self._accept_warned > 5.0:
                        self._accept_warned = now
                        log.warning("cannot accept on %s: %s; trying again in %g s",
                                    bound, exc.strerror, ACCEPT_BACKOFF_S)
                    self._accept_retry = now + ACCEPT_BACKOFF_S
                    for fd in self._listeners:
                        try:
                            self._ep.unregister(fd)
                        except OSError:
                            pass
                    return
                log.debug("accept on %s: %s", bound, exc)
                continue
            s.setblocking(False)
            if path is None:
                try:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
                peer = addr[0] if isinstance(addr, tuple) else str(addr)
            else:
                peer = ""
            c = _zmtpsrv.Conn(self, self._wire, s, peer)
            c.deadline = time.monotonic() + self.handshake_s
            self._conns[c.fd] = c
            self._handshaking[c.fd] = c
            try:
                self._ep.register(c.fd, select.EPOLLIN)
            except OSError:
                self._close(c, None)
                continue
            c.queue(GREET)
            if c.state == _CLOSED:
                continue
            if self.on_accept is not None:
                try:
                    self.on_accept(c.fd)
                except Exception:
                    log.exception("internal error in the accept hook")

    def _close(self, c: Any, why: str | None) -> None:
        if c.state == _CLOSED:
            return
        if why is not None:
            self._count(why)
            log.debug("connection on fd %d closed: %s", c.fd, why)
        c.state = _CLOSED
        fd = c.fd
        self._conns.pop(fd, None)
        self._handshaking.pop(fd, None)
        self._wire.backlog.pop(fd, None)
        if c.ident and self._by_ident.get(c.ident) is c:
            del self._by_ident[c.ident]
        c.drop()
        if self.on_close is not None:
            try:
                self.on_close(fd)      # before the number can be another's
            except Exception:
                log.exception("internal error in the close hook")
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):
            pass
        c.sock.close()

    # the calls of kvshm.zmq_ctrl._zmtpsrv.Conn into its listener

    def _protocol_error(self, c: Any, why: str) -> None:
        """What ``c``'s peer sent is not ZMTP as taken here (``why``): it is closed."""
        if why in ("message_too_large", "frame_too_large"):
            log.warning("connection on fd %d (%s) closed: %s", c.fd,
                        c.ident.hex() or c.peer, why.replace("_", " "))
        self._close(c, why)

    def _unread_output(self, c: Any) -> None:
        """``c``'s queue passed its bound (a peer that reads no replies): it is closed."""
        log.warning("peer %s reads no replies (%d bytes, %d messages queued): its "
                    "connection is closed", c.ident.hex(), c.out_bytes, c.out_msgs)
        self._close(c, "unread_output")

    def _want_write(self, c: Any, want: bool) -> None:
        """Whether ``c`` waits to be writable (its output queued) in the epoll set."""
        try:
            self._ep.modify(c.fd, select.EPOLLIN | (select.EPOLLOUT if want else 0))
        except OSError:
            pass

    def _close_all(self) -> None:
        """Close every connection, listening socket (ipc paths unlinked) and the inner
        socket."""
        for c in list(self._conns.values()):
            self._close(c, None)
        for s, _bound, path in self._listeners.values():
            s.close()
            if path is not None:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        self._listeners.clear()
        if self._inner is not None:
            self._inner.close(0)
            self._inner = None

    def shut(self, conn: tuple[int, int, int] | None) -> bool:
        """Close the connection ``conn`` names, ``(fd, st_dev, st_ino)``, if it is one of
        this listener's still (as :func:`~kvshm.zmq_ctrl.admission.shut_conn`, with no
        descriptor needed: it works while none is free). Returns True when closed."""
        if conn is None:
            return False
        c = self._conns.get(conn[0])
        if c is None:
            return False
        try:
            st = os.fstat(c.fd)
        except OSError:
            return False
        if (st.st_dev, st.st_ino) != (conn[1], conn[2]):
            return False
        self._close(c, "shut")
        return True
