"""``kvshm replay``: its flags (:func:`add_parser`, added to the ``kvshm`` command by
:mod:`kvshm.cli`) and the command (:func:`cmd_replay`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
from typing import Any

from kvshm.cliargs import gib_size0_t, gib_size_t, nonneg_int, pos_float, pos_int, size_t
from kvshm.replay.options import (BACKENDS, DEFAULT_WINDOW_PER_CLIENT, KiB, ReplayError,
                                  ReplayOptions, UsageError)
from kvshm.replay.workload import CHUNK_TOKENS

__all__ = ["add_parser", "cmd_replay"]


#: ``--block-bytes``: a plain number is bytes; a multiple of 8, at least 16.
_block_bytes_t = size_t(1, lambda v: v >= 16 and v % 8 == 0, "of at least 16 bytes, a "
                        "multiple of 8")


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
    p.add_argument("--block-bytes", type=_block_bytes_t, default=64 * KiB, metavar="SIZE",
                   help="one-block mode: bytes of one block value, a multiple of 8; with "
                        "--chunk-tokens: KV bytes of 512 tokens, a multiple of 4KiB "
                        "(64KiB, 1MiB; a plain number is bytes; default 64KiB)")
    p.add_argument("--chunk-tokens", type=int, choices=CHUNK_TOKENS, default=None,
                   metavar="N",
                   help="re-chunk the trace as the engines key it: each 512-token block "
                        "becomes 512/N chained keys of N tokens (16: vLLM pages, 256: "
                        "LMCache chunks), the last chunk of a request partial "
                        "(input_length). Default: one-block mode, one entry per block of "
                        "--block-bytes: the only mode where the store must equal the "
                        "exact LRU")
    p.add_argument("--pool-gib", type=gib_size_t, default=1.0, metavar="SIZE",
                   help="capacity of the server started here: kvshm's pool (block size = "
                        "the largest value rounded up to 4KiB) or redis's maxmemory "
                        "(0.5GiB, 512MiB; a plain number is GiB; default 1GiB)")
    p.add_argument("--ssd-gib", type=gib_size0_t, default=0.0, metavar="SIZE",
                   help="kvshm server started here: an SSD tier of this size below the "
                        "pool (a plain number is GiB; the exact LRU gets pool + SSD "
                        "capacity, pool evictions are set beside an LRU of the pool's; "
                        "default 0: none)")
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
                        "messages), redis, or a peer from its venv of scripts/peers-env.sh, "
                        "its servers started here: lmcache (LMCache's lm-server; it cannot "
                        "be given a capacity) or mooncake (Mooncake Store, its segment = "
                        "--pool-gib) (default kvshm)")
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
    from kvshm.cluster.replay import add_flags

    add_flags(p)      # --hosts N: the multi-host replay (kvshm.cluster.replay)
    p.set_defaults(func=cmd_replay, parser=p)
    return p


def cmd_replay(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``kvshm replay``: exit 0 when every read matched and no request failed, 1 when
    not (or the replay could not run), 2 for a bad flag."""
    from kvshm.errors import KvshmError
    from kvshm.trace import TraceError

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "hosts", 1) > 1:
        from kvshm.cluster.replay import cmd

        return cmd(args)
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
                         window=args.window, ssd_gib=args.ssd_gib,
                         ssd_path=args.ssd_path, chunk_tokens=args.chunk_tokens)
    from kvshm.replay.report import format_summary, plot
    from kvshm.replay.run import run_replay

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
