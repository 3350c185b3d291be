"""kvshm as an SGLang 0.5.23 HiCache storage backend, on SGLang's own classes, on CPU.

Real SGLang code here: the host KV pool ``MHATokenToKVPoolHost`` in every layout it offers
to storage backends (``layer_first``, ``page_first``, ``page_first_direct``,
``page_head``), with its own ``get_page_buffer_meta`` / ``get_data_page`` /
``set_from_flat_data_page``; ``HiCacheController``'s storage path (``_page_backup``,
``_storage_hit_query``, ``_page_transfer``, the zero-copy and the generic page functions);
``HiCacheStorage`` (the base class), ``HiCacheStorageConfig``,
``StorageBackendFactory.create_backend("dynamic", ...)`` and ``get_storage_hash_str``.

Stand-ins: the GPU <-> host copies (the tests write and read the host pool's KV
directly, as the device -> host kernels would have) and the controller's constructor
(it needs a device allocator and torch process groups): :func:`controller` makes a
``HiCacheController`` without ``__init__`` and sets what ``attach_storage_backend``
sets for the storage path (the backend, the host pool, the page size, the get/set page
functions it selects for ``interface_v1``). SGLang imports triton and torchvision at
module level; the test-only stubs in ``stubs/`` stand in for them (no kernel, no image
op runs).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
from collections.abc import Iterator
from typing import Any

import pytest

import _engines

_engines.load("sglang")

import torch  # noqa: E402

from sglang.srt.managers.cache_controller import (  # noqa: E402
    HiCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

import kvshm  # noqa: E402
from _support import stop_server, wait_for  # noqa: E402
from kvshm.integrations.sglang import KvshmHiCacheStorage, key_layout  # noqa: E402
from servers import ServerProcess  # noqa: E402

PAGE, LAYERS, HEADS, DIM = 16, 3, 2, 8
DEVICE_TOKENS = 8 * PAGE
MODEL = "org/fake-model"
#: Every layout MHATokenToKVPoolHost offers a storage backend (page_unified has no
#: get_page_buffer_meta / get_data_page: SGLang refuses it for storage itself).
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def host_pool(layout: str = "page_first", dtype: torch.dtype = torch.bfloat16) -> Any:
    """SGLang's MHATokenToKVPoolHost on CPU (8 device pages, host ratio 2 -> 17 pages,
    the last one SGLang's padding page). The "device" buffers it is built from are CPU
    tensors: only their geometry is read."""
    k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, DIM, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, DIM, dtype=dtype) for _ in range(LAYERS))
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64) for ts in (k, v)]
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1],
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=HEADS, head_dim=DIM, v_head_dim=DIM,
                         dtype=dtype, device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=DEVICE_TOKENS, start_layer=0,
                                end_layer=LAYERS)


def _token_view(pool: Any, slot: int) -> torch.Tensor:
    """The host pool's KV of one token slot as a [2, LAYERS, HEADS, DIM] view, whatever
    its layout (what a device -> host copy writes; the stand-in for it)."""
    b, lay = pool.kv_buffer, pool.layout
    p, t = divmod(slot, PAGE)
    if lay == "layer_first":
        return b[:, :, slot]
    if lay == "page_first":
        return b[:, slot]
    if lay == "page_first_direct":
        return b[:, p, :, t]
    if lay == "page_head":
        return b[:, p, :, t].transpose(1, 2)
    raise ValueError(lay)


def logical_kv(seed: int, pages: int = 1, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """KV of ``pages`` pages, [2, LAYERS, pages * PAGE, HEADS, DIM], seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, LAYERS, pages * PAGE, HEADS, DIM), generator=g).to(dtype)


def write_kv(pool: Any, first_slot: int, kv: torch.Tensor) -> None:
    for t in range(kv.shape[2]):
        _token_view(pool, first_slot + t).copy_(kv[:, :, t])


def read_kv(pool: Any, first_slot: int, ntokens: int) -> torch.Tensor:
    return torch.stack([_token_view(pool, first_slot + t).clone() for t in range(ntokens)],
                       dim=2)


def controller(backend: Any, pool: Any, v1: bool = True) -> Any:
    """SGLang's HiCacheController for its storage path (see the module docstring)."""
    c = object.__new__(HiCacheController)
    c.storage_backend = backend
    c.mem_pool_host = c.storage_host_pool = pool
    c.page_size = PAGE
    c.page_get_func = c._page_get_zero_copy if v1 else c._generic_page_get
    c.page_set_func = c._page_set_zero_copy if v1 else c._generic_page_set
    c.prefetch_sync_queue = queue.Queue()
    return c


def backup(ctrl: Any, tokens: list[int], slots: torch.Tensor) -> int:
    """HiCacheController._page_backup of whole pages; tokens stored."""
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    op = StorageOperation(slots, tokens, hash_value=hashes)
    ctrl._page_backup(op)
    return int(op.completed_tokens)


def prefetch(ctrl: Any, tokens: list[int], slots: torch.Tensor) -> int:
    """HiCacheController's prefetch: the storage hit query, then the page transfer into
    ``slots``; tokens loaded."""
    op = PrefetchOperation("req", tokens)
    hashes, hit_tokens = ctrl._storage_hit_query(op)
    op.hash_value = hashes
    op.host_indices = slots[:len(hashes) * PAGE]
    return int(ctrl._page_transfer(op)) * PAGE if hashes else 0


def page_set(backend: Any, hash_values: list[str], host_indices: torch.Tensor) -> bool:
    return bool(HiCacheController._page_set_zero_copy(controller(backend, None), hash_values,
                                                      host_indices))


def page_get(backend: Any, hash_values: list[str], host_indices: torch.Tensor) -> int:
    return int(HiCacheController._page_get_zero_copy(controller(backend, None),
                                                     PrefetchOperation("r", []), hash_values,
                                                     host_indices))


def slots(*pages: int) -> torch.Tensor:
    """Host token indices of whole pages."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def tokens_of(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n * PAGE,), generator=g).tolist()


def page_keys(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (n * PAGE,), generator=g).tolist()
    return get_storage_hash_str(tokens, None, page_size=PAGE)


def make_config(address: str, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=True, model_name=MODEL,
        extra_config={"backend_name": "kvshm", "module_path": "kvshm.integrations.sglang",
                      "class_name": "KvshmHiCacheStorage", "interface_v1": 1,
                      "kvshm_url": address, "kvshm_timeout": 1.0,
                      "kvshm_retry_interval": 0.2, **extra})


def create(cfg: HiCacheStorageConfig, pool: Any) -> Any:
    """What HiCacheController.attach_storage_backend does: the factory, then the pool."""
    be = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    be.register_mem_pool_host(pool)
    return be


@pytest.fixture
def server(kvshm_server: ServerProcess) -> Iterator[ServerProcess]:
    with kvshm.Client(kvshm_server.address) as c:
        c.purge()
    yield kvshm_server


# --------------------------------------------------------------------------- tests


def test_loaded_by_the_dynamic_factory(server: ServerProcess) -> None:
    pool = host_pool()
    be = create(make_config(server.address), pool)
    try:
        assert isinstance(be, KvshmHiCacheStorage) and isinstance(be, HiCacheStorage)
        assert be.mem_pool_host is pool
        assert be.namespace == "sgl|org%2Ffake-model|bfloat16|kv-TLHD|p16|tp0of1|"
        assert be.get_stats() is None
    finally:
        be.close()


@pytest.mark.parametrize("v1", [True, False], ids=["zero-copy", "legacy"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_controller_backup_then_prefetch(server: ServerProcess, layout: str, v1: bool) -> None:
    """SGLang's controller backs 3 pages up from one host pool and prefetches them into
    other slots of a fresh pool of the same layout: the same KV comes back."""
    src, dst = host_pool(layout), host_pool(layout)
    cfg = make_config(server.address)
    cfg.extra_config["interface_v1"] = int(v1)
    bes = [create(cfg, src), create(cfg, dst)]
    try:
        kv = logical_kv(seed=1, pages=3)
        write_kv(src, 0, kv)
        tokens = tokens_of(3, seed=2)
        assert backup(controller(bes[0], src, v1), tokens, slots(0, 1, 2)) == 3 * PAGE
        assert prefetch(controller(bes[1], dst, v1), tokens, slots(5, 6, 7)) == 3 * PAGE
        assert torch.equal(read_kv(dst, 5 * PAGE, 3 * PAGE), kv)
        # one more page of tokens than stored: the hit query stops at the stored run
        more = tokens + tokens_of(1, seed=3)
        assert prefetch(controller(bes[1], dst, v1), more, slots(9, 10, 11, 12)) == 3 * PAGE
    finally:
        for be in bes:
            be.close()


def test_shared_keys_mean_identical_bytes(server: ServerProcess) -> None:
    """The same KV through SGLang's host pool in every layout, each stored under its own
    prefix: two layouts' pages have the same bytes exactly when the backend gives them the
    same key space (layer_first = page_first_direct; page_first and page_head differ from
    each other and from those), checked for every pair and every page."""
    kv = logical_kv(seed=4, pages=2)
    tokens = tokens_of(2, seed=5)
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    values: dict[str, list[bytes]] = {}
    spaces: dict[str, str] = {}
    for layout in LAYOUTS:
        pool = host_pool(layout)
        be = create(make_config(server.address, kvshm_key_prefix=f"cmp-{layout}"), pool)
        try:
            write_kv(pool, 2 * PAGE, kv)
            assert backup(controller(be, pool), tokens, slots(2, 3)) == 2 * PAGE
            with kvshm.Client(server.address) as c:
                values[layout] = [c.get(f"{be.namespace}{h}") for h in hashes]
            spaces[layout] = be.namespace.split("|", 1)[1]
            assert spaces[layout].split("|")[2] == key_layout(layout, False)
        finally:
            be.close()
    for a, b in itertools.combinations(LAYOUTS, 2):
        for page in range(2):
            same_bytes = values[a][page] == values[b][page]
            assert same_bytes == (spaces[a] == spaces[b]), (a, b, page)
    assert spaces["layer_first"] == spaces["page_first_direct"]
    assert len({spaces[x] for x in LAYOUTS}) == 3


def test_shared_key_space_loads_across_layouts(server: ServerProcess) -> None:
    """A page stored from a layer_first pool loads into a page_first_direct pool (the
    same bytes); a page_first pool finds nothing of either (another key space)."""
    lf, pfd, pf = host_pool("layer_first"), host_pool("page_first_direct"), host_pool()
    bes = [create(make_config(server.address), p) for p in (lf, pfd, pf)]
    try:
        kv = logical_kv(seed=6, pages=2)
        write_kv(lf, 0, kv)
        tokens = tokens_of(2, seed=7)
        assert backup(controller(bes[0], lf), tokens, slots(0, 1)) == 2 * PAGE
        assert prefetch(controller(bes[1], pfd), tokens, slots(3, 4)) == 2 * PAGE
        assert torch.equal(read_kv(pfd, 3 * PAGE, 2 * PAGE), kv)
        assert prefetch(controller(bes[2], pf), tokens, slots(3, 4)) == 0
    finally:
        for be in bes:
            be.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tp_ranks_store_their_own_shards(server: ServerProcess, layout: str) -> None:
    """Two TP ranks store their own shard of the same pages under the same SGLang keys;
    each reads back its own shard."""
    pools = [host_pool(layout), host_pool(layout)]
    bes = [create(make_config(server.address, r, 2), p) for r, p in enumerate(pools)]
    try:
        tokens = tokens_of(3)
        kvs = [logical_kv(seed=10 + r, pages=3) for r in range(2)]
        for be, pool, kv in zip(bes, pools, kvs):
            write_kv(pool, 0, kv)
            assert backup(controller(be, pool), tokens, slots(0, 1, 2)) == 3 * PAGE
        with kvshm.Client(server.address) as c:
            assert c.stats()["num_keys"] == 6            # 3 pages x 2 ranks
        for be, pool, kv in zip(bes, pools, kvs):
            pool.kv_buffer.zero_()
            assert prefetch(controller(be, pool), tokens, slots(5, 3, 6)) == 3 * PAGE
            for i, p in enumerate((5, 3, 6)):
                assert torch.equal(read_kv(pool, p * PAGE, PAGE),
                                   kv[:, :, i * PAGE:(i + 1) * PAGE])
    finally:
        for be in bes:
            be.close()


def test_exists_and_get_are_prefix_runs(server: ServerProcess) -> None:
    pool = host_pool()
    be = create(make_config(server.address), pool)
    try:
        write_kv(pool, 0, logical_kv(seed=1, pages=4))
        keys = page_keys(4)
        assert page_set(be, [keys[0], keys[1], keys[3]], slots(0, 1, 3))    # hole at 2
        assert be.batch_exists(keys) == 2
        assert be.batch_exists([keys[2]] + keys) == 0
        assert be.exists(keys[3]) and not be.exists(keys[2])
        before = read_kv(pool, 7 * PAGE, PAGE)
        assert be.batch_get_v1(keys, slots(4, 5, 6, 7)) == [True, True, False, False]
        assert torch.equal(read_kv(pool, 7 * PAGE, PAGE), before)   # nothing after the miss
        assert page_get(be, [keys[2], keys[0]], slots(4, 5)) == 0
        assert be.batch_get_v1([], torch.zeros(0, dtype=torch.int64)) == []
    finally:
        be.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_legacy_and_zero_copy_read_each_other(server: ServerProcess, layout: str) -> None:
    """A page stored by the legacy path (SGLang's flat data page) loads through the
    zero-copy path, and the other way round: the values are the same bytes."""
    pool = host_pool(layout)
    v1_cfg, legacy_cfg = make_config(server.address), make_config(server.address)
    legacy_cfg.extra_config["interface_v1"] = 0
    v1, legacy = create(v1_cfg, pool), create(legacy_cfg, pool)
    try:
        kv = logical_kv(seed=2, pages=2)
        write_kv(pool, 0, kv)
        t0, t1 = tokens_of(1, seed=20), tokens_of(1, seed=21)
        assert backup(controller(legacy, pool, v1=False), t0, slots(0)) == PAGE
        assert backup(controller(v1, pool, v1=True), t1, slots(1)) == PAGE
        pool.kv_buffer.zero_()
        assert prefetch(controller(v1, pool, v1=True), t0, slots(2)) == PAGE
        assert torch.equal(read_kv(pool, 2 * PAGE, PAGE), kv[:, :, :PAGE])
        assert prefetch(controller(legacy, pool, v1=False), t1, slots(3)) == PAGE
        assert torch.equal(read_kv(pool, 3 * PAGE, PAGE), kv[:, :, PAGE:])
        key = get_storage_hash_str(t0, None, page_size=PAGE)[0]
        assert legacy.get(key, pool.get_dummy_flat_data_page()) is not None
        assert legacy.get("0" * 64, pool.get_dummy_flat_data_page()) is None
        assert legacy.set(key, pool.get_data_page(0))
    finally:
        v1.close()
        legacy.close()


def test_mla_pages_are_shared_by_ranks(server: ServerProcess) -> None:
    pools = [host_pool(), host_pool()]
    bes = [create(make_config(server.address, r, 2, mla=True), p) for r, p in enumerate(pools)]
    try:
        assert bes[0].namespace == bes[1].namespace and "|mla|" in bes[0].namespace
        assert "|page_first|" in bes[0].namespace     # MLA: the layout name as it is
        kv = logical_kv(seed=3, pages=2)
        write_kv(pools[0], 0, kv)
        tokens = tokens_of(2, seed=9)
        assert backup(controller(bes[0], pools[0]), tokens, slots(0, 1)) == 2 * PAGE
        assert prefetch(controller(bes[1], pools[1]), tokens, slots(0, 1)) == 2 * PAGE
        assert torch.equal(read_kv(pools[1], 0, 2 * PAGE), kv)
    finally:
        for be in bes:
            be.close()


def test_existing_pages_are_not_copied_again(server: ServerProcess) -> None:
    pool = host_pool()
    be = create(make_config(server.address), pool)
    try:
        kv = logical_kv(seed=4)
        write_kv(pool, 0, kv)
        keys = page_keys(1, seed=11)
        assert page_set(be, keys, slots(0))
        write_kv(pool, 0, logical_kv(seed=99))   # different bytes, same key
        assert page_set(be, keys, slots(0))       # reported stored, not rewritten
        assert page_get(be, keys, slots(1)) == 1
        assert torch.equal(read_kv(pool, PAGE, PAGE), kv)
    finally:
        be.close()


def test_wrong_page_size_is_a_miss(server: ServerProcess) -> None:
    pool = host_pool()
    be = create(make_config(server.address), pool)
    try:
        keys = page_keys(1, seed=12)
        with kvshm.Client(server.address) as c:
            c.put(f"{be.namespace}{keys[0]}", b"short")
        assert be.batch_exists(keys) == 1
        assert be.batch_get_v1(keys, slots(0)) == [False]
    finally:
        be.close()


def test_server_down_then_restarted() -> None:
    """While the server is down every call is a miss or a failed store at once (one
    short probe); the same backend works again when it is back."""
    srv = ServerProcess(prealloc_size=0.125)
    port = srv.port
    pool = host_pool()
    be = create(make_config(srv.address), pool)
    try:
        kv = logical_kv(seed=6, pages=2)
        write_kv(pool, 0, kv)
        keys = page_keys(2, seed=13)
        assert page_set(be, keys, slots(0, 1))
        stop_server(srv)
        assert be.batch_exists(keys) == 0
        assert not be._kv.up
        for _ in range(20):                      # no wait per call: the probe is off-thread
            assert be.batch_exists(keys) == 0
            assert be.batch_get_v1(keys, slots(2, 3)) == [False, False]
        assert be.batch_set_v1(keys, slots(0, 1)) == [False, False]
        assert be.batch_get(keys, [pool.get_dummy_flat_data_page()] * 2) == [None, None]
        assert be.batch_set(keys, [pool.get_data_page(0)] * 2) is False
        srv = ServerProcess(prealloc_size=0.125, service_port=port)
        wait_for(lambda: be.batch_set_v1(keys, slots(0, 1)) == [True, True],
                 what="the backend to store again after the restart")
        assert be.batch_exists(keys) == 2
        assert page_get(be, keys, slots(4, 5)) == 2
        assert torch.equal(read_kv(pool, 4 * PAGE, 2 * PAGE), kv)
    finally:
        be.close()
        stop_server(srv)


def test_unreachable_server_costs_one_short_wait() -> None:
    """No server at all: the first call probes once, then every call misses at once."""
    from _support import free_port

    pool = host_pool()
    be = create(make_config(f"127.0.0.1:{free_port()}"), pool)
    try:
        keys = page_keys(2, seed=15)
        assert be.batch_exists(keys) == 0
        assert not be._kv.up
        for _ in range(50):
            assert be.batch_exists(keys) == 0
            assert be.batch_get_v1(keys, slots(0, 1)) == [False, False]
    finally:
        be.close()


def test_clear_needs_the_option(server: ServerProcess) -> None:
    pool = host_pool()
    be = create(make_config(server.address), pool)
    be2 = create(make_config(server.address, kvshm_allow_clear=True), pool)
    try:
        keys = page_keys(1, seed=14)
        assert page_set(be, keys, slots(0))
        be.clear()
        assert be.batch_exists(keys) == 1
        be2.clear()
        assert be.batch_exists(keys) == 0
    finally:
        be.close()
        be2.close()


def test_split_heads_is_refused_with_a_clear_error(server: ServerProcess) -> None:
    """SGLang sets should_split_heads (page_head layout, tp_lcm_size > tp_size) to have
    pages cut by heads into tp_lcm_size shards; kvshm does not cut them, so it refuses at
    once, through SGLang's own factory (SGLang's attach re-raises: start-up fails)."""
    pool = host_pool("page_head")
    cfg = dataclasses.replace(make_config(server.address, tp_rank=0, tp_size=2),
                              tp_lcm_size=4, should_split_heads=True)
    with pytest.raises(ValueError, match="tp_lcm_size=4 > tp_size=2.*remove 'tp_lcm_size'"):
        create(cfg, pool)
    # tp_lcm_size equal to the TP size: SGLang does not ask for the split; loads as usual
    cfg = dataclasses.replace(make_config(server.address, tp_rank=0, tp_size=2),
                              tp_lcm_size=2, should_split_heads=False)
    be = create(cfg, pool)
    try:
        assert be.namespace is not None and "tp0of2" in be.namespace
    finally:
        be.close()


def test_fields_holding_the_separator_never_share_a_key(server: ServerProcess) -> None:
    """A page key holding "|" (or a key prefix) is escaped: joined raw, rank 0 of a
    PP=2 engine's page ``K`` and a PP=1 engine's page ``pp0of2|K`` were one key, and
    one read the other's KV. SGLang's own page keys (hex) keep today's keys."""
    pa, pb = host_pool(), host_pool()
    ca = make_config(server.address)
    cb = make_config(server.address)
    cb.pp_size, cb.pp_rank = 2, 0
    a, b = create(ca, pa), create(cb, pb)
    try:
        assert b.namespace == a.namespace + "pp0of2|"
        k = page_keys(1)[0]
        assert a._keys([k]) == [(a.namespace + k).encode()]          # as before
        assert a._keys(["pp0of2|" + k]) != b._keys([k])
        write_kv(pa, 0, logical_kv(seed=4))
        assert page_set(a, ["pp0of2|" + k], slots(0))
        assert page_get(b, [k], slots(0)) == 0                      # not a's page
        c = create(make_config(server.address, kvshm_key_prefix="sgl|x"), host_pool())
        try:
            assert c.namespace is not None and c.namespace.startswith("%~sgl%7Cx|")
            assert c.namespace.count("|") == a.namespace.count("|")
        finally:
            c.close()
    finally:
        a.close()
        b.close()
