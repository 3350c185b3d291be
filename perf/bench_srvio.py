"""What a remote request's transport costs the server: libzmq's ROUTER vs a ZMTP server of its own.

Issue 13 asks for single-key requests through the server at >= 1.0x Redis; the kvshm server
spends about half its CPU per request in libzmq's I/O thread (``perf/bench_small.py``
prints the split). This script measures the transport, first alone (no store behind it),
so the two ways a server can carry the same ZMTP traffic are compared like with like:

``zmq``
    A ROUTER socket served as :class:`kvshm.zmq_ctrl.router.ServiceLoop` serves it:
    ``_zmqc.wait_in``, ``recv_multipart`` until nothing is queued, then the replies
    (``send_parts``), one thread of ours plus libzmq's I/O thread.
``zmtp``
    One thread, ``epoll`` over the accepted TCP connections, each a
    :class:`kvshm.zmq_ctrl._zmtp.Conn` (the client's own ZMTP code used on the server's
    end): a readable connection's whole messages received, each answered at once.

The same two with a Store behind them (``--modes``; by default all four):

``zmq+store``
    kvshm's own loop, :meth:`ServiceLoop.run` (its lean turns in C, the one-key fast
    path), over a Store of its own, no door (an implicit session per peer).
``native+store``
    ``zmq+store`` over kvshm's own ZMTP listener (:mod:`kvshm.zmq_ctrl.listener`, the
    server's ``--listener native``) instead of libzmq's ROUTER: the whole loop (timers,
    HELLO, slices, zero-copy sends, bounds), compared with ``zmq+store``.
``zmtp+store``
    A prototype, not kvshm's server: ``zmtp``'s connections, each message served by the
    same loop's ``FastPath.handle`` (the session, the Store, the reply's bytes) and its
    reply sent on its connection. It serves only what the fast path takes (a declined
    request ends the run with an error) and none of the loop's other duties (timers,
    HELLO, slices, zero-copy sends, cutting stalled peers): it sizes what a ZMTP listener
    of the server's own would save, nothing more.

Each of N client processes (separate processes, as remote clients) speaks ZMTP itself over
one TCP connection, as ``kvshm.Client`` does on ``tcp://``, and sends 4 KiB PUT requests
(the header ``kvshm.zmq_ctrl._zmqc.encode1`` packs) one at a time for ``--seconds``; every
reply is the same small header. Printed per N: requests/s, server CPU per request (all its
threads, and the I/O thread's share for ``zmq``), client CPU per request, and the load
average; the two servers take turns (``--reps`` pairs, the first server alternating).
With ``KVSHM_BENCH_HELLO=1`` in the environment each client says HELLO first, so its
requests are those of a session bound to its connection (the per-request check of
:func:`kvshm.zmq_ctrl.sends.bound_ok`) instead of a door-less implicit session's.

Run: ``python perf/bench_srvio.py [--clients 1,2,4,8] [--seconds 2] [--reps 2]
[--modes zmq,zmtp,zmq+store,zmtp+store] [--json F]`` (``--quick`` for the test's smoke
run). Figures are for comparing the two servers of a pair with each other in one run (the
server's pool is unlinked when it stops).
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


def _store() -> tuple[Any, Any]:
    """A pool of its own (16 MiB, 4 KiB blocks; unlinked by the caller) and a Store."""
    from kvshm._pool import Pool
    from kvshm.limits import Limits
    from kvshm.store import Store, StoreConfig

    pool = Pool.create(f"/kvshm-srvio-{os.getpid()}-{os.urandom(4).hex()}", 4096 * 4096, 4096)
    return pool, Store(pool, StoreConfig(limits=Limits()))


def _serve_loop_store(stop_fd: int, native: bool) -> None:
    """kvshm's own loop (ServiceLoop.run, its fast path and lean turns) over a Store, no
    door (an implicit session per peer, as in-process tests serve), on libzmq's ROUTER or
    (``native``) kvshm's own ZMTP listener; returns when ``stop_fd`` is readable."""
    import threading

    from kvshm.zmq_ctrl import router
    from kvshm.zmq_ctrl.listener import NativeListener
    from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION

    pool, store = _store()
    loop = router.ServiceLoop(store, ["tcp://127.0.0.1:0"], {"version": PROTOCOL_VERSION}, 7,
                              sock=NativeListener() if native else None)
    try:
        print(loop.endpoints[0].rsplit(":", 1)[1], flush=True)
        t = threading.Thread(target=loop.run, daemon=True)
        t.start()
        select.select([stop_fd], [], [])
        loop.stop()
        t.join(30)
    finally:
        loop.close()
        pool.close()
        pool.unlink()


def serve_zmq_store(stop_fd: int) -> None:
    """:func:`_serve_loop_store` on libzmq's ROUTER."""
    _serve_loop_store(stop_fd, native=False)


def serve_native_store(stop_fd: int) -> None:
    """``zmq+store`` with kvshm's own ZMTP listener
    (:class:`kvshm.zmq_ctrl.listener.NativeListener`, the server's ``--listener native``)
    in place of libzmq's ROUTER."""
    _serve_loop_store(stop_fd, native=True)


def serve_zmtp_store(stop_fd: int) -> None:
    """A prototype, not kvshm's server: :func:`serve_zmtp`'s connections, each message
    served by the same loop's C fast path (``FastPath.handle``: the session, the Store,
    the reply bytes) and its reply sent on the connection it came on. Only what the fast
    path takes is served (a declined message ends the run with an error)."""
    from kvshm.zmq_ctrl import _zmtp, router
    from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION

    pool, store = _store()
    loop = router.ServiceLoop(store, [], {"version": PROTOCOL_VERSION}, 7)
    fast = loop._fast
    if fast is None:
        raise RuntimeError("no fast path (kvshm.zmq_ctrl._fastpath, _zmqc not built?)")
    router._FullGcHold.take()       # as ServiceLoop.run: no automatic full collection
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(64)
    ls.setblocking(False)
    print(ls.getsockname()[1], flush=True)
    ep = select.epoll()
    ep.register(ls.fileno(), select.EPOLLIN)
    ep.register(stop_fd, select.EPOLLIN)
    conns: dict[int, tuple[Any, bytes]] = {}
    outq: list[Any] = []
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
                    c.handshake(b"", TIMEOUT_MS)
                    props = c.peer or {}
                    ident = props.get(b"identity", b"")
                    if not ident:
                        raise RuntimeError("a client without a routing id")
                    loop._session_of(ident)     # its implicit session
                    conns[c.fileno()] = (c, ident)
                    ep.register(c.fileno(), select.EPOLLIN)
                    continue
                c, ident = conns[fd]
                try:
                    while True:
                        m = c.recv(0)
                        if m is None:
                            break
                        if not fast.handle([ident, *m], outq):
                            raise RuntimeError("the fast path declined a request")
                        for r in outq:
                            c.send(r[1], r[2:], TIMEOUT_MS)
                        outq.clear()
                except _zmtp.PeerClosed:
                    del conns[fd]       # (Conn closed its fd: epoll forgot it)
    finally:
        router._FullGcHold.give()
        for c, _ident in conns.values():
            c.close()
        ls.close()
        ep.close()
        loop.close()
        pool.close()
        pool.unlink()


SERVERS = {"zmq": serve_zmq, "zmtp": serve_zmtp, "zmq+store": serve_zmq_store,
           "zmtp+store": serve_zmtp_store, "native+store": serve_native_store}


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
    if os.environ.get("KVSHM_BENCH_HELLO") == "1":
        # a session opened by HELLO, bound to this connection (kvshm.zmq_ctrl.sends.
        # bound_ok checked on every request), instead of the door-less implicit one
        import msgpack

        from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Op
        c.send(msgpack.packb([PROTOCOL_VERSION, Op.HELLO, 1, 0, {"nonce": os.urandom(16)}],
                             use_bin_type=True), (), TIMEOUT_MS)
        if c.recv(TIMEOUT_MS) is None:
            raise RuntimeError("no reply to HELLO")
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
    ap.add_argument("--modes", default="zmq,zmtp,zmq+store,zmtp+store",
                    help="servers to compare (pairs: zmq,zmtp and zmq+store,zmtp+store)")
    ap.add_argument("--serve", choices=tuple(SERVERS), help=argparse.SUPPRESS)
    ap.add_argument("--client", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        SERVERS[args.serve](sys.stdin.fileno())
        return 0
    if args.client:
        client_main(int(args.client[0]), float(args.client[1]), args.client[2].encode())
        return 0
    if args.quick:
        args.clients, args.seconds, args.reps = "1,2", 0.3, 1
    counts = [int(x) for x in args.clients.split(",")]
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in SERVERS]
    if bad:
        ap.error(f"unknown --modes {bad}; known: {', '.join(SERVERS)}")
    pairs = [(a, b) for a, b in (("zmq", "zmtp"), ("zmq+store", "zmtp+store"),
                                 ("zmq+store", "native+store"))
             if a in modes and b in modes]
    if not pairs:
        ap.error("--modes names no pair to compare (zmq,zmtp or zmq+store,zmtp+store or "
                 "zmq+store,native+store)")
    res: dict[str, Any] = {"meta": {"seconds": args.seconds, "reps": args.reps,
                                    "cpus": os.cpu_count(), "pairs": pairs,
                                    "loadavg_start": os.getloadavg()[0]}, "rows": []}
    for n in counts:
        row: dict[str, Any] = {"clients": n}
        for pair in pairs:
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in pair}
            for rep in range(args.reps):
                for kind in (pair if (rep + n) % 2 == 0 else pair[::-1]):
                    runs[kind].append(one_run(kind, n, args.seconds))
            for kind, rs in runs.items():
                for fig in ("rps", "srv_us", "io_us", "client_us"):
                    row[f"{kind}_{fig}"] = statistics.median(r[fig] for r in rs)
            row[f"{pair[1]}_vs_{pair[0]}_rps"] = row[f"{pair[1]}_rps"] / row[f"{pair[0]}_rps"]
        row["loadavg"] = os.getloadavg()[0]
        res["rows"].append(row)
    res["meta"]["loadavg_end"] = os.getloadavg()[0]
    for a, b in pairs:
        what = ("SERVER TRANSPORT ALONE (no store)" if a == "zmq" else
                "WITH THE STORE (the loop's C fast path; zmtp+store is a prototype)"
                if b == "zmtp+store" else
                "WITH THE STORE: kvshm's loop over libzmq's ROUTER vs its native listener")
        print(f"{what}: 4 KiB PUT requests over TCP, ZMTP clients, {args.seconds} s phases, "
              f"median of {args.reps}")
        hdr = ("clients", f"{a} req/s", f"{b} req/s", f"{b}/{a}", f"{a} srv us",
               "of it I/O thr", f"{b} srv us", f"{a} cli us", f"{b} cli us", "load")
        print("  " + " ".join(f"{h:>16}" for h in hdr))
        for r in res["rows"]:
            vals = (r["clients"], r[f"{a}_rps"], r[f"{b}_rps"], r[f"{b}_vs_{a}_rps"],
                    r[f"{a}_srv_us"], r[f"{a}_io_us"], r[f"{b}_srv_us"], r[f"{a}_client_us"],
                    r[f"{b}_client_us"], r["loadavg"])
            print("  " + " ".join(f"{v:16.2f}" if isinstance(v, float) and v < 100 else
                                  f"{v:16.0f}" for v in vals))
    print(f"  load average {res['meta']['loadavg_start']:.2f} at start, "
          f"{res['meta']['loadavg_end']:.2f} at end, {res['meta']['cpus']} CPUs")
    if args.json:
        write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
