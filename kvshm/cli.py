"""The ``kvshm`` command: serve, ctl, replay.

Bad flag values are usage errors: one message naming the flag, exit status 2, no
traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import Any, Sequence

from kvshm.cliargs import (block_size_t, bytes_t, gib_size_t, ib_port_t, mib_size_t,
                           nonneg_float, nonneg_int, pool_size_t, port_t, pos_float, pos_int,
                           ratio_t)

__all__ = ["main"]

log = logging.getLogger("kvshm")


def _link_type(text: str) -> str:
    from kvshm.rdma.device import normalize_link_type

    try:
        return normalize_link_type(text)  # type: ignore[return-value]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not IB or Ethernet") from None


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


# ---------------------------------------------------------------------- serve

def add_server_flags(p: argparse.ArgumentParser) -> None:
    """Flags of `kvshm serve` (InfiniStore's names where it has them)."""
    p.add_argument("--host", default="127.0.0.1",
                   help="address every socket binds (default 127.0.0.1)")
    p.add_argument("--service-port", type=port_t, default=12345,
                   help="ZeroMQ service port (0: a free port; default 12345)")
    p.add_argument("--manage-port", type=port_t, default=18080,
                   help="HTTP management port (0: a free port; default 18080)")
    p.add_argument("--no-manage", action="store_true", help="do not serve the management port")
    p.add_argument("--prealloc-size", type=pool_size_t, default=1.0, metavar="SIZE",
                   help="pool size: 0.5GiB, 512MiB; a plain number is GiB, fractions "
                        "allowed (default 1GiB)")
    p.add_argument("--block-size", type=block_size_t, default=64, metavar="SIZE",
                   help="block size: 64KiB; a plain number is KiB (>= 4KiB, a multiple of "
                        "4KiB; default 64KiB)")
    p.add_argument("--lease-timeout", type=pos_float, default=10.0,
                   help="seconds before an uncommitted write or unreleased pin is reclaimed "
                        "(default 10)")
    p.add_argument("--session-idle-timeout", type=pos_float, default=600.0, metavar="S",
                   help="seconds of silence after which a remote session holding nothing "
                        "is closed (its client says HELLO again; default 600)")
    p.add_argument("--enable-periodic-evict", action="store_true",
                   help="evict periodically when usage passes --evict-max-threshold")
    p.add_argument("--evict-interval", type=pos_float, default=5.0,
                   help="seconds between periodic eviction checks (default 5)")
    p.add_argument("--evict-min-threshold", type=ratio_t, default=0.6,
                   help="periodic eviction evicts down to this usage (default 0.6)")
    p.add_argument("--evict-max-threshold", type=ratio_t, default=0.8,
                   help="periodic eviction starts above this usage (default 0.8)")
    p.add_argument("--shm-name", default=None, help="shared-memory segment name (default: unique)")
    p.add_argument("--no-ipc", action="store_true", help="do not serve the ipc:// endpoint")
    p.add_argument("--no-shared-index", action="store_true",
                   help="do not publish the index for same-host lock-free reads")
    p.add_argument("--max-key-bytes", type=pos_int, default=4096, help="longest key (default 4096)")
    p.add_argument("--max-batch", type=pos_int, default=1_000_000,
                   help="most keys per request (default 1000000)")
    p.add_argument("--slice-keys", type=pos_int, default=2048,
                   help="a request of more keys is served in slices of this many, other "
                        "clients' requests served between them (default 2048)")
    p.add_argument("--hello-timeout", type=nonneg_float, default=5.0, metavar="S",
                   help="seconds a connection may go without a valid HELLO before the "
                        "server closes it (default 5; 0: never)")
    p.add_argument("--listener", choices=("libzmq", "native"), default=None,
                   help="what serves the tcp:// and ipc:// endpoints: libzmq's ROUTER or "
                        "kvshm's own ZMTP listener (native; not with CURVE: libzmq then) "
                        "(default $KVSHM_LISTENER, else native)")
    p.add_argument("--max-unadmitted", type=pos_int, default=256, metavar="N",
                   help="connections without HELLO held at most; beyond, the oldest are "
                        "closed (default 256, at most a quarter of the descriptor limit)")
    p.add_argument("--max-client-pending", type=bytes_t, default=None, metavar="SIZE",
                   help="what one client may hold in uncommitted writes: 256MiB; a plain "
                        "number is bytes (default 3/4 of the pool; 0: no limit)")
    p.add_argument("--max-client-pinned", type=bytes_t, default=None, metavar="SIZE",
                   help="what one client may hold pinned by reads: 256MiB; a plain number "
                        "is bytes (default 3/4 of the pool; 0: no limit)")
    p.add_argument("--curve-secret-key", default=None, metavar="FILE",
                   help="serve with CurveZMQ using this .key_secret file (kvshm keygen)")
    p.add_argument("--curve-allowed-clients", default=None, metavar="DIR",
                   help="only accept clients whose public .key file is in DIR")
    p.add_argument("--curve-allow-any", action="store_true",
                   help="with --curve-secret-key and no --curve-allowed-clients: let in "
                        "any client key (each its own principal); logged as a warning")
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help="also write the server's door token here (mode 0640), to give "
                        "another user or group access (clients: KVSHM_TOKEN_FILE)")
    p.add_argument("--door-token-file", default=None, metavar="PATH",
                   help="use the door token in this token file instead of a random one "
                        "(a cluster without CURVE: every member the same; clients name "
                        "the file with KVSHM_TOKEN_FILE)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without CURVE keys")
    p.add_argument("--manage-host", default=None,
                   help="address of the management port (default: --host, or 127.0.0.1 "
                        "when --host is not loopback and --insecure is not given)")
    p.add_argument("--dev-name", default=None, metavar="DEVICE",
                   help="RDMA device (e.g. mlx5_0): register the pool with it and serve "
                        "RDMA clients (default: shm and TCP only; see docs/RDMA.md)")
    p.add_argument("--ib-port", type=ib_port_t, default=1,
                   help="port of --dev-name (default 1)")
    p.add_argument("--link-type", type=_link_type, default=None, metavar="IB|Ethernet",
                   help="expected link layer of the port (default: whatever it is)")
    p.add_argument("--gid-index", type=nonneg_int, default=None,
                   help="GID index (default: the port GID on InfiniBand; on RoCE the "
                        "RoCEv2 GID of the port's IPv4 address)")
    p.add_argument("--ssd-path", default=None, metavar="DIR",
                   help="SSD tier: evicted entries are written to files in DIR and read "
                        "back on a lookup (see docs/SSD.md; needs --ssd-size)")
    p.add_argument("--ssd-size", type=gib_size_t, default=None, metavar="SIZE",
                   help="disk space of the SSD tier: 200GiB; a plain number is GiB, "
                        "fractions allowed")
    p.add_argument("--ssd-persist", action="store_true",
                   help="keep the SSD entries across restarts (manifest written "
                        "periodically and at a clean stop); without it the files are "
                        "removed at exit")
    p.add_argument("--ssd-files", type=nonneg_int, default=0, metavar="N",
                   help="number of SSD data files (default 0: one per GiB, 1 to 8)")
    p.add_argument("--ssd-workers", type=pos_int, default=4, metavar="N",
                   help="I/O threads of the SSD tier (default 4)")
    p.add_argument("--ssd-queue", type=mib_size_t, default=0.0, metavar="SIZE",
                   help="spill writes in flight at most: 32MiB; a plain number is MiB "
                        "(default 0: 1/8 of the pool, at most 64MiB)")
    p.add_argument("--ssd-wait", type=pos_float, default=1.0, metavar="S",
                   help="seconds a request may wait for the disk before it is answered "
                        "anyway (default 1)")
    p.add_argument("--ssd-manifest-interval", type=pos_float, default=5.0, metavar="S",
                   help="seconds between manifest writes with --ssd-persist (default 5)")
    from kvshm.cluster.config import add_cli_flags

    add_cli_flags(p)
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "debug", "info", "warning",
                            "error"], help="log level (default INFO)")


def config_from_args(args: argparse.Namespace) -> Any:
    from kvshm.cluster.config import cli_options
    from kvshm.server import ServerConfig

    return ServerConfig(
        **cli_options(args),
        host=args.host,
        service_port=args.service_port,
        manage_port=None if args.no_manage else args.manage_port,
        prealloc_size=args.prealloc_size,
        block_size=args.block_size,
        lease_timeout=args.lease_timeout,
        session_idle_timeout=args.session_idle_timeout,
        enable_periodic_evict=args.enable_periodic_evict,
        evict_interval=args.evict_interval,
        evict_min_threshold=args.evict_min_threshold,
        evict_max_threshold=args.evict_max_threshold,
        ipc=not args.no_ipc,
        shm_name=args.shm_name,
        max_key_bytes=args.max_key_bytes,
        max_batch=args.max_batch,
        slice_keys=args.slice_keys,
        hello_timeout=args.hello_timeout,
        max_unadmitted=args.max_unadmitted,
        listener=args.listener,
        max_client_pending_bytes=args.max_client_pending,
        max_client_pinned_bytes=args.max_client_pinned,
        curve_secret_key=args.curve_secret_key,
        curve_allowed_clients=args.curve_allowed_clients,
        curve_allow_any=args.curve_allow_any,
        token_file=args.token_file,
        door_token_file=args.door_token_file,
        insecure=args.insecure,
        manage_host=args.manage_host,
        dev_name=getattr(args, "dev_name", None),
        ib_port=getattr(args, "ib_port", 1),
        link_type=getattr(args, "link_type", None),
        gid_index=getattr(args, "gid_index", None),
        ssd_path=getattr(args, "ssd_path", None),
        ssd_size=getattr(args, "ssd_size", None),
        ssd_persist=getattr(args, "ssd_persist", False),
        ssd_files=getattr(args, "ssd_files", 0),
        ssd_workers=getattr(args, "ssd_workers", 4),
        ssd_queue=getattr(args, "ssd_queue", 0.0),
        ssd_wait=getattr(args, "ssd_wait", 1.0),
        ssd_manifest_interval=getattr(args, "ssd_manifest_interval", 5.0),
        shared_index=not getattr(args, "no_shared_index", False),
    )


def cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvshm.server import ConfigError, Server

    _setup_logging(args.log_level)
    try:
        server = Server(config_from_args(args))
    except ConfigError as exc:
        parser.error(f"argument --{exc.option.replace('_', '-')}: {exc.message}")
    except ValueError as exc:       # an environment variable's value (ServerConfig.validate)
        print(f"kvshm serve: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        server.stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    def ready(srv: Any) -> None:
        print(srv.ready_line(), flush=True)

    try:
        server.serve_forever(ready=ready)
    except OSError as exc:
        # The message names the port or the path; "[Errno 98]" adds nothing to it.
        msg = exc.strerror if exc.strerror and exc.filename is None else str(exc)
        print(f"kvshm serve: {msg}", file=sys.stderr)
        if server.config.dev_name is not None:
            from kvshm.rdma.errors import RdmaError

            if isinstance(exc, RdmaError):   # no device, port down, memlock: a usage error
                return 2
        return 1
    log.info("stopped; segment removed")
    return 0


# ---------------------------------------------------------------------- ctl

def cmd_ctl(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvshm import segments
    from kvshm.errors import KvshmError

    _setup_logging("WARNING")
    if args.action == "cleanup":
        from kvshm.tiers.ssd.files import cleanup_scratch

        removed = segments.cleanup(args.prefix, dry_run=args.dry_run)
        removed += segments.cleanup_proofs(args.prefix, dry_run=args.dry_run)
        removed += segments.cleanup_ipc_dirs(dry_run=args.dry_run)
        from kvshm.security import cleanup_tokens

        removed += cleanup_tokens(dry_run=args.dry_run)
        removed += cleanup_scratch(args.ssd_path, dry_run=args.dry_run)
        for name in removed:
            print(("would remove " if args.dry_run else "removed ") + name)
        if not removed:
            print("nothing to remove")
        return 0
    if args.action == "segments":
        for name, held in segments.list_segments(args.prefix):
            print(f"{name}\t{'in use' if held else 'orphaned'}")
        return 0
    from kvshm.client import Client
    from kvshm.security import load_public_key
    from kvshm.zmq_ctrl.channel import endpoint_of

    try:
        endpoint_of(args.address)
    except ValueError as exc:
        parser.error(f"argument --address: {exc}")
    for flag, value in (("--curve-server-key", args.curve_server_key),):
        if value is not None:
            try:
                load_public_key(value)
            except ValueError as exc:
                parser.error(f"argument {flag}: {exc}")
    operator = None
    if args.operator_token_file is not None:
        from kvshm.security import read_token_file

        try:
            operator = read_token_file(args.operator_token_file)
        except ValueError as exc:
            parser.error(f"argument --operator-token-file: {exc}")
    try:
        with Client(args.address, transport="tcp", timeout=args.timeout,
                    curve_server_key=args.curve_server_key,
                    curve_keypair=args.curve_keypair, token_file=args.token_file,
                    operator_token=operator) as c:
            if args.action == "stats":
                print(json.dumps(c.stats(verify=args.verify), indent=2, sort_keys=True))
            elif args.action == "evict":
                print(c.evict(args.ratio))
            elif args.action == "purge":
                print(c.purge())
            elif args.action == "delete":
                print(c.delete(args.keys))
            elif args.action == "exists":
                for k, found in zip(args.keys, c.exists_batch(args.keys)):
                    print(f"{k}\t{'yes' if found else 'no'}")
            elif args.action == "keys":
                for k in c.list_keys(args.prefix.encode(), limit=args.limit):
                    print(k.decode(errors="backslashreplace"))
            elif args.action in ("cluster", "drain"):
                from kvshm.cluster.cli import ctl

                return ctl(c, args)
            elif args.action == "ping":
                info = c.ping()
                print(json.dumps({"epoch": info["epoch"], "pool": info["pool"]["name"],
                                  "size": info["pool"]["size"],
                                  "block_size": info["pool"]["block_size"],
                                  "server": info["server"]}, indent=2))
    except KvshmError as exc:
        print(f"kvshm ctl: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_keygen(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvshm.security import keygen

    try:
        public, secret = keygen(args.directory, args.name, force=args.force)
    except OSError as exc:
        print(f"kvshm keygen: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret} (mode 0600; keep it on the server)")
    return 0


# ---------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvshm", description="kvshm KV-cache store")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run a store server on this host")
    add_server_flags(s)
    s.set_defaults(func=cmd_serve, parser=s)

    c = sub.add_parser("ctl", help="drive a running server (stats, evict, purge, ...)")
    c.add_argument("--address", default="127.0.0.1:12345",
                   help="server host:port (default 127.0.0.1:12345)")
    c.add_argument("--timeout", type=pos_float, default=5.0, help="seconds to wait (default 5)")
    c.add_argument("--curve-server-key", default=None, metavar="KEY|FILE",
                   help="the server's CurveZMQ public key (Z85) or .key file")
    c.add_argument("--curve-keypair", default=None, metavar="FILE",
                   help="this client's .key_secret file (when the server restricts clients)")
    c.add_argument("--token-file", default=None, metavar="PATH",
                   help="the server's door token file (default: found by itself for a "
                        "server of this user; or $KVSHM_TOKEN_FILE)")
    c.add_argument("--operator-token-file", default=None, metavar="PATH",
                   help="the server's operator token file, for drain/purge/evict (default: "
                        "found by itself for a server of this user)")
    csub = c.add_subparsers(dest="action", required=True, metavar="ACTION")
    st = csub.add_parser("stats", help="print the server's statistics as JSON")
    st.add_argument("--verify", action="store_true", help="add the accounting check")
    ev = csub.add_parser("evict", help="evict LRU entries down to RATIO of the pool")
    ev.add_argument("ratio", type=ratio_t)
    csub.add_parser("purge", help="remove every entry")
    de = csub.add_parser("delete", help="delete keys")
    de.add_argument("keys", nargs="+")
    ex = csub.add_parser("exists", help="check keys")
    ex.add_argument("keys", nargs="+")
    ks = csub.add_parser("keys", help="list keys (an O(keys) scan on the server)")
    ks.add_argument("--prefix", default="", help="only keys starting with this")
    ks.add_argument("--limit", type=pos_int, default=None, help="at most this many")
    csub.add_parser("ping", help="HELLO: print the server's pool and identity")
    from kvshm.cluster.cli import add_ctl_parsers

    add_ctl_parsers(csub)
    cl = csub.add_parser("cleanup", help="remove segments, clients' liveness files, ipc "
                                         "directories, token files and SSD scratch files "
                                         "left by dead servers")
    cl.add_argument("--prefix", default="kvshm-", help="segment name prefix (default kvshm-)")
    cl.add_argument("--ssd-path", action="append", default=[], metavar="DIR",
                    help="also an SSD directory of a server run without --ssd-persist "
                         "(the ones this user's servers used are found without it); "
                         "may repeat")
    cl.add_argument("--dry-run", action="store_true")
    sg = csub.add_parser("segments", help="list kvshm segments in /dev/shm")
    sg.add_argument("--prefix", default="kvshm-")
    c.set_defaults(func=cmd_ctl, parser=c)

    k = sub.add_parser("keygen", help="write a CurveZMQ key pair (DIR/NAME.key, .key_secret)")
    k.add_argument("directory")
    k.add_argument("--name", default="server")
    k.add_argument("--force", action="store_true", help="replace an existing key pair")
    k.set_defaults(func=cmd_keygen, parser=k)

    from kvshm.replay.cli import add_parser as add_replay_parser

    add_replay_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args, args.parser) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
