"""``kvshm replay --hosts N``: replay a trace against a cluster of N stores.

N servers run on loopback in this process, members of one cluster in an etcd started
here (the ``etcd`` binary and the ``cluster`` extra are needed); each has a pool of
``--pool-gib``. Request ``i`` of the trace goes to host ``i % N`` (``--assign
round-robin``) or to the host of its session (``--assign session``: its first block
id), whose :class:`~kvshm.ClusterClient` does what a single-host replay does: match the
prefix, read the leading hits (checked byte for byte), write the rest; placement is by
stripes of ``--stripe`` blocks (the placement key of block ``j`` is the key of block
``j - j % G`` of the request).

Printed beside the cluster's hit rate, over the same requests: *placed LRU* (an exact LRU
cache of each host's capacity fed the accesses of the blocks this run's placement put on
that host: what the stores must equal, hit for hit, when nothing fails), *isolated* (each host an
exact LRU cache of its own capacity, seeing only its own requests: hosts without a
cluster) and *summed LRU* (one exact LRU cache of the summed capacity: the best a
partitioned cache of that size can hope for); and the bytes read from the local store
versus other hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence


__all__ = ["ClusterReplayOptions", "run_cluster_replay", "add_flags", "cmd"]

KiB = 1024
GiB = 1 << 30


@dataclass
class ClusterReplayOptions:
    hosts: int = 3
    trace: str | None = None
    requests: int | None = None
    block_bytes: int = 4 * KiB
    pool_gib: float = 0.08
    stripe: int = 1
    assign: str = "round-robin"
    timeout: float = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Etcd:
    def __init__(self) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            raise RuntimeError("kvshm replay --hosts needs etcd (apt-get install etcd-server)")
        self.dir = tempfile.mkdtemp(prefix="kvshm-replay-etcd-")
        cp, pp = _free_port(), _free_port()
        self.url = f"etcd://127.0.0.1:{cp}"
        self.proc = subprocess.Popen(
            [exe, "--name", "r", "--data-dir", self.dir,
             "--listen-client-urls", f"http://127.0.0.1:{cp}",
             "--advertise-client-urls", f"http://127.0.0.1:{cp}",
             "--listen-peer-urls", f"http://127.0.0.1:{pp}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{pp}",
             "--initial-cluster", f"r=http://127.0.0.1:{pp}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


def _host_of(req: Sequence[int], i: int, n: int, assign: str) -> int:
    if assign == "session":
        return int(req[0]) % n if req else 0
    return i % n


def run_cluster_replay(opts: ClusterReplayOptions) -> dict[str, Any]:
    """Run the replay; returns the summary (see the module docstring)."""
    import numpy as np   # not at import: `kvshm --help` must stay light

    import kvshm
    from kvshm.cluster.client import ClusterClient
    from kvshm.trace import block_key, check_blocks, fill_blocks, load_trace, simulate_lru

    if opts.hosts < 1 or opts.stripe < 1 or opts.block_bytes % 8 or opts.block_bytes < 16:
        raise ValueError("hosts >= 1, stripe >= 1, block bytes a multiple of 8 (>= 16)")
    if opts.assign not in ("round-robin", "session"):
        raise ValueError("assign must be round-robin or session")
    reqs = load_trace(opts.trace, opts.requests)
    n = opts.hosts
    bs_kib = max(4, -(-opts.block_bytes // (4 * KiB)) * 4)
    per_host_blocks = int(opts.pool_gib * GiB) // (bs_kib * KiB)
    if per_host_blocks < 1:
        raise ValueError("--pool-gib holds no block")
    share = [[r for i, r in enumerate(reqs) if _host_of(r, i, n, opts.assign) == h]
             for h in range(n)]
    iso = [simulate_lru(s, per_host_blocks) for s in share if s]
    iso_rate = (sum(r.hits for r in iso) / sum(r.blocks for r in iso)) if iso else 0.0
    summed = simulate_lru(reqs, per_host_blocks * n)
    etcd = _Etcd()
    servers: list[Any] = []
    clients: list[Any] = []
    run = uuid.uuid4().hex[:8]
    prefix = f"kvshm-replay/{run}/".encode()
    words = opts.block_bytes // 8
    hits = blocks = mismatches = local_bytes = remote_bytes = 0
    t0 = time.perf_counter()
    try:
        for h in range(n):
            servers.append(kvshm.Server(
                service_port=0, manage_port=None, block_size=bs_kib,
                prealloc_size=per_host_blocks * bs_kib * KiB / GiB,
                shm_name=f"kvshm-replay-{os.getpid()}-{run}-{h}", cluster=etcd.url,
                cluster_name=f"replay-{run}", node_id=f"host{h}", cluster_ttl=5).start())
        for s in servers:
            assert s.membership is not None
            if not s.membership.registered.wait(30):
                raise RuntimeError("a replay server did not register in etcd")
        for s in servers:
            c = ClusterClient(s.address, stripe=1, timeout=opts.timeout)
            deadline = time.monotonic() + 30
            while len(c.refresh().members) < n:
                if time.monotonic() > deadline:
                    raise RuntimeError("the replay cluster did not form")
                time.sleep(0.05)
            clients.append(c)
        g = opts.stripe
        # where this cluster's placement (HRW over its members) puts every block: an
        # exact LRU per host fed the same accesses (``placed``) is what the stores must
        # equal, one block a key (the keys carry this run's prefix, so the placement,
        # and with it the hit rate, differs from run to run)
        index = {f"host{h}": h for h in range(n)}
        where = []
        for req in reqs:
            keys = [block_key(b, prefix) for b in req]
            pkeys = [keys[j - j % g] for j in range(len(keys))]
            where.append([index[o] for o in clients[0].owners(keys, placement_keys=pkeys)])
        placed = simulate_lru(reqs, per_host_blocks, shards=where)
        for i, req in enumerate(reqs):
            h = _host_of(req, i, n, opts.assign)
            c = clients[h]
            keys = [block_key(b, prefix) for b in req]
            pkeys = [keys[j - j % g] for j in range(len(keys))]
            blocks += len(keys)
            m = c.match_prefix(keys, placement_keys=pkeys)
            if m:
                got = c.get_batch(keys[:m], placement_keys=pkeys[:m])
                owners = c.owners(keys[:m], placement_keys=pkeys[:m])
                ok = 0
                for j, v in enumerate(got):
                    if v is None:
                        break
                    row = np.frombuffer(v, dtype=np.uint64).reshape(1, -1)
                    if row.shape[1] != words or not check_blocks(
                            row, np.array([req[j]], dtype=np.uint64))[0]:
                        mismatches += 1
                        break
                    ok += 1
                    if owners[j] == f"host{h}":
                        local_bytes += len(v)
                    else:
                        remote_bytes += len(v)
                m = ok
            hits += m
            if m < len(keys):
                ids = np.array(req[m:], dtype=np.uint64)
                rows = np.empty((len(ids), words), dtype=np.uint64)
                fill_blocks(rows, ids)
                c.put_batch(keys[m:], list(rows), placement_keys=pkeys[m:])
        elapsed = time.perf_counter() - t0
        fallback = sum(c.metrics()["fallback_hits"] for c in clients)
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.stop()
        etcd.close()
    rate = hits / blocks if blocks else 0.0
    return {"hosts": n, "requests": len(reqs), "blocks": blocks, "block_bytes": opts.block_bytes,
            "per_host_capacity_blocks": per_host_blocks, "stripe": opts.stripe,
            "assign": opts.assign, "cluster_hit_rate": rate, "hits": hits,
            "placed_lru_hits": placed.hits, "placed_lru_hit_rate": placed.hit_rate,
            "isolated_hit_rate": iso_rate, "summed_lru_hit_rate": summed.hit_rate,
            "cluster_vs_summed_lru": rate / summed.hit_rate if summed.hit_rate else 0.0,
            "mismatches": mismatches, "local_bytes": local_bytes,
            "remote_bytes": remote_bytes, "fallback_hits": fallback, "seconds": elapsed}


def add_flags(p: argparse.ArgumentParser) -> None:
    """`kvshm replay` flags of the multi-host replay."""
    p.add_argument("--hosts", type=int, default=1, metavar="N",
                   help="replay against a cluster of N stores (loopback servers and an etcd "
                        "started here; see docs/CLUSTER.md); default 1: the single-store replay")
    p.add_argument("--assign", choices=("round-robin", "session"), default="round-robin",
                   help="with --hosts: which host takes a request (default round-robin)")
    p.add_argument("--stripe", type=int, default=1, metavar="G",
                   help="with --hosts: blocks per placement stripe (default 1: per block; "
                        "stripes trade hit rate for fewer holes when a host is lost, see "
                        "docs/CLUSTER.md)")


def cmd(args: argparse.Namespace) -> int:
    """Run ``kvshm replay --hosts N``; 0 when no read mismatched."""
    opts = ClusterReplayOptions(hosts=args.hosts, trace=args.trace, requests=args.requests,
                                block_bytes=args.block_bytes if args.block_bytes != 64 * KiB
                                else 4 * KiB,
                                pool_gib=args.pool_gib if args.pool_gib != 1.0 else 0.08,
                                stripe=args.stripe, assign=args.assign, timeout=args.timeout)
    try:
        s = run_cluster_replay(opts)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"kvshm replay: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(s, sort_keys=True))
    else:
        print(f"kvshm replay --hosts {s['hosts']}: {s['requests']} requests, {s['blocks']} "
              f"blocks of {s['block_bytes']} B, {s['per_host_capacity_blocks']} blocks per "
              f"host, stripes of {s['stripe']}, {s['assign']}\n"
              f"  cluster hit rate     {s['cluster_hit_rate']:.4f} ({s['hits']} hits; an "
              f"exact LRU per host over this placement: {s['placed_lru_hits']})\n"
              f"  summed-capacity LRU  {s['summed_lru_hit_rate']:.4f} (cluster = "
              f"{s['cluster_vs_summed_lru']:.3f}x)\n"
              f"  isolated hosts       {s['isolated_hit_rate']:.4f}\n"
              f"  bytes read local {s['local_bytes']}, remote {s['remote_bytes']}; "
              f"mismatches {s['mismatches']}; {s['seconds']:.1f} s")
    return 0 if s["mismatches"] == 0 else 1
