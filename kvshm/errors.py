"""Exceptions raised by kvshm.

One base, :class:`KvshmError`; each specific error also inherits the builtin it refines,
so ``except KeyError`` or ``except MemoryError`` keep working (msgpack's habit).
"""

from __future__ import annotations

__all__ = [
    "KvshmError",
    "KeyNotFound",
    "PoolFull",
    "ValueTooLarge",
    "InvalidKey",
    "InvalidRequest",
    "ServerUnavailable",
    "ProtocolError",
    "LeaseExpired",
    "QuotaExceeded",
    "CorruptValue",
    "TransportError",
    "AuthenticationFailed",
    "WriteRefused",
    "WritesLost",
]


class KvshmError(Exception):
    """Base of every kvshm error."""


class KeyNotFound(KvshmError, KeyError):
    """The key is not in the store (never written, deleted, evicted or still pending)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "key not found"


class PoolFull(KvshmError, MemoryError):
    """No space could be made for a value: every entry left is pinned or pending."""


class ValueTooLarge(KvshmError, ValueError):
    """A value larger than the pool (or the server's per-value limit)."""


class InvalidKey(KvshmError, ValueError):
    """An empty key, a key longer than the server's limit, or a key of the wrong type."""


class InvalidRequest(KvshmError, ValueError):
    """A request the server refused as malformed (bad batch size, bad argument)."""


class ServerUnavailable(KvshmError, ConnectionError):
    """No answer from the server within the timeout, or the server went away."""


class ProtocolError(KvshmError):
    """A reply that does not follow the protocol, or a protocol version mismatch."""


class LeaseExpired(KvshmError):
    """A pending write was reclaimed before COMMIT (its lease ran out)."""


class QuotaExceeded(KvshmError, MemoryError):
    """The client holds more pending bytes or pins than the server allows one client."""


class CorruptValue(KvshmError, ValueError):
    """A value failed its end-to-end checksum."""


class TransportError(KvshmError, OSError):
    """A mover failed (RDMA completion error, shm attach failure) for a reason it names."""


class AuthenticationFailed(KvshmError, PermissionError):
    """The server refused the connection's security handshake (CurveZMQ keys)."""


class WriteRefused(KvshmError):
    """Writes made behind (``write_behind=True``) that the server refused; raised by the
    client's next call after it learnt of them. ``failed`` maps each refused key to its
    :class:`~kvshm.zmq_ctrl.protocol.Status` (the reason); none of them was stored (an
    old value of such a key stays)."""

    def __init__(self, message: str, failed: "dict[bytes, object] | None" = None) -> None:
        super().__init__(message)
        self.failed = dict(failed or {})


class WritesLost(KvshmError):
    """Writes made behind that the server never acknowledged: it restarted (they are
    gone), or the connection was dropped before their replies came (they may or may not
    be stored). ``keys`` lists them; raised by the client's next call."""

    def __init__(self, message: str, keys: "list[bytes] | None" = None) -> None:
        super().__init__(message)
        self.keys = list(keys or [])
