"""How a :class:`kvshm.Server` joins a cluster: option checks and the wiring at start-up.

Kept here so that server.py only calls :func:`validate` and :func:`attach`.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

__all__ = ["validate", "attach", "add_cli_flags", "cli_options"]

log = logging.getLogger(__name__)


def validate(cfg: Any) -> tuple[str, str] | None:
    """Check the cluster options of a ServerConfig: None, or (option, message) of the
    first bad one (the server raises its ConfigError with them)."""
    from kvshm.cluster.membership import parse_etcd_url

    try:
        parse_etcd_url(cfg.cluster)
    except ValueError as exc:
        return "cluster", str(exc)
    if not cfg.cluster_name or "/" in cfg.cluster_name:
        return "cluster_name", f"must be non-empty without '/', got {cfg.cluster_name!r}"
    if cfg.node_id is not None and (not cfg.node_id or "/" in cfg.node_id):
        return "node_id", f"must be non-empty without '/', got {cfg.node_id!r}"
    if cfg.advertise is not None:
        host, sep, port = cfg.advertise.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            return "advertise", f"must be HOST:PORT, got {cfg.advertise!r}"
    if isinstance(cfg.cluster_ttl, bool) or not isinstance(cfg.cluster_ttl, (int, float)) \
            or not 1 <= cfg.cluster_ttl <= 3600:
        return "cluster_ttl", f"must be 1 to 3600 s, got {cfg.cluster_ttl!r}"
    return None


def attach(server: Any) -> None:
    """Register the cluster ops on a server's loop and, with ``--cluster``, start its
    membership agent (the service port is bound by now)."""
    from kvshm.zmq_ctrl.ops_cluster import ClusterOps

    cfg = server.config
    node_id = cfg.node_id or socket.gethostname()
    membership = None
    if cfg.cluster is not None:
        from kvshm.cluster.membership import Membership
        from kvshm.cluster.view import Member

        service = cfg.advertise or server.address
        pub = server.loop.hello.get("curve_public_key")
        member = Member(id=node_id, service=service, epoch=server.epoch,
                        pool_size=server.pool.size, block_size=server.pool.block_size,
                        ttl=float(cfg.cluster_ttl),
                        curve_public_key=pub.decode() if isinstance(pub, bytes) else pub,
                        rdma=server.loop.hello.get("rdma"))
        loop = server.loop
        # a new view: answer the parked CLUSTER_VIEW requests now (the push)
        membership = Membership(cfg.cluster, cfg.cluster_name, member, ttl=cfg.cluster_ttl,
                                on_change=lambda view: loop.poke())
        server.loop.hello["cluster"] = {"name": cfg.cluster_name, "node_id": node_id,
                                        "advertise": service}
    ops = ClusterOps(server.store, server.epoch, node_id if membership else "",
                     view=(lambda: membership.view) if membership else None,
                     drain=membership.drain if membership else None,
                     membership_stats=membership.stats if membership else None)
    server.cluster_ops = ops
    server.loop.add_ops(ops.handlers(), ops.tick)
    if membership is not None:
        server.membership = membership.start()
        log.info("joining cluster %s at %s as node %s", cfg.cluster_name, cfg.cluster,
                 node_id)


def add_cli_flags(p: Any) -> None:
    """`kvshm serve` flags of the cluster (docs/CLUSTER.md)."""
    p.add_argument("--cluster", default=None, metavar="etcd://H:P[,H:P...]",
                   help="join a cluster whose membership lives in these etcd endpoints")
    p.add_argument("--cluster-name", default="kvshm", help="cluster name (default kvshm)")
    p.add_argument("--node-id", default=None,
                   help="this node's id in the cluster (default: the host name); the same "
                        "id gets its place back after a restart")
    p.add_argument("--advertise", default=None, metavar="HOST:PORT",
                   help="service address other hosts use (default --host:--service-port)")
    p.add_argument("--cluster-ttl", type=float, default=5.0, metavar="S",
                   help="etcd lease seconds (default 5; kept alive every TTL/3)")


def cli_options(args: Any) -> dict[str, Any]:
    return {"cluster": getattr(args, "cluster", None),
            "cluster_name": getattr(args, "cluster_name", "kvshm"),
            "node_id": getattr(args, "node_id", None),
            "advertise": getattr(args, "advertise", None),
            "cluster_ttl": getattr(args, "cluster_ttl", 5.0)}
