"""Request limits (:class:`Limits`): enforced by the store and the server, announced to
clients in HELLO. A neutral module, so the store need not import the wire protocol
(:mod:`kvshm.zmq_ctrl.protocol` re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Limits", "HELLO_REPLY_BOUND", "REPLY_META_MIN", "REPLY_META_PER_KEY"]

#: Bytes a client accepts in one reply before the server's HELLO reply has told it the
#: pool's size (that reply is a few hundred bytes; 1 MiB leaves room for any server's).
HELLO_REPLY_BOUND = 1 << 20
#: Bytes of a reply's metadata (sizes, places, found flags, a LIST page's keys) a client
#: accepts beside the values: at least REPLY_META_MIN (64 MiB), else REPLY_META_PER_KEY
#: (64) bytes a key of the largest batch (a LOOKUP place is at most ~30 bytes of
#: msgpack, a GET size 9, a checksum 9).
REPLY_META_MIN = 64 << 20
REPLY_META_PER_KEY = 64


@dataclass(frozen=True)
class Limits:
    """Request limits enforced by the server and announced in HELLO.

    Attributes
    ----------
    max_key_bytes : int
        Longest key in bytes (default 4096, as InfiniStore's 4 KiB key limit).
    max_batch : int
        Most keys in one request (default 1,000,000: room for a 10,000-key prefix match
        a hundred times over, small enough that one message stays below ~4 GiB of keys).
    max_value_bytes : int
        Largest value in bytes (0: the pool size). A server sets it (``kvshm serve``:
        the pool, at most 256 MiB) so that the largest message it accepts is bounded by
        it, not by the pool.
    """

    max_key_bytes: int = 4096
    max_batch: int = 1_000_000
    max_value_bytes: int = 0

    def to_wire(self) -> dict[str, int]:
        return {"key": self.max_key_bytes, "batch": self.max_batch,
                "value": self.max_value_bytes}

    def reply_meta(self) -> int:
        """Bytes of metadata a client accepts in one reply (see REPLY_META_MIN)."""
        return max(REPLY_META_MIN, REPLY_META_PER_KEY * self.max_batch)

    def reply_bound(self, capacity: int) -> int:
        """Bytes a client accepts in one reply from a server whose pool holds
        ``capacity`` bytes: every value of one reply is in that pool at once, plus
        :meth:`reply_meta`. A larger reply is a ProtocolError (the connection closed)."""
        return max(0, int(capacity)) + self.reply_meta()

    def list_page(self, page: int) -> int:
        """The most keys of a LIST page whose reply stays within :meth:`reply_meta`
        (keys of ``max_key_bytes`` each, with their msgpack headers), at most ``page``."""
        return max(1, min(page, self.max_batch, self.reply_meta() // (self.max_key_bytes + 8)))

    @classmethod
    def from_wire(cls, d: dict[str, int]) -> "Limits":
        return cls(int(d["key"]), int(d["batch"]), int(d["value"]))
