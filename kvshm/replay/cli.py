"""``kvshm replay``: its flags (:func:`add_parser`, added to the ``kvshm`` command by
:mod:`kvshm.cli`) and the command (:func:`cmd_replay`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import sys
from typing import Any

from kvshm.cliargs import nonneg_float, nonneg_int, pos_float, pos_int
from kvshm.replay.options import (BACKENDS, DEFAULT_WINDOW_PER_CLIENT, KiB, ReplayError,
                                  ReplayOptions, UsageError)
from kvshm.replay.report import format_summary, plot
from kvshm.replay.run import run_replay

__all__ = ["add_parser", "cmd_replay"]


_SIZE = re.compile(r"^\s*(\d+)\s*([kKmM]i?[bB]?|[bB])?\s*$")


def _block_bytes_t(text: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 65536, 64K)")
    v = int(m.group(1))
    unit = (m.group(2) or "").lower()
    if unit.startswith("k"):
        v *= KiB
    elif unit.startswith("m"):
        v *= KiB * KiB
    if v < 16 or v % 8:
        raise argparse.ArgumentTypeError(f"{text!r}: a block must be a multiple of 8 "
                                         "bytes, >= 16")
    return v


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``kvshm replay`` to the ``kvshm`` command's subparsers."""
    p = sub.add_parser(
        "replay", help="replay a request trace against a store and check every byte",
        description=(
            "Replay a KV-cache request trace: per request, match_prefix of its block keys, "
            "get_batch_into of the leading hits (checked byte for byte), put_batch of the "
            "rest. Prints the hit rate beside an exact LRU over the same capacity and the "
            "unbounded bound, the bytes moved, GB/s and latency. Exits 1 on any mismatch "
            "or error. With --clients K, request i goes to client process i % K."))
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="trace file, JSON lines with hash_ids, gzip or not (default: the "
                        "bundled Mooncake FAST'25 conversation trace)")
    p.add_argument("--requests", type=pos_int, default=None, metavar="N",
                   help="replay only the first N requests (default: all)")
    p.add_argument("--block-bytes", type=_block_bytes_t, default=64 * KiB, metavar="B",
                   help="bytes of one block value, a multiple of 8 (64K, 1M allowed; "
                        "default 65536)")
    p.add_argument("--pool-gib", type=pos_float, default=1.0, metavar="G",
                   help="capacity in GiB of the server started here: kvshm's pool (block "
                        "size = B rounded up to 4 KiB) or redis's maxmemory (default 1)")
    p.add_argument("--ssd-gib", type=nonneg_float, default=0.0, metavar="G",
                   help="kvshm server started here: an SSD tier of G GiB below the pool "
                        "(the exact LRU gets pool + SSD capacity; default 0: none)")
    p.add_argument("--ssd-path", default=None, metavar="DIR",
                   help="directory of that SSD tier's files (default: a temporary one)")
    p.add_argument("--clients", type=pos_int, default=1, metavar="K",
                   help="client processes sharing the replay, round robin (default 1)")
    p.add_argument("--window", type=nonneg_int, default=None, metavar="W",
                   help="with --clients K: request i starts only once every request before "
                        "i - W has finished, so the clients stay near trace order "
                        f"(default {DEFAULT_WINDOW_PER_CLIENT}*K; 0: the clients run free)")
    p.add_argument("--backend", choices=BACKENDS, default="kvshm",
                   help="kvshm (bytes through shared memory), kvshm-tcp (bytes in the "
                        "messages) or redis (default kvshm)")
    p.add_argument("--address", default=None, metavar="A",
                   help="host:port of a running server to use instead of starting one")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw hit rate and throughput over the replay (needs matplotlib: "
                        "pip install 'kvshm[plot]')")
    p.add_argument("--timeout", type=pos_float, default=30.0,
                   help="seconds any one reply may take (default 30)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--shm-name", default=None,
                   help="segment name of the kvshm server started here (default: unique)")
    p.add_argument("--redis-server", default=None, metavar="PATH",
                   help="redis-server executable (default: the one on PATH)")
    p.set_defaults(func=cmd_replay, parser=p)
    return p


def cmd_replay(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``kvshm replay``: exit 0 when every read matched and no request failed, 1 when
    not (or the replay could not run), 2 for a bad flag."""
    from kvshm.errors import KvshmError
    from kvshm.trace import TraceError

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("argument --plot: needs matplotlib, which is not installed "
                         "(pip install 'kvshm[plot]' or pip install matplotlib)")
        d = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(d):
            parser.error(f"argument --plot: no such directory: {d}")
    if args.ssd_path is not None and not args.ssd_gib:
        parser.error("argument --ssd-path: needs --ssd-gib (the SSD tier's size)")
    if args.shm_name is not None:
        bare = args.shm_name.lstrip("/")
        if not bare or "/" in bare or len(bare) > 250:
            parser.error(f"argument --shm-name: {args.shm_name!r} is not a valid POSIX "
                         "shared-memory name (1-250 characters, no '/')")
    opts = ReplayOptions(trace=args.trace, requests=args.requests,
                         block_bytes=args.block_bytes, pool_gib=args.pool_gib,
                         clients=args.clients, backend=args.backend, address=args.address,
                         timeout=args.timeout, progress=not args.no_progress,
                         shm_name=args.shm_name, redis_server=args.redis_server,
                         window=args.window, ssd_gib=args.ssd_gib, ssd_path=args.ssd_path)
    try:
        result = run_replay(opts)
    except KeyboardInterrupt:
        print("kvshm replay: interrupted; every server and client it started is stopped",
              file=sys.stderr)
        return 130
    except UsageError as exc:
        parser.error(str(exc))
    except TraceError as exc:
        parser.error(f"argument --trace: {exc}")
    except (ReplayError, KvshmError, OSError) as exc:
        print(f"kvshm replay: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if type(exc).__module__.startswith("redis"):
            print(f"kvshm replay: redis: {exc}", file=sys.stderr)
            return 1
        raise
    if args.json:
        print(json.dumps(result.summary, sort_keys=True))
    else:
        print(format_summary(result.summary))
    if args.plot is not None:
        plot(args.plot, result)
        if not args.json:
            print(f"  plot       {args.plot}")
    sys.stdout.flush()
    return 0 if result.ok else 1
