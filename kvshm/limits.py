"""Request limits (:class:`Limits`): enforced by the store and the server, announced to
clients in HELLO. A neutral module, so the store need not import the wire protocol
(:mod:`kvshm.zmq_ctrl.protocol` re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Limits"]


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

    @classmethod
    def from_wire(cls, d: dict[str, int]) -> "Limits":
        return cls(int(d["key"]), int(d["batch"]), int(d["value"]))
