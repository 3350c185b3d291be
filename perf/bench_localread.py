#!/usr/bin/env python
"""Single-key 4 KiB get on a local (shm) client: lock-free through the shared index vs
through the server, beside a bare pyzmq DEALER/ROUTER echo round trip and a numpy copy
of the same 4 KiB plus one Python call, all measured in the same run.

Cases (interleaved, one round of each per repetition, after a warm-up round, so a load
change on a shared machine hits them alike):

- ``local get``: ``Client.get(key)`` of a client that maps the server's shared index
  (kvshm/localread.py): no message at all;
- ``server get``: the same call on a client made with ``KVSHM_NO_LOCAL_READS=1`` (LOOKUP
  round trip, copy, RELEASE riding on the next request: the path before issue 13);
- ``local get_into``: ``Client.get_into(key, buf)`` lock-free into a reused buffer;
- ``zmq echo``: one 4 KiB message DEALER -> ROUTER -> DEALER over ipc, the ROUTER in a
  thread of this process echoing (the floor of any request/reply over ZeroMQ here);
- ``numpy copy``: ``np.copyto(dst, src)`` of 4 KiB through a Python function call (into a
  reused buffer, the baseline of ``local get_into``);
- ``numpy tobytes``: ``src.tobytes()``, a new bytes object of the same 4 KiB through a
  Python function call (fresh bytes, the baseline of ``local get``).

Every timed read is checked (the value's bytes, the buffer zeroed before each
``get_into``; outside the clock). Prints p50 / p99 in microseconds per case and the
ratios the issue asks for, like with like: local get p50 <= 0.25x the zmq echo, and
<= 3x its copy baseline (get vs tobytes: fresh bytes both; get_into vs copyto: a reused
buffer both).

Usage::

    python perf/bench_localread.py                 # 20,000 gets a case, 5 rounds
    python perf/bench_localread.py --n 50000 --rounds 7 --size 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def timed(fn, n: int, before=None, check=None) -> list[float]:
    """ns of each of n calls of fn(); before() runs ahead of each call and check(result)
    after it, both outside the clock. A check that returns False raises RuntimeError
    (every read is checked, not only a warm-up one)."""
    out = [0.0] * n
    clock = time.perf_counter_ns
    bad = 0
    for i in range(n):
        if before is not None:
            before()
        t0 = clock()
        r = fn()
        out[i] = clock() - t0
        if check is not None and not check(r):
            bad += 1
    if bad:
        raise RuntimeError(f"{bad} of {n} calls returned wrong bytes")
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1000.0


def echo_pair(ctx: zmq.Context, size: int):
    d = tempfile.mkdtemp(prefix="kvshm-bench-echo-")
    ep = f"ipc://{d}/echo.sock"
    router = ctx.socket(zmq.ROUTER)
    router.bind(ep)
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(100):
                ident, msg = router.recv_multipart(copy=False)
                router.send_multipart([ident, msg], copy=False)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(ep)
    payload = b"e" * size

    def once() -> None:
        dealer.send(payload, copy=False)
        dealer.recv(copy=False)

    def close() -> None:
        stop.set()
        th.join(5)
        dealer.close(0)
        router.close(0)
        try:
            os.unlink(f"{d}/echo.sock")
        except OSError:
            pass
        os.rmdir(d)

    return once, close


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20_000, help="calls per case per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", type=int, default=4096, help="value bytes")
    args = ap.parse_args()

    srv = _common.small_server()
    ctx = zmq.Context()
    echo, echo_close = echo_pair(ctx, args.size)
    try:
        local, remote = _common.local_and_remote(srv.address)
        assert local._session.local is not None and remote._session.local is None
        value = os.urandom(args.size)
        local.put("bench", value)
        assert local.get("bench") == value and remote.get("bench") == value
        buf = bytearray(args.size)
        src = np.frombuffer(value, dtype=np.uint8)
        dst = np.empty_like(src)

        def np_copy() -> None:
            np.copyto(dst, src)

        def np_tobytes() -> bytes:
            return src.tobytes()

        def zero_buf() -> None:
            buf[:] = zeros

        zeros = bytes(args.size)
        is_value = value.__eq__

        # name: (call, before each call, check of its result), before and check unclocked
        cases = {
            "local get": (lambda: local.get("bench"), None, is_value),
            "local get_into": (lambda: local.get_into("bench", buf), zero_buf,
                               lambda _: buf == value),
            "server get": (lambda: remote.get("bench"), None, is_value),
            "zmq echo": (echo, None, None),
            "numpy copy": (np_copy, lambda: dst.fill(0), lambda _: dst.tobytes() == value),
            "numpy tobytes": (np_tobytes, None, is_value),
        }
        for fn, before, check in cases.values():           # warm-up
            timed(fn, min(2000, args.n), before, check)
        samples: dict[str, list[float]] = {k: [] for k in cases}
        p50s: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for k, (fn, before, check) in cases.items():
                xs = timed(fn, args.n, before, check)
                samples[k].extend(xs)
                p50s[k].append(pct(xs, 0.5))
        r = local._session.local
        print(f"single-key {args.size} B get, {args.n} calls x {args.rounds} rounds "
              f"(python {sys.version.split()[0]}, {os.cpu_count()} cpus)")
        print(f"{'case':<16} {'p50 us':>8} {'p99 us':>8}")
        for k in cases:
            print(f"{k:<16} {pct(samples[k], 0.5):8.2f} {pct(samples[k], 0.99):8.2f}")
        ratios_echo = [a / b for a, b in zip(p50s["local get"], p50s["zmq echo"])]
        ratios_np = [a / b for a, b in zip(p50s["local get"], p50s["numpy tobytes"])]
        ratios_into = [a / b for a, b in zip(p50s["local get_into"], p50s["numpy copy"])]
        ratios_srv = [b / a for a, b in zip(p50s["local get"], p50s["server get"])]
        print(f"local get p50 / zmq echo p50   = {statistics.median(ratios_echo):.3f}x "
              "(target <= 0.25)")
        print(f"local get p50 / numpy tobytes p50 = {statistics.median(ratios_np):.2f}x "
              "(fresh bytes both; target <= 3)")
        print(f"local get_into p50 / numpy copy p50 = {statistics.median(ratios_into):.2f}x "
              "(a reused buffer both; target <= 3)")
        print(f"server get p50 / local get p50 = {statistics.median(ratios_srv):.1f}x faster")
        print(f"reader: hits {r.hits} fallbacks {r.fallbacks} retries {r.retries}")
        local.close()
        remote.close()
    finally:
        echo_close()
        ctx.term()
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
