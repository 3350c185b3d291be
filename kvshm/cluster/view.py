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
        """Raises ValueError on a record missing a field or with a wrong type."""
        try:
            known = {"id", "service", "epoch", "pool_size", "block_size", "status", "ttl",
                     "curve_public_key", "rdma"}
            m = cls(id=str(d["id"]), service=str(d["service"]), epoch=int(d["epoch"]),
                    pool_size=int(d["pool_size"]), block_size=int(d["block_size"]),
                    status=str(d.get("status", UP)), ttl=float(d.get("ttl", 5.0)),
                    curve_public_key=d.get("curve_public_key"), rdma=d.get("rdma"),
                    extra={k: v for k, v in d.items() if k not in known})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad member record {d!r}: {exc!r}") from None
        if m.status not in STATUSES:
            raise ValueError(f"bad member status {m.status!r}")
        if m.pool_size <= 0:
            raise ValueError(f"member {m.id}: pool_size must be > 0")
        return m

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Member":
        try:
            d = json.loads(raw)
        except ValueError as exc:
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
