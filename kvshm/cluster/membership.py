"""Cluster membership in etcd: one record per server under a lease, and the view of all.

:class:`Membership` runs one thread in the server process. It

* registers ``/kvshm/<cluster>/nodes/<id>`` (a :class:`~kvshm.cluster.view.Member` as
  JSON) under a lease of ``ttl`` seconds and keeps the lease alive every ``ttl / 3``;
  when etcd says the lease is gone (it expired during a partition, or etcd lost it) it
  registers again under a new lease;
* watches the prefix from the last revision it saw; after a watch error it lists the
  prefix again and watches again from that revision; it also lists every
  ``relist_interval`` seconds, so a missed event is repaired within that time;
* keeps the last view when etcd cannot be reached (``View.fresh`` is then False): the
  data plane never waits on etcd.

etcd client: ``etcd-sdk-python`` (``import pyetcd``, the ``cluster`` extra), its
multi-endpoint client with failover and a short retry per endpoint (its default refuses
a failed endpoint for 300 s). Only this module imports it, lazily.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

from kvshm.cluster.view import DRAINING, UP, Member, View, node_key, nodes_prefix

__all__ = ["Membership", "parse_etcd_url", "EtcdUnavailable"]

log = logging.getLogger(__name__)


class EtcdUnavailable(ConnectionError):
    """No etcd endpoint answered."""


def parse_etcd_url(url: str) -> list[tuple[str, int]]:
    """``etcd://H:P[,H:P...]`` -> [(host, port), ...]. ValueError when malformed."""
    if not isinstance(url, str) or not url.startswith("etcd://"):
        raise ValueError(f"cluster address must look like etcd://HOST:PORT[,HOST:PORT...], "
                         f"got {url!r}")
    out = []
    for part in url[len("etcd://"):].split(","):
        part = part.strip().rstrip("/")
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad etcd endpoint {part!r} in {url!r} (want HOST:PORT)")
        out.append((host.strip("[]"), int(port)))
    return out


class _Etcd:
    """The few etcd calls membership needs, over pyetcd (errors -> EtcdUnavailable)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], timeout: float) -> None:
        try:
            import pyetcd
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError("kvshm --cluster needs the etcd client: pip install "
                              "'kvshm[cluster]' (etcd-sdk-python, protobuf, grpcio)") from exc
        self._mod = pyetcd
        # gRPC backs off reconnecting up to 120 s by default: after etcd was down for a
        # few seconds the channel would stay idle longer than a lease lives
        opts = [("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 500)]
        eps = [pyetcd.Endpoint(h, p, secure=False, time_retry=0.5, opts=opts)
               for h, p in endpoints]
        self.client = pyetcd.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout,
                                                      failover=True)

    def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        # A connection error marks the endpoint in use failed for time_retry (0.5 s) and
        # the next call fails over. Retried at once, while the mark holds: an agent that
        # came back only after the mark expired found the dead endpoint "recovered" and
        # failed on it again, for ever (its retry interval is also 0.5 s), and lost its
        # lease when that endpoint was etcd's killed leader.
        e = self._mod.exceptions
        failover = (e.ConnectionFailedError, e.ConnectionTimeoutError)
        last: Exception = EtcdUnavailable("no etcd endpoint")
        for attempt in range(max(1, len(self.client.endpoints))):
            try:
                return fn(*args, **kw)
            except failover as exc:
                last = exc
                continue
            except Exception as exc:    # grpc errors, NoServerAvailable, ...
                raise EtcdUnavailable(f"{type(exc).__name__}: {exc}") from None
        raise EtcdUnavailable(f"{type(last).__name__}: {last}") from None

    def grant(self, ttl: int) -> int:
        return int(self._call(self.client.lease, ttl).id)

    def keepalive(self, lease_id: int) -> int:
        """Remaining TTL after the refresh; <= 0 when etcd no longer has the lease."""
        rs = self._call(lambda: list(self.client.refresh_lease(lease_id)))
        ttl = int(rs[0].TTL) if rs else 0
        if ttl <= 0:
            # ask again: a member still catching up after a restart may not know it yet
            ttl = int(self._call(self.client.get_lease_info, lease_id).TTL)
        return ttl

    def revoke(self, lease_id: int) -> None:
        self._call(self.client.revoke_lease, lease_id)

    def put(self, key: str, value: bytes, lease_id: int | None) -> int:
        rs = self._call(self.client.put, key, value, lease=lease_id)
        return int(rs.header.revision)

    def delete(self, key: str) -> None:
        self._call(self.client.delete, key)

    def list(self, prefix: str) -> tuple[int, dict[bytes, bytes]]:
        rs = self._call(self.client.get_prefix_response, prefix)
        return int(rs.header.revision), {kv.key: kv.value for kv in rs.kvs}

    def watch(self, prefix: str, start_revision: int,
              callback: Callable[[Any], None]) -> int:
        return int(self._call(self.client.add_watch_prefix_callback, prefix, callback,
                              start_revision=start_revision))

    def cancel(self, watch_id: int) -> None:
        try:
            self.client.cancel_watch(watch_id)
        except Exception:
            pass

    def is_put(self, ev: Any) -> bool:
        return isinstance(ev, self._mod.events.PutEvent)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass


class Membership:
    """Register a server in etcd and follow the cluster's member view.

    Parameters
    ----------
    endpoints : str or list of (host, port)
        ``etcd://H:P[,H:P...]`` or parsed endpoints.
    cluster : str
        Cluster name (``--cluster-name``).
    member : Member
        This server's record (its ``status`` may change with :meth:`drain`).
    ttl : float
        Lease seconds (whole seconds in etcd; at least 1). Default 5.
    relist_interval : float
        Seconds between full re-lists of the prefix. Default 3.
    timeout : float
        Seconds per etcd call. Default 1.
    on_change : callable, optional
        Called with the new :class:`View` (from the agent's thread) whenever it changes.
    """

    def __init__(self, endpoints: str | Sequence[tuple[str, int]], cluster: str,
                 member: Member, *, ttl: float = 5.0, relist_interval: float = 3.0,
                 timeout: float = 1.0, on_change: Callable[[View], None] | None = None
                 ) -> None:
        if isinstance(endpoints, str):
            endpoints = parse_etcd_url(endpoints)
        if not cluster or "/" in cluster:
            raise ValueError(f"cluster name must be non-empty without '/', got {cluster!r}")
        if not member.id or "/" in member.id:
            raise ValueError(f"node id must be non-empty without '/', got {member.id!r}")
        self.endpoints = list(endpoints)
        self.cluster = cluster
        self.ttl = max(1, int(round(ttl)))
        self.member = Member.from_dict({**member.to_dict(), "ttl": float(self.ttl)})
        self.relist_interval = relist_interval
        self.timeout = timeout
        self.on_change = on_change
        self._etcd: _Etcd | None = None
        self._view = View(cluster=cluster, fresh=False)
        self._members: dict[str, Member] = {}
        self._revision = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lease: int | None = None
        self._watch_id: int | None = None
        self._watch_broken = True
        self._republish = False
        self._leave_at: float | None = None
        self._left = False
        self.counters = dict.fromkeys(("registrations", "lease_lost", "etcd_errors",
                                       "watch_errors", "relists", "view_changes",
                                       "keepalives"), 0)
        self.registered = threading.Event()

    # ------------------------------------------------------------------ public

    @property
    def view(self) -> View:
        """The last view (never blocks; thread-safe)."""
        return self._view

    def start(self) -> "Membership":
        self._etcd = _Etcd(self.endpoints, self.timeout)
        self._thread = threading.Thread(target=self._run, name="kvshm-membership",
                                        daemon=True)
        self._thread.start()
        return self

    def drain(self, leave_after: float | None = None) -> None:
        """Mark this member draining (takes no new keys); with ``leave_after`` seconds,
        then delete its record (it leaves the view; the server goes on serving whoever
        still reads from it until it is stopped). Returns at once."""
        self.member = Member.from_dict({**self.member.to_dict(), "status": DRAINING})
        self._republish = True
        if leave_after is not None:
            self._leave_at = time.monotonic() + max(0.0, leave_after)
        self._wake.set()

    @property
    def left(self) -> bool:
        """Whether this member left the cluster (drain with ``leave_after``)."""
        return self._left

    def stop(self, leave: bool = True) -> None:
        """Stop the agent; ``leave``: delete the record and revoke the lease first."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        etcd, self._etcd = self._etcd, None
        if etcd is None:
            return
        if self._watch_id is not None:
            etcd.cancel(self._watch_id)
        if leave and self._lease is not None and not self._left:
            try:
                etcd.delete(node_key(self.cluster, self.member.id))
                etcd.revoke(self._lease)
            except EtcdUnavailable as exc:
                log.warning("could not leave cluster %s cleanly (%s); the lease expires "
                            "in %d s", self.cluster, exc, self.ttl)
        etcd.close()

    def stats(self) -> dict[str, Any]:
        v = self._view
        return {"revision": v.revision, "members": len(v.members), "up": len(v.up),
                "fresh": v.fresh, "registered": self.registered.is_set(),
                "left": self._left,
                **self.counters}

    # ------------------------------------------------------------------ agent

    def _run(self) -> None:
        next_keepalive = 0.0
        next_list = 0.0
        retry = min(0.5, self.ttl / 6)
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if self._leave_at is not None and now >= self._leave_at and not self._left:
                    self._leave()
                if self._left:
                    pass
                elif self._lease is None or self._republish:
                    self._register()
                    next_keepalive = time.monotonic() + self.ttl / 3
                elif now >= next_keepalive:
                    left = self._require().keepalive(self._lease)
                    if left <= 0:
                        self.counters["lease_lost"] += 1
                        log.warning("etcd lease of node %s is gone; registering again",
                                    self.member.id)
                        self._lease = None
                        continue
                    self.counters["keepalives"] += 1
                    next_keepalive = now + self.ttl / 3
                if self._left:
                    next_keepalive = now + self.relist_interval
                if self._watch_broken or now >= next_list:
                    self._relist()
                    next_list = time.monotonic() + self.relist_interval
                self._set_fresh(True)
                wait = max(0.0, min(next_keepalive, next_list) - time.monotonic())
            except EtcdUnavailable as exc:
                self.counters["etcd_errors"] += 1
                log.debug("etcd call failed: %s", exc)
                self._set_fresh(False)
                wait = retry
            except Exception:
                # a bug or an unforeseen reply must not end the agent: without it the
                # lease lapses and this server silently leaves the cluster
                self.counters["etcd_errors"] += 1
                log.exception("cluster membership step failed; retrying")
                self._watch_broken = True
                wait = retry
            self._wake.wait(wait)
            self._wake.clear()

    def _leave(self) -> None:
        etcd = self._require()
        etcd.delete(node_key(self.cluster, self.member.id))
        # left from here on: peers may see the record gone at once (a revoke that fails
        # leaves the lease to lapse by its TTL; no keepalive is sent once left)
        self._left = True
        if self._lease is not None:
            lease, self._lease = self._lease, None
            etcd.revoke(lease)
        log.info("node %s left cluster %s (drained)", self.member.id, self.cluster)

    def _require(self) -> _Etcd:
        if self._etcd is None:
            raise EtcdUnavailable("membership stopped")
        return self._etcd

    def _register(self) -> None:
        etcd = self._require()
        if self._lease is None:
            self._lease = etcd.grant(self.ttl)
        self._republish = False
        rev = etcd.put(node_key(self.cluster, self.member.id), self.member.to_json(),
                       self._lease)
        self.counters["registrations"] += 1
        log.info("node %s registered in cluster %s (lease %x, revision %d)", self.member.id,
                 self.cluster, self._lease, rev)
        self.registered.set()

    def _relist(self) -> None:
        etcd = self._require()
        rev, kvs = etcd.list(nodes_prefix(self.cluster))
        self.counters["relists"] += 1
        members: dict[str, Member] = {}
        prefix = nodes_prefix(self.cluster).encode()
        for k, raw in kvs.items():
            node = k[len(prefix):].decode(errors="replace")
            m = self._parse(node, raw)
            if m is not None:
                members[node] = m
        with self._lock:
            self._members = members
            self._revision = max(self._revision, rev)
            self._publish()
        if self._watch_broken:
            if self._watch_id is not None:
                etcd.cancel(self._watch_id)
                self._watch_id = None
            self._watch_broken = False
            try:
                self._watch_id = etcd.watch(nodes_prefix(self.cluster), rev + 1,
                                            self._on_watch)
            except EtcdUnavailable:
                self._watch_broken = True
                raise

    def _on_watch(self, resp: Any) -> None:
        etcd = self._etcd
        if etcd is None:
            return
        if isinstance(resp, BaseException) or resp is None:
            self.counters["watch_errors"] += 1
            log.debug("etcd watch ended: %r; watching again from revision %d", resp,
                      self._revision)
            self._watch_broken = True
            self._wake.set()
            return
        with self._lock:
            prefix = nodes_prefix(self.cluster).encode()
            for ev in resp.events:
                node = ev.key[len(prefix):].decode(errors="replace")
                if etcd.is_put(ev):
                    m = self._parse(node, ev.value)
                    if m is not None:
                        self._members[node] = m
                    else:
                        self._members.pop(node, None)
                else:
                    self._members.pop(node, None)
            self._revision = max(self._revision, int(resp.header.revision))
            self._publish()

    @staticmethod
    def _parse(node: str, raw: bytes) -> Member | None:
        """The record under ``nodes/<node>``, or None (logged) when it is garbage or
        names another id than its key (a record cannot stand in for another member)."""
        try:
            m = Member.from_json(raw)
        except ValueError as exc:
            log.warning("ignoring member record of %r: %s", node, exc)
            return None
        if m.id != node:
            log.warning("ignoring member record under %r: it names id %r", node, m.id)
            return None
        return m

    def _set_fresh(self, fresh: bool) -> None:
        if self._view.fresh != fresh:
            with self._lock:
                self._view = View(self._view.revision, self._view.members, self.cluster,
                                  fresh)
            if not fresh:
                log.warning("etcd unreachable; keeping the last view (revision %d)",
                            self._view.revision)

    def _publish(self) -> None:
        # under self._lock
        old = self._view
        new = View(self._revision, tuple(self._members.values()), self.cluster, True)
        if new.same_members(old) and old.fresh:
            if new.revision != old.revision:
                self._view = new
            return
        self._view = new
        if not new.same_members(old):
            self.counters["view_changes"] += 1
            log.info("cluster %s view at revision %d: %s", self.cluster, new.revision,
                     ", ".join(f"{m.id}({m.status})" for m in new.members) or "empty")
            if self.on_change is not None:
                try:
                    self.on_change(new)
                except Exception:
                    log.exception("view change callback failed")


def default_member(node_id: str, service: str, epoch: int, pool_size: int, block_size: int,
                   ttl: float, curve_public_key: str | None = None) -> Member:
    return Member(id=node_id, service=service, epoch=epoch, pool_size=pool_size,
                  block_size=block_size, status=UP, ttl=ttl,
                  curve_public_key=curve_public_key)
