"""What a remote request's transport costs the server: libzmq's ROUTER vs a ZMTP server of its own.

Issue 13 asks for single-key requests through the server at >= 1.0x Redis; the kvshm server
spends about half its CPU per request in libzmq's I/O thread (``perf/bench_small.py``
prints the split). This script measures the transport alone, with no store behind it, so
the two ways a server can carry the same ZMTP traffic are compared like with like:

``zmq``
    A ROUTER socket served as :class:`kvshm.zmq_ctrl.router.ServiceLoop` serves it:
    ``_zmqc.wait_in``, ``recv_multipart`` until nothing is queued, then the replies
    (``send_parts``), one thread of ours plus libzmq's I/O thread.
``zmtp``
    One thread, ``epoll`` over the accepted TCP connections, each a
    :class:`kvshm.zmq_ctrl._zmtp.Conn` (the client's own ZMTP code used on the server's
    end): a readable connection's whole messages received, each answered at once.

Each of N client processes (separate processes, as remote clients) speaks ZMTP itself over
one TCP connection, as ``kvshm.Client`` does on ``tcp://``, and sends 4 KiB PUT requests
(the header ``kvshm.zmq_ctrl._zmqc.encode1`` packs) one at a time for ``--seconds``; every
reply is the same small header. Printed per N: requests/s, server CPU per request (all its
threads, and the I/O thread's share for ``zmq``), client CPU per request, and the load
average; the two servers take turns (``--reps`` pairs, the first server alternating).

Run: ``python perf/bench_srvio.py [--clients 1,2,4,8] [--seconds 2] [--reps 2] [--json F]``
(``--quick`` for the test's smoke run). Figures are for comparing the two servers with each
other in one run; they do not include the store, the session checks or the dispatch
(kvshm's own fast path adds those to either).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import ROOT, cpu_seconds, stop, thread_cpu_seconds, write_json  # noqa: E402

sys.path.insert(0, ROOT)

#: the reply every request gets: [version 2, OK, request id 1, {"st": [0]}], as a PUT's
REPLY = b"\x94\x02\x00\x01\x81\xa2st\x91\x00"
VALUE_BYTES = 4096
TIMEOUT_MS = 10_000


# --------------------------------------------------------------------------- servers


def serve_zmq(stop_fd: int) -> None:
    """The ROUTER server (see the module docstring); returns when ``stop_fd`` is readable."""
    import zmq

    from kvshm.zmq_ctrl import _zmqc

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    print(port, flush=True)
    recv, send, wait = _zmqc.recv_multipart, _zmqc.send_parts, _zmqc.wait_in
    outq: list[tuple[Any, bytes]] = []    # (routing id, reply)
    try:
        while True:
            ev = wait(sock, stop_fd, None, -1)
            if ev & 2:
                return
            if not ev & 1:
                continue
            for _ in range(256):
                m = recv(sock, 1, 65536, 1)
                if m is None:
                    break
                outq.append((m[0], REPLY))
            for r in outq:
                send(sock, r)
            outq.clear()
    finally:
        sock.close(0)
        ctx.term()


def serve_zmtp(stop_fd: int) -> None:
    """The server of its own (see the module docstring); returns when ``stop_fd`` is
    readable."""
    from kvshm.zmq_ctrl import _zmtp

    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(64)
    ls.setblocking(False)
    print(ls.getsockname()[1], flush=True)
    ep = select.epoll()
    ep.register(ls.fileno(), select.EPOLLIN)
    ep.register(stop_fd, select.EPOLLIN)
    conns: dict[int, Any] = {}
    try:
        while True:
            for fd, _ in ep.poll():
                if fd == stop_fd:
                    return
                if fd == ls.fileno():
                    try:
                        s, _addr = ls.accept()
                    except BlockingIOError:
                        continue
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    c = _zmtp.Conn(s.detach())
                    c.handshake(b"", TIMEOUT_MS)    # (before the timed phase)
                    conns[c.fileno()] = c
                    ep.register(c.fileno(), select.EPOLLIN)
                    continue
                c = conns[fd]
                try:
                    while True:
                        m = c.recv(0)
                        if m is None:
                            break
                        c.send(REPLY, (), TIMEOUT_MS)
                except _zmtp.PeerClosed:
                    del conns[fd]       # (Conn closed its fd: epoll forgot it)
    finally:
        for c in conns.values():
            c.close()
        ls.close()
        ep.close()


# --------------------------------------------------------------------------- clients


def client_main(port: int, seconds: float, ident: bytes) -> None:
    """One client process: connects, prints "ready", waits for a line on stdin, sends
    requests for ``seconds``, prints its count and CPU seconds as JSON."""
    from kvshm.zmq_ctrl import _zmqc, _zmtp

    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c = _zmtp.Conn(s.detach())
    c.handshake(ident, TIMEOUT_MS)
    value = os.urandom(VALUE_BYTES)
    header = _zmqc.encode1(6, 1, 7, b"remote-key", VALUE_BYTES, None)
    print("ready", flush=True)
    sys.stdin.readline()
    n = 0
    cpu0 = time.process_time()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        c.send(header, (value,), TIMEOUT_MS)
        r = c.recv(TIMEOUT_MS)
        if r is None or r[0] != REPLY:
            raise RuntimeError(f"bad reply {r!r}")
        n += 1
    cpu = time.process_time() - cpu0
    c.close()
    print(json.dumps({"n": n, "cpu": cpu}), flush=True)


# --------------------------------------------------------------------------- driver


def one_run(kind: str, nclients: int, seconds: float) -> dict[str, Any]:
    """One server of ``kind`` and ``nclients`` client processes: the figures of a phase."""
    me = os.path.abspath(__file__)
    srv = subprocess.Popen([sys.executable, me, "--serve", kind], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    clients: list[subprocess.Popen] = []
    try:
        assert srv.stdout is not None and srv.stdin is not None
        line = srv.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the {kind} server did not start")
        port = int(line)
        for i in range(nclients):
            clients.append(subprocess.Popen(
                [sys.executable, me, "--client", str(port), str(seconds), f"c{i}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in clients:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a client did not start")
        cpu0, th0 = cpu_seconds(srv.pid), thread_cpu_seconds(srv.pid)
        for p in clients:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = []
        for p in clients:
            assert p.stdout is not None
            outs.append(json.loads(p.stdout.readline()))
        cpu, th1 = cpu_seconds(srv.pid) - cpu0, thread_cpu_seconds(srv.pid)
        for p in clients:
            p.wait(30)
        srv.stdin.write("stop\n")
        srv.stdin.flush()
        srv.wait(30)
    finally:
        for p in clients:
            stop(p)
        stop(srv)
    total = sum(o["n"] for o in outs)
    io = sum(t - th0.get(name, 0.0) for name, t in th1.items() if name.startswith("ZMQbg/IO"))
    return {"rps": total / seconds, "srv_us": cpu / max(total, 1) * 1e6,
            "io_us": io / max(total, 1) * 1e6,
            "client_us": sum(o["cpu"] for o in outs) / max(total, 1) * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per phase")
    ap.add_argument("--reps", type=int, default=2, help="pairs of phases per N")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (for tests)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON ('-': stdout)")
    ap.add_argument("--serve", choices=("zmq", "zmtp"), help=argparse.SUPPRESS)
    ap.add_argument("--client", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        (serve_zmq if args.serve == "zmq" else serve_zmtp)(sys.stdin.fileno())
        return 0
    if args.client:
        client_main(int(args.client[0]), float(args.client[1]), args.client[2].encode())
        return 0
    if args.quick:
        args.clients, args.seconds, args.reps = "1,2", 0.3, 1
    counts = [int(x) for x in args.clients.split(",")]
    res: dict[str, Any] = {"meta": {"seconds": args.seconds, "reps": args.reps,
                                    "cpus": os.cpu_count(),
                                    "loadavg_start": os.getloadavg()[0]}, "rows": []}
    for n in counts:
        runs: dict[str, list[dict[str, Any]]] = {"zmq": [], "zmtp": []}
        for rep in range(args.reps):
            for kind in (("zmq", "zmtp") if (rep + n) % 2 == 0 else ("zmtp", "zmq")):
                runs[kind].append(one_run(kind, n, args.seconds))
        row: dict[str, Any] = {"clients": n, "loadavg": os.getloadavg()[0]}
        for kind, rs in runs.items():
            for fig in ("rps", "srv_us", "io_us", "client_us"):
                row[f"{kind}_{fig}"] = statistics.median(r[fig] for r in rs)
        row["zmtp_vs_zmq_rps"] = row["zmtp_rps"] / row["zmq_rps"]
        res["rows"].append(row)
    res["meta"]["loadavg_end"] = os.getloadavg()[0]
    print("SERVER TRANSPORT ALONE (no store): 4 KiB PUT requests over TCP, ZMTP clients, "
          f"{args.seconds} s phases, median of {args.reps}")
    hdr = ("clients", "zmq req/s", "zmtp req/s", "zmtp/zmq", "zmq srv us", "of it I/O thr",
           "zmtp srv us", "zmq cli us", "zmtp cli us", "load")
    print("  " + " ".join(f"{h:>13}" for h in hdr))
    for r in res["rows"]:
        vals = (r["clients"], r["zmq_rps"], r["zmtp_rps"], r["zmtp_vs_zmq_rps"], r["zmq_srv_us"],
                r["zmq_io_us"], r["zmtp_srv_us"], r["zmq_client_us"], r["zmtp_client_us"],
                r["loadavg"])
        print("  " + " ".join(f"{v:13.2f}" if isinstance(v, float) and v < 100 else
                              f"{v:13.0f}" for v in vals))
    print(f"  load average {res['meta']['loadavg_start']:.2f} at start, "
          f"{res['meta']['loadavg_end']:.2f} at end, {res['meta']['cpus']} CPUs")
    if args.json:
        write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
