"""GB/s of batch put and get over RDMA, for 64 KiB and 1 MiB values (hardware only).

Starts a ``kvshm serve --dev-name DEV`` on this host (or uses ``--address`` of a server
started with ``--dev-name`` on another host), then for each value size times
``put_batch`` and ``get_batch_into`` of ``--batch`` keys, over ``--rounds`` rounds after
one warm-up round (which registers the buffers), with ``transport="rdma"`` and, as the
baseline measured in the same run, ``transport="tcp"``. Every get is checked byte for
byte once. Prints one row per (size, transport, direction) and the RDMA/TCP ratios::

    python perf/bench_rdma.py --dev-name mlx5_0
    python perf/bench_rdma.py --dev-name mlx5_0 --address 10.0.0.2:12345 --gid-index 3
    python perf/bench_rdma.py --dev-name mlx5_0 --sizes 64K,1M,4M --batch 256 --json

GB/s = bytes moved / seconds of the calls (10^9 bytes). Needs an RDMA device with an
active port and RLIMIT_MEMLOCK above the pool size (see docs/RDMA.md); on a host without
one it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def parse_size(text: str) -> int:
    t = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


def check_device(args: argparse.Namespace) -> str | None:
    try:
        from kvshm.rdma.device import open_port
        from kvshm.rdma.verbs import PyverbsBackend

        p = open_port(PyverbsBackend(), args.dev_name, args.ib_port,
                      gid_index=args.gid_index)
    except Exception as exc:
        return str(exc)
    print(f"# device {p.describe()}", file=sys.stderr)
    p.close()
    return None


def bench(address: str, transport: str, size: int, batch: int, rounds: int,
          rdma: dict[str, Any] | None) -> dict[str, Any]:
    from kvshm import Client

    keys = [f"bench/{size}/{i}" for i in range(batch)]
    src = np.random.default_rng(size).integers(0, 256, (batch, size), dtype=np.uint8)
    out = np.zeros_like(src)
    srcs, outs = list(src), list(out)
    with Client(address, transport=transport, timeout=60, rdma=rdma) as c:
        got = c.transport
        c.put_batch(keys, srcs)                       # warm-up: registers both arrays
        c.get_batch_into(keys, outs)
        if not np.array_equal(src, out):
            raise SystemExit(f"{transport}: values read back differ")
        t_put = t_get = 0.0
        for _ in range(rounds):
            t = time.perf_counter()
            c.put_batch(keys, srcs)
            t_put += time.perf_counter() - t
            t = time.perf_counter()
            c.get_batch_into(keys, outs)
            t_get += time.perf_counter() - t
        c.delete(keys)
    moved = batch * size * rounds
    return {"transport": got, "put_gbps": moved / t_put / 1e9,
            "get_gbps": moved / t_get / 1e9, "put_s": t_put, "get_s": t_get}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dev-name", default=None, help="RDMA device (default: the first "
                                                    "with an active port)")
    p.add_argument("--ib-port", type=int, default=1)
    p.add_argument("--gid-index", type=int, default=None)
    p.add_argument("--address", default=None,
                   help="host:port of a server started with --dev-name (default: start "
                        "one here)")
    p.add_argument("--sizes", default="64K,1M", help="value sizes (default 64K,1M)")
    p.add_argument("--batch", type=int, default=128, help="keys per batch (default 128)")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (default 20)")
    p.add_argument("--pool-gib", type=float, default=2.0,
                   help="pool of the server started here (default 2)")
    p.add_argument("--no-tcp", action="store_true", help="skip the TCP baseline")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args()

    why = check_device(args)
    if why is not None:
        print(f"bench_rdma: needs an RDMA device: {why}", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    need = max(sizes) * args.batch
    rdma = {"dev_name": args.dev_name, "ib_port": args.ib_port,
            "gid_index": args.gid_index}
    srv = None
    address = args.address
    if address is None:
        if need > args.pool_gib * (1 << 30):
            print(f"bench_rdma: --pool-gib {args.pool_gib} is smaller than one batch "
                  f"({need} bytes)", file=sys.stderr)
            return 2
        from servers import ServerProcess

        flags = ["--ib-port", str(args.ib_port)]
        if args.dev_name:
            flags += ["--dev-name", args.dev_name]
        else:
            print("bench_rdma: --dev-name is needed to start a server", file=sys.stderr)
            return 2
        if args.gid_index is not None:
            flags += ["--gid-index", str(args.gid_index)]
        srv = ServerProcess(*flags, prealloc_size=args.pool_gib)
        address = srv.address
        print(f"# {srv.ready_line}", file=sys.stderr)
    rows = []
    try:
        for size in sizes:
            r = bench(address, "rdma", size, args.batch, args.rounds, rdma)
            t = None if args.no_tcp else bench(address, "tcp", size, args.batch,
                                               args.rounds, None)
            rows.append({"size": size, "batch": args.batch, "rounds": args.rounds,
                         "rdma": r, "tcp": t})
    finally:
        if srv is not None:
            srv.stop()
            srv.remove_segment()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'value':>9} {'batch':>6} {'op':>4} {'rdma GB/s':>10} {'tcp GB/s':>9} "
          f"{'rdma/tcp':>9}")
    for row in rows:
        for op in ("put", "get"):
            rg = row["rdma"][f"{op}_gbps"]
            tg = row["tcp"][f"{op}_gbps"] if row["tcp"] else float("nan")
            print(f"{row['size']:>9} {row['batch']:>6} {op:>4} {rg:>10.2f} {tg:>9.2f} "
                  f"{rg / tg if row['tcp'] else float('nan'):>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
