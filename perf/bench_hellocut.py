"""Server CPU per single-key request with the admission monitor on and off.

Starts ``kvshm serve`` in three modes, alternating, ``--pairs`` rounds: ``off``
(``KVSHM_HELLO_CUT=0``: no socket monitor, as before), ``on`` (the default: the monitor
polled, nothing held), ``held`` (on, with 16 raw connections that never say HELLO held
for the whole run: every request of the client then admits-checks its connection). One
TCP client (the ZMTP transport) does ``--n`` single-key 4 KiB GETs; printed: the server
process's CPU (user + system, /proc) per request and the client's wall time per request,
the median over the rounds, and the load average.

    python perf/bench_hellocut.py --pairs 5 --n 20000
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from kvshm import Client  # noqa: E402
from servers import ServerProcess  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _silent_peer(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
              + b"\0" * 32)
    got = b""
    while len(got) < 64:
        got += s.recv(64 - len(got))
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(bytes([0x04, len(ready)]) + ready)
    return s


def run(mode: str, n: int) -> tuple[float, float]:
    env = {"KVSHM_HELLO_CUT": "0"} if mode == "off" else {}
    flags = ("--hello-timeout", "600") if mode == "held" else ()
    with ServerProcess(*flags, env=env) as srv:
        held = [_silent_peer(srv.address) for _ in range(16)] if mode == "held" else []
        try:
            with Client(srv.address, transport="tcp", timeout=10) as c:
                c.put(b"k", b"x" * 4096)
                for _ in range(1000):
                    c.get(b"k")
                c0, t0 = _cpu(srv.proc.pid), time.perf_counter()
                for _ in range(n):
                    c.get(b"k")
                t1, c1 = time.perf_counter(), _cpu(srv.proc.pid)
                if mode == "held":
                    errs = c.stats()["error_kinds"]
                    assert not errs.get("unadmitted_cut") and not errs.get("unadmitted_bound")
        finally:
            for s in held:
                s.close()
    return (c1 - c0) / n * 1e6, (t1 - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--n", type=int, default=20000)
    a = ap.parse_args()
    modes = ["off", "on", "held"]
    got: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for i in range(a.pairs):
        order = modes if i % 2 == 0 else modes[::-1]
        for m in order:
            got[m].append(run(m, a.n))
            print(f"round {i} {m:4s} server {got[m][-1][0]:6.2f} us CPU/req, client "
                  f"{got[m][-1][1]:6.2f} us/req  load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"median over {a.pairs} rounds of {a.n} single-key 4 KiB GETs (tcp, ZMTP client); "
          f"load {os.getloadavg()}")
    for m in modes:
        cpu = statistics.median(x[0] for x in got[m])
        wall = statistics.median(x[1] for x in got[m])
        print(f"  {m:4s} server CPU {cpu:6.2f} us/req   client wall {wall:6.2f} us/req")


if __name__ == "__main__":
    main()
