"""kvshm as an SGLang HiCache storage backend (written against SGLang 0.5.23).

SGLang loads it with its ``dynamic`` storage backend; no patch to SGLang::

    python -m sglang.launch_server --model-path ... \\
        --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvshm",
            "module_path": "kvshm.integrations.sglang", "class_name": "KvshmHiCacheStorage",
            "interface_v1": 1, "kvshm_url": "127.0.0.1:12345"}'

``"interface_v1": 1`` turns on SGLang's zero-copy path: ``batch_set_v1`` / ``batch_get_v1``
get host-pool indices and this backend copies each page once between SGLang's host KV pool
and the kvshm pool (``get_page_buffer_meta`` gives the addresses). Without it SGLang uses
the legacy ``batch_set`` / ``batch_get`` on flat page tensors (an extra copy in SGLang).

Options (in the same JSON; SGLang passes them through ``storage_config.extra_config``):

``kvshm_url``
    kvshm server: ``host:port``, ``tcp://host:port`` or ``kvshm://host:port``. Default
    ``127.0.0.1:12345``.
``kvshm_transport``
    ``auto`` (default), ``shm``, ``tcp``, ``rdma``.
``kvshm_timeout``
    Seconds to wait for one reply (default 5).
``kvshm_retry_interval``
    After the server did not answer, seconds during which calls report misses at once
    (default 1).
``kvshm_key_prefix``
    First field of every key (default ``sgl``).
``kvshm_skip_existing``
    ``batch_set_v1`` asks which pages are already stored and copies only the others
    (default true).
``kvshm_allow_clear``
    ``clear()`` (SGLang's flush of the storage tier) purges the whole kvshm server, which
    other engines may share; off by default (then ``clear()`` only logs).

Keys
    SGLang gives every rank the same page key (a SHA-256 chain over the page tokens), so
    the backend adds what tells the shards apart:
    ``{prefix}|{model}|{dtype}|{layout}|p{page_size}|tp{rank}of{size}[|pp..][|cp..][|dcp..]|{page key}``
    (``mla`` instead of the TP rank for MLA models, whose KV is the same on every rank;
    only SGLang's writer rank stores it). ``{layout}`` is the byte order of a stored page
    (:data:`MHA_PAGE_ORDER`): ``page_first`` (``kv-TLHD``), ``page_head`` (``kv-HTLD``)
    and ``layer_first`` = ``page_first_direct`` (``kv-LTHD``, the same bytes, checked);
    MLA pools and other layouts use the layout name itself. A prefix, dtype, layout or
    page key holding ``|`` is written escaped (``_common.key_field``: ``%~`` + its
    percent-encoding), so no two configurations share a key.

Values
    One kvshm entry per page: the page's buffers from ``get_page_buffer_meta`` end to end
    (MHA ``page_first``: K then V of all layers; ``layer_first``: reordered to all K layers
    then all V layers), which is exactly SGLang's flat data page, so the zero-copy and the
    legacy paths read each other's pages. A stored value of another size is a miss.

Failures
    Nothing here raises into SGLang for a kvshm problem: while the server is down,
    ``batch_exists`` returns 0, gets and sets report ``False`` per page (logged once), and
    the same backend works again after the server restarts.

Not implemented: the ``*_v2`` methods (hybrid models: Mamba, SWA, DSA sidecar pools); SGLang
raises NotImplementedError for them as for every backend that lacks them.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional
from urllib.parse import quote

import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvshm.errors import KvshmError
from kvshm.integrations._common import (
    ResilientClient,
    as_bool,
    get_pieces_into,
    key_field,
    put_pieces,
    raw_view,
)

__all__ = ["KvshmHiCacheStorage", "DEFAULTS", "MHA_PAGE_ORDER", "key_layout"]

log = logging.getLogger(__name__)

#: Options (``extra_config`` keys) and their defaults.
DEFAULTS: dict[str, Any] = {"kvshm_url": "127.0.0.1:12345", "kvshm_transport": "auto",
                            "kvshm_timeout": 5.0, "kvshm_retry_interval": 1.0,
                            "kvshm_key_prefix": "sgl", "kvshm_skip_existing": True,
                            "kvshm_allow_clear": False}


#: The byte order of one stored page of an MHA host pool, per SGLang layout: K then V, each
#: in this dimension order (L layers, T tokens of the page, H heads, D head dim), as
#: ``get_page_buffer_meta`` hands the page out (``layer_first`` reordered to all K, then
#: all V) and as the legacy path's flat data page holds it. Layouts of one order store
#: the same bytes and share keys; the others differ byte for byte (within a page
#: ``page_first`` is token-major, ``page_first_direct`` layer-major, ``page_head``
#: head-major). tests/integrations/test_sglang.py stores the same KV through SGLang's own
#: MHATokenToKVPoolHost in every layout and compares the stored bytes of every pair.
MHA_PAGE_ORDER: dict[str, str] = {"layer_first": "kv-LTHD", "page_first_direct": "kv-LTHD",
                                  "page_first": "kv-TLHD", "page_head": "kv-HTLD"}


def key_layout(layout: str, mla: bool) -> str:
    """The layout field of the keys: the page byte order for the MHA layouts of
    :data:`MHA_PAGE_ORDER`, else the layout name as it is (MLA pools and layouts not
    checked here share keys only with themselves)."""
    if not mla and layout in MHA_PAGE_ORDER:
        return MHA_PAGE_ORDER[layout]
    return layout


def _dtype_name(d: Any) -> str:
    return str(d).removeprefix("torch.")


class KvshmHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` backed by a kvshm server (see the module docstring).

    Parameters
    ----------
    storage_config : HiCacheStorageConfig
        Ranks, model name, ``extra_config`` (the options).
    kwargs : dict
        What SGLang's dynamic factory passes as its second argument (``{}``); unused.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = cfg = storage_config
        if getattr(cfg, "should_split_heads", False):
            # SGLang asks for pages cut by heads into tp_lcm_size shards, so that engines
            # of different TP sizes share them; kvshm keys each rank's whole page by its
            # own TP rank and size: sharing across TP sizes would need the split, and
            # taking the flag while not splitting would give another TP size wrong heads
            raise ValueError(
                f"kvshm HiCache storage does not split pages by heads for heterogeneous TP "
                f"(should_split_heads: tp_lcm_size={cfg.tp_lcm_size} > tp_size="
                f"{cfg.tp_size} with the page_head layout); remove 'tp_lcm_size' from "
                f"--hicache-storage-backend-extra-config: engines of different TP sizes "
                f"then keep separate pages in kvshm")
        extra = dict(cfg.extra_config or {})
        self.options = o = {k: extra.get(k, v) for k, v in DEFAULTS.items()}
        self._kv = ResilientClient(str(o["kvshm_url"]), transport=str(o["kvshm_transport"]),
                                   timeout=float(o["kvshm_timeout"]),
                                   retry_interval=float(o["kvshm_retry_interval"]),
                                   label=f"SGLang HiCache kvshm (tp{cfg.tp_rank})")
        self.skip_existing = as_bool(o["kvshm_skip_existing"])
        self.allow_clear = as_bool(o["kvshm_allow_clear"])
        self.mem_pool_host: Any = None
        self.namespace: str | None = None
        self.key_layout: str | None = None
        self._reorder: list[int] | None = None

    # ------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host KV pool; the key namespace is fixed here (dtype, layout)."""
        super().register_mem_pool_host(mem_pool_host)
        cfg = self.storage_config
        layout = str(getattr(mem_pool_host, "layout", "unknown"))
        self.key_layout = key_layout(layout, bool(cfg.is_mla_model))
        # every field free of "|" (key_field: as it is unless it holds one), the page
        # key too (_keys): two configurations never share a key, today's keys stay
        parts = [key_field(str(self.options["kvshm_key_prefix"])),
                 quote(cfg.model_name or "", safe=""),
                 key_field(_dtype_name(getattr(mem_pool_host, "dtype", "unknown"))),
                 key_field(self.key_layout), f"p{getattr(mem_pool_host, 'page_size', 0)}"]
        parts.append("mla" if cfg.is_mla_model else f"tp{cfg.tp_rank}of{cfg.tp_size}")
        if cfg.pp_size > 1:
            parts.append(f"pp{cfg.pp_rank}of{cfg.pp_size}")
        if cfg.attn_cp_size > 1:
            parts.append(f"cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
        if getattr(cfg, "dcp_size", 1) > 1:
            parts.append(f"dcp{cfg.dcp_rank}of{cfg.dcp_size}p{cfg.logical_page_size}")
        self.namespace = "|".join(parts) + "|"
        # MHA layer_first gives (K, V) per layer; store all K then all V (the flat page)
        n_layers = getattr(mem_pool_host, "layer_num", None)
        self._reorder = None
        if layout == "layer_first" and n_layers and hasattr(mem_pool_host, "head_num"):
            self._reorder = list(range(0, 2 * n_layers, 2)) + list(range(1, 2 * n_layers, 2))
        log.info("kvshm HiCache backend: server %s, namespace %s", self._kv.address,
                 self.namespace)

    def _keys(self, keys: List[str]) -> list[bytes]:
        if self.namespace is None:
            raise RuntimeError("KvshmHiCacheStorage: register_mem_pool_host() was not called")
        ns = self.namespace
        return [(ns + key_field(k)).encode() for k in keys]

    def _page_views(self, keys: List[str], host_indices: torch.Tensor) -> list[list[memoryview]]:
        """Per key, the host-pool buffers of its page (one copy each way)."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        n = len(keys)
        if n == 0:
            return []
        m, rem = divmod(len(ptrs), n)
        if rem or m == 0 or len(sizes) != len(ptrs):
            raise ValueError(f"get_page_buffer_meta gave {len(ptrs)} buffers for {n} pages")
        order = self._reorder if self._reorder is not None and len(self._reorder) == m \
            else range(m)
        out = []
        for i in range(n):
            base = i * m
            out.append([raw_view(int(ptrs[base + j]), int(sizes[base + j])) for j in order])
        return out

    # ------------------------------------------------------------------ zero copy (v1)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store pages straight from the host pool (one copy per page buffer). Pages
        already stored are not copied again (``kvshm_skip_existing``)."""
        if not keys:
            return []
        bkeys = self._keys(keys)
        views = self._page_views(keys, host_indices)
        ok = [False] * len(keys)
        try:
            todo = list(range(len(keys)))
            if self.skip_existing:
                found = self._kv.call(lambda c: c.exists_batch(bkeys))
                todo = [i for i, f in enumerate(found) if not f]
                for i, f in enumerate(found):
                    ok[i] = bool(f)
            if todo:
                failed: dict[bytes, Any] = {}
                try:
                    self._kv.call(lambda c: put_pieces(c, [bkeys[i] for i in todo],
                                                       [views[i] for i in todo]))
                except KvshmError as exc:
                    if getattr(exc, "failed", None) is None:
                        raise
                    failed = exc.failed  # type: ignore[attr-defined]
                    log.warning("kvshm HiCache: %d of %d pages not stored: %s",
                                len(failed), len(todo), exc)
                for i in todo:
                    ok[i] = bkeys[i] not in failed
        except KvshmError as exc:
            log.debug("kvshm HiCache batch_set_v1 failed: %s", exc)
            return [False] * len(keys)
        return ok

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Fill pages of the host pool (one copy per page buffer). Only the leading run of
        hits is copied: SGLang uses no page after the first miss."""
        if not keys:
            return []
        bkeys = self._keys(keys)
        views = self._page_views(keys, host_indices)
        try:
            return self._kv.call(lambda c: get_pieces_into(c, bkeys, views, prefix=True))
        except KvshmError as exc:
            log.debug("kvshm HiCache batch_get_v1 failed: %s", exc)
            return [False] * len(keys)

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Number of leading pages stored (one MATCH_PREFIX round trip)."""
        if not keys:
            return 0
        bkeys = self._keys(keys)
        try:
            return int(self._kv.call(lambda c: c.match_prefix(bkeys)))
        except KvshmError as exc:
            log.debug("kvshm HiCache batch_exists failed: %s", exc)
            return 0

    # ------------------------------------------------------------------ legacy API

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        """Fill ``target_location`` (a flat page tensor, SGLang's
        ``get_dummy_flat_data_page()``); None on a miss."""
        got = self.batch_get([key], [target_location], [target_sizes])
        return got[0] if isinstance(got, list) else None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None] | int:
        if not keys:
            return []
        if target_locations is None:
            raise ValueError("KvshmHiCacheStorage.batch_get needs target_locations "
                             "(flat page tensors)")
        bkeys = self._keys(keys)
        outs = [[memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())]
                for t in target_locations]
        try:
            found = self._kv.call(lambda c: get_pieces_into(c, bkeys, outs))
        except KvshmError as exc:
            log.debug("kvshm HiCache batch_get failed: %s", exc)
            return [None] * len(keys)
        return [t if f else None for t, f in zip(target_locations, found)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store flat page tensors (SGLang's ``get_data_page()``); True when all were stored."""
        if not keys:
            return True
        if values is None:
            raise ValueError("KvshmHiCacheStorage.batch_set needs values (page tensors)")
        bkeys = self._keys(keys)
        pieces = [[memoryview(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy())]
                  for v in values]
        try:
            self._kv.call(lambda c: put_pieces(c, bkeys, pieces))
        except KvshmError as exc:
            log.debug("kvshm HiCache batch_set failed: %s", exc)
            return False
        return True

    # ------------------------------------------------------------------ misc

    def clear(self) -> None:
        """Purge the kvshm server when ``kvshm_allow_clear`` is set (it may hold other
        engines' data); otherwise log and keep everything."""
        if not self.allow_clear:
            log.warning("kvshm HiCache: clear() ignored (the kvshm server may be shared; "
                        "set kvshm_allow_clear to purge it)")
            return
        try:
            self._kv.call(lambda c: c.purge())
        except KvshmError as exc:
            log.warning("kvshm HiCache: clear() failed: %s", exc)

    def get_stats(self) -> None:
        return None

    def close(self) -> None:
        self._kv.close()
