"""The management HTTP port: /selftest, /stats, /metrics (Prometheus), POST /purge.

Doors: /selftest (which writes test keys) asks for the server's door token as
``Authorization: Bearer <hex>`` (the token file's content; 401 without it), POST /purge
for its operator token (the ``<port>.operator`` file beside it, :mod:`kvshm.security`;
a door-token holder may not purge). /stats,
/metrics and /healthz reveal no key and stay open on a loopback address only; on any
other address every endpoint asks for the token.

It runs in its own thread with the standard library's ThreadingHTTPServer and talks to
the store only through a regular :class:`kvshm.Client` on the service socket, so the
store keeps its single owner thread and /selftest checks the real request path.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import selectors
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import zmq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ManageServer", "StoreCollector", "selftest"]

log = logging.getLogger(__name__)

_COUNTERS = (
    ("hits", "Keys found by LOOKUP/GET"),
    ("misses", "Keys not found by LOOKUP/GET"),
    ("bytes_in", "Value bytes written (committed)"),
    ("bytes_out", "Value bytes read"),
    ("puts", "Values committed"),
    ("gets", "Values read"),
    ("evictions", "Entries evicted"),
    ("evicted_bytes", "Value bytes evicted"),
    ("replaced_early", "Old copies of keys being rewritten, freed early to make room"),
    ("lease_expired_writes", "Pending writes reclaimed after their lease ran out"),
    ("lease_expired_pins", "Pin grants dropped after their lease ran out"),
    ("pool_full", "Keys refused because nothing could be evicted"),
    ("deletes", "Keys deleted"),
)
#: Per-tier figures (stats()["tiers"][tier]), labelled tier="pool" / tier="ssd".
_TIER_GAUGES = (
    ("entries", "Entries held by the tier"),
    ("bytes", "Bytes held by the tier (pool: allocated blocks; ssd: value bytes)"),
)
_TIER_COUNTERS = (
    ("hits", "Keys read that were found in the tier (ssd: promoted to the pool first)"),
    ("spills", "Entries written down from the tier (pool: evicted with an SSD copy; "
               "ssd: writes completed)"),
    ("promotions", "Entries read back into the pool from SSD"),
    ("drops", "Entries dropped for room with no copy below (their bytes are gone)"),
    ("checksum_failures", "Entries whose checksum did not match on read (dropped, "
                          "never served)"),
)

_GAUGES = (
    ("used_bytes", "Bytes of the pool in allocated blocks"),
    ("capacity_bytes", "Bytes of the pool"),
    ("usage", "Fraction of the pool's blocks allocated"),
    ("num_keys", "Committed keys"),
    ("pending", "Entries allocated but not committed"),
    ("pinned", "Entries pinned by readers"),
    ("pins", "Pins held"),
    ("largest_free_run", "Longest run of free blocks"),
)


#: Endpoints that change or reveal data: the door token is asked for even on loopback.
_GUARDED = frozenset({"/purge", "/selftest"})


class StoreCollector:
    """A prometheus_client collector that reads the server's STATS on each scrape."""

    def __init__(self, client_fn: Any) -> None:
        self._client_fn = client_fn

    def collect(self) -> Iterator[Metric]:
        s = self._client_fn().stats(latency=True)
        for name, doc in _COUNTERS:
            yield CounterMetricFamily(f"kvshm_{name}", doc, value=s.get(name, 0))
        for name, doc in _GAUGES:
            yield GaugeMetricFamily(f"kvshm_{name}", doc, value=s.get(name, 0))
        tiers = s.get("tiers")
        if tiers:
            for name, doc in _TIER_GAUGES:
                g = GaugeMetricFamily(f"kvshm_tier_{name}", doc, labels=["tier"])
                for tier, ts in sorted(tiers.items()):
                    g.add_metric([tier], ts.get(name, 0))
                yield g
            for name, doc in _TIER_COUNTERS:
                c = CounterMetricFamily(f"kvshm_tier_{name}", doc, labels=["tier"])
                for tier, ts in sorted(tiers.items()):
                    c.add_metric([tier], ts.get(name, 0))
                yield c
        errs = CounterMetricFamily("kvshm_errors", "Requests answered with an error, by kind",
                                   labels=["kind"])
        for kind, n in sorted(s.get("error_kinds", {}).items()):
            errs.add_metric([kind], n)
        yield errs
        hist = HistogramMetricFamily("kvshm_request_duration_seconds",
                                     "Server time per request, by op", labels=["op"])
        for op, h in sorted(s.get("latency", {}).items()):
            cum = 0
            buckets = []
            for le, c in zip(h["buckets"] + [float("inf")], h["counts"]):
                cum += c
                buckets.append(("+Inf" if le == float("inf") else repr(le), cum))
            hist.add_metric([op], buckets, sum_value=h["sum"])
        yield hist


def selftest(client: Any) -> dict[str, Any]:
    """Put, get, compare, delete one value through ``client``. Returns a report with
    ``ok`` and the time of each step, or what failed."""
    key = b"__kvshm_selftest__/" + os.urandom(8).hex().encode()
    value = os.urandom(4096)
    steps: dict[str, Any] = {}
    report: dict[str, Any] = {"ok": False, "transport": client.transport, "steps": steps}
    try:
        t = time.perf_counter()
        client.put(key, value)
        steps["put_ms"] = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        got = client.get(key)
        steps["get_ms"] = (time.perf_counter() - t) * 1e3
        if got != value:
            report["error"] = "value read back differs from the value written"
            return report
        t = time.perf_counter()
        n = client.delete([key])
        steps["delete_ms"] = (time.perf_counter() - t) * 1e3
        if n != 1 or client.exists(key):
            report["error"] = "delete did not remove the key"
            return report
        st = client.stats(verify=True)
        if not st["accounting_ok"]:
            report["error"] = (f"accounting mismatch: {st['entry_blocks']} blocks in entries, "
                               f"{st['num_blocks'] - st['free_blocks']} allocated")
            return report
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        return report
    report["ok"] = True
    return report


class ManageServer:
    """HTTP management endpoint bound to ``host:port`` (0: a free port).

    Parameters
    ----------
    host, port
        Where to listen.
    service : str
        ZeroMQ endpoint of the store's service socket.
    """

    def __init__(self, host: str, port: int, service: str, *,
                 context: zmq.Context | None = None, token: bytes | None = None,
                 open_reads: bool = True, operator_token: bytes | None = None) -> None:
        self._service = service
        self._ctx = context
        self._token = token
        self._operator = operator_token
        self._open_reads = open_reads
        self._client: Any = None
        self._client_lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(self.client))  # type: ignore[arg-type]
        from kvshm.cluster.metrics import ServerClusterCollector   # kvshm_cluster_*
        self.registry.register(ServerClusterCollector(self.client))  # type: ignore[arg-type]
        owner = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "kvshm-manage"
            timeout = 10          # seconds a connection may sit idle or half-sent

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("manage %s - " + fmt, self.address_string(), *args)

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _json(self, code: int, obj: Any) -> None:
                self._send(code, json.dumps(obj, default=str).encode() + b"\n",
                           "application/json")

            def _authorized(self, path: str, operator: bool = False) -> bool:
                tok = owner._token
                if operator and owner._operator is not None:
                    tok = owner._operator
                if tok is None:
                    return True
                if owner._open_reads and path not in _GUARDED:
                    return True
                h = self.headers.get("Authorization", "")
                scheme, _, value = h.partition(" ")
                ok = False
                if scheme.lower() == "bearer":
                    try:
                        ok = hmac.compare_digest(bytes.fromhex(value.strip()), tok)
                    except ValueError:
                        ok = False
                if not ok:
                    which = ("operator token (<port>.operator beside the token file)"
                             if tok is owner._operator else "door token")
                    body = json.dumps({"error": f"this endpoint needs the server's {which}: "
                                       "Authorization: Bearer <token file content>"}).encode()
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Bearer realm="kvshm"')
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                return ok

            def do_GET(self) -> None:  # noqa: N802 (http.server naming)
                path = self.path.split("?", 1)[0]
                if path == "/purge":
                    self._json(405, {"error": "use POST /purge"})
                    return
                if not self._authorized(path):
                    return
                try:
                    if path == "/stats":
                        self._json(200, owner.client().stats(verify="verify" in self.path))
                    elif path == "/metrics":
                        self._send(200, generate_latest(owner.registry), CONTENT_TYPE_LATEST)
                    elif path == "/selftest":
                        rep = selftest(owner.client())
                        self._json(200 if rep["ok"] else 503, rep)
                    elif path in ("/", "/healthz"):
                        owner.client().stats()       # the service loop answers
                        self._json(200, {"ok": True})
                    elif path == "/purge":
                        self._json(405, {"error": "use POST /purge"})
                    else:
                        self._json(404, {"error": f"no such path {path}"})
                except Exception as exc:
                    log.warning("manage %s failed: %s", path, exc)
                    self._json(503, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})

            def do_POST(self) -> None:  # noqa: N802
                path = self.path.split("?", 1)[0]
                if not self._authorized(path, operator=path == "/purge"):
                    return
                try:
                    if path == "/purge":
                        self._json(200, {"purged": owner.client().purge()})
                    else:
                        self._json(404, {"error": f"no such path {path}"})
                except Exception as exc:
                    self._json(503, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})

        self.host = host
        server_cls = ThreadingHTTPServer
        if ":" in host:                       # an IPv6 address
            class _V6(ThreadingHTTPServer):
                address_family = socket.AF_INET6
            server_cls = _V6
        try:
            self._http = server_cls((host.strip("[]"), port), Handler)
        except OSError as exc:
            shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
            raise OSError(exc.errno, f"cannot bind the management port {shown}:{port} "
                                     f"(--manage-port): {exc.strerror or exc}; choose another, "
                                     "0 for a free one, or --no-manage") from None
        self._http.daemon_threads = True
        self.port: int = self._http.server_address[1]
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()

    def client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                from kvshm.client import Client

                self._client = Client(self._service, timeout=5.0, context=self._ctx,
                                      token=self._token, operator_token=self._operator)
            return self._client

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="kvshm-manage", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # Like serve_forever, but it sleeps until a connection or stop(): no periodic
        # wake-ups, so an idle server uses no CPU.
        with selectors.DefaultSelector() as sel:
            sel.register(self._http.socket, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj == self._wake_r:
                        return
                    self._http._handle_request_noblock()  # type: ignore[attr-defined]

    def stop(self) -> None:
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._http.server_close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
