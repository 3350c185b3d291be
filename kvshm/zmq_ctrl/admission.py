"""Admission: connections that say no valid HELLO are closed, within a bound of time and
of number.

A peer can complete ZMTP's handshake with the ROUTER socket (libzmq drops only those
that never finish it, ``ZMQ_HANDSHAKE_IVL``) and then say nothing: such a connection has
no session, so no idle expiry ends it, and the loop never sees it (it sent no message).
Enough of them (the soft descriptor limit, usually 1024) leave the server no descriptor
to accept with, and every client is locked out. So the loop watches its socket's
connections (a ZeroMQ socket monitor: ``ZMQ_EVENT_ACCEPTED`` gives each accepted
connection's descriptor, ``ZMQ_EVENT_DISCONNECTED`` its end) and holds every accepted
connection as *unadmitted* until it is admitted:

- by a HELLO answered OK on it (the request frame's ``zmq.SRCFD``), or
- by a request on it of a session bound to it (:func:`~kvshm.zmq_ctrl.sends.bound_ok`:
  a session serves only the connection its HELLO came on, so a client's connection made
  again under the same routing id, as libzmq and the ZMTP client do after a drop, is
  answered "say HELLO" and admitted by that HELLO).

An unadmitted connection is shut down ``hello_timeout`` seconds after it was accepted
(default :data:`HELLO_TIMEOUT_S`), and when more than ``max_unadmitted`` are held
(default :data:`MAX_UNADMITTED`, and at most a quarter of the process's soft
``RLIMIT_NOFILE``, read at each accept) the oldest are shut down at once, so a burst
cannot use up the descriptors before the timer fires. A connection is named by
``(fd, st_dev, st_ino)``, as :func:`~kvshm.zmq_ctrl.sends.conn_of` names it: the fd
number alone is not a connection (the kernel gives it to the next socket once libzmq
closed it), so a connection is shut down only while its fd still names the same socket
(:func:`~kvshm.zmq_ctrl.sends.shut_conn`, on a dup of the fd; when no descriptor is
free for that dup, the connection stays held and is checked again
:data:`UNTOLD_RETRY_S` later, first in line), and an ACCEPTED event read after its connection ended is not held
when the number names a socket not accepted on that event's endpoint by then
(:func:`_accepted_on`: another thread's socket, the management port's). Counted in ``errors``: ``unadmitted_cut`` (timer),
``unadmitted_bound`` (over the bound).

Cost: nothing per request while no connection is unadmitted (one truthiness test of a
dict in :meth:`~kvshm.zmq_ctrl.dispatch.DispatchMixin._dispatch` and in the C fast path);
the monitor's descriptor is one more entry of the loop's ``poll(2)``; events and the
HELLO's fstat are per connection. Only loops with a door (``door_token``) admit: a
door-less loop gives every peer a session.
"""

from __future__ import annotations

import logging
import os
import resource
import socket as _socket
import stat
import struct
import time
from typing import Any

import zmq

from kvshm.zmq_ctrl.listener import NativeListener
from kvshm.zmq_ctrl.loopstate import LoopState
from kvshm.zmq_ctrl.sends import SHUT, UNTOLD, bound_ok, conn_of, shut_any, shut_conn

__all__ = ["AdmissionMixin", "shut_conn", "HELLO_TIMEOUT_S", "MAX_UNADMITTED"]

log = logging.getLogger("kvshm.zmq_ctrl.router")

#: Seconds a connection may stay without a valid HELLO (or a request of an open session)
#: before the server shuts it down (``--hello-timeout``; 0: never).
HELLO_TIMEOUT_S = 5.0
#: Unadmitted connections held at most (``--max-unadmitted``); beyond, the oldest are
#: shut down. Also at most a quarter of the soft descriptor limit.
MAX_UNADMITTED = 256

#: KVSHM_HELLO_CUT=0 in the environment (read at import) turns admission off: no
#: monitor of connections, nothing shut down (A/B figures; the behaviour before)
HELLO_CUT_ON = os.environ.get("KVSHM_HELLO_CUT", "1") != "0"

_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_EV = struct.Struct("=HI")

#: Seconds until a connection to be shut down is checked again when no descriptor was
#: free for the check (:data:`~kvshm.zmq_ctrl.sends.UNTOLD`): it stays held meanwhile.
UNTOLD_RETRY_S = 0.25
#: the UNTOLD warning is logged at most once in this many seconds (a server at its
#: descriptor limit would otherwise log one every UNTOLD_RETRY_S)
_UNTOLD_LOG_S = 10.0
_untold_logged = [-_UNTOLD_LOG_S]


def _accepted_on(fd: int, endpoint: bytes) -> bool:
    """Whether ``fd`` is a socket accepted on ``endpoint`` (the monitor event's: tcp by
    its local port, ipc by its path), not something else that got the number since
    (another thread's socket: the management port's, a file, a pipe)."""
    # read on ``fd`` itself, never closed here (no dup: it needs a free descriptor, and
    # the connection may have taken the last one); a number given to another socket
    # meanwhile answers for that socket
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return False
        s = _socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        fam, name = s.family, s.getsockname()
    except OSError:
        return False
    finally:
        s.detach()
    return _names(fam, name, endpoint)


def _names(fam: int, name: Any, endpoint: bytes) -> bool:
    """Whether a socket of family ``fam`` named ``name`` is one accepted on ``endpoint``."""
    ep = endpoint.decode(errors="replace")
    if ep.startswith("tcp://"):
        return (fam in (_socket.AF_INET, _socket.AF_INET6) and isinstance(name, tuple)
                and str(name[1]) == ep.rsplit(":", 1)[1])
    if ep.startswith("ipc://"):
        return fam == _socket.AF_UNIX and name == ep[len("ipc://"):]
    return False


class AdmissionMixin(LoopState):
    """Admission of ServiceLoop's connections (a mixin of it)."""

    def _init_admission(self, hello_timeout: float, max_unadmitted: int,
                        log_handshakes: bool) -> None:
        if isinstance(hello_timeout, bool) or not isinstance(hello_timeout, (int, float)) \
                or not hello_timeout >= 0:
            raise ValueError(f"hello_timeout must be >= 0 s, got {hello_timeout!r}")
        if isinstance(max_unadmitted, bool) or not isinstance(max_unadmitted, int) \
                or max_unadmitted < 1:
            raise ValueError(f"max_unadmitted must be an int >= 1, got {max_unadmitted!r}")
        # self._unadmitted: unadmitted connections, oldest first: fd -> (st_dev, st_ino,
        # deadline), the same dict for the life of the loop (the C fast path holds it);
        # self._admitted: admitted connections whose end was not seen yet: fd ->
        # (st_dev, st_ino). Both made by the loop before its fast path.
        self.hello_timeout = float(hello_timeout)
        self.max_unadmitted = max_unadmitted
        self._admitting = (HELLO_CUT_ON and self.door_token is not None
                           and hello_timeout > 0)
        self._log_hs = log_handshakes
        #: the loop's native listener (kvshm.zmq_ctrl.listener), or None: libzmq's ROUTER
        self._native = self._sock if isinstance(self._sock, NativeListener) else None
        if self._native is not None:
            # the listener tells its accepts and ends itself: no monitor
            self._monitor = None
            self._mon_fd = -1
            if self._admitting:
                self._native.on_accept = self._native_accepted
                self._native.on_close = self._native_ended
            if self.door_token is not None:
                # a peer without a session holds no more than a HELLO's worth of an
                # unended message (no door: every peer has a session)
                self._native.trust = self._native_trusted
            return
        events = 0
        if log_handshakes:
            events |= _HANDSHAKE_EVENTS
        if self._admitting:
            events |= zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        self._monitor = None
        if events:
            # (as Socket.get_monitor_socket, with no high-water mark on the receiving
            # side: libzmq drops the events past it, and an ACCEPTED dropped would be
            # a connection never held; each is read at the loop's next turn)
            addr = f"inproc://kvshm-monitor-{os.getpid()}-{os.urandom(8).hex()}"
            self._sock.monitor(addr, events)
            mon = self._sock.context.socket(zmq.PAIR)
            mon.setsockopt(zmq.LINGER, 0)
            mon.setsockopt(zmq.RCVHWM, 0)
            mon.connect(addr)
            self._monitor = mon
        #: the monitor socket's ZMQ_FD, polled with poll(2) by the lean turns, or -1
        self._mon_fd = -1
        if self._monitor is not None:
            self._mon_fd = int(self._monitor.getsockopt(zmq.FD))
            # read until EAGAIN once, so that its descriptor signals the next event
            self._on_monitor()

    def _unadmitted_bound(self) -> int:
        try:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except (OSError, ValueError):
            soft = resource.RLIM_INFINITY
        if soft == resource.RLIM_INFINITY or soft <= 0:
            return self.max_unadmitted
        return max(1, min(self.max_unadmitted, soft // 4))

    def _on_monitor(self) -> None:
        """Read every queued event of the monitor: accepted connections held as
        unadmitted (the oldest shut down beyond the bound), ended ones forgotten,
        failed handshakes counted and logged."""
        mon = self._monitor
        if mon is None:
            return
        pending = self._unadmitted
        accepted = False
        while True:
            try:
                parts = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(parts) < 2 or len(parts[0]) < 6:
                continue
            event, value = _EV.unpack_from(parts[0])
            if event == zmq.EVENT_ACCEPTED:
                if not self._admitting:
                    continue
                try:
                    st = os.fstat(value)
                except OSError:
                    continue                # gone already
                if not _accepted_on(value, parts[1]):
                    continue                # closed, the number given to another's
                pending.pop(value, None)    # a stale entry of that number: not this one
                a = self._admitted.pop(value, None)
                if a is not None and a == (st.st_dev, st.st_ino):
                    self._admitted[value] = a   # its HELLO was read before this event
                    continue
                pending[value] = (st.st_dev, st.st_ino,
                                  time.monotonic() + self.hello_timeout)
                accepted = True
            elif event == zmq.EVENT_DISCONNECTED:
                # forgotten unless the fd names that socket still: a new connection
                # on the same number (accepted, maybe admitted, before this event was
                # read) keeps its entry (libzmq closes the old socket just after
                # telling; if it had not yet, its entry goes by the inode later)
                try:
                    st = os.fstat(value)
                    now_is = (st.st_dev, st.st_ino)
                except OSError:
                    now_is = None
                p = pending.get(value)
                if p is not None and p[:2] != now_is:
                    del pending[value]
                a = self._admitted.get(value)
                if a is not None and a != now_is:
                    del self._admitted[value]
            elif event & _HANDSHAKE_EVENTS:
                self._count_error("auth_refused")
                if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    why = "its key is not allowed"
                elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                    why = "CURVE handshake failed (no key, or not this server's public key)"
                else:
                    why = "handshake failed"
                log.warning("refused a client connection on %s: %s",
                            parts[1].decode(errors="replace"), why)
        if accepted:
            self._over_bound()

    def _over_bound(self) -> None:
        """Shut down the oldest unadmitted connections beyond the bound (one that could
        not be checked, no descriptor free, is held for the timer)."""
        pending = self._unadmitted
        bound = self._unadmitted_bound()
        while len(pending) > bound:
            fd, (dev, ino, _) = pending.popitem(last=False)
            got = shut_any(self._native, (fd, dev, ino))
            if got == UNTOLD:           # no descriptor to check it: the timer's, soon
                self._hold_untold(fd, dev, ino)
                break
            self._count_error("unadmitted_bound")
            if got == SHUT:
                log.info("connection on fd %d shut down: more than %d connections "
                         "without HELLO", fd, bound)

    def _native_accepted(self, fd: int) -> None:
        """The native listener accepted a connection on ``fd``: held as unadmitted (as an
        ACCEPTED event of the monitor), the oldest shut down beyond the bound."""
        try:
            st = os.fstat(fd)
        except OSError:
            return
        self._unadmitted.pop(fd, None)
        self._admitted.pop(fd, None)
        self._unadmitted[fd] = (st.st_dev, st.st_ino, time.monotonic() + self.hello_timeout)
        self._over_bound()

    def _native_ended(self, fd: int) -> None:
        """The native listener's connection on ``fd`` ended (told before its close)."""
        self._unadmitted.pop(fd, None)
        self._admitted.pop(fd, None)

    def _native_trusted(self, fd: int, ident: bytes) -> bool:
        """Whether the connection on ``fd`` may hold a message larger than a HELLO:
        admitted, or its routing id an open session's."""
        if fd in self._admitted and fd not in self._unadmitted:
            return True
        sess = self._by_ident.get(ident)
        if sess is None or sess.closed:
            return False
        b = sess.bound
        # a session's routing id vouches only on the connection its HELLO came on
        return b is None or (b[3] is not None and b[3].fd == fd and b[3].is_open)

    def _hold_untold(self, fd: int, dev: int, ino: int) -> None:
        """A connection to be shut down that could not be checked (no descriptor free):
        held again, first in line, due :data:`UNTOLD_RETRY_S` from now (the loop's
        timer then asks again). Its fd, dev, ino are kept, so the check is still of the
        connection recorded, not of whatever has the number by then."""
        pending = self._unadmitted
        pending[fd] = (dev, ino, time.monotonic() + UNTOLD_RETRY_S)
        pending.move_to_end(fd, last=False)

    def _admit(self, src: Any) -> None:
        """The connection ``src`` (a request's header frame, or a connection
        :func:`conn_of` took) is admitted: no longer held as unadmitted, and not held
        when its ACCEPTED event is read later."""
        conn = conn_of(src)
        if conn is None:
            return
        fd, dev, ino = conn
        got = self._unadmitted.get(fd)
        if got is not None and got[0] == dev and got[1] == ino:
            del self._unadmitted[fd]
        if self._admitting:
            self._admitted[fd] = (dev, ino)

    def _admit_live(self, ident: bytes, src: Any) -> None:
        """A request of ``ident`` on ``src`` (its header frame) while connections are
        unadmitted: its connection is admitted when ``ident`` names an open session
        (the client's connection made again under its routing id)."""
        sess = self._by_ident.get(ident)
        if sess is None or sess.closed:
            return
        if sess.bound is not None and not bound_ok(sess.bound, src):
            return                          # another connection: its own HELLO admits it
        if type(src) is not tuple:
            try:
                fd = src.get(zmq.SRCFD)
            except (zmq.ZMQError, AttributeError, TypeError):
                return
            if fd in self._admitted and fd not in self._unadmitted:
                return                      # admitted already (no fstat)
        self._admit(src)

    def _cut_unadmitted(self, now: float) -> None:
        """Shut down the unadmitted connections whose time is up. One that cannot be
        checked now (no descriptor free: :data:`~kvshm.zmq_ctrl.sends.UNTOLD`) stays
        held, first in line, and is asked about again :data:`UNTOLD_RETRY_S` later (the
        ones behind it would find no descriptor either); counted once, when cut or
        found gone."""
        pending = self._unadmitted
        while pending:
            fd, (dev, ino, deadline) = next(iter(pending.items()))
            if deadline > now:
                return
            del pending[fd]
            got = shut_any(self._native, (fd, dev, ino))
            if got == UNTOLD:
                self._hold_untold(fd, dev, ino)
                if now - _untold_logged[0] >= _UNTOLD_LOG_S:
                    _untold_logged[0] = now
                    log.warning("connection on fd %d: no HELLO within %g s, but no "
                                "descriptor free to check it: tried again every %g s "
                                "(logged once in %g s)", fd, self.hello_timeout,
                                UNTOLD_RETRY_S, _UNTOLD_LOG_S)
                return
            self._count_error("unadmitted_cut")
            if got == SHUT:
                log.info("connection on fd %d shut down: no HELLO within %g s", fd,
                         self.hello_timeout)

    def _admission_deadline(self) -> float | None:
        pending = self._unadmitted
        if not pending:
            return None
        return next(iter(pending.values()))[2]

    def _close_admission(self) -> None:
        if self._monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None
        self._unadmitted.clear()
        self._admitted.clear()
