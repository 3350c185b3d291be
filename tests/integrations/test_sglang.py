"""kvshm as an SGLang 0.5.23 HiCache storage backend, on CPU host buffers.

Real SGLang code here: ``HiCacheStorage`` (the base class), ``HiCacheStorageConfig``,
``StorageBackendFactory.create_backend("dynamic", ...)`` (the loader ``--hicache-storage-
backend dynamic`` uses) and ``get_storage_hash_str`` (SGLang's page keys). Stand-in: the
host KV pool. SGLang's ``MHATokenToKVPoolHost`` needs a device pool to be built, so
``HostPool`` below follows its ``page_first`` / ``layer_first`` layouts and copies the
arithmetic of its ``get_page_buffer_meta``, ``get_data_page``,
``get_dummy_flat_data_page`` and ``set_from_flat_data_page`` (sglang 0.5.23,
``srt/mem_cache/pool_host/mha.py``). SGLang's cache controller does not import on CPU
(triton kernels), so its two zero-copy glue functions are reproduced in ``page_get`` /
``page_set`` as they read in ``managers/cache_controller.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import _engines

_engines.load("sglang")

import torch  # noqa: E402

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

import kvshm  # noqa: E402
from _support import stop_server, wait_for  # noqa: E402
from kvshm.integrations.sglang import KvshmHiCacheStorage  # noqa: E402
from servers import ServerProcess  # noqa: E402

PAGE, LAYERS, HEADS, DIM = 16, 3, 2, 8
MODEL = "org/fake-model"


class HostPool:
    """Stand-in for MHATokenToKVPoolHost (see the module docstring)."""

    def __init__(self, layout: str = "page_first", size: int = 8 * PAGE,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.layout, self.size, self.page_size, self.dtype = layout, size, PAGE, dtype
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, DIM
        self.device, self.pin_memory = "cpu", False
        if layout == "layer_first":
            dims = (2, LAYERS, size, HEADS, DIM)
        elif layout == "page_first":
            dims = (2, size, LAYERS, HEADS, DIM)
        else:
            raise ValueError(layout)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g).to(self.dtype))

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        ptr_list = []
        base = self.kv_buffer.data_ptr()
        indices = indices.tolist()
        it = self.dtype.itemsize
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * it
        if self.layout == "layer_first":
            for index in range(0, len(indices), self.page_size):
                for layer_id in range(self.layer_num):
                    k_ptr = (base + indices[index] * self.head_num * self.head_dim * it
                             + layer_id * self.size * self.head_num * self.head_dim * it)
                    ptr_list += [k_ptr, k_ptr + v_offset]
            element_size = it * self.page_size * self.head_num * self.head_dim
        else:
            for index in range(0, len(indices), self.page_size):
                k_ptr = base + indices[index] * self.layer_num * self.head_num * self.head_dim * it
                ptr_list += [k_ptr, k_ptr + v_offset]
            element_size = self.layer_num * it * self.page_size * self.head_num * self.head_dim
        return ptr_list, [element_size] * len(ptr_list)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + self.page_size, :, :]
        else:
            page = self.kv_buffer[:, index:index + self.page_size, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + self.page_size, :, :] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            self.kv_buffer[:, index:index + self.page_size, :, :, :] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)

    def page(self, slot: int) -> torch.Tensor:
        """Page at token slot ``slot`` (a copy), for comparisons."""
        return self.get_data_page(slot).clone()


def page_set(backend: Any, hash_values: list[str], host_indices: torch.Tensor) -> bool:
    # HiCacheController._page_set_zero_copy (sglang 0.5.23)
    return all(backend.batch_set_v1(hash_values, host_indices, None))


def page_get(backend: Any, hash_values: list[str], host_indices: torch.Tensor) -> int:
    # HiCacheController._page_get_zero_copy (sglang 0.5.23): the leading run of True
    results = backend.batch_get_v1(hash_values, host_indices, None)
    inc = 0
    for i in range(len(hash_values)):
        if not results[i]:
            break
        inc += 1
    return inc


def slots(*pages: int) -> torch.Tensor:
    """Host token indices of whole pages."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


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


def create(cfg: HiCacheStorageConfig, pool: HostPool) -> Any:
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
    pool = HostPool()
    be = create(make_config(server.address), pool)
    try:
        assert isinstance(be, KvshmHiCacheStorage) and isinstance(be, HiCacheStorage)
        assert be.mem_pool_host is pool
        assert be.namespace == "sgl|org%2Ffake-model|bfloat16|page_first|p16|tp0of1|"
        assert be.get_stats() is None
    finally:
        be.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_zero_copy_round_trip_with_tp_ranks(server: ServerProcess, layout: str) -> None:
    """Two TP ranks store their own shard of the same pages under the same SGLang keys;
    each reads back its own shard, into other host slots."""
    pools = [HostPool(layout), HostPool(layout)]
    bes = [create(make_config(server.address, r, 2), p) for r, p in enumerate(pools)]
    try:
        keys = page_keys(3)
        for r, (be, pool) in enumerate(zip(bes, pools)):
            pool.fill(seed=10 + r)
            assert page_set(be, keys, slots(0, 1, 2))
        refs = [[p.page(s * PAGE) for s in range(3)] for p in pools]
        with kvshm.Client(server.address) as c:
            assert c.stats()["num_keys"] == 6            # 3 pages x 2 ranks
            assert c.exists(f"{bes[1].namespace}{keys[0]}")
        for be, pool, ref in zip(bes, pools, refs):
            pool.kv_buffer.zero_()
            assert be.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=None)) == 3
            assert page_get(be, keys, slots(5, 3, 6)) == 3
            for got_slot, r in zip((5, 3, 6), ref):
                assert torch.equal(pool.page(got_slot * PAGE), r)
        assert not torch.equal(refs[0][0], refs[1][0])     # really two shards
    finally:
        for be in bes:
            be.close()


def test_exists_and_get_are_prefix_runs(server: ServerProcess) -> None:
    pool = HostPool()
    be = create(make_config(server.address), pool)
    try:
        pool.fill(seed=1)
        keys = page_keys(4)
        assert page_set(be, [keys[0], keys[1], keys[3]], slots(0, 1, 3))    # hole at 2
        assert be.batch_exists(keys) == 2
        assert be.batch_exists([keys[2]] + keys) == 0
        assert be.exists(keys[3]) and not be.exists(keys[2])
        before = pool.page(7 * PAGE)
        assert be.batch_get_v1(keys, slots(4, 5, 6, 7)) == [True, True, False, False]
        assert torch.equal(pool.page(7 * PAGE), before)     # nothing after the miss copied
        assert page_get(be, [keys[2], keys[0]], slots(4, 5)) == 0
        assert be.batch_get_v1([], torch.zeros(0, dtype=torch.int64)) == []
    finally:
        be.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_legacy_and_zero_copy_read_each_other(server: ServerProcess, layout: str) -> None:
    """A page stored by the legacy batch_set (SGLang's flat data page) reads back through
    batch_get_v1, and the other way round: the values are the same bytes."""
    pool = HostPool(layout)
    cfg = make_config(server.address)
    cfg.extra_config["interface_v1"] = 0
    be = create(cfg, pool)
    try:
        pool.fill(seed=2)
        keys = page_keys(2, seed=5)
        ref0, ref1 = pool.page(0), pool.page(PAGE)
        # legacy write (HiCacheController._generic_page_set)
        assert be.batch_set([keys[0]], [pool.get_data_page(0)])
        # zero-copy write
        assert page_set(be, [keys[1]], slots(1))
        pool.kv_buffer.zero_()
        assert page_get(be, [keys[0]], slots(2)) == 1
        assert torch.equal(pool.page(2 * PAGE), ref0)
        # legacy read (HiCacheController._generic_page_get)
        dst = [pool.get_dummy_flat_data_page()]
        got = be.batch_get([keys[1]], dst)
        assert got[0] is dst[0]
        pool.set_from_flat_data_page(3 * PAGE, got[0])
        assert torch.equal(pool.page(3 * PAGE), ref1)
        assert be.get(keys[0], pool.get_dummy_flat_data_page()) is not None
        assert be.get("0" * 64, pool.get_dummy_flat_data_page()) is None
        assert be.set(keys[0], pool.get_data_page(0))
    finally:
        be.close()


def test_mla_pages_are_shared_by_ranks(server: ServerProcess) -> None:
    pools = [HostPool(), HostPool()]
    bes = [create(make_config(server.address, r, 2, mla=True), p) for r, p in enumerate(pools)]
    try:
        assert bes[0].namespace == bes[1].namespace and "|mla|" in bes[0].namespace
        pools[0].fill(seed=3)
        keys = page_keys(2, seed=9)
        assert page_set(bes[0], keys, slots(0, 1))        # the writer rank
        assert bes[1].batch_exists(keys) == 2
        assert page_get(bes[1], keys, slots(0, 1)) == 2
        assert torch.equal(pools[1].kv_buffer[:, :2 * PAGE], pools[0].kv_buffer[:, :2 * PAGE])
    finally:
        for be in bes:
            be.close()


def test_existing_pages_are_not_copied_again(server: ServerProcess) -> None:
    pool = HostPool()
    be = create(make_config(server.address), pool)
    try:
        pool.fill(seed=4)
        keys = page_keys(1, seed=11)
        ref = pool.page(0)
        assert page_set(be, keys, slots(0))
        pool.fill(seed=99)                    # different bytes, same key
        assert page_set(be, keys, slots(0))   # reported stored, not rewritten
        assert page_get(be, keys, slots(1)) == 1
        assert torch.equal(pool.page(PAGE), ref)
    finally:
        be.close()


def test_wrong_page_size_is_a_miss(server: ServerProcess) -> None:
    pool = HostPool()
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
    srv = ServerProcess(prealloc_size=0.125)
    port = srv.port
    pool = HostPool()
    be = create(make_config(srv.address), pool)
    try:
        pool.fill(seed=6)
        keys = page_keys(2, seed=13)
        assert page_set(be, keys, slots(0, 1))
        stop_server(srv)
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
        assert torch.equal(pool.page(4 * PAGE), pool.page(0))
    finally:
        be.close()
        stop_server(srv)


def test_clear_needs_the_option(server: ServerProcess) -> None:
    pool = HostPool()
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
