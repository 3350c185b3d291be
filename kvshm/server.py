"""The kvshm server: a Store behind the ZeroMQ loop, plus the management port.

Start it from the command line (``kvshm serve``) or from Python::

    with kvshm.Server(service_port=0, manage_port=0, prealloc_size=0.25) as srv:
        c = kvshm.Client(srv.address)

Both take the same options (:class:`ServerConfig`).
"""

from __future__ import annotations

import atexit
import dataclasses
import ipaddress
import logging
import math
import os
import shutil
import signal
import socket
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvshm import segments
from kvshm._pool import Pool
from kvshm.store import Store, StoreConfig
from kvshm.zmq_ctrl.protocol import PROTOCOL_VERSION, Limits
from kvshm.zmq_ctrl.listener import NativeListener
from kvshm.zmq_ctrl.router import ServiceLoop, bind, make_router

__all__ = ["Server", "ServerConfig", "ConfigError", "GiB", "KiB"]

log = logging.getLogger(__name__)

KiB = 1024
GiB = 1024 ** 3
#: Largest value by default (and so, plus 1 MiB, the largest message): the pool, at most.
MAX_VALUE_DEFAULT = 256 << 20


class _StopRequested(Exception):
    """stop() was called (SIGTERM/SIGINT) while the server was still starting."""


class ConfigError(ValueError):
    """A bad server option; ``option`` names it (the CLI flag is ``--`` + dashes)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option
        self.message = message


@dataclass
class ServerConfig:
    """Options of a kvshm server; the CLI flags map one to one (``--service-port``, ...).

    Attributes
    ----------
    host : str
        Address every socket binds (service and management). Default 127.0.0.1.
    service_port : int
        ZeroMQ ROUTER port (tcp). 0 picks a free port. Default 12345 (as InfiniStore).
    manage_port : int or None
        HTTP management port; 0 picks a free port; None disables it. Default 18080.
    prealloc_size : float
        Pool size in GiB (fractions allowed), rounded down to whole blocks.
    block_size : int
        Block size in KiB, >= 4 and a multiple of 4. Default 64.
    lease_timeout : float
        Seconds before an uncommitted write or an unreleased pin is reclaimed.
    session_idle_timeout : float
        Seconds of silence after which a remote session holding nothing is closed
        (:mod:`kvshm.zmq_ctrl.ops_session`; its client says HELLO again by itself).
        Default 600.
    enable_periodic_evict, evict_interval, evict_min_threshold, evict_max_threshold
        Every ``evict_interval`` s, when usage passes ``evict_max_threshold`` (0..1),
        evict LRU entries down to ``evict_min_threshold``.
    ipc : bool
        Also serve an ``ipc://`` endpoint (in a private 0700 directory) for same-host
        clients.
    shm_name : str, optional
        Segment name; default ``kvshm-<port>-<pid>-<random>``.
    max_key_bytes, max_batch : int
        Request limits (see :class:`~kvshm.zmq_ctrl.protocol.Limits`).
    slice_keys : int
        A request of more keys is served in slices of this many, other clients'
        requests served between two slices (default 2048,
        :data:`kvshm.zmq_ctrl.router.SLICE_KEYS`).
    hello_timeout : float
        Seconds (>= 0, finite) a connection may go without a HELLO answered OK (or a
        request of an open session) before the server shuts it down; 0: never. Default
        5 (:data:`kvshm.zmq_ctrl.admission.HELLO_TIMEOUT_S`; docs/RELIABILITY.md,
        "Limits").
    max_unadmitted : int
        Connections without HELLO held at most (>= 1); beyond, the oldest are shut down
        (and never more than a quarter of the soft descriptor limit). Default 256.
    listener : str, optional
        What serves the tcp:// and ipc:// endpoints: ``"libzmq"`` (its ROUTER socket)
        or ``"native"`` (kvshm's own ZMTP listener, :mod:`kvshm.zmq_ctrl.listener`; not
        with CURVE, which keeps libzmq's). None (default): ``$KVSHM_LISTENER``, else
        native (about half libzmq's server CPU per request: README, ``--listener``).
    max_client_pending_bytes, max_client_pinned_bytes : int, optional
        Per-client limits in bytes: uncommitted writes, and pinned reads. None (the
        default): 3/4 of the pool each; 0: no limit.
    curve_secret_key : str, optional
        The server's CurveZMQ ``.key_secret`` file (``kvshm keygen``): the service
        socket then takes only encrypted connections from clients that know the server's
        public key.
    curve_allowed_clients : str, optional
        Directory of client public ``.key`` files; with it, only those clients get in.
    curve_allow_any : bool
        With ``curve_secret_key`` and no ``curve_allowed_clients``: let any client key
        in (an explicit choice, logged as a warning); each key is its own principal.
    door_token_file : str, optional
        Use the door token in this existing token file (hex, as the server writes them)
        instead of a random one: the members of a cluster without CURVE share it, and
        clients name it (``token_file=`` / ``KVSHM_TOKEN_FILE``) to reach every member.
    token_file : str, optional
        Also write the door token here (mode 0640) for another user or group; same-user
        clients find the default one by themselves (:mod:`kvshm.security`).
    max_value_bytes : int, optional
        Largest value; None: the pool, at most 256 MiB. The largest message the server
        accepts follows from it (plus 1 MiB), never from the pool size alone.
    insecure : bool
        Serve a non-loopback ``host`` without CURVE (an explicit choice).
    manage_host : str, optional
        Address of the management port; default ``host``, except 127.0.0.1 when ``host``
        is not loopback and ``insecure`` is not set (HTTP has no keys).
    dev_name : str, optional
        RDMA device (``mlx5_0``): register the pool with it at start-up and serve RDMA
        clients (see docs/RDMA.md). None (default): shm and TCP only.
    ib_port : int
        Port of ``dev_name`` (1-based). Default 1.
    link_type : {"IB", "Ethernet"}, optional
        Expected link layer of the port; checked when given.
    gid_index : int, optional
        GID index; default: the port GID on InfiniBand, on RoCE the RoCEv2 GID of the
        port's IPv4 address (of ``host`` when it is one).
    ssd_path : str, optional
        Directory of the SSD tier's files (see docs/SSD.md): entries evicted from the pool
        are written there instead of dropped, and read back on a LOOKUP. None (default):
        no SSD tier.
    ssd_size : float, optional
        GiB of disk the SSD tier uses (required with ``ssd_path``).
    ssd_persist : bool
        Keep the SSD entries across restarts (a manifest is written periodically and on
        a clean stop). Without it the files are scratch and removed at exit.
    ssd_files : int
        Data files (0: one per GiB, 1 to 8).
    ssd_workers : int
        I/O threads of the SSD tier. Default 4.
    ssd_queue : float
        MiB of spill writes in flight at most (0: 1/8 of the pool, at most 64 MiB).
    ssd_wait : float
        Seconds a request may wait for the disk (room made by spills, or a promotion)
        before it is answered anyway. Default 1.
    ssd_manifest_interval : float
        Seconds between manifest writes while entries change (``ssd_persist``).
    shared_index : bool
        Publish the index in a read-only shm table next to the pool, so same-host
        clients read without a round trip (docs/DESIGN.md). Default True.
    shared_index_slots : int
        Most slots of that table (0: twice the pool's blocks, a power of two; 64 bytes
        each). It starts with 4,096 and grows by half from 13/16 full: memory follows the
        keys stored.
    cluster : str, optional
        ``etcd://H:P[,H:P...]``: join a cluster (docs/CLUSTER.md); needs the ``cluster``
        extra. None (default): a lone server.
    cluster_name, node_id, advertise, cluster_ttl
        Cluster name; this node's id (default the host name); ``host:port`` other hosts
        reach the service port at (default ``host:service_port``); etcd lease seconds.
    """

    host: str = "127.0.0.1"
    service_port: int = 12345
    manage_port: int | None = 18080
    prealloc_size: float = 1.0
    block_size: int = 64
    lease_timeout: float = 10.0
    session_idle_timeout: float = 600.0
    enable_periodic_evict: bool = False
    evict_interval: float = 5.0
    evict_min_threshold: float = 0.6
    evict_max_threshold: float = 0.8
    ipc: bool = True
    shm_name: str | None = None
    max_key_bytes: int = 4096
    max_batch: int = 1_000_000
    slice_keys: int = 2048
    hello_timeout: float = 5.0
    max_unadmitted: int = 256
    listener: str | None = None
    max_client_pending_bytes: int | None = None
    max_client_pinned_bytes: int | None = None
    curve_secret_key: str | None = None
    curve_allowed_clients: str | None = None
    curve_allow_any: bool = False
    token_file: str | None = None
    door_token_file: str | None = None
    max_value_bytes: int | None = None
    insecure: bool = False
    manage_host: str | None = None
    dev_name: str | None = None
    ib_port: int = 1
    link_type: str | None = None
    gid_index: int | None = None
    ssd_path: str | None = None
    ssd_size: float | None = None
    ssd_persist: bool = False
    ssd_files: int = 0
    ssd_workers: int = 4
    ssd_queue: float = 0.0
    ssd_wait: float = 1.0
    ssd_manifest_interval: float = 5.0
    shared_index: bool = True
    shared_index_slots: int = 0
    cluster: str | None = None
    cluster_name: str = "kvshm"
    node_id: str | None = None
    advertise: str | None = None
    cluster_ttl: float = 5.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ssd_bytes(self) -> int:
        """Bytes of the SSD tier (whole blocks); 0 without one."""
        if self.ssd_path is None or not self.ssd_size:
            return 0
        bs = self.block_size * KiB
        return int(self.ssd_size * GiB) // bs * bs

    @property
    def listener_kind(self) -> str:
        """``listener``, else ``$KVSHM_LISTENER``, else ``"native"``."""
        return self.listener or os.environ.get("KVSHM_LISTENER") or "native"

    @property
    def pool_bytes(self) -> int:
        bs = self.block_size * KiB
        return int(self.prealloc_size * GiB) // bs * bs

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad option (ValueError naming
        ``KVSHM_INDEX_GROWTH`` for a bad value of it, with the shared index on)."""
        if self.shared_index:
            from kvshm._shmindex import growth_policy

            growth_policy()     # before any segment is made, not a traceback after
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            if self.host != "localhost":
                try:
                    socket.getaddrinfo(self.host, None)
                except OSError:
                    raise ConfigError("host", f"cannot resolve {self.host!r}") from None
        for name in ("service_port", "manage_port"):
            v = getattr(self, name)
            if v is None and name == "manage_port":
                continue
            if type(v) is not int or not 0 <= v <= 65535:
                raise ConfigError(name, f"must be a port number 0-65535, got {v!r}")
        for name in ("prealloc_size", "lease_timeout", "evict_interval",
                     "evict_min_threshold", "evict_max_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(name, f"must be a finite number, got {v!r}")
        if not self.prealloc_size > 0:
            raise ConfigError("prealloc_size", f"must be > 0 GiB, got {self.prealloc_size}")
        if type(self.block_size) is not int or self.block_size < 4 or self.block_size % 4:
            raise ConfigError("block_size",
                              f"must be a multiple of 4 KiB, >= 4, got {self.block_size}")
        if self.pool_bytes < self.block_size * KiB:
            raise ConfigError("prealloc_size", "is smaller than one block")
        if not self.lease_timeout > 0:
            raise ConfigError("lease_timeout", f"must be > 0 s, got {self.lease_timeout}")
        v = self.session_idle_timeout
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError("session_idle_timeout", f"must be > 0 s, got {v!r}")
        if not self.evict_interval > 0:
            raise ConfigError("evict_interval", f"must be > 0 s, got {self.evict_interval}")
        for name in ("evict_min_threshold", "evict_max_threshold"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(name, f"must be in [0, 1], got {v}")
        if self.evict_min_threshold > self.evict_max_threshold:
            raise ConfigError("evict_min_threshold", "must not exceed evict_max_threshold")
        if self.curve_secret_key is not None:
            from kvshm.security import load_keypair

            try:
                load_keypair(self.curve_secret_key)
            except ValueError as exc:
                raise ConfigError("curve_secret_key", str(exc)) from None
            if self.curve_allowed_clients is None and not self.curve_allow_any:
                raise ConfigError("curve_allowed_clients",
                                  "CURVE without an allow-list admits any client key that "
                                  "knows the server's public key: give a directory of "
                                  "client keys, or --curve-allow-any to choose that")
        elif self.curve_allowed_clients is not None:
            raise ConfigError("curve_allowed_clients", "needs --curve-secret-key")
        if self.curve_allowed_clients is not None and not os.path.isdir(
                self.curve_allowed_clients):
            raise ConfigError("curve_allowed_clients",
                              f"{self.curve_allowed_clients} is not a directory")
        from kvshm.security import is_loopback

        if not is_loopback(self.host) and self.curve_secret_key is None and not self.insecure:
            raise ConfigError("host", f"{self.host} is not a loopback address: serving other "
                                      "hosts needs --curve-secret-key (see `kvshm keygen`) "
                                      "or an explicit --insecure")
        if self.shm_name is not None:
            bare = self.shm_name[1:] if self.shm_name.startswith("/") else self.shm_name
            if not bare or "/" in bare or "\0" in bare or len(bare) > 250:
                raise ConfigError("shm_name", f"{self.shm_name!r} is not a valid POSIX "
                                              "shared-memory name (1-250 characters, no '/')")
        if self.max_value_bytes is not None and (type(self.max_value_bytes) is not int
                                                 or self.max_value_bytes < 1):
            raise ConfigError("max_value_bytes", "must be an int >= 1")
        if self.max_key_bytes < 1:
            raise ConfigError("max_key_bytes", "must be >= 1")
        if self.max_batch < 1:
            raise ConfigError("max_batch", "must be >= 1")
        if self.listener_kind not in ("libzmq", "native"):
            raise ConfigError("listener", "must be libzmq or native, not "
                              f"{self.listener_kind!r} (--listener, $KVSHM_LISTENER)")
        if type(self.slice_keys) is not int or self.slice_keys < 1:
            raise ConfigError("slice_keys", "must be an int >= 1")
        v = self.hello_timeout
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e9:
            raise ConfigError("hello_timeout", f"must be a number of s >= 0, got {v!r}")
        if type(self.max_unadmitted) is not int or self.max_unadmitted < 1:
            raise ConfigError("max_unadmitted", "must be an int >= 1")
        if self.dev_name is not None and (not isinstance(self.dev_name, str)
                                          or not self.dev_name.strip()):
            raise ConfigError("dev_name", f"must be a device name, got {self.dev_name!r}")
        if type(self.ib_port) is not int or not 1 <= self.ib_port <= 255:
            raise ConfigError("ib_port", f"must be a port number 1-255, got {self.ib_port!r}")
        if self.link_type is not None:
            from kvshm.rdma.device import normalize_link_type

            try:
                self.link_type = normalize_link_type(self.link_type)
            except (ValueError, AttributeError):
                raise ConfigError("link_type", f"must be IB or Ethernet, got "
                                               f"{self.link_type!r}") from None
        if self.gid_index is not None and (type(self.gid_index) is not int
                                           or self.gid_index < 0):
            raise ConfigError("gid_index", f"must be an integer >= 0, got {self.gid_index!r}")
        self._validate_ssd()
        if self.cluster is not None:
            from kvshm.cluster.config import validate

            problem = validate(self)
            if problem is not None:
                raise ConfigError(*problem)

    def _validate_ssd(self) -> None:
        import math

        if self.ssd_path is None:
            if self.ssd_size is not None:
                raise ConfigError("ssd_path", "is required with --ssd-size (the directory "
                                              "of the SSD tier's files)")
            if self.ssd_persist:
                raise ConfigError("ssd_persist", "needs --ssd-path and --ssd-size")
            return
        if not isinstance(self.ssd_path, str) or not self.ssd_path.strip():
            raise ConfigError("ssd_path", f"must be a directory, got {self.ssd_path!r}")
        if os.path.exists(self.ssd_path) and not os.path.isdir(self.ssd_path):
            raise ConfigError("ssd_path", f"{self.ssd_path} exists and is not a directory")
        if self.ssd_size is None:
            raise ConfigError("ssd_size", "is required with --ssd-path (GiB of disk to use)")
        if (type(self.ssd_size) not in (int, float) or not math.isfinite(self.ssd_size)
                or not self.ssd_size > 0):
            raise ConfigError("ssd_size", f"must be > 0 GiB, got {self.ssd_size!r}")
        if type(self.ssd_files) is not int or not 0 <= self.ssd_files <= 64:
            raise ConfigError("ssd_files", f"must be 0 (auto) to 64, got {self.ssd_files!r}")
        nfiles = self.ssd_files or max(1, min(8, math.ceil(self.ssd_size)))
        if self.ssd_bytes // (self.block_size * KiB) < nfiles:
            raise ConfigError("ssd_size", f"{self.ssd_size} GiB holds less than one block of "
                                          f"{self.block_size} KiB per file")
        if type(self.ssd_workers) is not int or not 1 <= self.ssd_workers <= 64:
            raise ConfigError("ssd_workers", f"must be 1 to 64, got {self.ssd_workers!r}")
        if not (self.ssd_queue >= 0 and math.isfinite(self.ssd_queue)):
            raise ConfigError("ssd_queue", f"must be >= 0 MiB, got {self.ssd_queue!r}")
        if not (self.ssd_wait > 0 and math.isfinite(self.ssd_wait)):
            raise ConfigError("ssd_wait", f"must be > 0 s, got {self.ssd_wait!r}")
        if not (self.ssd_manifest_interval > 0 and math.isfinite(self.ssd_manifest_interval)):
            raise ConfigError("ssd_manifest_interval",
                              f"must be > 0 s, got {self.ssd_manifest_interval!r}")


class Server:
    """A kvshm store server.

    Parameters
    ----------
    config : ServerConfig, optional
    rdma_backend : object, optional
        A verbs backend replacing pyverbs for ``dev_name`` (the tests' verbs double;
        never set by ``kvshm serve``).
    **options
        Fields of :class:`ServerConfig`, overriding ``config``.

    Raises
    ------
    ConfigError
        A bad option (at construction).
    OSError
        At :meth:`start`: the pool does not fit in /dev/shm (ENOSPC), a port is taken.
    """

    def __init__(self, config: ServerConfig | None = None, *, rdma_backend: Any = None,
                 **options: Any) -> None:
        cfg = dataclasses.replace(config) if config else ServerConfig()
        for k, v in options.items():
            if not hasattr(cfg, k):
                raise TypeError(f"unknown server option {k!r}")
            setattr(cfg, k, v)
        cfg.validate()
        self.config = cfg
        self.pool: Pool | None = None
        self.store: Store | None = None
        self.loop: ServiceLoop | None = None
        self.tier: Any = None    # kvshm.tiers.SsdTier with ssd_path
        self.manage: Any = None
        self._ctx: zmq.Context | None = None
        self._thread: threading.Thread | None = None
        self._lock_fd = -1
        self._ipc_dir: str | None = None
        self._ipc_lock_fd = -1      # segments.hold_ipc_dir: the ipc directory in use
        self._curve: Any = None
        self._router: Any = None
        self.rdma: Any = None    # kvshm.rdma.server.ServerEndpoint with dev_name
        self.shared_index: Any = None   # kvshm._shmindex.IndexWriter with shared_index
        self._rdma_backend = rdma_backend   # a verbs double; tests only (never the CLI)
        self.door: Any = None    # kvshm.security.DoorToken
        self._started = False
        self._stopped = False
        self._stop_requested = False    # stop() during start-up: checked between steps
        self._clean_stop = False    # the loop returned (not a failed start-up)
        self.epoch = int.from_bytes(os.urandom(6), "little") | 1
        self.cluster_ops: Any = None   # kvshm.zmq_ctrl.ops_cluster.ClusterOps
        self.session_ops: Any = None   # kvshm.zmq_ctrl.ops_session.SessionOps (BYE)
        self.local_ops: Any = None     # kvshm.zmq_ctrl.ops_local.LocalOps
        self.membership: Any = None    # kvshm.cluster.membership.Membership (--cluster)

    # ------------------------------------------------------------------ set-up

    def _setup(self) -> None:
        if self._started:
            raise RuntimeError("server already started")
        self._started = True
        cfg = self.config
        _tune_malloc()
        removed = segments.cleanup()
        segments.cleanup_ipc_dirs()
        segments.cleanup_proofs()
        from kvshm.security import cleanup_tokens

        cleanup_tokens()        # token files of this user's servers killed with SIGKILL
        if removed:
            log.info("removed %d segment(s) left by dead servers: %s", len(removed),
                     ", ".join(removed))
        try:
            self._ctx = zmq.Context()
            socket_setup = None
            if cfg.curve_secret_key is not None:
                from kvshm.security import CurveServer

                self._curve = CurveServer(cfg.curve_secret_key, cfg.curve_allowed_clients,
                                          self._ctx)
                socket_setup = self._curve.setup
            if cfg.curve_secret_key is not None and cfg.curve_allowed_clients is None:
                log.warning("CURVE without --curve-allowed-clients (--curve-allow-any): any "
                            "client that knows this server's public key gets in")
            # The largest message taken follows from the largest value, not the pool: a
            # peer cannot make the server buffer a pool's worth of one message.
            max_value = cfg.max_value_bytes or min(cfg.pool_bytes, MAX_VALUE_DEFAULT)
            max_message = max(max_value, 64 << 20) + (1 << 20)
            # Bind the service port first, so a taken port fails before the pool (and
            # the RDMA registration) cost anything.
            if cfg.listener_kind == "native" and socket_setup is None:
                # kvshm's own ZMTP listener (tcp, ipc; inproc through its inner libzmq
                # ROUTER); CURVE keeps libzmq's ROUTER for every endpoint
                self._router = NativeListener(self._ctx, max_frame_bytes=max_message,
                                              # no message holds more than the pool
                                              max_message_bytes=cfg.pool_bytes + max_message,
                                              ipv6=":" in cfg.host)
            else:
                if cfg.listener_kind == "native":
                    log.info("--listener native serves no CURVE: libzmq's ROUTER serves")
                self._router = make_router(self._ctx, socket_setup, max_message,
                                           ipv6=":" in cfg.host)
            try:
                bound = [bind(self._router, f"tcp://{_bracket(cfg.host)}:{cfg.service_port}")]
            except OSError as exc:
                raise OSError(exc.errno, f"{exc.strerror} (--service-port "
                                         f"{cfg.service_port}; 0 picks a free port)") from None
            store_cfg = StoreConfig(
                lease_timeout=cfg.lease_timeout,
                limits=Limits(cfg.max_key_bytes, cfg.max_batch, max_value),
                tier_wait=cfg.ssd_wait,
            )
            if cfg.dev_name is not None:   # before the pool: a bad device fails fast
                from kvshm import rdma

                self.rdma = rdma.open_server_endpoint(
                    cfg.dev_name, pool_bytes=cfg.pool_bytes, ib_port=cfg.ib_port,
                    link_type=cfg.link_type, gid_index=cfg.gid_index, host=cfg.host,
                    backend=self._rdma_backend)
            self._check_stop()
            self._pool_create()         # seconds for a large pool (fallocate, populate)
            self._check_stop()
            assert self.pool is not None
            pool_bytes = self.pool.size
            if self.rdma is not None:
                self.rdma.register_pool(self.pool.address, self.pool.size)
            store_cfg.max_client_pending_bytes = _default(cfg.max_client_pending_bytes,
                                                          pool_bytes)
            store_cfg.max_client_pinned_bytes = _default(cfg.max_client_pinned_bytes,
                                                         pool_bytes)
            self.store = Store(self.pool, store_cfg)
            if cfg.ssd_path is not None:
                self._tier_create()
                self._check_stop()
            if cfg.shared_index:
                self._shared_index_create()
            hello = {
                "version": PROTOCOL_VERSION,
                # the token's digest, never the token: a same-host client proves it
                # attached the pool with the token it read from the 0600 segment
                "pool": {"name": self.pool.name, "size": self.pool.size,
                         "block_size": self.pool.block_size,
                         "token_digest": segments.token_digest(self.pool.token)},
                "limits": store_cfg.limits.to_wire(),
                "lease_timeout": cfg.lease_timeout,
                "server": {"pid": os.getpid(), "host": socket.gethostname()},
                "ipc": None,
                "max_message": max_message,
                # bytes one principal may hold in ALLOCs not yet committed (0: no
                # limit): a same-host client sends a small batch inline (one PUT, which
                # holds none) only when well below it (kvshm.client INLINE_PUT)
                "pending_limit": store_cfg.max_client_pending_bytes,
            }
            if self._curve is not None:
                hello["curve_public_key"] = self._curve.public
            if self.shared_index is not None:
                hello["shared_index"] = self.shared_index.info()
            if cfg.ipc:   # after the pool: its segment's lock marks the server alive
                self._ipc_dir = tempfile.mkdtemp(prefix="kvshm-ipc-")
                # held before the bind: another server's cleanup_ipc_dirs then tells
                # this directory is in use without connecting to its socket
                self._ipc_lock_fd = segments.hold_ipc_dir(self._ipc_dir)
                bound.append(bind(self._router, f"ipc://{self._ipc_dir}/service.sock"))
            # The management port's own client comes in over inproc, which CURVE does
            # not apply to (and which no other process can reach); it shows the token.
            bound.append(bind(self._router, f"inproc://kvshm-service-{self.epoch}"))
            from kvshm.security import DoorToken

            self.door = DoorToken(bound, cfg.token_file, cfg.door_token_file)
            periodic = None
            if cfg.enable_periodic_evict:
                periodic = (cfg.evict_interval, cfg.evict_min_threshold,
                            cfg.evict_max_threshold)
            self.loop = ServiceLoop(self.store, [], hello, self.epoch,
                                    periodic_evict=periodic, context=self._ctx,
                                    hello_hook=(self.rdma.hello_hook
                                                if self.rdma is not None else None),
                                    log_handshakes=socket_setup is not None,
                                    sock=self._router, bound=bound,
                                    door_token=self.door.token,
                                    operator_token=self.door.operator,
                                    slice_keys=cfg.slice_keys,
                                    hello_timeout=cfg.hello_timeout,
                                    max_unadmitted=cfg.max_unadmitted)
            self._router = None           # the loop owns it now
            from kvshm.zmq_ctrl.ops_session import SessionOps

            self.session_ops = SessionOps(self.loop, cfg.session_idle_timeout).install()
            if self.rdma is not None:
                rdma_ep = self.rdma
                # every QP of the client, retired ones too (keyed by its session nonce)
                self.store.reclaim_hook = lambda sess: rdma_ep.drop(sess.nonce)
            if self.tier is not None:
                self.tier.notify = self.loop.wake
            self._check_stop()
            if cfg.ipc:
                self.loop.hello["ipc"] = self.loop.endpoints[1]
            from kvshm.cluster.config import attach

            attach(self)        # handoff pins, CLUSTER_VIEW; etcd membership with --cluster
            from kvshm.zmq_ctrl import ops_local

            self.local_ops = ops_local.attach(self.loop, self.store)  # RESERVE, PLACE
            if cfg.manage_port is not None:
                from kvshm.manage import ManageServer
                from kvshm.security import is_loopback

                mhost = cfg.manage_host
                if mhost is None:
                    mhost = cfg.host if (is_loopback(cfg.host) or cfg.insecure) else "127.0.0.1"
                    if mhost != cfg.host:
                        log.info("management port bound to 127.0.0.1 (HTTP has no keys; "
                                 "--manage-host sets another address)")
                if not is_loopback(mhost):
                    log.warning("management port on %s (not loopback): every endpoint asks "
                                "for the door token, which HTTP carries in clear", mhost)
                self.manage = ManageServer(mhost, cfg.manage_port, self.loop.endpoints[-1],
                                           context=self._ctx, token=self.door.token,
                                           operator_token=self.door.operator,
                                           open_reads=is_loopback(mhost))
                self.manage.start()
        except BaseException:
            self._teardown()
            raise

    def _check_stop(self) -> None:
        if self._stop_requested:
            log.info("stop requested during start-up: tearing down")
            raise _StopRequested()

    def _pool_create(self) -> None:
        cfg = self.config
        name = cfg.shm_name or (f"{segments.DEFAULT_PREFIX}{cfg.service_port}-{os.getpid()}-"
                                f"{os.urandom(4).hex()}")
        # Pool.create holds the segment's liveness lock until unlink (see segments.py).
        # It takes seconds for a large pool (fallocate, then populate, in steps of
        # kvshm._pool.CREATE_STEP with the GIL released): it runs in a helper thread so
        # that a SIGTERM/SIGINT is handled at once; then the segment is unlinked by name
        # (that waits for the step under way at most) and the helper, which looks at
        # the stop request between steps, gives up and unmaps what it made.
        box: dict[str, Any] = {}

        def make() -> None:
            try:
                box["pool"] = Pool.create(name, cfg.pool_bytes, cfg.block_size * KiB,
                                          stop=lambda: self._stop_requested)
            except BaseException as exc:   # handed to the starting thread
                box["error"] = exc

        t = threading.Thread(target=make, name="kvshm-pool-create", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.05)
            if self._stop_requested:
                try:
                    os.unlink(os.path.join(segments.SHM_DIR, name.lstrip("/")))
                except OSError:
                    pass
                t.join(10)      # one step; a made pool (the race) is closed below
                made = box.get("pool")
                if made is not None:
                    made.close()
                    made.unlink()
                raise _StopRequested()
        if "error" in box:
            raise box["error"]
        self.pool = box["pool"]

    def _shared_index_create(self) -> None:
        from kvshm._shmindex import IndexWriter, default_slots

        assert self.pool is not None and self.store is not None
        pool = self.pool
        self.shared_index = IndexWriter.create(
            pool.name + "-index", pool.name + "-reads",
            self.config.shared_index_slots or default_slots(pool.num_blocks),
            epoch=self.epoch, block_size=pool.block_size, num_blocks=pool.num_blocks,
            token=pool.token, misses_final=self.tier is None)
        self.store.index.attach_shared(self.shared_index)

    def _tier_create(self) -> None:
        from kvshm.tiers import SsdConfig, SsdTier

        cfg = self.config
        assert self.pool is not None and self.store is not None and cfg.ssd_path is not None
        pool_bytes = self.pool.size
        bs = self.pool.block_size
        queue = int(cfg.ssd_queue * KiB * KiB) or min(64 * KiB * KiB, pool_bytes // 8)
        self.tier = SsdTier(self.pool, SsdConfig(
            path=cfg.ssd_path, size=cfg.ssd_bytes, block_size=bs, files=cfg.ssd_files,
            workers=cfg.ssd_workers, queue_bytes=queue, persist=cfg.ssd_persist,
            manifest_interval=cfg.ssd_manifest_interval))
        # The cleaner keeps 1/16 of the pool free or already copied to SSD, so that an
        # eviction rarely waits for a write (and the copies cost little SSD capacity).
        self.store.attach_tier(self.tier, clean_target=max(4 * bs, pool_bytes // 16))

    # ------------------------------------------------------------------ running

    def start(self) -> "Server":
        """Set up and serve in a background thread; returns when ready."""
        self._setup()
        assert self.loop is not None
        self._thread = threading.Thread(target=self._run_loop, name="kvshm-server",
                                        daemon=True)
        self._thread.start()
        _live.add(self)
        return self

    def _run_loop(self) -> None:
        assert self.loop is not None
        try:
            self.loop.run()
            self._clean_stop = True
        except Exception:
            log.exception("server loop crashed")

    def serve_forever(self, ready: Any = None) -> None:
        """Set up and serve in this thread until :meth:`stop` (e.g. from a signal
        handler); tears everything down before returning. ``ready`` is called once
        serving. A :meth:`stop` during set-up (SIGTERM while a large pool is being
        reserved) ends it after the current step, leaving no segment."""
        try:
            self._setup()
        except _StopRequested:
            return              # _setup tore everything down
        assert self.loop is not None
        # A process-directed signal may land on any thread (zmq's I/O threads, the
        # management thread); the wakeup fd makes it also wake this thread's poll so the
        # Python handler runs at once.
        prev_fd = None
        if threading.current_thread() is threading.main_thread():
            prev_fd = signal.set_wakeup_fd(self.loop.wake_fd)
        try:
            if self._stop_requested:        # a signal between set-up and here
                self.loop.stop()
            elif ready is not None:
                ready(self)
            self.loop.run()
            self._clean_stop = True
        finally:
            if prev_fd is not None:
                signal.set_wakeup_fd(prev_fd)
            self._teardown()

    def stop(self) -> None:
        """Stop serving, unlink the segment, close every socket. Idempotent; safe from a
        signal handler when serving with :meth:`serve_forever` (also while it is still
        starting)."""
        self._stop_requested = True
        if self.loop is not None:
            self.loop.stop()
        if self._thread is not None:
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=30)
            self._thread = None
            self._teardown()

    def _teardown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        _live.discard(self)
        if self.manage is not None:
            try:
                self.manage.stop()
            except Exception:
                log.exception("stopping the management port failed")
            self.manage = None
        if self.membership is not None:   # leave the cluster before the store goes
            self.membership.stop(leave=True)
            self.membership = None
        if self.cluster_ops is not None:
            self.cluster_ops.close()
        if self.loop is not None:
            self.loop.close()
        if self._router is not None:      # set-up failed before the loop took it
            self._router.close(0)
            self._router = None
        if self.tier is not None:   # its I/O threads use pool memory: before the pool
            try:
                if self.tier.persist and self.store is not None and self._clean_stop:
                    n = self.store.flush_tier(timeout=30.0)
                    if n:
                        log.info("SSD tier: %d pool entries written down before exit", n)
                self.tier.close()
            except Exception:
                log.exception("closing the SSD tier failed")
            self.tier = None
        if self.rdma is not None:   # QPs and the pool's MR go before the pool
            self.rdma.close()
            self.rdma = None
        if self._curve is not None:
            self._curve.close()
            self._curve = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.shared_index is not None:    # readers see it closed, then it goes
            if self.store is not None:
                self.store.index.detach_shared()
            self.shared_index.unlink()
            self.shared_index = None
        if self.pool is not None:
            try:
                self.pool.unlink()
            except OSError as exc:
                log.warning("unlink of %s failed: %s", self.pool.name, exc)
            try:
                self.pool.close()
            except BufferError:
                log.debug("pool still exported at shutdown; the process exit unmaps it")
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self.door is not None:
            self.door.close()
            self.door = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None
        if self._ipc_lock_fd >= 0:
            os.close(self._ipc_lock_fd)
            self._ipc_lock_fd = -1

    # ------------------------------------------------------------------ info

    @property
    def service_port(self) -> int:
        assert self.loop is not None, "server not started"
        return int(self.loop.endpoints[0].rsplit(":", 1)[1])

    @property
    def manage_port(self) -> int | None:
        return self.manage.port if self.manage is not None else None

    @property
    def address(self) -> str:
        """``host:port`` of the service port, for :class:`kvshm.Client`."""
        host = self.config.host
        return f"{_bracket(host)}:{self.service_port}"

    @property
    def endpoint(self) -> str:
        assert self.loop is not None, "server not started"
        return self.loop.endpoints[0]

    def ready_line(self) -> str:
        """The one line the CLI prints when serving."""
        assert self.loop is not None and self.pool is not None
        parts = [f"kvshm ready: service {self.loop.endpoints[0]}"]
        if self.config.ipc:
            parts.append(f"ipc {self.loop.endpoints[1]}")
        if self.manage is not None:
            parts.append(f"manage http://{_bracket(self.manage.host)}:{self.manage.port}")
        if self._curve is not None:
            parts.append(f"curve public key {self._curve.public.decode()}")
        parts.append(f"pool {self.pool.name} {self.pool.size / GiB:.3g} GiB")
        parts.append(f"block {self.pool.block_size // KiB} KiB")
        if self.tier is not None:
            t = self.tier
            cap = sum(f.nblocks for f in t.files) * t.bs
            parts.append(f"ssd {t.path} {cap / GiB:.3g} GiB "
                         f"{'O_DIRECT' if t.direct else 'buffered'}"
                         f"{' persist' if t.persist else ''}")
        if self.rdma is not None:
            parts.append(f"rdma {self.rdma.describe()}")
        parts.append(f"pid {os.getpid()}")
        return ", ".join(parts)

    def __enter__(self) -> "Server":
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Servers started in a background thread; stopped at interpreter exit so that an
# exception that ends the program still removes their segments.
_live: "weakref.WeakSet[Server]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for srv in list(_live):
        try:
            srv.stop()
        except Exception:
            pass


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Freed heap the server keeps for reuse instead of returning it to the kernel. TCP PUT
#: frames arrive in buffers libzmq mallocs per message; without this, every large batch
#: is page-faulted (and zeroed) anew, which costs about a third of TCP throughput.
MALLOC_KEEP_BYTES = 512 << 20


def _tune_malloc() -> None:
    """Keep large message buffers on the heap and do not trim it after each batch.

    Skipped when the user set glibc's own MALLOC_*_ environment variables, or off glibc.
    """
    if any(k in os.environ for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")):
        return
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)   # glibc's largest dynamic threshold
        libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_KEEP_BYTES)
    except (OSError, AttributeError):
        pass


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _default(v: int | None, pool_bytes: int) -> int:
    # None: 3/4 of the pool, so no one client can hold all of it hostage; 0: no limit
    return pool_bytes * 3 // 4 if v is None else v
