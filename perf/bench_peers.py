#!/usr/bin/env python3
"""kvshm beside the stores a user would use instead: one workload, one run, one table.

    scripts/peers-env.sh                       # once: the peers' venvs (cached)
    .venv/bin/python perf/bench_peers.py [--quick] [--reps 3] [--count 100]
        [--peers kvshm-shm,kvshm-tcp,redis,lm-server,mooncake,infinistore]
        [--peers-cache /root/.cache/kvshm-peers] [--json FILE|-]

Workload, the same for every row, every byte read checked (outside the timed region):

* single put / get of 64 KiB and of 1 MiB values: --count distinct values, one call each
  (MB/s of the whole pass; the values together exceed the caches at 1 MiB);
* x100 batches: the same --count values in one batch call (or the peer's closest thing);
* 4 KiB single get p50 / p99 over --lat-iters calls of one key.

Reads come in two kinds and are only ever compared within a kind (same-work rule):
``into`` = into a caller's preallocated buffer, ``fresh`` = a new bytes-like object per
value. Each peer's best path of each kind is used and named in the output.

Rows (each peer in its own venv from scripts/peers-env.sh, its server on a free loopback
port started here and stopped at the end):

``memcpy``      numpy.copyto between preallocated arrays (the physical reference for shm)
``raw socket``  a Python TCP socket on loopback to a child that acks each value (put) or
                echoes 4 KiB (latency): the physical reference for a TCP store
``kvshm shm``   kvshm.Client(transport="shm") to ``kvshm serve`` (same host)
``kvshm tcp``   kvshm.Client(transport="tcp") to the same server
``redis``       redis-server (Debian) + redis-py with hiredis: SET/GET, pipelined SET/MGET
``lm-server``   LMCache 0.5.6 ``python -m lmcache.v1.server HOST PORT cpu`` with LMCache's
                own wire messages (lmcache.v1.protocol) on a socket, reads with recv_into
                as its LMCServerConnector does; it has no batch op, so x100 = 100
                requests pipelined on one connection
``mooncake``    Mooncake Store (mooncake-transfer-engine-non-cuda): ``mooncake_master``
                (with its HTTP metadata server) and a segment-holder process that mounts
                the memory; the benchmarked client mounts none, so every byte crosses TCP
                (lm-server's and Mooncake's start-up is kvshm.replay.peers', shared with
                ``kvshm replay --backend lmcache|mooncake``)
``infinistore`` tried; its server needs an RDMA device, so here it is a row that says why

A peer that cannot be installed or started prints its row as unavailable with the reason.
``--quick`` is a smoke run (tiny sizes) for tests; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _common  # noqa: E402
from _common import free_port, pct, stop  # noqa: E402
from peer_clients import LAT_CAP_S, pattern  # noqa: E402

CLIENTS = os.path.join(HERE, "peer_clients.py")

SIZES = ((64 << 10, "64K"), (1 << 20, "1M"))
ALL_PEERS = ("kvshm-shm", "kvshm-tcp", "redis", "lm-server", "mooncake", "infinistore")
VENV_OF = {"redis": "redis", "lm-server": "lmcache", "mooncake": "mooncake",
           "infinistore": "infinistore"}
# rows of the table: (metric key, label, unit, higher is better)
METRICS = []
for _size, _tag in SIZES:
    METRICS += [(f"put1_{_tag}", f"single put {_tag}", "MB/s", True),
                (f"get1_{_tag}_into", f"single get {_tag} into", "MB/s", True),
                (f"get1_{_tag}_fresh", f"single get {_tag} fresh", "MB/s", True),
                (f"putB_{_tag}", f"x100 put {_tag}", "MB/s", True),
                (f"getB_{_tag}_into", f"x100 get {_tag} into", "MB/s", True),
                (f"getB_{_tag}_fresh", f"x100 get {_tag} fresh", "MB/s", True)]
METRICS += [("lat4k_into_p50", "4 KiB get into p50", "us", False),
            ("lat4k_into_p99", "4 KiB get into p99", "us", False),
            ("lat4k_fresh_p50", "4 KiB get fresh p50", "us", False),
            ("lat4k_fresh_p99", "4 KiB get fresh p99", "us", False)]


# --------------------------------------------------------------------------- references


def ref_memcpy(count: int, reps: int, sizes: tuple[tuple[int, str], ...]) -> dict[str, Any]:
    import numpy as np

    out: dict[str, Any] = {}
    for size, tag in sizes:
        srcs = [pattern(size + i, size) for i in range(count)]
        dsts = [np.empty(size, np.uint8) for _ in range(count)]
        rates = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            for s, d in zip(srcs, dsts):
                np.copyto(d, s)
            rates.append(size * count / (time.perf_counter() - t) / 1e6)
        if not all(np.array_equal(s, d) for s, d in zip(srcs, dsts)):
            raise RuntimeError("memcpy reference copied other bytes")
        r = statistics.median(rates[1:])
        for m in (f"put1_{tag}", f"putB_{tag}", f"get1_{tag}_into", f"getB_{tag}_into"):
            out[m] = r
        fresh = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            got = [s.tobytes() for s in srcs]
            fresh.append(size * count / (time.perf_counter() - t) / 1e6)
        del got
        out[f"get1_{tag}_fresh"] = out[f"getB_{tag}_fresh"] = statistics.median(fresh[1:])
    src = pattern(4, 4096)
    dst = np.empty(4096, np.uint8)
    lat = []
    for _ in range(2000):
        t = time.perf_counter()
        np.copyto(dst, src)
        lat.append(time.perf_counter() - t)
    lat.sort()
    out["lat4k_into_p50"], out["lat4k_into_p99"] = pct(lat, 0.5) * 1e6, pct(lat, 0.99) * 1e6
    out["paths"] = {"put": "numpy.copyto", "into": "numpy.copyto",
                    "fresh": "ndarray.tobytes"}
    return out


def ref_socket(count: int, reps: int, lat_iters: int, sizes: tuple[tuple[int, str], ...]
               ) -> dict[str, Any]:
    """A raw TCP socket to a child: ack per value (single), acks after all (x100), 4 KiB echo."""
    import numpy as np

    proc, line = _common.spawn_helper("tcp_echo_server")
    s = socket.create_connection(("127.0.0.1", int(line)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out: dict[str, Any] = {}
    ack = bytearray(1)
    try:
        for size, tag in sizes:
            vals = [pattern(size + i, size) for i in range(count)]
            hdr = (size | (1 << 63)).to_bytes(8, "little")      # top bit: ack, no echo
            single, batch = [], []
            for _ in range(reps + 1):
                t = time.perf_counter()
                for v in vals:
                    s.sendall(hdr)
                    s.sendall(v)
                    s.recv_into(ack, 1)
                single.append(size * count / (time.perf_counter() - t) / 1e6)
                t = time.perf_counter()
                for v in vals:
                    s.sendall(hdr)
                    s.sendall(v)
                acks = bytearray(count)
                got = 0
                while got < count:
                    got += s.recv_into(memoryview(acks)[got:], count - got)
                batch.append(size * count / (time.perf_counter() - t) / 1e6)
            out[f"put1_{tag}"] = statistics.median(single[1:])
            out[f"putB_{tag}"] = statistics.median(batch[1:])
        msg = pattern(4, 4096).tobytes()
        buf = bytearray(4096)
        mv = memoryview(buf)
        lat = []
        hdr = (4096).to_bytes(8, "little")
        for i in range(lat_iters + lat_iters // 10):
            t = time.perf_counter()
            s.sendall(hdr + msg)
            got = 0
            while got < 4096:
                got += s.recv_into(mv[got:], 4096 - got)
            dt = time.perf_counter() - t
            if buf != msg:
                raise RuntimeError("raw socket echo returned other bytes")
            if i >= lat_iters // 10:
                lat.append(dt)
        lat.sort()
        out["lat4k_into_p50"], out["lat4k_into_p99"] = pct(lat, 0.5) * 1e6, pct(lat, 0.99) * 1e6
        out["paths"] = {"put": "sendall + 1-byte ack per value / acks after all",
                        "into": "4 KiB echo, recv_into", "fresh": "-"}
    finally:
        s.close()
        stop(proc)
    del np
    return out


# --------------------------------------------------------------------------- servers


class Unavailable(Exception):
    pass


def peer_python(peer: str, cache: str) -> str:
    """The python of the peer's venv (kvshm.replay.peers' lookup, shared with the replay)."""
    from kvshm.replay.peers import PeerUnavailable, venv_python

    try:
        return venv_python(VENV_OF[peer], cache)
    except PeerUnavailable as exc:
        raise Unavailable(str(exc)) from None


def run_worker(py: str, peer: str, spec: dict[str, Any], timeout: float,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    p = subprocess.run([py, CLIENTS, "worker", peer, json.dumps(spec)],
                       capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])  # type: ignore[no-any-return]
    tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise RuntimeError(f"{peer} worker exited {p.returncode}: {tail[:300]}")


def bench_kvshm(peers: list[str], spec: dict[str, Any], timeout: float
                ) -> dict[str, dict[str, Any]]:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from servers import ServerProcess

    total = sum(s for s, _ in spec["sizes"]) * spec["count"]
    pool = round(max(0.0625, (2.5 * total + (16 << 20)) / 2**30), 4)
    out: dict[str, dict[str, Any]] = {}
    with ServerProcess(prealloc_size=pool) as srv:
        for peer in peers:
            try:
                out[peer] = run_worker(sys.executable, peer, {**spec, "address": srv.address},
                                       timeout, env={"PYTHONPATH": ROOT})
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                out[peer] = {"unavailable": str(exc)}
    return out


def bench_redis(spec: dict[str, Any], cache: str, timeout: float) -> dict[str, Any]:
    py = peer_python("redis", cache)
    try:
        proc, port, d = _common.start_redis(4 << 30)
    except (FileNotFoundError, RuntimeError) as exc:
        raise Unavailable(str(exc)) from None
    try:
        return run_worker(py, "redis", {**spec, "port": port}, timeout)
    finally:
        stop(proc)
        shutil.rmtree(d, ignore_errors=True)


def _peer_start(fn: Callable[..., Any], *args: Any) -> Any:
    """Start a peer's server(s) with kvshm.replay.peers' start-up (shared with
    ``kvshm replay --backend lmcache|mooncake``); a failure is the row's reason."""
    from kvshm.replay.options import ReplayError

    try:
        return fn(*args)
    except ReplayError as exc:
        raise Unavailable(str(exc)[:300]) from None


def bench_lm_server(spec: dict[str, Any], cache: str, timeout: float) -> dict[str, Any]:
    from kvshm.replay.peers import start_lm_server

    py = peer_python("lm-server", cache)
    child, port = _peer_start(start_lm_server, py)
    try:
        return run_worker(py, "lm-server", {**spec, "port": port}, timeout,
                          env={"LMCACHE_LOG_LEVEL": "WARNING"})
    finally:
        child.stop()


def bench_mooncake(spec: dict[str, Any], cache: str, timeout: float) -> dict[str, Any]:
    from kvshm.replay.peers import start_mooncake

    py = peer_python("mooncake", cache)
    total = sum(s for s, _ in spec["sizes"]) * spec["count"]
    d = tempfile.mkdtemp(prefix="kvshm-bench-mooncake-")
    children: list[Any] = []
    try:
        children, mspec = _peer_start(start_mooncake, py,
                                      int((2 * spec["reps"] + 1) * total + (64 << 20)), d)
        return run_worker(py, "mooncake", {**spec, **mspec,
                                           "local_buffer": int(total + (32 << 20))}, timeout)
    finally:
        for c in children:
            c.stop()
        shutil.rmtree(d, ignore_errors=True)


def bench_infinistore(cache: str) -> dict[str, Any]:
    """Start InfiniStore's server as its README says; without an RDMA device it exits at
    start-up (its register_server looks the device up), which is the row's reason."""
    py = peer_python("infinistore", cache)
    port, mport = free_port(), free_port()
    log = tempfile.TemporaryFile()
    p = subprocess.Popen([py, "-m", "infinistore.server", "--service-port", str(port),
                          "--manage-port", str(mport), "--prealloc-size", "1",
                          "--host", "127.0.0.1"], stdout=log, stderr=log)
    try:
        try:
            p.wait(30)            # it binds its port, then fails: a listening port proves little
        except subprocess.TimeoutExpired:
            raise Unavailable("its server stayed up (an RDMA device is present?), but this "
                              "benchmark has no InfiniStore client row: it was only ever run "
                              "where InfiniStore cannot start") from None
        log.seek(0)
        lines = log.read().decode(errors="replace").strip().splitlines()
        why = [ln.strip() for ln in lines if "rdma" in ln.lower() or "ibv" in ln.lower()]
        raise Unavailable(f"its server exits ({p.returncode}) at start-up without an RDMA "
                          f"device: {(why or lines or [''])[-1][:200]}")
    finally:
        stop(p)
        log.close()


# --------------------------------------------------------------------------- report


ROW_NAMES = {"memcpy": "memcpy", "raw-socket": "raw socket", "kvshm-shm": "kvshm shm",
             "kvshm-tcp": "kvshm tcp", "redis": "redis", "lm-server": "lm-server",
             "mooncake": "mooncake", "infinistore": "infinistore"}


def report(res: dict[str, Any]) -> None:
    rows = res["rows"]
    names = [n for n in ROW_NAMES if n in rows]
    live = [n for n in names if "unavailable" not in rows[n]]
    print(f"\nkvshm and its peers, one workload ({res['meta']['mode']}; {res['meta']['count']} "
          f"values, median of {res['meta']['reps']}; MB/s = 1e6 bytes/s; 'into' = into "
          "caller buffers, 'fresh' = new bytes objects; "
          f"{res['meta']['cpus']} CPUs, load average {res['meta']['loadavg_start']:.1f} -> "
          f"{res['meta']['loadavg_end']:.1f})\n")
    w = 12
    print(f"{'':24}" + "".join(f"{ROW_NAMES[n]:>{w}}" for n in live))
    for key, label, unit, _ in METRICS:
        cells = []
        for n in live:
            v = rows[n].get(key)
            cells.append(f"{'-':>{w}}" if v is None else f"{v:{w}.0f}" if v >= 100
                         else f"{v:{w}.1f}")
        print(f"{label + ' ' + unit:24}" + "".join(cells))
    base = "kvshm-shm" if "kvshm-shm" in live else None
    if base:
        print("\nratios: kvshm shm vs each row (> 1: kvshm shm is better; MB/s kvshm/row, "
              "latency row/kvshm)\n")
        print(f"{'':24}" + "".join(f"{ROW_NAMES[n]:>{w}}" for n in live))
        for key, label, unit, higher in METRICS:
            b = rows[base].get(key)
            cells = []
            for n in live:
                v = rows[n].get(key)
                if v is None or b is None or not v or not b:
                    cells.append(f"{'-':>{w}}")
                else:
                    cells.append(f"{(b / v if higher else v / b):{w}.2f}")
            print(f"{label:24}" + "".join(cells))
    print("\nread paths used (the best of each kind each peer has):")
    for n in live:
        p = rows[n].get("paths", {})
        print(f"  {ROW_NAMES[n]:12} put: {p.get('put', '-')}; into: {p.get('into', '-')}; "
              f"fresh: {p.get('fresh', '-')}")
        if "note" in p:
            print(f"  {'':12} note: {p['note']}")
        for kind in ("into", "fresh"):
            k = rows[n].get(f"lat4k_{kind}_n")
            if k is not None and k < res["meta"]["lat_iters"]:
                print(f"  {'':12} 4 KiB {kind}: {k} samples (the loop stops after "
                      f"{LAT_CAP_S:.0f} s)")
    for n in names:
        if "unavailable" in rows[n]:
            print(f"unavailable: {ROW_NAMES[n]}: {rows[n]['unavailable']}")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (for tests)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--count", type=int, default=100, help="values per size (x100 batches)")
    ap.add_argument("--lat-iters", type=int, default=2000)
    ap.add_argument("--peers", default=",".join(ALL_PEERS))
    ap.add_argument("--peers-cache", default=os.environ.get("KVSHM_PEERS_CACHE",
                                                           "/root/.cache/kvshm-peers"))
    ap.add_argument("--timeout", type=float, default=600, help="seconds per peer")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    sizes: tuple[tuple[int, str], ...] = SIZES
    if args.quick:
        args.reps, args.count, args.lat_iters = 1, 4, 50
        sizes = ((64 << 10, "64K"), (1 << 20, "1M"))
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(ALL_PEERS)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)} (known: {', '.join(ALL_PEERS)})")
    spec = {"count": args.count, "reps": args.reps, "lat_iters": args.lat_iters,
            "sizes": [list(s) for s in sizes]}
    rows: dict[str, Any] = {}
    load0 = os.getloadavg()[0]
    rows["memcpy"] = ref_memcpy(args.count, args.reps, sizes)
    rows["raw-socket"] = ref_socket(args.count, args.reps, args.lat_iters, sizes)
    kv = [p for p in peers if p.startswith("kvshm-")]
    if kv:
        rows.update(bench_kvshm(kv, spec, args.timeout))
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "redis": lambda: bench_redis(spec, args.peers_cache, args.timeout),
        "lm-server": lambda: bench_lm_server(spec, args.peers_cache, args.timeout),
        "mooncake": lambda: bench_mooncake(spec, args.peers_cache, args.timeout),
        "infinistore": lambda: bench_infinistore(args.peers_cache)}
    for peer in peers:
        if peer in runners:
            try:
                rows[peer] = runners[peer]()
            except (Unavailable, RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                rows[peer] = {"unavailable": str(exc)}
    res = {"meta": {"mode": "quick" if args.quick else "full", "count": args.count,
                    "reps": args.reps, "lat_iters": args.lat_iters,
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "cpus": os.cpu_count(), "loadavg_start": load0,
                    "loadavg_end": os.getloadavg()[0]},
           "rows": rows}
    report(res)
    if args.json:
        _common.write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
