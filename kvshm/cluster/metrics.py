"""Cluster metrics: the client's counters and Prometheus collectors for both sides.

Client side (:class:`ClusterMetrics`, one per :class:`~kvshm.ClusterClient`): misses by
reason, fallback hits and copies, rerouted writes, suspect marks, view revision and
changes, and per peer requests, bytes, latency and errors. ``ClusterClient.metrics()``
returns them as a dict; ``ClusterClient.collector()`` is a ``prometheus_client``
collector an engine may register in its own registry (``prometheus_client`` is needed
only then).

Server side (:class:`ServerClusterCollector`): the management port's ``/metrics``
(:mod:`kvshm.manage`) reads CLUSTER_VIEW with ``stats`` on each scrape: view revision,
view changes, members by status, handoff pins held/expired/renewed/refused, etcd errors
and the membership agent's other counters.

Metric names (all prefixed ``kvshm_cluster_``) are listed in docs/CLUSTER.md.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterator

__all__ = ["ClusterMetrics", "ClientCollector", "ClientsCollector", "clients_collector",
           "ServerClusterCollector", "MISS_REASONS"]

#: Why a key read as a miss: not stored at the owner, its owner unreachable or gone,
#: its owner suspect (not asked), a handoff of another server instance.
MISS_REASONS = ("absent", "peer_down", "suspect", "epoch")


class _Peer:
    __slots__ = ("requests", "bytes_in", "bytes_out", "seconds", "errors")

    def __init__(self) -> None:
        self.requests = self.bytes_in = self.bytes_out = self.errors = 0
        self.seconds = 0.0


class ClusterMetrics:
    """Counters of one cluster client (thread-safe enough for counters: each update is
    one ``+=`` under the GIL, read as a snapshot)."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = defaultdict(int)
        self.peers: dict[str, _Peer] = defaultdict(_Peer)
        self._lock = threading.Lock()

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def miss(self, reason: str, n: int = 1) -> None:
        self.counters[f"miss_{reason}"] += n

    def request(self, node: str, seconds: float, bytes_out: int = 0) -> None:
        """A request to ``node`` answered in ``seconds``."""
        with self._lock:
            p = self.peers[node]
            p.requests += 1
            p.seconds += seconds
            p.bytes_out += bytes_out

    def bytes_in(self, node: str, n: int) -> None:
        with self._lock:
            self.peers[node].bytes_in += n

    def error(self, node: str) -> None:
        with self._lock:
            self.peers[node].errors += 1

    def snapshot(self, view: Any, suspects: list[str]) -> dict[str, Any]:
        """The dict :meth:`kvshm.ClusterClient.metrics` returns."""
        c = self.counters
        with self._lock:
            peers = {n: {"requests": p.requests, "bytes_in": p.bytes_in,
                         "bytes_out": p.bytes_out, "errors": p.errors,
                         "mean_latency_s": p.seconds / p.requests if p.requests else 0.0,
                         "seconds": p.seconds}
                     for n, p in self.peers.items()}
        return {"view_revision": view.revision, "view_changes": c["view_changes"],
                "members": len(view.members), "up": len(view.up), "suspects": suspects,
                "misses": {r: c[f"miss_{r}"] for r in MISS_REASONS},
                "fallback_hits": c["fallback_hits"],
                "fallback_copies": c["fallback_copies"],
                "rerouted_writes": c["rerouted_writes"],
                "suspect_marks": c["suspect_marks"],
                "view_pushes": c["view_pushes"],
                "peers": peers}


def _families() -> Any:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        SummaryMetricFamily,
    )
    return CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily


class ClientCollector:
    """``prometheus_client`` collector of a cluster client's :meth:`metrics`.

    Parameters
    ----------
    metrics : callable
        Returns :meth:`kvshm.ClusterClient.metrics`'s dict.
    labels : dict, optional
        Constant labels added to every sample (e.g. ``{"engine": "decode-0"}``).

    Examples
    --------
    >>> from prometheus_client import REGISTRY               # doctest: +SKIP
    >>> REGISTRY.register(cluster_client.collector())        # doctest: +SKIP
    """

    def __init__(self, metrics: Callable[[], dict[str, Any]],
                 labels: dict[str, str] | None = None) -> None:
        self._metrics = metrics
        self._labels = dict(labels or {})

    def collect(self) -> Iterator[Any]:
        Counter, Gauge, Summary = _families()
        m = self._metrics()
        if not m:
            return
        ln = list(self._labels)
        lv = [self._labels[k] for k in ln]

        def gauge(name: str, doc: str, value: float) -> Any:
            g = Gauge(f"kvshm_cluster_client_{name}", doc, labels=ln)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> Any:
            c = Counter(f"kvshm_cluster_client_{name}", doc, labels=ln)
            c.add_metric(lv, value)
            return c

        yield gauge("view_revision", "etcd revision of the member view this client uses",
                    m["view_revision"])
        yield counter("view_changes", "Changes of the member list seen", m["view_changes"])
        yield counter("view_pushes", "Views received by the push (a parked CLUSTER_VIEW "
                      "answered on a revision change)", m.get("view_pushes", 0))
        yield gauge("members", "Members in the view", m["members"])
        yield gauge("members_up", "Members taking new keys", m["up"])
        yield gauge("suspects", "Members marked suspect now", len(m["suspects"]))
        miss = Counter("kvshm_cluster_client_misses", "Keys read as misses, by reason",
                       labels=ln + ["reason"])
        for reason, n in sorted(m["misses"].items()):
            miss.add_metric(lv + [reason], n)
        yield miss
        yield counter("fallback_hits", "Hits at a second choice after a view change",
                      m["fallback_hits"])
        yield counter("fallback_copies", "Fallback hits copied home to the first choice",
                      m["fallback_copies"])
        yield counter("rerouted_writes", "Keys written to the next choice because their "
                      "owner failed", m["rerouted_writes"])
        yield counter("suspect_marks", "Members marked suspect after a failed request",
                      m["suspect_marks"])
        labels = ln + ["peer"]
        req = Summary("kvshm_cluster_client_peer_request_seconds",
                      "Requests to each member and the seconds they took", labels=labels)
        bin_ = Counter("kvshm_cluster_client_peer_bytes_in",
                       "Value bytes read from each member", labels=labels)
        bout = Counter("kvshm_cluster_client_peer_bytes_out",
                       "Value bytes written to each member", labels=labels)
        err = Counter("kvshm_cluster_client_peer_errors",
                      "Requests to each member that failed (timeout, gone)", labels=labels)
        for peer, p in sorted(m["peers"].items()):
            req.add_metric(lv + [peer], count_value=p["requests"], sum_value=p["seconds"])
            bin_.add_metric(lv + [peer], p["bytes_in"])
            bout.add_metric(lv + [peer], p["bytes_out"])
            err.add_metric(lv + [peer], p["errors"])
        yield req
        yield bin_
        yield bout
        yield err


class ClientsCollector:
    """One ``prometheus_client`` collector of every cluster client of a registry.

    A registry refuses a second collector with the same metric names (two
    :class:`ClientCollector` s, whatever their labels), so the clients of one process
    share this one: a family per metric name, a sample per client, told apart by their
    constant labels. :meth:`kvshm.ClusterClient.register_metrics` adds a client
    (:func:`clients_collector` finds or registers the registry's); a closed client is
    removed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[int, ClientCollector] = {}
        self._labels: dict[int, tuple[tuple[str, str], ...]] = {}

    def add(self, key: int, metrics: Callable[[], dict[str, Any]],
            labels: dict[str, str] | None) -> None:
        """Add a client (``key``: any id unique to it). Raises ValueError when another
        client has the same labels (their samples would be one series)."""
        lab = tuple(sorted((labels or {}).items()))
        with self._lock:
            if key in self._sources:
                raise ValueError("this cluster client exports into this registry already")
            if lab in self._labels.values():
                raise ValueError(f"another cluster client exports with the same labels "
                                 f"{dict(lab)}: give each client its own")
            self._sources[key] = ClientCollector(metrics, labels)
            self._labels[key] = lab

    def remove(self, key: int) -> None:
        with self._lock:
            self._sources.pop(key, None)
            self._labels.pop(key, None)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            sources = list(self._sources.values())
        fams: dict[str, Any] = {}
        for src in sources:
            for f in src.collect():
                have = fams.get(f.name)
                if have is None:
                    fams[f.name] = f
                else:
                    have.samples.extend(f.samples)
        yield from fams.values()


_shared: "weakref.WeakKeyDictionary[Any, ClientsCollector]" = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def clients_collector(registry: Any = None) -> ClientsCollector:
    """The :class:`ClientsCollector` of ``registry`` (default
    ``prometheus_client.REGISTRY``), registered there on first use."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    with _shared_lock:
        col = _shared.get(registry)
        if col is None:
            col = _shared[registry] = ClientsCollector()
            registry.register(col)
        return col


#: Membership agent counters (CLUSTER_VIEW stats "membership") exported as counters.
_MEMBERSHIP_COUNTERS = (
    ("view_changes", "Changes of the member list this server saw in etcd"),
    ("etcd_errors", "etcd calls that failed (the last view is kept)"),
    ("watch_errors", "etcd watches that broke (listed and watched again)"),
    ("registrations", "Times this server put its member record under a new lease"),
    ("lease_lost", "Times this server found its etcd lease gone"),
    ("relists", "Full listings of the member prefix"),
)
#: Handoff counters (CLUSTER_VIEW stats "handoff_*").
_HANDOFF_COUNTERS = (
    ("pins", "Handoff pins made"),
    ("renewed", "Handoff pins renewed"),
    ("unpinned", "Handoff pins dropped by UNPIN (read)"),
    ("expired", "Handoff pins that expired unread"),
    ("refused", "Handoff PINs refused (a cap or a client's share of it)"),
    ("refused_share", "Handoff PINs refused because the client's share was spent"),
)


class ServerClusterCollector:
    """``prometheus_client`` collector of a server's cluster figures, read through a
    client's CLUSTER_VIEW ``{stats: true}`` on each scrape.

    Parameters
    ----------
    client_fn : callable
        Returns a connected :class:`kvshm.Client` of the server (the management port's).
    """

    def __init__(self, client_fn: Callable[[], Any]) -> None:
        self._client_fn = client_fn

    def collect(self) -> Iterator[Any]:
        from kvshm.cluster.cli import op_view

        Counter, Gauge, _ = _families()
        c = self._client_fn()
        body = c.run_op(op_view(c.session, stats=True))
        st = body.get("stats", {})
        held = Gauge("kvshm_cluster_handoff_pins_held", "Handoff pins held now")
        held.add_metric([], st.get("handoff_pins_held", 0))
        yield held
        pb = Gauge("kvshm_cluster_handoff_pinned_bytes",
                   "Pool bytes (whole blocks) held by handoff pins")
        pb.add_metric([], st.get("handoff_pinned_bytes", 0))
        yield pb
        for name, doc in _HANDOFF_COUNTERS:
            f = Counter(f"kvshm_cluster_handoff_{name}", doc)
            f.add_metric([], st.get(f"handoff_{name}", 0))
            yield f
        vr = Counter("kvshm_cluster_view_requests", "CLUSTER_VIEW requests served")
        vr.add_metric([], st.get("view_requests", 0))
        yield vr
        vp = Counter("kvshm_cluster_view_pushes", "Parked CLUSTER_VIEW requests answered "
                     "because the revision changed")
        vp.add_metric([], st.get("view_pushed", 0))
        yield vp
        vw = Gauge("kvshm_cluster_view_waiting", "CLUSTER_VIEW requests parked now")
        vw.add_metric([], st.get("view_waiting", 0))
        yield vw
        if not body.get("clustered"):
            return
        rev = Gauge("kvshm_cluster_view_revision", "etcd revision of this server's view")
        rev.add_metric([], body.get("revision", 0))
        yield rev
        fresh = Gauge("kvshm_cluster_view_fresh",
                      "1 while etcd answers, 0 while the last view is kept")
        fresh.add_metric([], 1 if body.get("fresh", True) else 0)
        yield fresh
        by_status: dict[str, int] = {"up": 0, "draining": 0}
        for n in (body.get("view") or {}).get("nodes", []):
            s = str(n.get("status", "up"))
            by_status[s] = by_status.get(s, 0) + 1
        mem = Gauge("kvshm_cluster_members", "Members in this server's view, by status",
                    labels=["status"])
        for s, n in sorted(by_status.items()):
            mem.add_metric([s], n)
        yield mem
        ms = st.get("membership", {})
        for name, doc in _MEMBERSHIP_COUNTERS:
            f = Counter(f"kvshm_cluster_{name}", doc)
            f.add_metric([], ms.get(name, 0))
            yield f
        reg = Gauge("kvshm_cluster_registered", "1 once this server's record is in etcd")
        reg.add_metric([], 1 if ms.get("registered") else 0)
        yield reg
