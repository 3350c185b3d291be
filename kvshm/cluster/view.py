"""The member view: what a server learnt from etcd and hands to its clients.

A :class:`Member` is one server's record under ``/kvshm/<cluster>/nodes/<id>`` (JSON
in etcd, a plain dict on the wire); a :class:`View` is all of them at one etcd revision.
Neither knows etcd nor sockets, so a client (which needs no etcd) and the server's
membership agent share them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["Member", "View", "UP", "DRAINING", "node_key", "nodes_prefix"]

UP = "up"
DRAINING = "draining"
STATUSES = (UP, DRAINING)
#: Bounds of a member record's numbers: ints msgpack packs (CLUSTER_VIEW) and floats
#: placement can weigh; a lease longer than an hour is no lease.
MAX_INT = (1 << 63) - 1
MAX_TTL = 3600.0


def nodes_prefix(cluster: str) -> str:
    """etcd prefix of a cluster's member records."""
    return f"/kvshm/{cluster}/nodes/"


def node_key(cluster: str, node_id: str) -> str:
    return nodes_prefix(cluster) + node_id


@dataclass(frozen=True)
class Member:
    """One server of the cluster.

    Attributes
    ----------
    id : str
        Node id (stable across restarts: ``--node-id``, default the host name).
    service : str
        ``host:port`` of its service port, as other hosts reach it (``--advertise``).
    epoch : int
        Server instance number (changes at every start; a handoff names it).
    pool_size, block_size : int
        Bytes; the pool size is the member's placement weight.
    status : {"up", "draining"}
    ttl : float
        Seconds of its etcd lease (a suspect mark lasts at most that long).
    curve_public_key : str, optional
        Z85 CurveZMQ key when the server requires CURVE.
    rdma : dict, optional
        RDMA endpoint information when the server has a device.
    """

    id: str
    service: str
    epoch: int
    pool_size: int
    block_size: int
    status: str = UP
    ttl: float = 5.0
    curve_public_key: str | None = None
    rdma: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "service": self.service, "epoch": self.epoch,
                             "pool_size": self.pool_size, "block_size": self.block_size,
                             "status": self.status, "ttl": self.ttl}
        if self.curve_public_key is not None:
            d["curve_public_key"] = self.curve_public_key
        if self.rdma is not None:
            d["rdma"] = self.rdma
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Member":
        """Raises ValueError on a record missing a field or with a wrong type or an
        absurd value (a hostile or broken member must not break the watcher nor any
        client's placement)."""
        if not isinstance(d, dict):
            raise ValueError(f"member record is not a mapping: {type(d).__name__}")

        def integer(name: str, lo: int, hi: int) -> int:
            v = d[name]
            if type(v) is not int or not lo <= v <= hi:
                raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")
            return v

        def text(name: str, v: Any) -> str:
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name} must be a non-empty string, got {v!r}")
            return v

        try:
            known = {"id", "service", "epoch", "pool_size", "block_size", "status", "ttl",
                     "curve_public_key", "rdma"}
            ttl = d.get("ttl", 5.0)
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) \
                    or not 0 < ttl <= MAX_TTL:
                raise ValueError(f"ttl must be a number of seconds in (0, {MAX_TTL}], "
                                 f"got {ttl!r}")
            key = d.get("curve_public_key")
            if key is not None and not isinstance(key, str):
                raise ValueError(f"curve_public_key must be a string, got {key!r}")
            rdma = d.get("rdma")
            if rdma is not None and not isinstance(rdma, dict):
                raise ValueError(f"rdma must be an object, got {rdma!r}")
            m = cls(id=text("id", d["id"]), service=text("service", d["service"]),
                    epoch=integer("epoch", 0, MAX_INT),
                    pool_size=integer("pool_size", 1, MAX_INT),
                    block_size=integer("block_size", 1, MAX_INT),
                    status=text("status", d.get("status", UP)), ttl=float(ttl),
                    curve_public_key=key, rdma=rdma,
                    extra={k: v for k, v in d.items() if k not in known})
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"bad member record: {exc!r}"[:500]) from None
        if m.status not in STATUSES:
            raise ValueError(f"bad member status {m.status!r}")
        return m

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Member":
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"member record is not JSON: {exc}") from None
        if not isinstance(d, dict):
            raise ValueError("member record is not a JSON object")
        return cls.from_dict(d)


@dataclass(frozen=True)
class View:
    """The members at one etcd revision (``revision`` 0: never listed)."""

    revision: int = 0
    members: tuple[Member, ...] = ()
    cluster: str = ""
    #: False while the server's last contact with etcd failed (the view is kept).
    fresh: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(sorted(self.members, key=lambda m: m.id)))

    @property
    def up(self) -> tuple[Member, ...]:
        """Members that take new keys (status ``up``), sorted by id."""
        return tuple(m for m in self.members if m.status == UP)

    def get(self, node_id: str) -> Member | None:
        for m in self.members:
            if m.id == node_id:
                return m
        return None

    def same_members(self, other: "View") -> bool:
        return self.members == other.members

    def to_dict(self) -> dict[str, Any]:
        return {"revision": self.revision, "cluster": self.cluster, "fresh": self.fresh,
                "nodes": [m.to_dict() for m in self.members]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "View":
        nodes = d.get("nodes")
        if not isinstance(nodes, list):
            raise ValueError("view must carry a list 'nodes'")
        return cls(revision=int(d.get("revision", 0)),
                   members=tuple(Member.from_dict(n) for n in nodes),
                   cluster=str(d.get("cluster", "")), fresh=bool(d.get("fresh", True)))

    @classmethod
    def of(cls, members: Iterable[Member], revision: int = 0, cluster: str = "") -> "View":
        return cls(revision=revision, members=tuple(members), cluster=cluster)
