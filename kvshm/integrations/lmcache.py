"""kvshm as an LMCache remote storage plugin (written against LMCache 0.5.6).

LMCache loads it by name; no patch to LMCache or to the engine. In the LMCache config
(YAML via ``LMCACHE_CONFIG_FILE``, or the ``LMCACHE_*`` environment variables)::

    chunk_size: 256
    local_cpu: false                 # LMCache's CPU buffer stays (staging for the copies)
    max_local_cpu_size: 2.0
    remote_serde: naive
    remote_storage_plugins: ["kvshm"]
    extra_config:
      remote_storage_plugin.kvshm.module_path: kvshm.integrations.lmcache
      remote_storage_plugin.kvshm.class_name: KvshmConnector
      remote_storage_plugin.kvshm.url: 127.0.0.1:12345     # the kvshm server of this host

Plugin options (``remote_storage_plugin.<name>.<option>`` in ``extra_config``):

``url``
    kvshm server address: ``host:port``, ``tcp://host:port``, ``kvshm://host:port``.
    Default ``127.0.0.1:12345``.
``transport``
    ``auto`` (default: shared memory on the same host, else RDMA, else TCP), ``shm``,
    ``tcp``, ``rdma``.
``timeout``
    Seconds to wait for one reply (default 5).
``retry_interval``
    After the server did not answer, seconds during which calls fail at once (default 1).
``key_prefix``
    Prepended to every key (default ``lmc/``).
``threads``
    Worker threads that run the blocking calls off LMCache's event loop (default 4).
``alloc_wait``
    Seconds a get waits for LMCache's CPU buffer to have room before it counts a miss
    (default 2).

``class_name: KvshmConnectorAdapter`` works too (LMCache's adapter style: the plugin then
also gets its instance name, so several kvshm plugins ``kvshm.a``, ``kvshm.b`` can coexist;
the plugin name must then be ``kvshm`` or ``kvshm.<instance>``).

Values
    One kvshm entry per chunk, under ``key_prefix + CacheEngineKey.to_string()`` (the
    key already names model, world size, worker (TP rank), chunk hash and dtype). A prefix
    other than a name and one ``/`` at its end (``lmc/``), and model names or tags that
    make LMCache's string ambiguous, are written escaped (:func:`prefix_field`,
    :func:`chunk_field`), so no two plugins or chunks share a key. The value
    is a self-describing header (:mod:`kvshm.integrations._common`: magic, version,
    MemoryFormat, dtype and shape of each layer group, payload length) followed by the
    MemoryObj's bytes. ``put`` copies the MemoryObj's bytes once, straight into the pool;
    ``get`` reads the header, allocates the MemoryObj with that shape, dtype and format
    from LMCache's local CPU backend and copies the payload once, straight out of the pool
    (over TCP each way is one extra copy).

Failures
    The plugin never raises from its constructor and connects on first use. While the
    server is down, calls raise :class:`kvshm.ServerUnavailable` (a ConnectionError):
    LMCache turns that into a miss (``contains`` False, ``get`` None, prefix 0) or a
    logged failed put; after the server restarts the same plugin object works again.
    ``list()`` returns ``[]``: kvshm has no key listing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, Callable, List, Optional, Sequence
from urllib.parse import quote

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvshm.errors import ServerUnavailable
from kvshm.integrations._common import (
    ESCAPED,
    ChunkHeader,
    ResilientClient,
    get_framed,
    key_field,
    pack_header,
    put_framed,
)

__all__ = ["KvshmConnector", "KvshmConnectorAdapter", "DEFAULTS", "store_key", "prefix_field",
           "chunk_field"]

log = logging.getLogger(__name__)

#: Plugin options and their defaults (see the module docstring).
DEFAULTS: dict[str, Any] = {"url": "127.0.0.1:12345", "transport": "auto", "timeout": 5.0,
                            "retry_interval": 1.0, "key_prefix": "lmc/", "threads": 4,
                            "alloc_wait": 2.0}

_PLUGIN = "remote_storage_plugin."


def _find_plugin_name(extra: dict[str, Any], cls: type) -> str:
    """The plugin name under which ``extra_config`` loads ``cls`` (LMCache's
    DynamicConnectorAdapter does not pass it to the connector)."""
    mod = cls.__module__
    names = []
    for k, v in extra.items():
        if k.startswith(_PLUGIN) and k.endswith(".class_name") and v == cls.__name__:
            name = k[len(_PLUGIN):-len(".class_name")]
            if extra.get(f"{_PLUGIN}{name}.module_path") == mod:
                names.append(name)
    if len(names) > 1:
        log.warning("several LMCache plugins load %s (%s); using the options of %s. Use "
                    "class_name KvshmConnectorAdapter to tell them apart", cls.__name__,
                    names, names[0])
    return names[0] if names else "kvshm"


def _options(extra: dict[str, Any] | None, name: str) -> dict[str, Any]:
    extra = extra or {}
    opts = dict(DEFAULTS)
    for k in DEFAULTS:
        v = extra.get(f"{_PLUGIN}{name}.{k}")
        if v is not None:
            opts[k] = type(DEFAULTS[k])(v) if not isinstance(DEFAULTS[k], str) else str(v)
    return opts


def prefix_field(prefix: str) -> str:
    """How ``key_prefix`` starts the keys: as it is when it is a name and one ``/`` at
    its end (``lmc/``, the default: today's keys byte for byte), else ``%~`` + its
    percent-encoding + ``/`` (``_common.key_field``). Either way the key's first ``/``
    ends it: with ``a/`` and ``a/b/`` as they are, ``a/`` + ``b/m@...`` (model ``b/m``)
    would be ``a/b/`` + ``m@...`` (model ``m``), one key for two plugins' chunks."""
    if prefix.endswith("/") and "/" not in prefix[:-1] and not prefix.startswith(ESCAPED):
        return prefix
    return ESCAPED + quote(prefix, safe="") + "/"


def chunk_field(key: CacheEngineKey) -> str:
    """``key.to_string()``, with the pieces that would make it ambiguous escaped
    (``_common.key_field``): a model name with ``@``, a tag name with ``@`` or ``%``,
    a tag value with ``@``, or with ``%`` after an escaped tag name (LMCache joins them
    raw: tags ``a=x@b%y`` and ``a=x, b=y`` gave one string). Byte for byte
    ``to_string()`` otherwise."""
    s = key.to_string()
    model = key.model_name
    tags = key.tags or ()
    plain = [(str(k), str(v)) for k, v in tags]
    if key_field(model, "@") == model and all(
            key_field(k, "@%") == k and key_field(v, "@") == v for k, v in plain):
        return s
    tail = ("@" + "@".join(f"{k}%{v}" for k, v in plain)) if plain else ""
    fixed = s[len(model):len(s) - len(tail)]        # @world@worker@hash@dtype[@layer]
    out = []
    for k, v in plain:
        ek = key_field(k, "@%")
        # an escaped name holds its own "%XX": its value then never holds a raw "%"
        # (escaped if it has one), so the "%" that ends the name is the last of the
        # tag (a plain value) or the one before "%~" (an escaped value); before, tag
        # a@ = 25% and tag a@% = "" were both %~a%40%25%
        out.append(f"@{ek}%{key_field(v, '@' if ek == k else '@%')}")
    return key_field(model, "@") + fixed + "".join(out)


def store_key(key: CacheEngineKey, prefix: str = DEFAULTS["key_prefix"]) -> bytes:
    """The kvshm key of an LMCache chunk key (:func:`prefix_field` +
    :func:`chunk_field`: two plugins or chunks never share a key)."""
    return (prefix_field(prefix) + chunk_field(key)).encode()


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return d


class KvshmConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` backed by a kvshm server (see the module docstring).

    Parameters
    ----------
    loop : asyncio.AbstractEventLoop
        LMCache's event loop (the async methods run on it).
    local_cpu_backend : LocalCPUBackend
        Allocates the MemoryObjs that ``get`` returns; its ``metadata`` describes the
        model (shapes, dtypes, chunk size).
    config : LMCacheEngineConfig
        ``extra_config`` holds the plugin options.
    plugin_name : str, optional
        The plugin's name in ``remote_storage_plugins`` (found from ``extra_config`` when
        LMCache does not pass it).
    metadata : LMCacheMetadata, optional
        Default ``local_cpu_backend.metadata`` (a scheduler-role LMCache has no CPU
        backend: use ``class_name: KvshmConnectorAdapter`` there, which passes it).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any,
                 config: Any, plugin_name: str | None = None,
                 metadata: Any = None) -> None:
        if metadata is None:      # LMCache's DynamicConnectorAdapter passes none
            metadata = getattr(local_cpu_backend, "metadata", None)
        super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.config = config
        extra = config.extra_config or {}
        self.plugin_name = plugin_name or _find_plugin_name(extra, type(self))
        self.options = o = _options(extra, self.plugin_name)
        self.key_prefix = o["key_prefix"]
        self._prefix = prefix_field(self.key_prefix)      # how the keys start
        self.alloc_wait = float(o["alloc_wait"])
        self._kv = ResilientClient(o["url"], transport=o["transport"], timeout=o["timeout"],
                                   retry_interval=o["retry_interval"],
                                   label=f"LMCache plugin {self.plugin_name}")
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, int(o["threads"])), thread_name_prefix="kvshm-lmcache")
        self._closed = False
        log.info("kvshm LMCache plugin %s: server %s (%s), key prefix %r",
                 self.plugin_name, self._kv.address, o["transport"], self.key_prefix)

    # ---------------------------------------------------------------- plumbing

    def _key(self, key: CacheEngineKey) -> bytes:
        return (self._prefix + chunk_field(key)).encode()

    async def _offload(self, fn: Callable[..., Any], *args: Any,
                       on_abandon: Callable[[Any], None] | None = None) -> Any:
        """Run a blocking call on the plugin's threads; if the awaiting task is cancelled
        (LMCache's timeout) while it runs, ``on_abandon`` gets its result."""
        try:
            cf = self._pool.submit(fn, *args)
        except RuntimeError:
            raise ServerUnavailable(f"LMCache plugin {self.plugin_name} is closed") from None
        try:
            return await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            if on_abandon is not None:
                def done(f: concurrent.futures.Future) -> None:
                    if not f.cancelled() and f.exception() is None:
                        on_abandon(f.result())
                cf.add_done_callback(done)
            raise

    def _allocate(self, h: ChunkHeader, _i: int) -> tuple[MemoryObj, memoryview] | None:
        shapes = [torch.Size(s) for s in h.shapes]
        dtypes = [_torch_dtype(d) for d in h.dtypes]
        obj = self.local_cpu_backend.allocate(shapes, dtypes, MemoryFormat(h.fmt),
                                              eviction=True, busy_loop=False)
        if obj is None:
            return None
        if obj.get_size() != h.payload_len:
            if obj.get_size() < h.payload_len:
                obj.ref_count_down()
                raise ValueError(f"a MemoryObj of shapes {shapes} holds {obj.get_size()} "
                                 f"bytes; the stored chunk has {h.payload_len}")
            obj.set_used_size(h.payload_len)
        return obj, obj.byte_array

    @staticmethod
    def _release(obj: MemoryObj) -> None:
        obj.ref_count_down()

    @staticmethod
    def _release_all(objs: Any) -> None:
        for o in objs if isinstance(objs, list) else [objs]:
            if o is not None:
                o.ref_count_down()

    def _put_sync(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        headers, payloads = [], []
        for o in objs:
            n = o.get_size()
            headers.append(pack_header(o.get_memory_format().value,
                                       [_dtype_name(d) for d in o.get_dtypes()],
                                       [tuple(s) for s in o.get_shapes()], n))
            payloads.append(o.byte_array.cast("B"))
        bkeys = [self._key(k) for k in keys]
        self._kv.call(lambda c: put_framed(c, bkeys, headers, payloads))

    def _get_sync(self, keys: Sequence[CacheEngineKey], prefix: bool) -> List[Any]:
        bkeys = [self._key(k) for k in keys]
        return self._kv.call(lambda c: get_framed(c, bkeys, self._allocate, self._release,
                                                  prefix=prefix,
                                                  alloc_wait=self.alloc_wait))

    # ---------------------------------------------------------------- single keys

    async def exists(self, key: CacheEngineKey) -> bool:
        k = self._key(key)
        return bool(await self._offload(lambda: self._kv.call(lambda c: c.exists(k))))

    def exists_sync(self, key: CacheEngineKey) -> bool:
        k = self._key(key)
        return bool(self._kv.call(lambda c: c.exists(k)))

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        objs = await self._offload(self._get_sync, [key], False,
                                   on_abandon=self._release_all)
        return objs[0]  # type: ignore[no-any-return]

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        # LMCache (InstrumentedRemoteConnector) drops its reference when this returns:
        # the bytes are in the pool by then.
        await self._offload(self._put_sync, [key], [memory_obj])

    async def list(self) -> List[str]:
        # CacheEngineKey strings of this plugin's chunks (kvshm's LIST: an O(keys) scan
        # on the server, for inspection, not the data path)
        p = self._prefix.encode()
        keys = await self._offload(lambda: self._kv.call(lambda c: c.list_keys(p)))
        return [k[len(p):].decode(errors="replace") for k in keys]

    async def close(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # queued calls are dropped, running ones finish (each is bounded by the timeout)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._kv.close()

    # ---------------------------------------------------------------- batches

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the server answers HELLO; raises ServerUnavailable otherwise."""
        await self._offload(lambda: self._kv.call(lambda c: c.ping()))
        return 0

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """One LOOKUP, one copy per hit; None for each miss."""
        return await self._offload(self._get_sync, list(keys), False,  # type: ignore[no-any-return]
                                   on_abandon=self._release_all)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey],
                          memory_objs: List[MemoryObj]) -> None:
        """One ALLOC and one COMMIT for the whole batch."""
        await self._offload(self._put_sync, list(keys), list(memory_objs))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey],
                                     pin: bool = False) -> int:
        """Number of leading keys present (one MATCH_PREFIX). ``pin`` is not needed: a
        kvshm get pins while it copies."""
        bkeys = [self._key(k) for k in keys]
        return int(await self._offload(lambda: self._kv.call(lambda c: c.match_prefix(bkeys))))

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The leading run of hits (prefix semantics): nothing after the first miss is
        copied or allocated."""
        objs = await self._offload(self._get_sync, list(keys), True,
                                   on_abandon=self._release_all)
        out = []
        for o in objs:
            if o is None:
                break
            out.append(o)
        return out

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        """Number of leading keys present (one MATCH_PREFIX), on the caller's thread."""
        bkeys = [self._key(k) for k in keys]
        return int(self._kv.call(lambda c: c.match_prefix(bkeys)))

    def remove_sync(self, key: CacheEngineKey) -> bool:
        k = self._key(key)
        return bool(self._kv.call(lambda c: c.delete([k])))

    def __repr__(self) -> str:
        return f"<KvshmConnector {self.plugin_name} {self._kv.address}>"

    def __del__(self) -> None:
        try:
            if not self._closed:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._kv.close()
        except Exception:
            pass


class KvshmConnectorAdapter(ConnectorAdapter):
    """LMCache adapter style (``class_name: KvshmConnectorAdapter``): claims the plugin
    names ``kvshm`` and ``kvshm.<instance>`` and passes the instance name and metadata on."""

    def __init__(self) -> None:
        super().__init__("plugin://kvshm")

    def can_parse(self, url: str) -> bool:
        return url.startswith("plugin://") and \
            extract_plugin_type(url[len("plugin://"):]) == "kvshm"

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        name = context.plugin_name or context.url[len("plugin://"):]
        return KvshmConnector(context.loop, context.local_cpu_backend, context.config,
                              plugin_name=name, metadata=context.metadata)

