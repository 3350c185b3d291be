"""kvshm across hosts: membership in etcd, placement, the cluster client (docs/CLUSTER.md).

Engine processes import only :mod:`kvshm.cluster.client` (through
``kvshm.ClusterClient``), which needs no etcd client; the server's membership agent
(:mod:`kvshm.cluster.membership`) imports the etcd client lazily.
"""

from kvshm.cluster.view import DRAINING, UP, Member, View

__all__ = ["Member", "View", "UP", "DRAINING"]
