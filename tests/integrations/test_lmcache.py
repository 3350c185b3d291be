"""kvshm as an LMCache 0.5.6 remote storage plugin, through LMCache's own RemoteBackend
(and the full LMCacheEngine), against a real ``kvshm serve`` on CPU.

Fake model: bf16, 4 layers, 4 KV heads x 32 dims, 256-token chunks (KV_2LTD chunks of
``[2, 4, 256, 128]``, 512 KiB).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import _engines

_engines.load("lmcache")

import torch  # noqa: E402

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

import kvshm  # noqa: E402
from kvshm.integrations import _common  # noqa: E402
from kvshm.integrations.lmcache import KvshmConnector, store_key  # noqa: E402
from _support import free_port, stop_server  # noqa: E402
from servers import ServerProcess  # noqa: E402

L, H, D, CHUNK = 4, 4, 32, 256
MODEL = "fake-model"
MODULE = "kvshm.integrations.lmcache"


def make_config(address: str, *, name: str = "kvshm", cls: str = "KvshmConnector",
                **extra: Any) -> Any:
    opts = {f"remote_storage_plugin.{name}.module_path": MODULE,
            f"remote_storage_plugin.{name}.class_name": cls,
            f"remote_storage_plugin.{name}.url": address,
            f"remote_storage_plugin.{name}.timeout": 1.0,
            f"remote_storage_plugin.{name}.retry_interval": 0.3}
    opts.update({f"remote_storage_plugin.{name}.{k}": v for k, v in extra.items()})
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.1, remote_serde="naive",
        save_unfull_chunk=True, blocking_timeout_secs=5, remote_storage_plugins=[name],
        extra_config=opts)


def make_metadata() -> Any:
    return LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(L, 2, CHUNK, H, D), chunk_size=CHUNK)


def ckey(i: int) -> CacheEngineKey:
    return CacheEngineKey(MODEL, 1, 0, 0x5EED0000 + i, torch.bfloat16)


class Lmc:
    """LMCache's RemoteBackend with the kvshm plugin, on its own event-loop thread."""

    def __init__(self, config: Any) -> None:
        self.metadata = make_metadata()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="lmcache-loop")
        self.thread.start()
        self.cpu = LocalCPUBackend(config, self.metadata, dst_device="cpu")
        self.allocated: list[Any] = []
        real = self.cpu.allocate

        def recording(*a: Any, **k: Any) -> Any:      # to check ref counts at the end
            o = real(*a, **k)
            if o is not None:
                self.allocated.append(o)
            return o

        self.cpu.allocate = recording  # type: ignore[method-assign]
        self.backend = RemoteBackend(config, self.metadata, self.loop, self.cpu,
                                     dst_device="cpu", plugin_name=config.remote_storage_plugins[0])
        assert self.backend.connection is not None, "LMCache did not load the kvshm plugin"
        self.conn: KvshmConnector = self.backend.connection._connector

    def chunk(self, seed: int, tokens: int = CHUNK) -> tuple[Any, torch.Tensor]:
        shape = torch.Size([2, L, tokens, H * D])
        o = self.cpu.allocate([shape], [torch.bfloat16], MemoryFormat.KV_2LTD)
        g = torch.Generator().manual_seed(seed)
        ref = torch.randn(shape, generator=g).to(torch.bfloat16)
        o.tensor.copy_(ref)
        return o, ref

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def put(self, keys: list[CacheEngineKey], objs: list[Any]) -> None:
        """Batched put through RemoteBackend; waits until the write completed."""
        done = threading.Semaphore(0)
        self.backend.batched_submit_put_task(keys, objs,
                                             on_complete_callback=lambda k: done.release())
        for _ in keys:
            assert done.acquire(timeout=10), "batched put did not complete"

    def close(self) -> None:
        try:
            self.backend.close()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    def check_no_leaks(self) -> None:
        live = [o for o in self.allocated if o.get_ref_count() > 0]
        assert not live, f"{len(live)} MemoryObjs still referenced"


@pytest.fixture
def lmc(kvshm_server: ServerProcess) -> Iterator[Lmc]:
    with kvshm.Client(kvshm_server.address) as c:
        c.purge()
    m = Lmc(make_config(kvshm_server.address))
    try:
        yield m
    finally:
        m.close()


def release(*objs: Any) -> None:
    for o in objs:
        if o is not None:
            o.ref_count_down()


# --------------------------------------------------------------------------- tests


def test_put_get_exists_through_remote_backend(lmc: Lmc, kvshm_server: ServerProcess) -> None:
    objs, refs = zip(*(lmc.chunk(i) for i in range(3)))
    keys = [ckey(i) for i in range(3)]
    lmc.put(keys[:2], list(objs[:2]))                       # batched_put
    lmc.backend.submit_put_task(keys[2], objs[2]).result(10)  # put
    release(*objs)
    assert all(lmc.backend.contains(k) for k in keys)           # exists
    assert not lmc.backend.contains(ckey(99))
    assert lmc.conn.exists_sync(keys[0]) and not lmc.conn.exists_sync(ckey(99))

    got = lmc.backend.get_blocking(keys[1])                    # get
    assert got is not None and torch.equal(got.tensor, refs[1])
    assert got.get_memory_format() == MemoryFormat.KV_2LTD
    assert got.get_dtypes() == [torch.bfloat16]
    release(got)
    gots = lmc.backend.batched_get_blocking(keys + [ckey(99)])  # batched_get
    assert gots[3] is None
    for g, r in zip(gots[:3], refs):
        assert g is not None and torch.equal(g.tensor, r)
    release(*gots)
    assert lmc.backend.get_blocking(ckey(99)) is None
    assert lmc.run(lmc.conn.ping()) == 0
    assert sorted(lmc.run(lmc.conn.list())) == sorted(k.to_string() for k in keys)
    lmc.check_no_leaks()

    # what kvshm holds: one entry per chunk, header + the raw bf16 bytes
    with kvshm.Client(kvshm_server.address) as c:
        raw = c.get(store_key(keys[0]))
    h = _common.parse_header(raw)
    assert h.fmt == MemoryFormat.KV_2LTD.value and h.dtypes == ("bfloat16",)
    assert h.shapes == ((2, L, CHUNK, H * D),) and h.payload_len == 2 * L * CHUNK * H * D * 2
    payload = torch.frombuffer(bytearray(raw[h.header_len:]), dtype=torch.bfloat16)
    assert torch.equal(payload.view(2, L, CHUNK, H * D), refs[0])


def test_partial_chunk_keeps_its_shape(lmc: Lmc) -> None:
    o, ref = lmc.chunk(7, tokens=100)
    lmc.put([ckey(0)], [o])
    release(o)
    g = lmc.backend.get_blocking(ckey(0))
    assert g is not None and g.get_shapes() == [torch.Size([2, L, 100, H * D])]
    assert torch.equal(g.tensor, ref)
    release(g)
    lmc.check_no_leaks()


def test_prefix_semantics_and_remove(lmc: Lmc) -> None:
    objs, refs = zip(*(lmc.chunk(i) for i in range(4)))
    keys = [ckey(i) for i in range(4)]
    lmc.put([keys[0], keys[1], keys[3]], [objs[0], objs[1], objs[3]])    # hole at 2
    release(*objs)
    assert lmc.backend.batched_contains(keys) == 2
    assert lmc.run(lmc.backend.batched_async_contains("l1", keys)) == 2
    assert lmc.run(lmc.backend.batched_async_contains("l1", [keys[2]] + keys)) == 0
    pre = lmc.run(lmc.conn.batched_get_non_blocking("l1", keys))
    assert len(pre) == 2
    for g, r in zip(pre, refs):
        assert torch.equal(g.tensor, r)
    release(*pre)
    # through RemoteBackend too (it passes a transfer spec LMCache ignores for plugins)
    pre = lmc.run(lmc.backend.batched_get_non_blocking("l2", keys))
    assert len(pre) == 2
    release(*pre)
    assert lmc.run(lmc.conn.batched_get_non_blocking("l3", [ckey(99)] + keys)) == []
    # remove_sync: the prefix shrinks to 1
    assert lmc.backend.remove(keys[1]) is True
    assert lmc.backend.batched_contains(keys) == 1
    assert lmc.conn.remove_sync(keys[1]) is False
    lmc.check_no_leaks()


def test_foreign_value_is_a_miss(lmc: Lmc, kvshm_server: ServerProcess) -> None:
    with kvshm.Client(kvshm_server.address) as c:
        c.put(store_key(ckey(0)), b"not a chunk value at all")
    assert lmc.backend.get_blocking(ckey(0)) is None
    assert lmc.backend.batched_get_blocking([ckey(0)]) == [None]
    lmc.check_no_leaks()


def test_full_local_buffer_waits_then_misses(kvshm_server: ServerProcess) -> None:
    """A get that finds no room in LMCache's CPU buffer waits ``alloc_wait`` s, then
    returns a miss (never blocks forever while holding kvshm pins)."""
    with kvshm.Client(kvshm_server.address) as c:
        c.purge()
    m = Lmc(make_config(kvshm_server.address, alloc_wait=0.2))
    try:
        o, ref = m.chunk(1)
        m.put([ckey(0)], [o])
        release(o)
        hog = []
        while True:             # fill the 0.1 GB buffer
            x = m.cpu.memory_allocator.allocate([torch.Size([2, L, CHUNK, H * D])],
                                                [torch.bfloat16], MemoryFormat.KV_2LTD)
            if x is None:
                break
            hog.append(x)
        t0 = time.monotonic()
        assert m.conn.exists_sync(ckey(0))
        assert m.backend.get_blocking(ckey(0)) is None
        assert 0.15 < time.monotonic() - t0 < 3
        release(hog.pop())      # room for one chunk again
        g = m.backend.get_blocking(ckey(0))
        assert g is not None and torch.equal(g.tensor, ref)
        release(g, *hog)
        m.check_no_leaks()
    finally:
        m.close()


def test_server_restart_in_the_middle() -> None:
    srv = ServerProcess(prealloc_size=0.125)
    port = srv.port
    m = Lmc(make_config(srv.address))
    try:
        o, ref = m.chunk(3)
        m.put([ckey(0)], [o])
        g = m.backend.get_blocking(ckey(0))
        assert g is not None and torch.equal(g.tensor, ref)
        release(g)

        stop_server(srv)                             # the server goes away
        t0 = time.monotonic()
        assert m.backend.contains(ckey(0)) is False                   # -> a miss
        assert m.backend.get_blocking(ckey(0)) is None
        assert m.backend.batched_get_blocking([ckey(0)]) == [None]
        assert m.backend.batched_contains([ckey(0)]) == 0
        assert m.run(m.backend.batched_async_contains("x", [ckey(0)])) == 0
        assert m.run(m.backend.batched_get_non_blocking("x", [ckey(0)])) == []
        with pytest.raises(kvshm.ServerUnavailable):
            m.backend.submit_put_task(ckey(1), o).result(10)          # logged by LMCache
        # one timeout (1 s) at most, then the calls fail fast
        assert time.monotonic() - t0 < 5
        assert m.backend.connection is not None

        srv = ServerProcess(prealloc_size=0.125, service_port=port)   # restart, same port
        deadline = time.monotonic() + 15
        while not m.backend.batched_contains([ckey(99)]) == 0 or not m.conn._kv.up:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # the same plugin object works again (the old pool's data is gone)
        deadline = time.monotonic() + 15
        while True:
            try:
                m.backend.submit_put_task(ckey(1), o).result(10)
                break
            except kvshm.ServerUnavailable:
                assert time.monotonic() < deadline, "plugin did not reconnect"
                time.sleep(0.1)
        release(o)
        assert m.backend.contains(ckey(1)) and not m.backend.contains(ckey(0))
        g = m.backend.get_blocking(ckey(1))
        assert g is not None and torch.equal(g.tensor, ref)
        release(g)
        m.check_no_leaks()
    finally:
        m.close()
        stop_server(srv)


def test_plugin_built_before_the_server_starts() -> None:
    """LMCache builds the plugin once and drops it if the constructor raises: it must
    come up without a server and connect later."""
    port = free_port()
    m = Lmc(make_config(f"127.0.0.1:{port}"))
    srv = None
    try:
        assert m.backend.contains(ckey(0)) is False
        srv = ServerProcess(prealloc_size=0.125, service_port=port)
        o, ref = m.chunk(5)
        deadline = time.monotonic() + 15
        while True:
            try:
                m.backend.submit_put_task(ckey(0), o).result(10)
                break
            except kvshm.ServerUnavailable:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        release(o)
        g = m.backend.get_blocking(ckey(0))
        assert g is not None and torch.equal(g.tensor, ref)
        release(g)
    finally:
        m.close()
        if srv is not None:
            stop_server(srv)


def test_unreachable_server_costs_one_short_wait() -> None:
    """No server: the first call probes once (a short HELLO), then every lookup and get
    is a miss at once, the plugin's background probe the only traffic."""
    m = Lmc(make_config(f"127.0.0.1:{free_port()}"))
    try:
        assert m.backend.contains(ckey(0)) is False
        assert not m.conn._kv.up
        for i in range(30):
            assert m.backend.contains(ckey(i)) is False
            assert m.backend.batched_contains([ckey(i), ckey(i + 1)]) == 0
            assert m.backend.get_blocking(ckey(i)) is None
        m.check_no_leaks()
    finally:
        m.close()


def test_adapter_style_and_config_file(kvshm_server: ServerProcess, tmp_path: Any) -> None:
    """The documented YAML loads, in the adapter style with an instance name."""
    cfg_file = tmp_path / "lmcache.yaml"
    cfg_file.write_text(f"""
chunk_size: {CHUNK}
local_cpu: false
max_local_cpu_size: 0.1
remote_serde: naive
remote_storage_plugins: ["kvshm.main"]
extra_config:
  remote_storage_plugin.kvshm.main.module_path: {MODULE}
  remote_storage_plugin.kvshm.main.class_name: KvshmConnectorAdapter
  remote_storage_plugin.kvshm.main.url: {kvshm_server.address}
  remote_storage_plugin.kvshm.main.key_prefix: "main/"
""")
    config = LMCacheEngineConfig.from_file(str(cfg_file))
    m = Lmc(config)
    try:
        assert m.conn.plugin_name == "kvshm.main" and m.conn.key_prefix == "main/"
        o, ref = m.chunk(9)
        m.put([ckey(0)], [o])
        release(o)
        with kvshm.Client(kvshm_server.address) as c:
            assert c.exists(b"main/" + ckey(0).to_string().encode())
        g = m.backend.get_blocking(ckey(0))
        assert torch.equal(g.tensor, ref)
        release(g)
    finally:
        m.close()


def test_env_var_config(kvshm_server: ServerProcess, monkeypatch: Any) -> None:
    """The environment-variable form of docs/INTEGRATIONS.md loads the plugin."""
    import json

    for k, v in {"LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_LOCAL_CPU": "False",
                 "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.1", "LMCACHE_REMOTE_SERDE": "naive",
                 "LMCACHE_REMOTE_STORAGE_PLUGINS": "kvshm",
                 "LMCACHE_EXTRA_CONFIG": json.dumps({
                     "remote_storage_plugin.kvshm.module_path": MODULE,
                     "remote_storage_plugin.kvshm.class_name": "KvshmConnector",
                     "remote_storage_plugin.kvshm.url": kvshm_server.address})}.items():
        monkeypatch.setenv(k, v)
    m = Lmc(LMCacheEngineConfig.from_env())
    try:
        o, ref = m.chunk(11)
        m.put([ckey(42)], [o])
        release(o)
        g = m.backend.get_blocking(ckey(42))
        assert g is not None and torch.equal(g.tensor, ref)
        release(g)
    finally:
        m.close()


def test_engine_store_lookup_retrieve(kvshm_server: ServerProcess) -> None:
    """The full LMCacheEngine (local_cpu off, so every hit comes from kvshm): store ->
    lookup -> retrieve bit-exact, then a hole in the prefix."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class CPUKV(GPUConnectorInterface):   # the fake model's KV cache: [2, L, T, H*D] on CPU
        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            memory_obj.tensor.copy_(kw["kvcaches"][:, :, start:end, :])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            kw["kvcaches"][:, :, start:end, :].copy_(memory_obj.tensor)

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for mo, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(mo, s, e, **kw)

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None,
                           ends: Any = None, **kw: Any) -> None:
            for mo, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(mo, s, e, **kw)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, L, num_tokens, H * D])

    with kvshm.Client(kvshm_server.address) as c:
        c.purge()
    name = "kvshm-engine-test"
    engine = LMCacheEngineBuilder.get_or_create(
        name, make_config(kvshm_server.address), make_metadata(), CPUKV(),
        broadcast_fn=lambda t, src: None, broadcast_object_fn=lambda o, src: o)
    try:
        engine.post_init()
        T = 3 * CHUNK + 100
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 32000, (T,), generator=g)
        kv = torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16)
        engine.store(tokens, kvcaches=kv)
        deadline = time.monotonic() + 15            # remote puts are asynchronous
        while engine.lookup(tokens) != T:
            assert time.monotonic() < deadline, f"lookup {engine.lookup(tokens)} != {T}"
            time.sleep(0.02)
        out = torch.zeros_like(kv)
        mask = engine.retrieve(tokens, kvcaches=out)
        assert int(mask.sum()) == T and torch.equal(out, kv)
        # drop the 2nd chunk from kvshm: only the first chunk is a usable prefix
        chunks = list(engine.token_database.process_tokens(tokens))
        assert len(chunks) == 4          # 3 full chunks and a partial one
        key2 = chunks[1][2]
        assert isinstance(key2, CacheEngineKey)
        with kvshm.Client(kvshm_server.address) as c:
            assert c.delete([store_key(key2)]) == 1
        assert engine.lookup(tokens) == CHUNK
    finally:
        LMCacheEngineBuilder.destroy(name)


def test_prefixes_models_and_tags_never_share_a_key(kvshm_server: ServerProcess) -> None:
    """The key prefix is joined to LMCache's key string with no separator: prefix
    ``lmc/`` with model ``team/llama`` and prefix ``lmc/team/`` with model ``llama``
    made one key, and one plugin read the other's chunk. Prefixes of a name and one
    ``/`` (the default) and plain keys keep today's keys byte for byte."""
    with kvshm.Client(kvshm_server.address) as c:
        c.purge()
    ka = CacheEngineKey("team/llama", 1, 0, 0x5EED, torch.bfloat16)
    kb = CacheEngineKey("llama", 1, 0, 0x5EED, torch.bfloat16)
    a = Lmc(make_config(kvshm_server.address, key_prefix="lmc/"))
    b = Lmc(make_config(kvshm_server.address, key_prefix="lmc/team/"))
    try:
        o, _ = a.chunk(3)
        a.put([ka], [o])
        release(o)
        assert a.backend.contains(ka)
        assert not b.backend.contains(kb)
        assert b.backend.get_blocking(kb) is None
    finally:
        a.close()
        b.close()
    assert store_key(ckey(0)) == b"lmc/" + ckey(0).to_string().encode()      # as before
    assert store_key(ckey(0), "main/") == b"main/" + ckey(0).to_string().encode()
    assert store_key(ka, "lmc/") != store_key(kb, "lmc/team/")
    # LMCache's own string: tags a=x@b%y and a=x, b=y were one
    from kvshm.integrations.lmcache import chunk_field, prefix_field

    assert prefix_field("lmc/team/").count("/") == 1
    t1 = CacheEngineKey(MODEL, 1, 0, 1, torch.bfloat16, {"lmcache.tag.a": "x@b%y"})
    t2 = CacheEngineKey(MODEL, 1, 0, 1, torch.bfloat16,
                        {"lmcache.tag.a": "x", "lmcache.tag.b": "y"})
    assert t1.to_string() == t2.to_string() and chunk_field(t1) != chunk_field(t2)
    assert chunk_field(t2) == t2.to_string()
