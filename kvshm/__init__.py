"""kvshm: a KV-cache store for LLM inference.

One store server per host owns a pre-allocated POSIX shared-memory pool; clients on the
same host copy straight into and out of it, remote clients use RDMA or TCP, and ZeroMQ
messages carry the control (see docs/DESIGN.md and docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

try:
    from kvshm._bitmap import BitmapAllocator
    from kvshm._pool import Pool
except ImportError as _exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "kvshm's compiled core (kvshm._bitmap, kvshm._pool) is not built: "
        f"{_exc}. Install the package with `pip install .` (or `pip install -e .` for "
        "development), or build in place with `python setup.py build_ext --inplace`."
    ) from _exc

from kvshm.errors import (
    AuthenticationFailed,
    CorruptValue,
    InvalidKey,
    InvalidRequest,
    KeyNotFound,
    KvshmError,
    LeaseExpired,
    PoolFull,
    ProtocolError,
    QuotaExceeded,
    ServerUnavailable,
    TransportError,
    ValueTooLarge,
)

from kvshm.client import Client

if TYPE_CHECKING:
    from kvshm.aio import AsyncClient
    from kvshm.cluster.client import AsyncClusterClient, ClusterClient
    from kvshm.server import Server, ServerConfig

__version__ = "0.1.0"

#: Imported on first use (PEP 562): an engine process that only uses the clients never
#: imports the server, the store, the management port or prometheus_client (nor asyncio,
#: unless it uses AsyncClient).
_LAZY = {"Server": "kvshm.server", "ServerConfig": "kvshm.server",
         "AsyncClient": "kvshm.aio",
         # the cluster client pulls numpy and the placement core
         "ClusterClient": "kvshm.cluster.client",
         "AsyncClusterClient": "kvshm.cluster.client"}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvshm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "Client",
    "AsyncClient",
    "ClusterClient",
    "AsyncClusterClient",
    "Server",
    "ServerConfig",
    "BitmapAllocator",
    "Pool",
    "KvshmError",
    "AuthenticationFailed",
    "KeyNotFound",
    "PoolFull",
    "ValueTooLarge",
    "InvalidKey",
    "InvalidRequest",
    "ServerUnavailable",
    "ProtocolError",
    "LeaseExpired",
    "QuotaExceeded",
    "CorruptValue",
    "TransportError",
    "__version__",
]
