"""The decode side of a prefill/decode handoff, as plans (see :mod:`kvshm.cluster.fanout`).

A :class:`~kvshm.handoff.Handoff` names the node, its address and its epoch: a node that
left the view or restarted (another epoch) gives all misses (the engine recomputes);
otherwise its keys are read from that node and the pin is dropped. A lost UNPIN only
lets the pin run to its deadline: the bytes are read.
"""

from __future__ import annotations

import logging
from typing import Any

from kvshm.cluster.fanout import Call, Fanout, Plan
from kvshm.errors import ServerUnavailable
from kvshm.handoff import Handoff

__all__ = ["read_handoff", "renew_handoff", "target_of"]

log = logging.getLogger(__name__)


def target_of(h: Handoff) -> str:
    """The node id, or ``@address`` for a handoff of a server outside a cluster."""
    return h.node_id or "@" + h.address


def read_handoff(fan: Fanout, handoff: Handoff | dict[str, Any], *, unpin: bool,
                 verify: bool) -> Plan:
    """Values of the handoff's keys (None per miss)."""
    h = handoff if isinstance(handoff, Handoff) else Handoff.from_dict(handoff)
    keys = list(h.keys)
    miss: list[bytes | None] = [None] * len(keys)
    m = fan.state.view.get(h.node_id) if h.node_id else None
    if h.node_id and (m is None or m.epoch != h.epoch):
        fan.m.miss("epoch" if m is not None else "peer_down", len(keys))
        return miss
    node = target_of(h)
    epoch = (yield {node: Call("epoch")})[node]
    if isinstance(epoch, ServerUnavailable):
        fan.m.miss("peer_down", len(keys))
        return miss
    if isinstance(epoch, BaseException):
        raise epoch
    if epoch != h.epoch:
        fan.m.miss("epoch", len(keys))
        return miss
    vals = (yield {node: Call("get_batch", (keys,), {"verify": verify})})[node]
    if isinstance(vals, ServerUnavailable):
        fan.m.miss("peer_down", len(keys))
        return miss
    if isinstance(vals, BaseException):
        raise vals
    fan.m.bytes_in(node, sum(len(v) for v in vals if v is not None))
    fan.m.miss("absent", sum(v is None for v in vals))
    if unpin:
        r = (yield {node: Call("unpin", (h,))})[node]
        if isinstance(r, ServerUnavailable):
            # the bytes are read: a lost UNPIN only lets the pin run to its end
            log.warning("unpin of handoff %d at %s failed: %s", h.pin, node, r)
        elif isinstance(r, BaseException):
            raise r
    return vals


def renew_handoff(fan: Fanout, handoff: Handoff, ttl: float) -> Plan:
    """Extend a handoff's pin at its node; None when the node is gone."""
    if not handoff.node_id or fan.state.view.get(handoff.node_id) is None:
        return None
    r = (yield {handoff.node_id: Call("renew", (handoff, ttl))})[handoff.node_id]
    if isinstance(r, BaseException):
        raise r
    return r
