"""`kvshm ctl cluster` and `kvshm ctl drain`."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["add_ctl_parsers", "ctl", "op_view"]


def add_ctl_parsers(csub: Any) -> None:
    cl = csub.add_parser("cluster", help="print the cluster view the server holds")
    cl.add_argument("--json", action="store_true", help="JSON: {revision, nodes: [...]}")
    dr = csub.add_parser("drain", help="mark this server draining in the cluster (it takes "
                                       "no new keys), then leave it")
    dr.add_argument("--leave-after", type=float, default=None, metavar="S",
                    help="leave the cluster S seconds after draining starts (its record is "
                         "deleted; the server serves on until stopped); default: stay "
                         "draining until the server stops")


def op_view(session: Any, since: int = -1, stats: bool = False,
            wait: float | None = None) -> Any:
    """CLUSTER_VIEW: the server's reply body (``view`` present when its revision is not
    ``since``). ``wait`` seconds: when the server's revision is ``since``, it answers
    only once it changes, or after that long (the client's timeout must be longer)."""
    from kvshm.zmq_ctrl.protocol import Op

    req: dict[str, Any] = {"since": since, "stats": stats}
    if wait:
        req["wait"] = wait
    body = yield from session.op_simple(Op.CLUSTER_VIEW, req, "cluster view")
    return body


def ctl(client: Any, args: Any) -> int:
    from kvshm.zmq_ctrl.protocol import Op

    if args.action == "drain":
        body = {} if args.leave_after is None else {"leave_after": args.leave_after}
        client.run_op(client.session.op_simple(Op.DRAIN, body, "drain"))
    body = client.run_op(op_view(client.session, stats=True))
    view = body.get("view") or {"revision": body["revision"], "nodes": []}
    out = {"revision": view["revision"], "node_id": body["node_id"],
           "clustered": body["clustered"], "fresh": body["fresh"],
           "nodes": view["nodes"], "stats": body.get("stats", {})}
    if args.action == "drain" or getattr(args, "json", False):
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    if not body["clustered"]:
        print("not in a cluster")
        return 0
    print(f"revision {out['revision']}{'' if out['fresh'] else ' (etcd unreachable: last view)'}"
          f", this node {out['node_id']}")
    for n in out["nodes"]:
        print(f"{n['id']}\t{n['status']}\t{n['service']}\tpool {n['pool_size']}\t"
              f"epoch {n['epoch']}")
    return 0
