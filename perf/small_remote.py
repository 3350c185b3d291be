"""The server-side parts of perf/bench_small.py: client processes, batches, a bystander.

``remote``, ``batch`` and ``bystander`` in bench_small's output come from here. Each client
process is this file run with a JSON spec (``python perf/small_remote.py SPEC``): it
connects, prints "ready", waits for a line on stdin, runs, and prints its counts as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import cpu_seconds, lat_stats, pattern, stop, thread_cpu_seconds  # noqa: E402

VALUE_4K = 4096


def _now() -> float:
    return time.perf_counter()


# --------------------------------------------------------------------------- workers


def worker_main(spec: dict[str, Any]) -> None:
    """A client process: prints "ready", waits for a line on stdin, runs, prints JSON."""
    kind = spec["kind"]
    if kind in ("kvshm-put", "kvshm-get", "bystander"):
        import kvshm

        c = kvshm.Client(spec["address"], transport=spec["transport"], timeout=60)
        key = spec["key"]
        val = pattern(spec["seed"], spec["size"])
        valb = val.tobytes()
        c.put(key, val)
        out = np.empty(spec["size"], np.uint8)

        def put() -> bool:
            c.put(key, val)
            return True

        def get() -> bool:
            c.get_into(key, out)
            # (a bytes compare, as the Redis worker's: np.array_equal costs ~3 us more)
            return out.tobytes() == valb

        op = {"kvshm-put": put, "kvshm-get": get, "bystander": get}[kind]
        close = c.close
    else:
        import redis

        r = redis.Redis(host="127.0.0.1", port=spec["port"])
        key = spec["key"]
        valb = pattern(spec["seed"], spec["size"]).tobytes()
        r.set(key, valb)

        def rput() -> bool:
            r.set(key, valb)
            return True

        def rget() -> bool:
            return r.get(key) == valb

        op = {"redis-set": rput, "redis-get": rget}[kind]
        close = r.close
    print("ready", flush=True)
    sys.stdin.readline()
    n = bad = 0
    stamps: list[tuple[float, float]] = []
    cpu = 0.0
    if kind == "bystander":
        # runs until the parent writes a second line (it decides the windows)
        import threading

        done = threading.Event()

        def wait_for_stop() -> None:
            sys.stdin.readline()
            done.set()

        threading.Thread(target=wait_for_stop, daemon=True).start()
        while not done.is_set():
            t0 = time.monotonic()
            ok = op()
            stamps.append((t0, time.monotonic() - t0))
            bad += not ok
            n += 1
    else:
        cpu0 = time.process_time()
        end = time.monotonic() + spec["seconds"]
        while time.monotonic() < end:
            bad += not op()
            n += 1
        cpu = time.process_time() - cpu0    # every thread of this process (ZeroMQ's too)
    close()
    print(json.dumps({"n": n, "bad": bad, "stamps": stamps, "cpu": cpu}), flush=True)


def run_workers(specs: list[dict[str, Any]], server_pid: int | None,
                threads: dict[str, float] | None = None
                ) -> tuple[list[dict[str, Any]], float, float]:
    """Start one process per spec, release them together; (results, wall s, server CPU s).
    ``threads``, when given, gets the server's CPU seconds of the run by thread name
    (:func:`_common.thread_cpu_seconds`)."""
    procs = []
    try:
        for s in specs:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), json.dumps(s)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {specs[0]['kind']} worker did not start")
        cpu0 = cpu_seconds(server_pid) if server_pid else 0.0
        th0 = thread_cpu_seconds(server_pid) if server_pid and threads is not None else {}
        t0 = time.monotonic()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = []
        for p in procs:
            assert p.stdout is not None
            outs.append(json.loads(p.stdout.readline()))
        wall = time.monotonic() - t0
        cpu = (cpu_seconds(server_pid) - cpu0) if server_pid else 0.0
        if server_pid and threads is not None:
            for name, t in thread_cpu_seconds(server_pid).items():
                threads[name] = t - th0.get(name, 0.0)
        for p in procs:
            p.wait(30)
    finally:
        for p in procs:
            stop(p)
    bad = sum(o["bad"] for o in outs)
    if bad:
        raise RuntimeError(f"{bad} reads of {specs[0]['kind']} workers returned wrong bytes")
    return outs, wall, cpu


def bench_remote_single(address: str, server_pid: int, redis_port: int | None,
                        redis_pid: int | None, counts: list[int], seconds: float
                        ) -> list[dict[str, Any]]:
    rows = []
    for n in counts:
        row: dict[str, Any] = {"clients": n}
        for label, kinds, pid in (("kvshm", ("kvshm-put", "kvshm-get"), server_pid),
                                  ("redis", ("redis-set", "redis-get"), redis_pid)):
            if label == "redis" and redis_port is None:
                continue
            for kind in kinds:
                specs = [{"kind": kind, "address": address, "transport": "tcp",
                          "port": redis_port, "key": f"remote-{i}", "seed": 50 + i,
                          "size": VALUE_4K, "seconds": seconds} for i in range(n)]
                threads: dict[str, float] = {}
                outs, wall, cpu = run_workers(specs, pid, threads)
                total = sum(o["n"] for o in outs)
                op = "put" if kind.endswith(("put", "set")) else "get"
                row[f"{label}_{op}_rps"] = total / seconds
                row[f"{label}_{op}_cpu_us"] = cpu / max(total, 1) * 1e6
                if label == "kvshm":
                    # the server's CPU split: libzmq's I/O thread(s) (its TCP reads and
                    # writes, hand-offs to and from the loop) and the rest (the loop thread)
                    io = sum(t for name, t in threads.items() if name.startswith("ZMQbg/IO"))
                    row[f"kvshm_{op}_io_us"] = io / max(total, 1) * 1e6
                row[f"{label}_{op}_client_us"] = (sum(o.get("cpu", 0.0) for o in outs)
                                                  / max(total, 1) * 1e6)
        for op in ("put", "get"):
            if f"redis_{op}_rps" in row:
                row[f"{op}_vs_redis"] = row[f"kvshm_{op}_rps"] / row[f"redis_{op}_rps"]
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- batches


def bench_batches(address: str, server_pid: int, r: Any, redis_pid: int | None,
                  keys: list[bytes], vals: list[bytes], reps: int) -> dict[str, Any]:
    import kvshm
    import kvshm.client

    n = len(keys)
    res: dict[str, list[float]] = {k: [] for k in (
        "put", "get", "exists", "rset", "rmget", "put_cpu", "get_cpu", "exists_pipe",
        "put_pipe", "put_cpu_pipe",
        "exists_cpu", "exists_cpu_pipe", "exists_srv", "exists_srv_pipe")}
    pipe0 = kvshm.client.PIPELINE
    with kvshm.Client(address, transport="tcp", timeout=120) as c:
        if c.transport != "tcp":
            raise RuntimeError(f"asked for tcp, got {c.transport}")
        c.put_batch(keys, vals)
        for _ in range(reps):
            # put_batch as one PUT (the default) and pipelined (KVSHM_PIPELINE=1), taking
            # turns; the values of the last one are read back below
            for pipe in ((True, False) if len(res["put"]) % 2 == 0 else (False, True)):
                kvshm.client.PIPELINE = pipe
                cpu0, t = cpu_seconds(server_pid), _now()
                c.put_batch(keys, vals)
                dt, cpu = _now() - t, cpu_seconds(server_pid) - cpu0
                sfx = "_pipe" if pipe else ""
                res["put" + sfx].append(n / dt)
                res["put_cpu" + sfx].append(cpu / n)
            kvshm.client.PIPELINE = pipe0
            cpu0, t = cpu_seconds(server_pid), _now()
            got = c.get_batch(keys)
            dt, cpu = _now() - t, cpu_seconds(server_pid) - cpu0
            res["get"].append(n / dt)
            res["get_cpu"].append(cpu / n)
            if got != vals:
                raise RuntimeError("get_batch returned other bytes")
            # exists_batch as one request (the default) and pipelined (KVSHM_PIPELINE=1,
            # kvshm.client.PIPELINE), taking turns first; wall, this thread's CPU, the
            # server's CPU
            for pipe in ((True, False) if len(res["exists"]) % 2 == 0 else (False, True)):
                kvshm.client.PIPELINE = pipe
                s0, c0, t = cpu_seconds(server_pid), time.thread_time(), _now()
                e = c.exists_batch(keys)
                dt, cc = _now() - t, time.thread_time() - c0
                sc = cpu_seconds(server_pid) - s0
                sfx = "_pipe" if pipe else ""
                res["exists" + sfx].append(n / dt)
                res["exists_cpu" + sfx].append(cc / n)
                res["exists_srv" + sfx].append(sc / n)
                if not all(e):
                    raise RuntimeError("exists_batch missed keys")
            kvshm.client.PIPELINE = pipe0
            if r is not None:
                t = _now()
                p = r.pipeline(transaction=False)
                for k, v in zip(keys, vals):
                    p.set(k, v)
                p.execute()
                res["rset"].append(n / (_now() - t))
                t = _now()
                rg = r.mget(keys)
                res["rmget"].append(n / (_now() - t))
                if rg != vals:
                    raise RuntimeError("redis MGET returned other bytes")
    out: dict[str, Any] = {"keys": n, "value_bytes": len(vals[0])}
    for name, figs in res.items():
        if figs:
            out[name] = statistics.median(figs)
    if r is not None:
        out["put_vs_redis"] = out["put"] / out["rset"]
        out["get_vs_redis"] = out["get"] / out["rmget"]
        r.flushall()
    return out


def bench_bystander(address: str, keys: list[bytes], vals: list[bytes], seconds: float
                    ) -> dict[str, Any]:
    """A 4 KiB single-get client (own process, TCP) while idle and while this process
    sends whole batches of ``keys`` (put_batch, then get_batch) to the same server."""
    import kvshm

    spec = {"kind": "bystander", "address": address, "transport": "tcp", "key": "bystander",
            "seed": 99, "size": VALUE_4K, "seconds": 0}
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps(spec)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    batches = 0
    try:
        assert p.stdin is not None and p.stdout is not None
        with kvshm.Client(address, transport="tcp", timeout=120) as c:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("bystander did not start")
            p.stdin.write("go\n")
            p.stdin.flush()
            t0 = time.monotonic()
            time.sleep(seconds)        # idle window: the bystander alone
            busy0 = time.monotonic()
            while time.monotonic() < busy0 + seconds:
                c.put_batch(keys, vals)
                if c.get_batch(keys) != vals:
                    raise RuntimeError("get_batch returned other bytes")
                batches += 2
            busy1 = time.monotonic()
            time.sleep(0.2)            # the requests the last batch held up finish
            p.stdin.write("stop\n")
            p.stdin.flush()
            out = json.loads(p.stdout.readline())
            p.wait(30)
    finally:
        stop(p)
    if out["bad"]:
        raise RuntimeError(f"{out['bad']} bystander reads returned wrong bytes")
    # by start time: a request that began while a batch ran counts as "busy" however long
    # it then waited
    idle = [lat for ts, lat in out["stamps"] if t0 <= ts and ts + lat < busy0]
    busy = [lat for ts, lat in out["stamps"] if busy0 <= ts < busy1]
    return {"batch_keys": len(keys), "batches": batches, "busy_s": busy1 - busy0,
            "idle": lat_stats(idle) if idle else {}, "busy": lat_stats(busy) if busy else {}}


if __name__ == "__main__":
    worker_main(json.loads(sys.argv[1]))
