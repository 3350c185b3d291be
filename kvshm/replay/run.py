"""One whole replay (:func:`run_replay`): start the servers it needs, run the exact LRU
and the unbounded cache over the same requests, replay (one client here, or K
processes), stop everything, merge what the clients measured.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Iterator, Sequence

from kvshm.replay.backends import BackendSpec
from kvshm.replay.clients import run_processes
from kvshm.replay.options import ReplayOptions, UsageError
from kvshm.replay.report import ReplayResult
from kvshm.replay.runner import KEEP_FIRST, Replayer
from kvshm.replay.servers import Child, start_kvshm, start_redis

__all__ = ["run_replay"]

log = logging.getLogger(__name__)


def _delete_keys(backend: Any, requests: Sequence[Sequence[int]], prefix: bytes,
                 batch: int = 20000) -> None:
    """Delete every key the replay may have written (best effort)."""
    ids = sorted({h for r in requests for h in r})
    try:
        for i in range(0, len(ids), batch):
            backend.delete([b"%s%d" % (prefix, h) for h in ids[i:i + batch]])
    except Exception as exc:
        log.warning("could not delete the replay's keys (%s: %s)", type(exc).__name__, exc)


@contextlib.contextmanager
def _signals_as_exit() -> Iterator[None]:
    """SIGTERM/SIGHUP raise SystemExit (so every ``finally`` runs) while replaying."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _shielded() -> Iterator[None]:
    """Hold off SIGINT/SIGTERM/SIGHUP while cleaning up (every wait in it is bounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class _Progress:
    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self.bar = None
        if enabled and sys.stderr is not None and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="req", desc=desc, file=sys.stderr,
                            dynamic_ncols=True, leave=False, mininterval=0.2)

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_replay(opts: ReplayOptions, requests: Sequence[Sequence[int]] | None = None
               ) -> ReplayResult:
    """Run one replay (see the module docstring) and return its figures.

    Parameters
    ----------
    opts : ReplayOptions
    requests : list of list of int, optional
        Block ids of each request; default: loaded from ``opts.trace``.

    Raises
    ------
    UsageError
        A bad option (names the flag), or a pool too small for the longest request.
    ReplayError
        A server or a client process failed to start or died.
    kvshm.trace.TraceError
        The trace cannot be read.

    Every server and process started here is stopped before this returns or raises
    (also on KeyboardInterrupt, and on SIGTERM/SIGHUP when called in the main thread).
    """
    import numpy as np

    from kvshm.trace import load_trace, simulate_lru, unbounded_hits

    opts.validate()
    if requests is None:
        requests = load_trace(opts.trace, opts.requests)
    elif opts.requests is not None:
        requests = requests[:opts.requests]
    if not requests:
        raise UsageError("--trace", "the trace has no requests")
    B = opts.block_bytes
    k = min(opts.clients, len(requests))
    prefix = opts.key_prefix if opts.key_prefix is not None else (
        b"kvshm-replay/%s/" % os.urandom(4).hex().encode())
    longest = max(len(r) for r in requests)
    owned = opts.address is None
    if owned:
        if B > opts.pool_bytes or opts.pool_bytes // opts.server_block_bytes < longest:
            raise UsageError("--pool-gib", f"a pool of {opts.pool_gib:g} GiB holds "
                             f"{opts.pool_bytes // opts.server_block_bytes} blocks of "
                             f"{B} bytes; the longest request has {longest} blocks")

    children: list[Child] = []
    tmpdir: str | None = None
    probe: Any = None
    bar = _Progress(len(requests), opts.progress, f"replay {opts.backend}")
    try:
        with _signals_as_exit():
            segment = None
            if opts.backend == "redis":
                if owned:
                    exe = opts.redis_executable()
                    assert exe is not None
                    tmpdir = tempfile.mkdtemp(prefix="kvshm-replay-redis-")
                    child, address = start_redis(exe, opts.pool_bytes, tmpdir)
                    children.append(child)
                else:
                    address = opts.address  # type: ignore[assignment]
            else:
                if owned:
                    ssd_dir = opts.ssd_path
                    if opts.ssd_gib and ssd_dir is None:
                        tmpdir = tempfile.mkdtemp(prefix="kvshm-replay-ssd-")
                        ssd_dir = os.path.join(tmpdir, "ssd")
                    child, address, segment = start_kvshm(opts, ssd_dir)
                    children.append(child)
                else:
                    address = opts.address  # type: ignore[assignment]
            spec = BackendSpec(opts.backend, address, opts.timeout)
            if k == 1:
                probe = spec.open()
            else:   # stats only: no need to map the pool here
                probe = BackendSpec("redis" if opts.backend == "redis" else "kvshm-tcp",
                                     address, opts.timeout).open()
            # Capacity in blocks of the store actually used, for the LRU simulator.
            if opts.backend == "redis":
                mm = probe.maxmemory() if not owned else opts.pool_bytes
                cap_bytes = mm or opts.pool_bytes
                block_size = opts.server_block_bytes
                capacity = cap_bytes // block_size
            else:
                cap_bytes, block_size = probe.capacity_bytes()
                capacity = (cap_bytes // block_size) // -(-B // block_size)
            if capacity < longest:
                raise UsageError("--pool-gib" if owned else "--address",
                                 f"the store holds {capacity} blocks of {B} bytes; the "
                                 f"longest request has {longest} blocks")
            lru = simulate_lru(requests, capacity)
            bound = unbounded_hits(requests)
            ev0 = probe.evictions()
            transport = probe.transport if k == 1 else (
                "shm" if opts.backend == "kvshm" else "tcp")
            if k == 1:
                t_go = time.monotonic()
                shares = [Replayer(probe, B, prefix).run(list(enumerate(requests)), bar)]
                t_done = time.monotonic()
            else:
                shares, t_go, t_done = run_processes(spec, requests, k, B, prefix, bar,
                                                      opts.window_for(k))
            evictions = probe.evictions() - ev0
            if not owned:       # leave someone else's server as we found it
                _delete_keys(probe, requests, prefix)
    finally:
        with _shielded():
            bar.close()
            if probe is not None:
                with contextlib.suppress(Exception):
                    probe.close()
            for c in children:
                rc = c.stop()
                if rc not in (0, None) and rc != -signal.SIGTERM:
                    log.warning("%s exited with status %s: %s", c.what, rc, c.output())
            if segment is not None:
                from kvshm import segments

                with contextlib.suppress(OSError):
                    segments.cleanup(segment)   # only if its server died holding it
            if tmpdir is not None:
                shutil.rmtree(tmpdir, ignore_errors=True)

    # ---- merge
    def cat(name: str, dtype: Any) -> "np.ndarray":
        return np.concatenate([np.asarray(getattr(s, name), dtype=dtype) for s in shares])

    index = cat("index", np.int64)
    matched = cat("matched", np.int64)
    nblocks = cat("blocks", np.int64)
    moved = cat("moved", np.int64)
    latency = cat("latency", np.float64)
    t_end = cat("t_end", np.float64)
    order = np.argsort(t_end, kind="stable")
    skew = int(np.abs(index[order] - np.arange(len(index))).max()) if len(index) else 0
    seconds = max(t_done - t_go, 1e-9)
    blocks = int(nblocks.sum())
    hits = int(matched.sum())
    tot = {f: sum(getattr(s, f) for s in shares)
           for f in ("bytes_read", "bytes_written", "blocks_read", "lost", "mismatches",
                     "errors")}
    good = latency[~np.isnan(latency)]
    lat_ms = good * 1e3
    replayed = len(index)
    lru_hits = int(sum(lru.per_request[i] for i in index))
    bound_hits = int(sum(bound.per_request[i] for i in index))
    lru_blocks = blocks if blocks else 1
    summary: dict[str, Any] = {
        "backend": opts.backend,
        "transport": transport,
        "clients": k,
        "split": "round-robin: request i to client i % clients" if k > 1 else "one client",
        "window": opts.window_for(k) if k > 1 else None,
        "paced_seconds": sum(s.paced_s for s in shares),
        "max_order_skew": skew,
        "trace": opts.trace or "bundled:conversation_trace.jsonl.gz",
        "requests": replayed,
        "requests_asked": len(requests),
        "blocks": blocks,
        "hits": hits,
        "hit_rate": hits / blocks if blocks else 0.0,
        "lru_hit_rate": lru_hits / lru_blocks if blocks else 0.0,
        "bound_hit_rate": bound_hits / lru_blocks if blocks else 0.0,
        "lost": tot["lost"],
        "blocks_read": tot["blocks_read"],
        "mismatches": tot["mismatches"],
        "errors": tot["errors"],
        "bytes_read": tot["bytes_read"],
        "bytes_written": tot["bytes_written"],
        "seconds": seconds,
        "gbps": (tot["bytes_read"] + tot["bytes_written"]) / seconds / 1e9,
        "requests_per_s": replayed / seconds,
        "p50_ms": float(np.percentile(lat_ms, 50)) if len(lat_ms) else None,
        "p99_ms": float(np.percentile(lat_ms, 99)) if len(lat_ms) else None,
        "evictions": evictions,
        "lru_evictions": lru.evictions,
        "block_bytes": B,
        "block_size": block_size,
        "capacity_bytes": cap_bytes,
        "capacity_blocks": capacity,
        "address": None if owned else opts.address,
        "first_errors": [e for s in shares for e in s.first_errors][:KEEP_FIRST],
        "first_mismatches": [e for s in shares for e in s.first_mismatches][:KEEP_FIRST],
        "gave_up": next((s.gave_up for s in shares if s.gave_up), None),
    }
    series = {
        "index": index[order], "matched": matched[order], "blocks": nblocks[order],
        "moved": moved[order], "t_end": t_end[order] - t_go,
        "lru": np.asarray(lru.per_request, dtype=np.int64)[index[order]],
        "bound": np.asarray(bound.per_request, dtype=np.int64)[index[order]],
    }
    return ReplayResult(summary, series)
