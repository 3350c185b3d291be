"""One whole replay (:func:`run_replay`): start the servers it needs, run the exact LRU
and the unbounded cache over the same requests, replay (one client here, or K
processes), stop everything, merge what the clients measured.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator, Sequence

from kvshm.replay.backends import BackendSpec
from kvshm.replay.clients import run_processes
from kvshm.replay.options import PEER_BACKENDS, ReplayOptions, UsageError
from kvshm.replay.report import ReplayResult, summarize
from kvshm.replay.runner import Replayer
from kvshm.replay.scratch import ScratchDir, remove_stale
from kvshm.replay.servers import Child, start_kvshm, start_redis
from kvshm.replay.workload import Workload, WorkloadError

__all__ = ["run_replay"]

log = logging.getLogger(__name__)


def _delete_keys(backend: Any, keys: Iterator[list[int]], prefix: bytes,
                 batch: int = 20000) -> None:
    """Delete every key the replay may have written (best effort)."""
    ids = sorted({h for r in keys for h in r})
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


class _Requests:
    """The requests of a replay with their keys (:class:`Workload`): ``nkeys[i]`` and
    ``last[i]`` (bytes of its last key) per request, and :meth:`keys`, each request's key
    list made again on each pass (chunk keys of a whole trace do not need to be held)."""

    def __init__(self, wl: Workload, requests: Sequence[Sequence[int]],
                 lengths: Sequence[int | None]) -> None:
        self.wl = wl
        self.requests = requests
        self.lengths = lengths
        self.nkeys: list[int] = []
        self.last: list[int] = []
        for i, (ids, n) in enumerate(zip(requests, lengths)):
            try:
                keys, last = wl.keys(ids, n)
            except WorkloadError as exc:
                from kvshm.trace import TraceError

                raise TraceError(f"request {i}: {exc}") from None
            self.nkeys.append(len(keys))
            self.last.append(last)

    def keys(self) -> Iterator[list[int]]:
        wl = self.wl
        for ids, n in zip(self.requests, self.lengths):
            yield wl.keys(ids, n)[0]

    def blocks(self, block_size: int) -> list[int]:
        """Pool blocks each request needs at once."""
        full = -(-self.wl.entry_bytes // block_size)
        return [0 if n == 0 else (n - 1) * full + max(1, -(-last // block_size))
                for n, last in zip(self.nkeys, self.last)]


def run_replay(opts: ReplayOptions, requests: Sequence[Sequence[int]] | None = None,
               lengths: Sequence[int | None] | None = None) -> ReplayResult:
    """Run one replay (see the module docstring) and return its figures.

    Parameters
    ----------
    opts : ReplayOptions
    requests : list of list of int, optional
        Block ids of each request; default: loaded from ``opts.trace``.
    lengths : list of int or None, optional
        ``input_length`` (tokens) of each request, used with ``opts.chunk_tokens``
        (default: loaded with the trace; None: whole blocks).

    Raises
    ------
    UsageError
        A bad option (names the flag), or a pool too small for the longest request.
    ReplayError
        A server or a client process failed to start or died.
    kvshm.trace.TraceError
        The trace cannot be read, or a request's input_length does not fit its blocks.

    Every server and process started here is stopped before this returns or raises
    (also on KeyboardInterrupt, and on SIGTERM/SIGHUP when called in the main thread).
    """
    from kvshm.trace import load_requests, simulate_lru, unbounded_hits

    opts.validate()
    if opts.backend in PEER_BACKENDS:
        from kvshm.replay.peers import peer_python

        peer_python(opts.backend)   # no venv: PeerUnavailable names scripts/peers-env.sh
    if requests is None:
        requests, lengths = load_requests(opts.trace, opts.requests)
    elif opts.requests is not None:
        requests = requests[:opts.requests]
        lengths = None if lengths is None else lengths[:opts.requests]
    if not requests:
        raise UsageError("--trace", "the trace has no requests")
    if lengths is None:
        lengths = [None] * len(requests)
    wl = opts.workload()
    reqs = _Requests(wl, requests, lengths)
    k = min(opts.clients, len(requests))
    prefix = opts.key_prefix if opts.key_prefix is not None else (
        b"kvshm-replay/%s/" % os.urandom(4).hex().encode())
    owned = opts.address is None
    if owned:
        bs = opts.server_block_bytes
        longest = max(reqs.blocks(bs))
        if opts.pool_bytes // bs < longest:
            raise UsageError("--pool-gib", f"a pool of {opts.pool_gib:g} GiB holds "
                             f"{opts.pool_bytes // bs} blocks of {bs} bytes; the "
                             f"longest request needs {longest} blocks")

    children: list[Child] = []
    scratch: ScratchDir | None = None
    probe: Any = None
    peer_cm: Any = None
    bar = _Progress(len(requests), opts.progress, f"replay {opts.backend}")
    try:
        with _signals_as_exit():
            segment = None
            if owned and (opts.backend == "redis" or (opts.ssd_gib and opts.ssd_path is None)):
                remove_stale()
                scratch = ScratchDir("redis" if opts.backend == "redis" else "ssd")
            if opts.backend in PEER_BACKENDS:
                from kvshm.replay.peers import peer_servers

                cm = peer_servers(opts.backend, opts.pool_bytes, opts.timeout)
                probe = cm.__enter__()
                peer_cm = cm
                address = "127.0.0.1"
            elif opts.backend == "redis":
                if owned:
                    exe = opts.redis_executable()
                    assert exe is not None and scratch is not None
                    child, address = start_redis(exe, opts.pool_bytes, scratch.path)
                    children.append(child)
                else:
                    address = opts.address  # type: ignore[assignment]
            else:
                if owned:
                    ssd_dir = opts.ssd_path
                    if opts.ssd_gib and ssd_dir is None:
                        assert scratch is not None
                        ssd_dir = os.path.join(scratch.path, "ssd")
                    child, address, segment = start_kvshm(opts, ssd_dir)
                    children.append(child)
                else:
                    address = opts.address  # type: ignore[assignment]
            spec = BackendSpec(opts.backend, address, opts.timeout)
            if probe is not None:
                pass                # a peer: opened with its servers
            elif k == 1:
                probe = spec.open()
            else:   # stats only: no need to map the pool here
                probe = BackendSpec("redis" if opts.backend == "redis" else "kvshm-tcp",
                                     address, opts.timeout).open()
            # Capacity of the store actually used, for the reference caches.
            if opts.backend in PEER_BACKENDS:
                pool_bytes, ssd_bytes = opts.pool_bytes, 0
                block_size = opts.server_block_bytes
            elif opts.backend == "redis":
                mm = probe.maxmemory() if not owned else opts.pool_bytes
                pool_bytes, ssd_bytes = mm or opts.pool_bytes, 0
                block_size = opts.server_block_bytes
            else:
                pool_bytes, ssd_bytes, block_size = probe.capacity()
            cap_bytes = pool_bytes + ssd_bytes
            longest = max(reqs.blocks(block_size))
            if cap_bytes // block_size < longest:
                raise UsageError("--pool-gib" if owned else "--address",
                                 f"the store holds {cap_bytes // block_size} blocks of "
                                 f"{block_size} bytes; the longest request needs "
                                 f"{longest} blocks")
            refs = _references(wl, reqs, pool_bytes, ssd_bytes, block_size,
                               simulate_lru, unbounded_hits)
            c0 = probe.counts()
            transport = probe.transport if k == 1 else (
                "shm" if opts.backend == "kvshm" else "tcp")
            if k == 1:
                t_go = time.monotonic()
                items = [(i, r, n) for i, (r, n) in enumerate(zip(requests, lengths))]
                shares = [Replayer(probe, wl, prefix).run(items, bar)]
                t_done = time.monotonic()
            else:
                shares, t_go, t_done = run_processes(spec, requests, lengths, k, wl, prefix,
                                                     bar, opts.window_for(k))
            c1 = probe.counts()
            if not owned:       # leave someone else's server as we found it
                _delete_keys(probe, reqs.keys(), prefix)
    finally:
        with _shielded():
            bar.close()
            if peer_cm is not None:
                peer_cm.__exit__(None, None, None)     # its client, then its servers
            elif probe is not None:
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
            if scratch is not None:
                scratch.close()

    counts = {"evictions": None if c1["evictions"] is None
              else c1["evictions"] - c0["evictions"],                  # type: ignore[operator]
              "dropped": None if c1["dropped"] is None
              else c1["dropped"] - c0["dropped"]}                      # type: ignore[operator]
    run = {"backend": opts.backend, "transport": transport, "clients": k,
           "window": opts.window_for(k) if k > 1 else None,
           "trace": opts.trace or "bundled:conversation_trace.jsonl.gz",
           "requests_asked": len(requests), "block_bytes": opts.block_bytes,
           "block_size": block_size, "capacity_bytes": cap_bytes,
           "pool_bytes": pool_bytes, "ssd_bytes": ssd_bytes,
           "address": None if owned else opts.address,
           "seconds": max(t_done - t_go, 1e-9), "t_go": t_go,
           "read_path": getattr(probe, "read_path", None) or _READ_PATH.get(opts.backend),
           "capacity_note": None, "refused": None}
    if opts.backend in PEER_BACKENDS:
        from kvshm.replay.peers import CAPACITY_NOTE

        run["capacity_note"] = CAPACITY_NOTE[opts.backend]
        if opts.backend == "mooncake":      # lm-server does not answer a PUT
            run["refused"] = {"writes": probe.refused, "codes": probe.refused_codes}
    return summarize(run, wl, reqs.nkeys, reqs.last, shares, refs, counts)


_READ_PATH = {"kvshm": "get_batch_into (bytes through shared memory)",
              "kvshm-tcp": "get_batch_into (bytes in the messages)",
              "redis": "MGET, copied into the caller's buffers"}


def _references(wl: Workload, reqs: _Requests, pool_bytes: int, ssd_bytes: int, bs: int,
                simulate_lru: Any, unbounded_hits: Any) -> dict[str, Any]:
    """The reference caches over the same requests, each with the capacity of the store:

    - ``lru``: the exact LRU of equal capacity. One-block mode: in entries (one block
      each, as the store holds them; the store should equal it). Chunk mode: in value
      bytes (an ideal cache that wastes nothing).
    - ``lru_blocks`` (chunk mode): the exact LRU charged as the store charges, whole
      blocks of ``bs`` per value: what is left between it and the store is the policy
      and the batching, not the rounding.
    - ``lru_pool`` (with an SSD tier): the exact LRU of the pool's capacity alone,
      charged as the store charges: its evictions are the pool's (an LRU hierarchy's top
      tier is an LRU of its own size), to set beside the store's pool evictions.
    - ``bound``: the unbounded cache.
    """
    cap = pool_bytes + ssd_bytes
    refs: dict[str, Any] = {}
    if wl.one_block:
        per = -(-wl.entry_bytes // bs)
        refs["lru"] = simulate_lru(reqs.keys(), (cap // bs) // per)
        refs["lru_capacity"] = f"{(cap // bs) // per} entries of {wl.entry_bytes} bytes"
        if ssd_bytes:
            refs["lru_pool"] = simulate_lru(reqs.keys(), (pool_bytes // bs) // per)
    else:
        size_of = wl.size_of

        def blocks_of(key: int) -> int:
            return -(-size_of(key) // bs)

        refs["lru"] = simulate_lru(reqs.keys(), cap, cost=size_of)
        refs["lru_capacity"] = f"{cap} bytes of values"
        refs["lru_blocks"] = simulate_lru(reqs.keys(), cap // bs, cost=blocks_of)
        if ssd_bytes:
            refs["lru_pool"] = simulate_lru(reqs.keys(), pool_bytes // bs, cost=blocks_of)
    refs["bound"] = unbounded_hits(reqs.keys())
    return refs
