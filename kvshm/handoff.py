"""Prefill/decode handoff: write locally, hand the location over.

The prefill side writes a request's KV into its own host's store (through shm, at memcpy
speed) with a *handoff pin*: a pin held by the server for ``ttl`` seconds, not by the
writer's session, so it outlives the writer's connection and keeps the entries from
eviction until the reader took them. ``Client.put_batch(keys, values, pin_ttl=S)``
returns a :class:`Handoff`; the engine's connector carries ``handoff.to_dict()`` in its
transfer parameters; the decode side reads from ``handoff.address`` (TCP or RDMA),
renews the pin while it reads if it needs more time, and unpins. A handoff whose
deadline passes unread expires on the server (the entries stay cached, unpinned).

A handoff names the server instance (``epoch``): if that server restarted, or the node
left, the read is a clean miss and the engine recomputes.

Wire (ops PIN / RENEW / UNPIN, :mod:`kvshm.zmq_ctrl.ops_cluster`)::

    PIN    {keys, ttl}  -> {pin, ttl, found: [bool]}   pins the found keys
    RENEW  {pin, ttl}   -> {ok: bool, ttl}             ok False: expired or unknown
    UNPIN  {pin}        -> {ok: bool}
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Handoff", "MAX_PIN_TTL", "check_ttl", "fetch"]

#: Longest handoff pin a server grants in one PIN or RENEW (seconds).
MAX_PIN_TTL = 600.0


def check_ttl(ttl: Any) -> float:
    """``ttl`` as seconds; ValueError unless a finite number in (0, MAX_PIN_TTL]."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) \
            or not 0 < ttl <= MAX_PIN_TTL:
        raise ValueError(f"pin ttl must be a number of seconds in (0, {MAX_PIN_TTL}], "
                         f"got {ttl!r}")
    return float(ttl)


@dataclass(frozen=True)
class Handoff:
    """Where a prefill left a request's KV.

    Attributes
    ----------
    node_id : str
        Cluster node id of the store ("" for a server outside a cluster).
    address : str
        ``host:port`` of that store's service port, as the reader reaches it.
    epoch : int
        That server instance; another epoch there means the data is gone.
    keys : tuple of bytes
        The keys written (in order); empty when ``first_key``/``count`` describe them.
    deadline : float
        Wall-clock time (``time.time()``) when the pin expires unless renewed.
    pin : int
        The server's handoff pin id (for RENEW / UNPIN).
    first_key : bytes, optional
        With ``count``: the keys are ``first_key`` and the ``count - 1`` that follow by
        the engine's own naming (the engine expands them); ``keys`` is then empty.
    count : int
        Number of keys (``len(keys)`` when keys are listed).
    """

    node_id: str
    address: str
    epoch: int
    keys: tuple[bytes, ...]
    deadline: float
    pin: int = 0
    first_key: bytes | None = None
    count: int = 0

    def __post_init__(self) -> None:
        def key(k: Any) -> bytes:
            if isinstance(k, str):
                return k.encode()
            if isinstance(k, (bytes, bytearray, memoryview)):
                return bytes(k)
            raise TypeError(f"a handoff key must be bytes or str, got {type(k).__name__}")

        object.__setattr__(self, "keys", tuple(key(k) for k in self.keys))
        if not self.count:
            object.__setattr__(self, "count", len(self.keys))
        elif self.keys and self.count != len(self.keys):
            raise ValueError(f"count {self.count} but {len(self.keys)} keys listed")

    @property
    def expired(self) -> bool:
        return time.time() >= self.deadline

    def remaining(self) -> float:
        """Seconds until the deadline (negative once passed)."""
        return self.deadline - time.time()

    def to_dict(self) -> dict[str, Any]:
        """A JSON- and msgpack-able dict (keys as hex strings); :meth:`from_dict` reads
        it back (and also takes keys given as bytes)."""
        d: dict[str, Any] = {"node_id": self.node_id, "address": self.address,
                             "epoch": self.epoch, "keys": [k.hex() for k in self.keys],
                             "deadline": self.deadline, "pin": self.pin,
                             "count": self.count}
        if self.first_key is not None:
            d["first_key"] = self.first_key.hex()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Handoff":
        """Inverse of :meth:`to_dict`. ValueError when ``d`` is not a handoff record."""

        def key(k: Any) -> bytes:
            # never bytes(int): that is n zero bytes (a hostile 10**12 allocates a TB)
            if isinstance(k, str):
                return bytes.fromhex(k)
            if isinstance(k, (bytes, bytearray, memoryview)):
                return bytes(k)
            raise TypeError(f"a key must be hex text or bytes, got {type(k).__name__}")

        def integer(v: Any, what: str) -> int:
            if type(v) is not int or v < 0:
                raise TypeError(f"{what} must be an int >= 0, got {v!r}")
            return v

        try:
            if not isinstance(d, dict):
                raise TypeError(f"expected a dict, got {type(d).__name__}")
            fk = d.get("first_key")
            raw_keys = d.get("keys") or ()
            if not isinstance(raw_keys, (list, tuple)):
                raise TypeError(f"keys must be a list, got {type(raw_keys).__name__}")
            deadline = d["deadline"]
            if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) \
                    or not math.isfinite(deadline):
                raise TypeError(f"deadline must be a finite number, got {deadline!r}")
            return cls(node_id=str(d["node_id"]), address=str(d["address"]),
                       epoch=integer(d["epoch"], "epoch"),
                       keys=tuple(key(k) for k in raw_keys),
                       deadline=float(deadline), pin=integer(d.get("pin", 0), "pin"),
                       first_key=key(fk) if fk is not None else None,
                       count=integer(d.get("count", 0), "count"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a handoff record: {exc!r}") from None


# ---------------------------------------------------------------------- op generators
# Driven by Client.run_op / AsyncClient.run_op (one protocol logic, sync and async).

def _where(session: Any, address: str) -> tuple[str, str]:
    c = session.hello.get("cluster") or {}
    return str(c.get("node_id", "")), str(c.get("advertise") or address)


def op_pin(session: Any, keys: Sequence[Any], ttl: float, address: str) -> Any:
    """PIN ``keys`` for ``ttl`` s; returns a :class:`Handoff` of the keys found.

    Raises KeyNotFound (with ``missing``) when a key is not stored."""
    from kvshm.errors import KeyNotFound
    from kvshm.replies import found_of
    from kvshm.zmq_ctrl.protocol import Op

    ttl = check_ttl(ttl)
    bkeys = session.keys(keys)
    if not bkeys:
        raise ValueError("a handoff needs at least one key")
    body = yield from session.op_simple(Op.PIN, {"keys": bkeys, "ttl": ttl}, "pin")
    session.raise_lost_commits()
    # (a found list of another length would leave keys out of missing: ProtocolError;
    # the pin it made, if any, ends with its ttl)
    missing = [k for k, f in zip(bkeys, found_of(body, len(bkeys), "PIN")) if not f]
    node_id, addr = _where(session, address)
    h = Handoff(node_id, addr, int(body["epoch"]), tuple(bkeys),
                time.time() + float(body["ttl"]), pin=int(body["pin"]))
    if missing:
        yield from session.op_simple(Op.UNPIN, {"pin": h.pin, "epoch": h.epoch}, "unpin")
        exc = KeyNotFound(f"{len(missing)} of {len(bkeys)} keys are not stored (first "
                          f"{missing[0]!r}); no handoff made")
        exc.missing = missing  # type: ignore[attr-defined]
        raise exc
    return h


def op_put_pinned(session: Any, keys: Sequence[Any], values: Sequence[Any],
                  checksum: bool, ttl: float, address: str) -> Any:
    """put_batch, then PIN (its COMMIT rides on the PIN: one round trip more than a
    plain put only over TCP). Returns the :class:`Handoff`."""
    ttl = check_ttl(ttl)
    yield from session.op_put_batch(keys, values, checksum, lazy=True)
    return (yield from op_pin(session, keys, ttl, address))


def _pin_of(h: "Handoff | int") -> dict[str, Any]:
    if isinstance(h, Handoff):
        return {"pin": h.pin, "epoch": h.epoch}
    if type(h) is int:
        return {"pin": h}
    raise TypeError(f"expected a Handoff or a pin id, got {type(h).__name__}")


def op_renew(session: Any, h: "Handoff | int", ttl: float) -> Any:
    """RENEW; returns the new deadline (time.time() seconds), or None when the pin had
    expired, was unpinned, or the server restarted (a clean miss)."""
    from kvshm.zmq_ctrl.protocol import Op

    body = yield from session.op_simple(Op.RENEW, {**_pin_of(h), "ttl": check_ttl(ttl)},
                                        "renew")
    return time.time() + float(body["ttl"]) if body.get("ok") else None


def op_unpin(session: Any, h: "Handoff | int") -> Any:
    """UNPIN; returns whether the pin was still held."""
    from kvshm.zmq_ctrl.protocol import Op

    body = yield from session.op_simple(Op.UNPIN, _pin_of(h), "unpin")
    return bool(body.get("ok"))


def fetch(client: Any, h: "Handoff | dict[str, Any]", outs: Sequence[Any] | None = None, *,
          unpin: bool = True) -> list[Any]:
    """Read a handoff with a plain :class:`kvshm.Client` connected to ``h.address``.

    Returns the values (bytes, None per miss), or with ``outs`` the sizes copied into
    them (-1 per miss). When the server there is another instance than the handoff's
    (``epoch``), every key is a miss and nothing is read. ``unpin`` drops the pin after
    the read.
    """
    h = h if isinstance(h, Handoff) else Handoff.from_dict(h)
    keys = list(h.keys)
    if not client.server_info:
        client.ping()
    if int(client.server_info.get("epoch", 0)) != h.epoch:
        return [-1 if outs is not None else None] * len(keys)
    if outs is not None:
        res: list[Any] = client.get_batch_into(keys, outs)
    else:
        res = client.get_batch(keys)
    if unpin:
        client.unpin(h)
    return res
