#!/usr/bin/env python3
"""CPU per single-key remote request, per thread, of one client process and its server.

    python perf/client_cpu.py [--seconds 3] [--ops put,get,exists] [--size 4096]
                              [--redis] [--json FILE|-]

One kvshm server (``kvshm serve``, its own process) and one client (this process, TCP
transport) doing single-key 4 KiB ``put`` / ``get_into`` / ``exists`` back to back for
``--seconds`` each. For each phase it prints requests/s and the CPU microseconds per
request of every thread of the client (the Python main thread, ZeroMQ's I/O thread, ...)
and of the server, read from /proc/PID/task/*/stat (clock ticks: run a few seconds).
``--ab REPS``: the client's one-key path in C (Channel.call1) and the Python path it
replaced, alternating in blocks of ``--seconds`` (the same load for both; the main
thread's CPU from ``time.thread_time``).
``--zmtp-ab REPS``: the client's own ZMTP transport (kvshm.zmq_ctrl._zmtp) and libzmq
(``KVSHM_ZMTP=0``), two clients of one server in this process, alternating in blocks of
``--seconds`` (with ``--redis``, redis-py SET/GET blocks alternate with them); CPU per
request of the whole client process (all threads: ZeroMQ's I/O thread included) and of
the server, from /proc.
``--redis``: the same for redis-py SET/GET against a redis-server of this run. The figures
are CPU time, so they mean something on a loaded machine; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import _common  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of ``pid``, keyed ``name/tid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except FileNotFoundError:
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        parts = raw.rsplit(")", 1)[1].split()
        out[f"{name}/{tid}"] = (int(parts[11]) + int(parts[12])) / TICK
    return out


def per_req(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    return {k: (after[k] - before.get(k, 0.0)) / n * 1e6 for k in after
            if after[k] - before.get(k, 0.0) > 0}


def phase(fn: Any, seconds: float, pids: dict[str, int]) -> dict[str, Any]:
    for _ in range(200):
        fn()
    b = {w: threads(p) for w, p in pids.items()}
    n = 0
    end = time.monotonic() + seconds
    t0 = time.monotonic()
    while time.monotonic() < end:
        for _ in range(50):
            fn()
        n += 50
    wall = time.monotonic() - t0
    a = {w: threads(p) for w, p in pids.items()}
    out: dict[str, Any] = {"rps": n / wall, "n": n}
    for w in pids:
        d = per_req(b[w], a[w], n)
        out[w] = {"total_us": sum(d.values()), "threads_us": d}
    return out


def ab(c: Any, fn: Any, seconds: float, reps: int, pids: dict[str, int]) -> dict[str, Any]:
    """The one-key path in C and the Python path (Channel.call1 answering NOT_SENT, as
    before it existed) in alternating blocks of ``seconds``, ``reps`` each: the same load
    for both. The main thread's CPU from time.thread_time (exact), the others' from
    /proc (clock ticks)."""
    from kvshm.zmq_ctrl import channel as chmod

    real = c._chan.call1
    acc: dict[str, dict[str, float]] = {m: {"n": 0, "wall": 0.0, "main": 0.0}
                                         for m in ("python", "c")}
    for _ in range(reps):
        for mode in ("python", "c"):
            c._chan.call1 = real if mode == "c" else (lambda *a: chmod.NOT_SENT)
            for _ in range(100):
                fn()
            b = {w: threads(p) for w, p in pids.items()}
            t0, m0 = time.monotonic(), time.thread_time()
            n = 0
            end = t0 + seconds
            while time.monotonic() < end:
                for _ in range(50):
                    fn()
                n += 50
            m1, t1 = time.thread_time(), time.monotonic()
            a = {w: threads(p) for w, p in pids.items()}
            r = acc[mode]
            r["n"] += n
            r["wall"] += t1 - t0
            r["main"] += m1 - m0
            for w in pids:
                for k, v in a[w].items():
                    name = f"{w} {k.split('/')[0]}"
                    r[name] = r.get(name, 0.0) + v - b[w].get(k, 0.0)
    c._chan.call1 = real
    out: dict[str, Any] = {}
    for mode, r in acc.items():
        count = r.pop("n")
        wall = r.pop("wall")
        out[mode] = {"rps": count / wall, **{k: v / count * 1e6 for k, v in r.items()}}
    return out


def alternate(modes: dict[str, tuple[Any, dict[str, int]]], seconds: float, reps: int
              ) -> dict[str, Any]:
    """``modes``: name -> (fn, pids); blocks of ``seconds`` of each in turn, ``reps``
    rounds. Per mode: requests/s and CPU us per request of each pid (all its threads)."""
    acc: dict[str, dict[str, float]] = {m: {"n": 0, "wall": 0.0} for m in modes}
    for _ in range(reps):
        for mode, (fn, pids) in modes.items():
            for _ in range(100):
                fn()
            b = {w: sum(threads(p).values()) for w, p in pids.items()}
            t0 = time.monotonic()
            n = 0
            while time.monotonic() < t0 + seconds:
                for _ in range(50):
                    fn()
                n += 50
            r = acc[mode]
            r["wall"] += time.monotonic() - t0
            r["n"] += n
            for w, p in pids.items():
                r[w] = r.get(w, 0.0) + sum(threads(p).values()) - b[w]
    out: dict[str, Any] = {}
    for mode, r in acc.items():
        count = r.pop("n")
        wall = r.pop("wall")
        out[mode] = {"rps": count / wall, **{k: v / count * 1e6 for k, v in r.items()}}
    return out


def show(label: str, r: dict[str, Any]) -> None:
    print(f"{label:12} {r['rps']:9.0f} req/s", end="")
    for w, v in r.items():
        if isinstance(v, dict):
            th = ", ".join(f"{k.split('/')[0]} {u:.1f}" for k, u in
                           sorted(v["threads_us"].items(), key=lambda kv: -kv[1]))
            print(f" | {w} {v['total_us']:.1f} us ({th})", end="")
    print()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--ops", default="put,get,exists")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--redis", action="store_true")
    ap.add_argument("--ab", type=int, default=0, metavar="REPS",
                    help="alternate the C one-key path and the Python one (REPS blocks "
                         "of --seconds each)")
    ap.add_argument("--zmtp-ab", type=int, default=0, metavar="REPS",
                    help="alternate the ZMTP transport and libzmq (REPS blocks of "
                         "--seconds each; with --redis, Redis blocks too)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.zmtp_ab:
        return zmtp_ab(args)
    import kvshm
    from servers import ServerProcess

    res: dict[str, Any] = {"load_start": os.getloadavg()}
    val = _common.pattern(7, args.size)
    out = np.empty(args.size, np.uint8)
    me = os.getpid()
    with ServerProcess(prealloc_size=0.0625) as srv:
        with kvshm.Client(srv.address, transport="tcp", timeout=30) as c:
            c.put("k", val)
            pids = {"client": me, "server": srv.pid}
            fns = {"put": lambda: c.put("k", val),
                   "get": lambda: c.get_into("k", out),
                   "exists": lambda: c.exists("k")}
            for op in args.ops.split(","):
                if args.ab:
                    res[f"ab_{op}"] = abr = ab(c, fns[op], args.seconds, args.ab, pids)
                    for mode, v in abr.items():
                        print(f"{op:7} {mode:7} {v['rps']:7.0f} req/s  main thread "
                              f"{v['main']:6.1f} us/req (thread_time)  " + ", ".join(
                                  f"{k} {u:.1f}" for k, u in v.items()
                                  if k not in ("rps", "main") and u > 0.5))
                    continue
                r = phase(fns[op], args.seconds, pids)
                res[f"kvshm_{op}"] = r
                show(f"kvshm {op}", r)
            if not np.array_equal(out, val) and "get" in args.ops:
                raise RuntimeError("get_into returned other bytes")
    if args.redis:
        import redis

        proc, port, d = _common.start_redis(1 << 30)
        try:
            rc = redis.Redis(host="127.0.0.1", port=port)
            vb = val.tobytes()
            rc.set("k", vb)
            pids = {"client": me, "server": proc.pid}
            for op, fn in (("set", lambda: rc.set("k", vb)), ("get", lambda: rc.get("k"))):
                r = phase(fn, args.seconds, pids)
                res[f"redis_{op}"] = r
                show(f"redis {op}", r)
            rc.close()
        finally:
            _common.stop(proc)
            import shutil

            shutil.rmtree(d, ignore_errors=True)
    res["load_end"] = os.getloadavg()
    print(f"load average {res['load_start'][0]:.2f} -> {res['load_end'][0]:.2f}")
    if args.json:
        _common.write_json(res, args.json)
    return 0


def zmtp_ab(args: Any) -> int:
    import kvshm
    from kvshm.zmq_ctrl import channel as chmod
    from servers import ServerProcess

    res: dict[str, Any] = {"load_start": os.getloadavg()}
    val = _common.pattern(7, args.size)
    vb = val.tobytes()
    out = np.empty(args.size, np.uint8)
    me = os.getpid()
    proc = None
    with ServerProcess(prealloc_size=0.0625) as srv:
        clients = {}
        for on in (True, False):
            chmod.ZMTP = on
            clients["zmtp" if on else "libzmq"] = c = kvshm.Client(
                srv.address, transport="tcp", timeout=30)
            assert c._chan.zmtp is on
        c.put("k", val)
        pids = {"client": me, "server": srv.pid}
        rc = None
        if args.redis:
            import redis

            proc, port, d = _common.start_redis(1 << 30)
            rc = redis.Redis(host="127.0.0.1", port=port)
            rc.set("k", vb)
        try:
            for op in args.ops.split(","):
                modes: dict[str, tuple[Any, dict[str, int]]] = {}
                for name, c in clients.items():
                    modes[name] = ({"put": lambda c=c: c.put("k", val),
                                    "get": lambda c=c: c.get_into("k", out),
                                    "exists": lambda c=c: c.exists("k")}[op], pids)
                if rc is not None and proc is not None and op in ("put", "get"):
                    modes["redis"] = ((lambda: rc.set("k", vb)) if op == "put"
                                      else (lambda: rc.get("k")),
                                      {"client": me, "server": proc.pid})
                res[op] = r = alternate(modes, args.seconds, args.zmtp_ab)
                for mode, v in r.items():
                    print(f"{op:7} {mode:7} {v['rps']:7.0f} req/s  client process "
                          f"{v['client']:6.1f} us/req  server {v['server']:6.1f} us/req")
                if "redis" in r:
                    for mode in clients:
                        print(f"{op:7} {mode:7} / redis: req/s x"
                              f"{r[mode]['rps'] / r['redis']['rps']:.2f}, client CPU x"
                              f"{r[mode]['client'] / r['redis']['client']:.2f}")
        finally:
            for c in clients.values():
                c.close()
            if proc is not None:
                if rc is not None:
                    rc.close()
                _common.stop(proc)
                import shutil

                shutil.rmtree(d, ignore_errors=True)
    res["load_end"] = os.getloadavg()
    print(f"load average {res['load_start'][0]:.2f} -> {res['load_end'][0]:.2f}")
    if args.json:
        _common.write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
