"""Zero-copy replies in flight: their pins settled once sent, a peer that does not read cut.

A GET reply of values of ``PACK_BELOW`` bytes and more is sent zero-copy from the pool,
its entries pinned (and its blocks counted against the principal) until libzmq lets go of
its frames (:meth:`~kvshm.zmq_ctrl.dispatch.DispatchMixin._reply` tracks it). Each turn
:meth:`SendsMixin._reap_sends` settles the sends done; a peer whose replies stay unsent
past the lease loses its connection (:meth:`SendsMixin._cut`); a reading peer's earlier
replies are let go before its new GET is counted (:meth:`SendsMixin._settle_own_sends`).
"""

from __future__ import annotations

import errno
import logging
import os
import socket as _socket
import time
from typing import Any

import zmq

from kvshm.store import Session
from kvshm.zmq_ctrl.listener import Header
from kvshm.zmq_ctrl.loopstate import LoopState

#: the loop's one logger: its records keep the name they had before the loop was
#: split into modules (as kvshm.store's modules share "kvshm.store")
log = logging.getLogger("kvshm.zmq_ctrl.router")


#: The ``conn`` of a request dispatched as it is received: :func:`conn_of` of its frame
#: is taken when its reply is queued (ServiceLoop._handle, DispatchMixin._dispatch).
CONN_NOW: Any = object()


def conn_of(frame: Any) -> tuple[int, int, int] | None:
    """The connection a received request ``frame`` (a libzmq message) came on, as
    ``(fd, st_dev, st_ino)``: its fd number (``zmq.SRCFD``) and what the kernel says
    that fd is now (fstat: a socket's inode). Taken when a tracked reply is queued, the
    request just received (its peer's pipe still up), for :meth:`SendsMixin._cut` to
    check later that the fd still names that socket. None where the frame has no fd
    (inproc, a test's stand-in) or the fd is closed already. A tuple is a connection
    taken already (a parked or sliced request's, when it came: its reply is queued turns
    later, when the fd number may be another client's): returned as it is."""
    if type(frame) is tuple:
        return frame
    try:
        fd = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    if type(fd) is not int or fd < 0:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return fd, st.st_dev, st.st_ino


#: the binding of a session whose HELLO's connection had ended before the HELLO was
#: served: no request matches it (:func:`bound_ok`)
DEAD: tuple[int, int, int, Any] = (-1, -1, -1, None)


def conn_key(src: Any, native: Any = None) -> tuple[int, int, int, Any] | None:
    """The connection a HELLO came on, as its session is bound to it
    (:attr:`Session.bound`): ``(fd, st_dev, st_ino, conn)``, ``conn`` the native
    listener's own connection object (:class:`~kvshm.zmq_ctrl.listener.Header`'s, one
    per connection, never reused while a session names it) or None under libzmq, where
    the fd and the inode fstat gives are the connection (:func:`conn_of`). ``src``: the
    request's header frame, or a connection :func:`conn_of` took when it came (a tuple).
    Returns None where there is no connection to bind to (inproc: no fd), :data:`DEAD`
    where it has ended already. ``native``: the native listener, when it is the loop's;
    a tuple is then bound to the connection object it still names
    (:meth:`~kvshm.zmq_ctrl.listener.NativeListener.connection`), as its requests'
    headers carry it, or is :data:`DEAD`."""
    if type(src) is Header:
        c = src.conn
        if not c.is_open:
            return DEAD
        try:
            st = os.fstat(c.fd)
        except OSError:
            return DEAD
        return c.fd, st.st_dev, st.st_ino, c
    if type(src) is tuple:
        if native is not None:
            c = native.connection(src[0], src[1], src[2])
            return DEAD if c is None else (src[0], src[1], src[2], c)
        return src[0], src[1], src[2], None
    try:
        fd = src.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    if type(fd) is not int or fd < 0:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        return DEAD
    return fd, st.st_dev, st.st_ino, None


def bound_ok(bound: tuple[int, int, int, Any], src: Any) -> bool:
    """Whether a request whose header frame (or :func:`conn_of` tuple) is ``src`` came
    on the connection ``bound`` (:func:`conn_key` of its session's HELLO). Native
    listener: the header's connection object is the bound one (no system call).
    libzmq: the frame's ``ZMQ_SRCFD`` is the bound fd and that fd is still the bound
    socket (fstat: the same ``st_dev``/``st_ino``; the kernel gives a closed fd's
    number to the next socket, so the number alone would take a later connection for
    the old one). A message libzmq read before its connection closed carries that fd
    number; once closed, fstat fails or names another socket: not the session's."""
    if type(src) is Header:
        return src.conn is bound[3]
    if type(src) is tuple:
        return src[0] == bound[0] and src[1] == bound[1] and src[2] == bound[2]
    if bound[3] is not None:
        return False                        # a native session's id on libzmq's inproc
    try:
        fd = src.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, TypeError):
        return False
    if fd != bound[0]:
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return st.st_ino == bound[2] and st.st_dev == bound[1]


def conn_still(native: Any, conn: Any) -> bool:
    """Whether the connection ``conn`` (a :func:`conn_of` tuple taken when a request
    came, or None: no fd, inproc) is still that socket, so a reply served turns later
    (read in slices, parked, encoded over turns) goes to the peer that asked, not to a
    later connection holding its routing id (a client reconnected, or a peer that
    claimed the id once the asker's connection ended). ``native``: the native listener
    (its connection object still open on that fd), or None: libzmq (fstat of the fd
    gives the same ``st_dev``/``st_ino``). A non-tuple (a header frame: the request was
    received just now) is the connection. One fstat; raises nothing."""
    if type(conn) is not tuple:
        return True
    if native is not None:
        return native.connection(conn[0], conn[1], conn[2]) is not None
    try:
        st = os.fstat(conn[0])
    except OSError:
        return False
    return st.st_ino == conn[2] and st.st_dev == conn[1]


#: what :func:`shut_conn` answers: the socket was shut down
SHUT = "shut"
#: ... the fd is closed, or names another socket, a file or a pipe now (or no
#: connection was named): nothing was done, nothing is to be done later
GONE = "gone"
#: ... no descriptor was free to check it (EMFILE, ENFILE, ENOMEM from dup(2)): nothing
#: was done; the caller asks again later (the connection may still be the one named)
UNTOLD = "untold"

_NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def shut_any(native: Any, conn: tuple[int, int, int] | None) -> str:
    """:func:`shut_conn`, or where the loop serves through a native listener
    (:class:`~kvshm.zmq_ctrl.listener.NativeListener`, ``native``), its own
    ``shut``: it closes a connection of its own with no descriptor needed, so it answers
    :data:`SHUT` or :data:`GONE`, never :data:`UNTOLD`."""
    if native is not None:
        return SHUT if native.shut(conn) else GONE
    return shut_conn(conn)


def shut_conn(conn: tuple[int, int, int] | None) -> str:
    """Shut down (``SHUT_RDWR``) the socket ``conn`` names, ``(fd, st_dev, st_ino)`` as
    :func:`conn_of` took it, if its fd still names that socket (its inode, which the
    kernel does not reuse while that socket is open); libzmq then sees the end and
    closes it. The one check of "is this fd still the connection recorded" of the
    loop (:meth:`SendsMixin._cut`, :mod:`kvshm.zmq_ctrl.admission`).

    The check and the shutdown are made on a dup(2) of the fd, never on the number:
    between an fstat of the number and a shutdown of it, libzmq's I/O thread may close
    it and another thread's socket take the number; the dup holds the open file the
    fstat looked at. So the check needs one free descriptor.

    Returns :data:`SHUT` (shut down), :data:`GONE` (``conn`` None, the fd closed, or it
    names another socket, a file, a pipe, or a socket not of AF_INET/AF_INET6/AF_UNIX)
    or :data:`UNTOLD` (no descriptor free for the dup: EMFILE, ENFILE, ENOMEM; nothing
    done, ask again later). Never raises."""
    if conn is None:
        return GONE
    fd, dev, ino = conn
    try:
        d = os.dup(fd)
    except OSError as exc:
        return UNTOLD if exc.errno in _NO_DESCRIPTOR else GONE     # EBADF: closed by now
    try:
        s = _socket.socket(fileno=d)
    except OSError:                         # not a socket now (a file, a pipe, an
        os.close(d)                         # eventfd got the number): the dup goes
        return GONE
    try:
        st = os.fstat(s.fileno())
        if (st.st_dev, st.st_ino) != (dev, ino):
            return GONE
        if s.family not in (_socket.AF_INET, _socket.AF_INET6, _socket.AF_UNIX):
            return GONE
        s.shutdown(_socket.SHUT_RDWR)
        return SHUT
    except OSError:
        return GONE
    finally:
        s.close()


class SendsMixin(LoopState):
    """Sends in flight of ServiceLoop (a mixin of it)."""

    def _reap_sends(self, now: float) -> None:
        keep = []
        stuck: dict[bytes, Any] = {}
        lease = self.store.config.lease_timeout
        for item in self._sending:
            tracker, entries, nblocks, sess, ident, since, conn = item
            if tracker.done:
                self.store.sent(sess, nblocks, entries)
            else:
                keep.append(item)
                if now - since > lease and ident not in stuck:
                    stuck[ident] = conn
                    # once: its connection goes now; a new one starts a new count
                    keep[-1] = (*item[:5], now, conn)
        self._sending = keep
        for ident, conn in stuck.items():
            self._cut(ident, conn)

    def _cut(self, ident: bytes, conn: Any) -> str:
        """A peer has not read its replies within the lease: shut its connection down
        (libzmq then drops the unsent replies, and their pins go when their trackers
        say so). ``conn``: that peer's connection as :func:`conn_of` took it when the
        reply was queued, ``(fd, st_dev, st_ino)``, or None (nothing is shut down).

        The fd number alone is not that connection: once the peer's connection closes,
        libzmq closes the fd and the kernel gives the same number to the next socket
        opened (another client's accepted connection). The socket is shut down only if
        the fd still names the same socket (its inode, which the kernel does not reuse
        while that socket is open, and ours is until libzmq closes it): :func:`shut_conn`.
        Returns what it answered; :data:`UNTOLD` (no descriptor free to check) leaves
        the connection up, and the replies' next lease tries again."""
        log.warning("peer %s has not read its replies within the lease (%g s): its "
                    "connection is dropped", ident.hex(), self.store.config.lease_timeout)
        self._count_error("unread_replies")
        got = shut_any(self._native, conn)
        if got == GONE and conn is not None:
            log.info("peer %s: its connection is gone (fd %d closed, or another socket's "
                     "or file's now): left alone", ident.hex(), conn[0])
        elif got == UNTOLD:
            log.warning("peer %s: no descriptor free to check its connection (fd %d): "
                        "tried again after the next lease", ident.hex(), conn[0])
        return got

    def _settle_own_sends(self, session: Session) -> None:
        """This peer's earlier GET replies leave before the reply to its new request
        (one pipe, in order) and it is reading: let their zero-copy pins go first, so
        that what it has already received is not counted against it. Bounded: only
        replies queued within the last second, 0.1 s in all; and once such a wait ran
        out, none more for this session while the reply it waited for is unsent: a
        peer that pipelines requests and does not read holds the loop (every other
        client) 0.1 s once, not 0.1 s a request."""
        if not session.sending:
            return
        unsettled = getattr(self, "_unsettled", None)
        if unsettled is None:       # (a loop made without ServiceLoop.__init__)
            unsettled = self._unsettled = {}
        stuck = unsettled.get(id(session))
        if stuck is not None:
            if stuck[0] is session and not stuck[1].done:
                self._reap_sends(time.monotonic())
                return
            del unsettled[id(session)]
        now = time.monotonic()
        deadline = now + 0.1
        for tracker, _, _, sess, _, since, _ in self._sending:
            if sess is session and not tracker.done and now - since < 1.0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    tracker.wait(left)
                except zmq.NotDone:
                    if len(unsettled) >= 64:
                        # (sessions gone since: their trackers are done by now)
                        for k in [k for k, v in unsettled.items() if v[1].done]:
                            del unsettled[k]
                    unsettled[id(session)] = (session, tracker)
                    break
        self._reap_sends(time.monotonic())
