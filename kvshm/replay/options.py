"""What ``kvshm replay`` replays and against what: :class:`ReplayOptions` and its checks.

Every bad option is a :class:`UsageError` naming its flag, so the CLI and Python callers
get the same message.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
from dataclasses import dataclass

from kvshm.replay.workload import CHUNK_TOKENS, Workload

__all__ = ["ReplayOptions", "ReplayError", "UsageError", "split_address", "BACKENDS",
           "DEFAULT_WINDOW_PER_CLIENT", "GiB", "KiB", "PEER_BACKENDS"]

BACKENDS = ("kvshm", "kvshm-tcp", "redis", "lmcache", "mooncake")
#: Peers run from their venvs of scripts/peers-env.sh (:mod:`kvshm.replay.peers`).
PEER_BACKENDS = ("lmcache", "mooncake")
GiB = 1024 ** 3
KiB = 1024
#: With --clients K, request i waits for every request before i - 4K (``--window``).
DEFAULT_WINDOW_PER_CLIENT = 4


class ReplayError(RuntimeError):
    """The replay could not run (a server did not start, a worker died, ...)."""


class UsageError(ValueError):
    """A bad option; ``flag`` names it (``--pool-gib``)."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


# ---------------------------------------------------------------------- options

@dataclass
class ReplayOptions:
    """What to replay and against what; the CLI flags map one to one.

    Attributes
    ----------
    trace : str or None
        Trace file (JSON lines, gzip or not); None: the bundled Mooncake trace.
    requests : int or None
        Replay only the first ``requests`` requests.
    block_bytes : int
        One-block mode: bytes of one block value (>= 16, a multiple of 8). With
        ``chunk_tokens``: KV bytes of one 512-token trace block (a multiple of 4096).
    pool_gib : float
        Capacity in GiB of the server started here (kvshm: its pool, with
        ``block_size`` = ``block_bytes`` rounded up to 4 KiB; redis: its maxmemory).
    clients : int
        Client processes sharing the replay (request i goes to client i % clients).
    backend : str
        "kvshm" (shm mover), "kvshm-tcp" (tcp mover), "redis", or a peer from its venv
        of scripts/peers-env.sh: "lmcache" (LMCache's lm-server) or "mooncake" (Mooncake
        Store), see :mod:`kvshm.replay.peers`.
    address : str or None
        Use this running server (``host:port``) instead of starting one.
    timeout : float
        Seconds any one reply may take.
    progress : bool
        Show a progress bar (only when stderr is a terminal).
    shm_name : str or None
        Segment name of the kvshm server started here (default: unique).
    redis_server : str or None
        The redis-server executable (default: found on PATH).
    key_prefix : bytes or None
        Prefix of every key; default ``kvshm-replay/<run id>/`` so that two replays
        against one server never see each other's blocks.
    ssd_gib : float
        kvshm server started here: an SSD tier of this many GiB below its pool (0: none);
        the exact LRU then gets the pool and the SSD tier's capacity together.
    ssd_path : str or None
        Directory of that SSD tier's files (default: a temporary directory, removed).
    chunk_tokens : int or None
        None: one-block mode (one entry per trace block, all of ``block_bytes``: the
        store must equal the exact LRU). 16, 64, 256 or 512: the trace re-chunked as the
        engines key it, with partial last chunks (:mod:`kvshm.replay.workload`).
    """

    trace: str | None = None
    requests: int | None = None
    block_bytes: int = 64 * KiB
    pool_gib: float = 1.0
    clients: int = 1
    backend: str = "kvshm"
    address: str | None = None
    timeout: float = 30.0
    progress: bool = True
    shm_name: str | None = None
    redis_server: str | None = None
    key_prefix: bytes | None = None
    window: int | None = None
    ssd_gib: float = 0.0
    ssd_path: str | None = None
    chunk_tokens: int | None = None

    def workload(self) -> Workload:
        """Keys and sizes of the requests (:class:`~kvshm.replay.workload.Workload`)."""
        return Workload(self.block_bytes, self.chunk_tokens)

    def window_for(self, k: int) -> int | None:
        """The pacing window for k clients (None: the clients run free)."""
        if self.window is None:
            return DEFAULT_WINDOW_PER_CLIENT * k
        return self.window or None

    def validate(self) -> None:
        """Raise :class:`UsageError` naming the first bad option."""
        if type(self.block_bytes) is not int or self.block_bytes < 16 or self.block_bytes % 8:
            raise UsageError("--block-bytes",
                             f"must be a multiple of 8 bytes, >= 16, got {self.block_bytes!r}")
        if self.chunk_tokens is not None:
            if self.chunk_tokens not in CHUNK_TOKENS:
                raise UsageError("--chunk-tokens", f"must be one of "
                                 f"{', '.join(map(str, CHUNK_TOKENS))}, got "
                                 f"{self.chunk_tokens!r}")
            if self.block_bytes % 4096:
                raise UsageError("--block-bytes", "with --chunk-tokens: the KV bytes of 512 "
                                 "tokens, a multiple of 4096 (8 bytes a token or more), "
                                 f"got {self.block_bytes!r}")
        if not (self.pool_gib > 0 and math.isfinite(self.pool_gib)):
            raise UsageError("--pool-gib", f"must be > 0, got {self.pool_gib!r}")
        if type(self.clients) is not int or not 1 <= self.clients <= 256:
            raise UsageError("--clients", f"must be 1..256, got {self.clients!r}")
        if self.backend not in BACKENDS:
            raise UsageError("--backend", f"must be one of {', '.join(BACKENDS)}, "
                                          f"got {self.backend!r}")
        if self.requests is not None and (type(self.requests) is not int or self.requests < 1):
            raise UsageError("--requests", f"must be >= 1, got {self.requests!r}")
        if self.window is not None and (type(self.window) is not int or self.window < 0):
            raise UsageError("--window", f"must be >= 0, got {self.window!r}")
        if not self.timeout > 0:
            raise UsageError("--timeout", f"must be > 0, got {self.timeout!r}")
        if not (self.ssd_gib >= 0 and math.isfinite(self.ssd_gib)):
            raise UsageError("--ssd-gib", f"must be >= 0, got {self.ssd_gib!r}")
        if self.ssd_gib and (self.backend == "redis" or self.address is not None):
            raise UsageError("--ssd-gib", "is for a kvshm server started here (not with "
                                          "--backend redis or --address)")
        if self.address is not None:
            split_address(self.address, "--address")
        if self.backend in PEER_BACKENDS:
            if self.address is not None:
                raise UsageError("--address", f"--backend {self.backend} starts its own "
                                              "servers (no --address)")
            if self.clients != 1:
                raise UsageError("--clients", f"--backend {self.backend} replays with one "
                                              "client")
            if self.ssd_gib:
                raise UsageError("--ssd-gib", "is for a kvshm server started here")
            # the peer's venv is looked for by run_replay (kvshm.replay.peers.peer_python)
        if self.trace is not None and not os.path.isfile(self.trace):
            raise UsageError("--trace", f"no such file: {self.trace}")
        if self.backend == "redis":
            if importlib.util.find_spec("redis") is None:
                raise UsageError("--backend", "redis needs the redis Python package: "
                                              "pip install redis")
            if self.address is None and self.redis_executable() is None:
                raise UsageError("--backend", "redis needs redis-server on PATH "
                                              "(or --redis-server PATH, or --address)")

    def redis_executable(self) -> str | None:
        if self.redis_server:
            return self.redis_server if os.access(self.redis_server, os.X_OK) else None
        return shutil.which("redis-server")

    @property
    def server_block_bytes(self) -> int:
        """Block size of a kvshm server started here: the largest value (block_bytes,
        or a chunk's bytes) rounded up to 4 KiB."""
        return -(-self.workload().entry_bytes // (4 * KiB)) * 4 * KiB

    @property
    def pool_bytes(self) -> int:
        """Pool bytes of a kvshm server started here (as ServerConfig.pool_bytes)."""
        bs = self.server_block_bytes
        return int(self.pool_gib * GiB) // bs * bs


def split_address(address: str, flag: str) -> tuple[str, int]:
    a = address
    if a.startswith("tcp://"):
        a = a[len("tcp://"):]
    host, sep, port = a.rpartition(":")
    if sep and host and port.isdigit() and not 0 < int(port) < 65536:
        raise UsageError(flag, f"port {int(port)} is out of range (1-65535) in {address!r}")
    if not sep or not host or not port.isdigit():
        raise UsageError(flag, f"must be host:port, got {address!r}")
    return host.strip("[]"), int(port)
