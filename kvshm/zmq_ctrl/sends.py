"""Zero-copy replies in flight: their pins settled once sent, a peer that does not read cut.

A GET reply of values of ``PACK_BELOW`` bytes and more is sent zero-copy from the pool,
its entries pinned (and its blocks counted against the principal) until libzmq lets go of
its frames (:meth:`~kvshm.zmq_ctrl.dispatch.DispatchMixin._reply` tracks it). Each turn
:meth:`SendsMixin._reap_sends` settles the sends done; a peer whose replies stay unsent
past the lease loses its connection (:meth:`SendsMixin._cut`); a reading peer's earlier
replies are let go before its new GET is counted (:meth:`SendsMixin._settle_own_sends`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from kvshm.store import Session
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

    def _cut(self, ident: bytes, conn: Any) -> None:
        """A peer has not read its replies within the lease: shut its connection down
        (libzmq then drops the unsent replies, and their pins go when their trackers
        say so). ``conn``: that peer's connection as :func:`conn_of` took it when the
        reply was queued, ``(fd, st_dev, st_ino)``, or None (nothing is shut down).

        The fd number alone is not that connection: once the peer's connection closes,
        libzmq closes the fd and the kernel gives the same number to the next socket
        opened (another client's accepted connection). The socket is shut down only if
        the fd still names the same socket (its inode, which the kernel does not reuse
        while that socket is open, and ours is until libzmq closes it)."""
        log.warning("peer %s has not read its replies within the lease (%g s): its "
                    "connection is dropped", ident.hex(), self.store.config.lease_timeout)
        self._count_error("unread_replies")
        if conn is None:
            return
        fd, dev, ino = conn
        import socket as _socket

        try:
            d = os.dup(fd)
        except OSError:
            return                          # closed by now
        try:
            s = _socket.socket(fileno=d)
        except OSError:                     # not a socket now (a file, a pipe, an
            os.close(d)                     # eventfd got the number): the dup goes
            return
        try:
            st = os.fstat(s.fileno())
            if (st.st_dev, st.st_ino) != (dev, ino):
                log.info("peer %s: its connection is gone, fd %d is another socket's "
                         "now: left alone", ident.hex(), fd)
                return
            if s.family not in (_socket.AF_INET, _socket.AF_INET6, _socket.AF_UNIX):
                return
            s.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()

    def _settle_own_sends(self, session: Session) -> None:
        """This peer's earlier GET replies leave before the reply to its new request
        (one pipe, in order) and it is reading: let their zero-copy pins go first, so
        that what it has already received is not counted against it. Bounded: only
        replies queued within the last second, 0.1 s in all; a peer that does not read
        gains no more than that."""
        if not session.sending:
            return
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
                    break
        self._reap_sends(time.monotonic())
