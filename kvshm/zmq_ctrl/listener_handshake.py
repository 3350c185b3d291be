"""The native listener's side of ZMTP 3's handshake and commands (kvshm.zmq_ctrl.listener).

The greeting it sends (signature, version 3.0, NULL), its READY (``Socket-Type`` ROUTER),
and what it does with a peer's commands once :mod:`kvshm.zmq_ctrl._zmtpsrv` has parsed
them: the peer's READY (its ``Socket-Type``, one a ROUTER takes; its ``Identity``, the
routing id: at most 255 bytes, not one a connected peer holds; none: a random one made
here), PING (a PONG with its context, unless output is queued still), anything else
ignored, as a ROUTER does. A malformed or unexpected command raises
:class:`ProtocolError` (``bad_ready``, ``id_taken``): the connection goes.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from typing import Any, Sequence

try:
    from kvshm.zmq_ctrl._zmtpsrv import ProtocolError
except ImportError:     # pragma: no cover - not built (the native listener refuses to start)
    class ProtocolError(ValueError):  # type: ignore[no-redef]
        """What a peer sent is not ZMTP 3 as the listener takes it."""

log = logging.getLogger("kvshm.zmq_ctrl.listener")

# connection states (kvshm.zmq_ctrl._zmtpsrv's): its READY awaited, open
_READY, _OPEN = 1, 2
#: Socket types a ROUTER takes at a peer's READY.
SOCKET_TYPES = (b"DEALER", b"ROUTER", b"REQ")


def greeting() -> bytes:
    """The 64-byte greeting: signature, version 3.0, NULL, as-server 0 (NULL has no
    server role), filler."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32


def command(name: bytes, props: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    """A command frame (flags, size, body) named ``name`` with properties ``props``."""
    body = bytes([len(name)]) + name
    for k, v in props:
        body += bytes([len(k)]) + k + struct.pack(">I", len(v)) + v
    if len(body) > 255:
        return b"\x06" + struct.pack(">Q", len(body)) + body
    return bytes([0x04, len(body)]) + body


GREET = greeting()
SERVER_READY = command(b"READY", [(b"Socket-Type", b"ROUTER")])


def parse_props(body: bytes | memoryview, at: int) -> dict[bytes, bytes]:
    """The properties of a ZMTP command body from offset ``at``: name (1-byte length),
    value (4-byte big-endian length); names lower-cased. Raises :class:`ProtocolError`
    when malformed."""
    out: dict[bytes, bytes] = {}
    n = len(body)
    while at < n:
        k = body[at]
        if k == 0 or at + 1 + k + 4 > n:
            raise ProtocolError("malformed property")
        name = bytes(body[at + 1:at + 1 + k])
        at += 1 + k
        (v,) = struct.unpack_from(">I", body, at)
        at += 4
        if at + v > n:
            raise ProtocolError("malformed property value")
        out[name.lower()] = bytes(body[at:at + v])
        at += v
    return out


def ended(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` has closed it (end of stream or an error waiting),
    without taking any byte."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class Handshake:
    """The commands of a :class:`~kvshm.zmq_ctrl.listener.NativeListener`'s connections
    (a mixin of it: its ``_by_ident``, ``_handshaking`` and ``_close``)."""

    _by_ident: dict[bytes, Any]
    _handshaking: Any

    def _close(self, c: Any, why: str | None) -> None:  # pragma: no cover - the listener's
        raise NotImplementedError

    def _command(self, c: Any, body: bytes) -> None:
        """A command ``body`` (name length, name, data) from connection ``c``. Raises
        :class:`ProtocolError` (``bad_ready``, ``id_taken``)."""
        if not body or len(body) < 1 + body[0]:
            raise ProtocolError("bad_ready")
        name = body[1:1 + body[0]]
        if c.state == _READY:
            if name != b"READY":
                raise ProtocolError("bad_ready")
            try:
                props = parse_props(body, 1 + body[0])
            except ProtocolError:
                raise ProtocolError("bad_ready") from None
            st = props.get(b"socket-type", b"")
            if st not in SOCKET_TYPES:
                raise ProtocolError("bad_ready")
            c.stype = st.decode()
            ident = props.get(b"identity", b"")
            if len(ident) > 255:
                raise ProtocolError("bad_ready")
            if ident:
                old = self._by_ident.get(ident)
                if old is not None and ended(old.sock):
                    self._close(old, None)      # its end not read yet: no handover
                if ident in self._by_ident:
                    log.info("connection on fd %d claims the routing id of a connected "
                             "peer (%s): closed", c.fd, ident.hex())
                    raise ProtocolError("id_taken")
            else:
                # random, not a count: a session outlives its connection, and an id
                # a peer could guess (b"\0n" + 1, 2, ...) would let another peer claim
                # it at its READY and be served in that session
                while True:
                    ident = b"\0n" + os.urandom(14)
                    if ident not in self._by_ident:
                        break
            c.ident = ident
            self._by_ident[ident] = c
            self._handshaking.pop(c.fd, None)
            c.state = _OPEN
            c.queue(SERVER_READY)
            return
        if name == b"PING" and len(body) >= 1 + body[0] + 2:
            if c.out:
                # output is queued still (the peer does not read, or not yet): no PONG
                # more, at most one pending, as libzmq (a PING flood from a peer that
                # never reads cannot grow the queue, nor cost a sendmsg a PING)
                return
            ctx = body[1 + body[0] + 2:][:16]
            b = b"\x04PONG" + ctx
            c.queue(bytes([0x04, len(b)]) + b)
        # other commands (PONG, SUBSCRIBE...) are ignored, as a ROUTER does
