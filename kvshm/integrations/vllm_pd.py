"""vLLM prefill/decode disaggregation through kvshm (``KVConnectorBase_V1``, vLLM 0.32).

The prefill engine writes each request's KV layer by layer into *its own host's* kvshm
server while the model computes (shared memory on the same host), and hands the location
over in the request's ``kv_transfer_params``; the decode engine reads it from that
server (TCP, or RDMA where both sides have it) layer by layer while its forward pass
runs, checks every value's checksum, and unpins it. No patch to vLLM: the class is
loaded by module path::

    # prefill engine (next to its kvshm server)
    --kv-transfer-config '{"kv_connector": "KvshmPDConnector",
        "kv_connector_module_path": "kvshm.integrations.vllm_pd",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"url": "127.0.0.1:12345",
                                      "advertise": "10.0.0.5:12345"}}'
    # decode engine (anywhere that reaches the prefill host's service port)
    --kv-transfer-config '{"kv_connector": "KvshmPDConnector",
        "kv_connector_module_path": "kvshm.integrations.vllm_pd",
        "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"stores": ["10.0.0.5:12345"]}}'

Request flow (vLLM's P/D convention, as its NIXL connector uses it): the proxy sends the
prompt to the prefill engine with ``kv_transfer_params={"do_remote_decode": true}`` and
``max_tokens=1``; the prefill's output carries ``kv_transfer_params`` =
``{"do_remote_prefill": true, "kvshm_pd": {...}}`` (the handoff record, below); the proxy
sends the same prompt with those parameters to the decode engine.

Prefill side
    ``build_connector_meta`` tells the workers which full blocks of each such request are
    complete after this step; ``save_kv_layer`` gathers that layer's blocks and hands
    them to a writer thread (the copy into the pool overlaps the next layers' compute);
    ``wait_for_save`` waits for the step's writes (so freeing the blocks need not wait:
    ``request_finished`` returns ``False``). ``request_finished`` pins every key of the
    request with one server-held handoff pin (``Client.pin``, :mod:`kvshm.handoff`) for
    ``pin_ttl`` seconds and returns the record. A write that failed, or keys evicted
    before the pin, shorten the handoff to the leading blocks all of whose keys are
    there; a store that is down gives no record (the decode recomputes). A request
    that finished aborted, with an error or ignored gives no record, pins nothing, and
    its keys are deleted. The record carries a digest of the handed-off prompt.

Decode side
    ``get_num_new_matched_tokens`` checks the record against this engine (block size,
    layers, TP size, page bytes, dtype) and renews the pin on the prefill's store for
    ``load_ttl`` s, on a helper thread (waited for at most :data:`ASK_WAIT`; vLLM asks again
    next step while it runs): an expired or unknown pin, another server epoch (restarted store) or
    an unreachable store (one probe of at most ``probe_timeout`` s, then immediate
    misses while it stays down, :class:`~kvshm.integrations._common.ResilientClient`)
    is a miss: 0 tokens, vLLM computes the prompt itself. Otherwise it offers the full
    blocks of the prompt but the last token. ``start_load_kv`` starts one reader thread
    that fetches layer after layer (``get_batch_into(..., verify=True)``: every value's
    xxh64 is checked); ``wait_for_layer_load`` waits for its layer and copies it into the
    paged KV cache. A failure during the load (store gone, checksum mismatch, wrong
    size) reports the request's blocks through ``get_block_ids_with_load_errors``: with
    ``kv_load_failure_policy: recompute`` vLLM recomputes them (its default, ``fail``,
    ends the request with an error). After the last layer the reader unpins the handoff
    and deletes its keys.

Trust: the record comes with the request; the decode bounds it by the prompt, checks it
against a digest of the prompt it was made for (token ids, cache salt, LoRA, multimodal
inputs: a record sent with another prompt is a miss) and checks every value, but reads
from the store it names unless ``stores`` lists the allowed ones: only a trusted proxy
should set ``kv_transfer_params``.

Keys: ``{key_prefix}|{uid}|tp{rank}of{size}|{layer name}|{block index}``, one value per
(layer, block, TP rank): the block's ``[H, N, C]`` KV (vLLM's logical per-layer view
``[blocks, heads, tokens, content]``; one block of the block manager is several kernel
blocks when the attention backend splits it), ``uid`` unique per request and engine
(``{engine id}.{request id}.{random}``, each id free of ``|``: ``_common.key_field``).

Options (``kv_connector_extra_config``):

``url``
    This engine's kvshm server, where the prefill writes (default ``127.0.0.1:12345``).
``advertise``
    ``host:port`` the decode engines reach that server at (default: the cluster's
    advertised address when the server is a cluster member, else ``url``).
``transport``
    Write transport on the prefill (default ``auto``: shared memory on the same host).
``remote_transport``
    Read transport on the decode (default ``auto``: RDMA when both ends have it, else TCP;
    shared memory when the prefill's store is on the same host); ``tcp`` forces TCP.
``pin_ttl``, ``load_ttl``
    Seconds the handoff is held for a decode (default 60), and to what a decode renews it
    when it takes the request (default 30); at most 600.
``timeout``, ``retry_interval``, ``probe_timeout``, ``lookup_timeout``
    Seconds per reply of a read or write (default 5), between probes of a store that did
    not answer (1), a probe's wait (0.5), and per reply of the scheduler's pin, renew
    (0.5: a store that died since the last call costs a request that long, once; then
    its requests miss at once while it stays down).
``verify``
    Write checksums and check them on every read (default true).
``delete_after_read``
    Delete the keys after a complete read (default true; else they stay cached,
    unpinned, until evicted).
``key_prefix``
    First key field (default ``vllmpd``).
``stores``
    Decode: the prefill stores (``host:port``, as their records name them) it may read
    from; a record naming another is a miss, and nothing connects there (its HELLO would
    carry this engine's door token). Default: any store (a warning at start-up).
``token_file``
    The door token file of the stores this engine talks to (default: a same-host store's
    own, or ``$KVSHM_TOKEN_FILE``). A decode on another host than its prefill's store
    needs that store's token (``kvshm serve --token-file``/``--door-token-file``) or CURVE.

Limits (refused at start-up with ValueError): one KV cache group (no hybrid models),
pipeline parallel size 1. Never run here on a GPU: the gather/scatter of blocks is the
same torch code for CUDA tensors (the ``.to()`` to and from host memory is synchronous),
tested on CPU only.
"""

from __future__ import annotations

import array
import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvshm.errors import KvshmError
from kvshm.handoff import Handoff, check_ttl
from kvshm.integrations._common import ResilientClient, as_bool, key_field, normalize_address

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvshmPDConnector", "PDMetadata", "RECORD_KEY", "DEFAULTS"]

log = logging.getLogger(__name__)

#: Name of the handoff record in ``kv_transfer_params``.
RECORD_KEY = "kvshm_pd"
#: Version of the record's layout.
RECORD_VERSION = 1
#: ``RequestStatus`` names of a finished request that no decode will take over.
_NO_HANDOFF = frozenset(("FINISHED_ABORTED", "FINISHED_ERROR", "FINISHED_IGNORED"))
#: Seconds the scheduler waits for a pin's renewal before it lets vLLM ask again next
#: step (a renewal is one round trip: well under this on a working network).
ASK_WAIT = 0.02

DEFAULTS: dict[str, Any] = {
    "url": "127.0.0.1:12345", "advertise": "", "transport": "auto",
    "remote_transport": "auto", "pin_ttl": 60.0, "load_ttl": 30.0, "timeout": 5.0,
    "retry_interval": 1.0, "probe_timeout": 0.5, "lookup_timeout": 0.5, "verify": True,
    "delete_after_read": True, "key_prefix": "vllmpd", "token_file": "", "stores": None,
}


def _store_address(a: Any) -> str:
    """A store address as the decode compares it (``kvshm://``/``tcp://`` dropped);
    ValueError unless ``host:port``."""
    if not isinstance(a, str):
        raise ValueError(f"a store address must be 'host:port', got {a!r}")
    s = normalize_address(a)
    if s.startswith("tcp://"):
        s = s[len("tcp://"):]
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a store address must be 'host:port', got {a!r}")
    return s


def _parse_stores(v: Any) -> frozenset[str] | None:
    """The ``stores`` option: None (any store) or the set of allowed addresses."""
    if v is None or v == "*" or v == ["*"]:
        return None
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"KvshmPDConnector: stores must be a list of 'host:port' (or "
                         f"'*'), got {v!r}")
    return frozenset(_store_address(a) for a in v)


def _key(prefix: str, uid: str, rank: int, tp: int, layer: str, block: int) -> bytes:
    return f"{prefix}|{uid}|tp{rank}of{tp}|{layer}|{block}".encode()


def _layers_digest(names: list[str]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def _prompt_digest(request: "Request", ntokens: int) -> str | None:
    """What the KV of a request's first ``ntokens`` prompt tokens depends on besides the
    model: the token ids, the cache salt, the LoRA adapter, and the multimodal inputs
    placed among them (vLLM's own prefix-cache key, less its per-process hash seed).
    None when the request has no token ids (prompt embeddings) or fewer tokens."""
    toks = request.prompt_token_ids
    if toks is None or ntokens <= 0 or len(toks) < ntokens:
        return None
    h = hashlib.sha256(b"kvshm-pd-prompt\0")
    h.update(array.array("q", toks[:ntokens]).tobytes())
    h.update(b"\0salt\0" + str(getattr(request, "cache_salt", None) or "").encode())
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        h.update(b"\0lora\0" + f"{lora.lora_name}\0{getattr(lora, 'lora_path', '')}"
                 .encode())
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        if int(pos.offset) < ntokens:
            h.update(f"\0mm\0{f.identifier}\0{int(pos.offset)}\0{int(pos.length)}".encode())
    return h.hexdigest()[:32]


# --------------------------------------------------------------------------- metadata


@dataclass
class _Save:
    """Blocks ``first .. first + len(block_ids) - 1`` of a request to write this step."""

    uid: str
    first: int
    block_ids: list[int]


@dataclass
class _Load:
    """What a decode worker reads for one request this step."""

    req_id: str
    uid: str
    address: str
    epoch: int
    pin: int
    first: int                 # index of the first block read
    block_ids: list[int]       # this engine's blocks they go into
    count: int                 # keys in the handoff (for the unpin/delete)
    blocks: int                # blocks in the handoff


@dataclass
class PDMetadata(KVConnectorMetadata):
    """Scheduler -> workers, per step: writes (prefill) and reads (decode)."""

    saves: list[_Save] = field(default_factory=list)
    loads: list[_Load] = field(default_factory=list)


@dataclass
class _Producing:
    uid: str
    prompt_len: int
    block_ids: list[int]
    saved: int = 0             # leading blocks handed to the workers so far


@dataclass
class _Offer:
    """A decode's look at a request's record (cached: the scheduler asks repeatedly)."""

    tokens: int                # tokens the record covers that this engine can take
    record: dict[str, Any] | None
    reason: str
    local: int = -1            # num_computed_tokens when the offer was taken


# --------------------------------------------------------------------------- connector


class KvshmPDConnector(KVConnectorBase_V1):
    """vLLM KV connector: prefill -> kvshm (its host) -> decode. See the module docstring.

    Parameters are vLLM's (``vllm_config``, ``role``, ``kv_cache_config``); options come
    from ``kv_transfer_config.kv_connector_extra_config`` (:data:`DEFAULTS`).

    Raises
    ------
    ValueError
        A bad option, more than one KV cache group, or pipeline parallel size > 1.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"KvshmPDConnector: unknown options {unknown}; known: "
                             f"{sorted(DEFAULTS)}")
        o = {k: extra.get(k, v) for k, v in DEFAULTS.items()}
        self.url = normalize_address(str(o["url"]))
        self.advertise = str(o["advertise"] or "")
        self.transport = str(o["transport"])
        self.remote_transport = str(o["remote_transport"])
        self.pin_ttl = check_ttl(float(o["pin_ttl"]))
        self.load_ttl = check_ttl(float(o["load_ttl"]))
        self.timeout = float(o["timeout"])
        self.retry_interval = float(o["retry_interval"])
        self.probe_timeout = float(o["probe_timeout"])
        self.lookup_timeout = float(o["lookup_timeout"])
        self.verify = as_bool(o["verify"])
        self.delete_after_read = as_bool(o["delete_after_read"])
        self.prefix = str(o["key_prefix"])
        self.token_file = str(o["token_file"] or "") or None
        self.stores = _parse_stores(o["stores"])
        if "|" in self.prefix or not self.prefix:
            raise ValueError(f"KvshmPDConnector: key_prefix {self.prefix!r} must be "
                             "non-empty without '|'")
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) != 1:
            raise ValueError(f"KvshmPDConnector handles one KV cache group; this model has "
                             f"{len(groups)} (hybrid models are not supported)")
        pc = vllm_config.parallel_config
        if int(pc.pipeline_parallel_size) != 1:
            raise ValueError("KvshmPDConnector: pipeline parallel size must be 1")
        self.tp = int(pc.tensor_parallel_size)
        self.block_size = int(vllm_config.cache_config.block_size)
        spec = groups[0].kv_cache_spec
        self.layers = list(groups[0].layer_names)
        self.page_bytes = int(spec.page_size_bytes)
        self.dtype = str(getattr(spec, "dtype", ""))
        self.engine_id = str(ktc.engine_id or "")
        self.producer = bool(ktc.is_kv_producer)
        self.consumer = bool(ktc.is_kv_consumer)
        self._clients: dict[str, ResilientClient] = {}
        self._clients_lock = threading.Lock()
        self._stats: dict[str, Any] = {
            "handoffs": 0, "handoff_blocks": 0, "handoff_short": 0, "handoff_none": 0,
            "offers": 0, "offered_tokens": 0, "misses": {},
            "saved_blocks": 0, "saved_bytes": 0, "save_errors": 0,
            "loads": {}, "load_failures": 0, "loaded_blocks": 0, "loaded_bytes": 0,
        }
        if role == KVConnectorRole.SCHEDULER:
            self._producing: dict[str, _Producing] = {}
            self._offers: dict[str, _Offer] = {}
            self._pending_loads: list[_Load] = []
            self._asking: dict[str, concurrent.futures.Future[_Offer]] = {}
            self._askers = concurrent.futures.ThreadPoolExecutor(
                4, thread_name_prefix="kvshm-pd-ask")
            if self.consumer and self.stores is None:
                log.warning("KvshmPDConnector: no 'stores' given: a decode reads from "
                            "whatever store a request's record names (and sends it this "
                            "engine's door token); list the prefill stores in 'stores'")
            if self.consumer and ktc.kv_load_failure_policy != "recompute":
                log.warning("KvshmPDConnector: kv_load_failure_policy is %r: a load that "
                            "fails after its check (the prefill's store died during it) "
                            "ends the request with an error; 'recompute' recomputes it",
                            ktc.kv_load_failure_policy)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = int(get_tensor_model_parallel_rank())
            self._kv: dict[str, torch.Tensor] = {}
            self._writer = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="kvshm-pd-write")
            self._reader = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="kvshm-pd-read")
            self._step_writes: list[concurrent.futures.Future[None]] = []
            self._step_loads: list[tuple[_Load, dict[str, concurrent.futures.Future[Any]],
                                         threading.Event, set[str]]] = []
            self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ shared

    def _client(self, address: str, transport: str,
                timeout: float | None = None) -> ResilientClient:
        timeout = self.timeout if timeout is None else timeout
        key = f"{transport}|{timeout}|{address}"
        with self._clients_lock:
            c = self._clients.get(key)
            if c is None:
                if len(self._clients) >= 64:          # many prefill hosts: keep the recent
                    old = next(iter(self._clients))
                    self._clients.pop(old).close()
                c = self._clients[key] = ResilientClient(
                    address, transport=transport, timeout=timeout,
                    retry_interval=self.retry_interval, probe_timeout=self.probe_timeout,
                    label=f"vLLM P/D kvshm ({self._role.name.lower()})",
                    token_file=self.token_file)
            return c

    def _keys(self, uid: str, blocks: range, rank: int | None = None) -> list[bytes]:
        ranks = range(self.tp) if rank is None else (rank,)
        return [_key(self.prefix, uid, r, self.tp, layer, b)
                for r in ranks for layer in self.layers for b in blocks]

    def stats(self) -> dict[str, Any]:
        """Counters of this side (a copy): scheduler: handoffs made, offers and misses
        by reason; worker: blocks and bytes saved and loaded, failures, and per request
        loaded ``{req_id: {"tokens", "bytes", "seconds"}}``."""
        import copy

        return copy.deepcopy(self._stats)

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self._writer.shutdown(wait=True)
            self._reader.shutdown(wait=True)
        else:
            self._askers.shutdown(wait=False, cancel_futures=True)
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = dict(kv_caches)

    def _rows(self, kv_layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
        """Rows of ``kv_layer`` (dim 0: kernel blocks) holding manager blocks
        ``block_ids`` (one manager block = ``block_size // kernel block`` rows)."""
        per = max(1, self.block_size // int(kv_layer.shape[2])) if kv_layer.dim() >= 3 else 1
        rows = [b * per + j for b in block_ids for j in range(per)]
        return torch.tensor(rows, dtype=torch.long, device=kv_layer.device)

    @staticmethod
    def _block_views(host: torch.Tensor, nblocks: int) -> list[Any]:
        flat = host.view(torch.uint8).numpy().reshape(nblocks, -1)
        return [flat[i] for i in range(nblocks)]

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PDMetadata) or not meta.saves:
            return
        for s in meta.saves:
            # the gather runs here, in the forward's order; the copy into the pool and
            # the checksum run in the writer thread while the next layers compute
            staged = kv_layer.index_select(0, self._rows(kv_layer, s.block_ids))
            if staged.device.type != "cpu":
                staged = staged.to("cpu")
            keys = [_key(self.prefix, s.uid, self.rank, self.tp, layer_name, s.first + i)
                    for i in range(len(s.block_ids))]
            self._step_writes.append(self._writer.submit(self._write, keys, staged))

    def _write(self, keys: list[bytes], staged: torch.Tensor) -> None:
        views = self._block_views(staged, len(keys))
        try:
            self._client(self.url, self.transport).call(
                lambda c: c.put_batch(keys, views, checksum=self.verify))
        except Exception as exc:     # noqa: BLE001 - a save must never fail the forward
            # the scheduler's pin finds the gap and shortens (or drops) the handoff
            self._stats["save_errors"] += 1
            log.warning("KvshmPDConnector: writing %d blocks (first %r) failed: %s",
                        len(keys), keys[0], exc, exc_info=not isinstance(exc, KvshmError))
            return
        self._stats["saved_blocks"] += len(keys)
        self._stats["saved_bytes"] += sum(v.nbytes for v in views)

    def wait_for_save(self) -> None:
        writes, self._step_writes = self._step_writes, []
        for f in writes:
            f.result()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PDMetadata) or not meta.loads:
            return
        t0 = time.monotonic()
        loads: list[tuple[_Load, dict[str, concurrent.futures.Future[Any]],
                          threading.Event, set[str]]] = [
            (ld, {}, threading.Event(), set()) for ld in meta.loads]
        for layer in self.layers:      # in forward order: the reader runs ahead of it
            for ld, futs, failed, _copied in loads:
                futs[layer] = self._reader.submit(self._read_layer, ld, layer, failed)
        for ld, _futs, failed, _copied in loads:
            self._reader.submit(self._finish_load, ld, failed, t0)
        self._step_loads.extend(loads)

    def _read_layer(self, ld: _Load, layer: str, failed: threading.Event) -> Any:
        if failed.is_set():
            return None
        kv = self._kv[layer]
        rows = self._rows(kv, ld.block_ids)
        host = torch.empty((len(rows),) + tuple(kv.shape[1:]), dtype=kv.dtype, device="cpu")
        views = self._block_views(host, len(ld.block_ids))
        keys = [_key(self.prefix, ld.uid, self.rank, self.tp, layer, ld.first + i)
                for i in range(len(ld.block_ids))]

        def read(c: Any) -> list[int]:
            if not c.server_info:
                c.ping()
            if int(c.server_info.get("epoch", 0)) != ld.epoch:   # another server now
                return [-1] * len(keys)
            return c.get_batch_into(keys, views, verify=self.verify)  # type: ignore[no-any-return]

        try:
            sizes = self._client(ld.address, self.remote_transport).call(read)
        except Exception as exc:     # noqa: BLE001 - a value of another size raises
            # ValueError: whatever the store holds, a load error, never the forward's
            log.warning("KvshmPDConnector: reading layer %s of request %s from %s failed "
                        "(%s); its blocks are recomputed", layer, ld.req_id, ld.address, exc,
                        exc_info=not isinstance(exc, (KvshmError, ValueError)))
            failed.set()
            return None
        want = views[0].nbytes
        if any(s != want for s in sizes):
            log.warning("KvshmPDConnector: request %s layer %s: %d of %d values missing or "
                        "of another size at %s; its blocks are recomputed", ld.req_id, layer,
                        sum(s != want for s in sizes), len(sizes), ld.address)
            failed.set()
            return None
        return host, rows

    def _finish_load(self, ld: _Load, failed: threading.Event, t0: float) -> None:
        ok = not failed.is_set()
        per_block = self.page_bytes * len(self.layers)
        if ok:
            self._stats["loaded_blocks"] += len(ld.block_ids) * len(self.layers)
            self._stats["loaded_bytes"] += len(ld.block_ids) * per_block
            self._stats["loads"][ld.req_id] = {
                "tokens": len(ld.block_ids) * self.block_size,
                "bytes": len(ld.block_ids) * per_block, "seconds": time.monotonic() - t0}
        else:
            self._stats["load_failures"] += 1
        # rank 0 drops the pin (one for all ranks); each rank deletes its own keys
        try:
            rc = self._client(ld.address, self.remote_transport)
            if self.rank == 0:
                rc.call(lambda c: c.unpin(ld.pin))
            if ok and self.delete_after_read:
                mine = self._keys(ld.uid, range(ld.blocks), self.rank)
                rc.call(lambda c: c.delete(mine))
        except Exception as exc:     # noqa: BLE001 - the pin expires by itself
            log.info("KvshmPDConnector: unpin of request %s at %s: %s", ld.req_id,
                     ld.address, exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for ld, futs, failed, copied in self._step_loads:
            f = futs.get(layer_name)
            if f is None:
                continue
            got = f.result()
            if got is None or failed.is_set():
                self._load_errors.update(ld.block_ids)
                continue
            host, rows = got
            kv = self._kv[layer_name]
            kv.index_copy_(0, rows, host.to(kv.device))
            copied.add(layer_name)

    def get_block_ids_with_load_errors(self) -> set[int]:
        loads, self._step_loads = self._step_loads, []
        for ld, futs, failed, copied in loads:
            for f in futs.values():
                f.result()
            # a layer the forward did not wait for was never copied in: not loaded
            if failed.is_set() or len(copied) != len(futs):
                self._load_errors.update(ld.block_ids)
        errs, self._load_errors = self._load_errors, set()
        return errs

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True         # layer-wise loads and saves run between the graph's pieces

    # ============================================================== scheduler side

    # ---- decode

    def _offer(self, request: "Request") -> _Offer:
        params = request.kv_transfer_params
        rec = params.get(RECORD_KEY) if isinstance(params, dict) \
            and params.get("do_remote_prefill") else None
        if rec is None:
            return _Offer(0, None, "no record")
        try:
            if not isinstance(rec, dict) or rec.get("v") != RECORD_VERSION:
                raise ValueError("record version "
                                 f"{rec.get('v') if isinstance(rec, dict) else rec!r}")
            h = Handoff.from_dict(rec["handoff"])
            mine = {"block_size": self.block_size, "tp": self.tp,
                    "layers": _layers_digest(self.layers), "page_bytes": self.page_bytes,
                    "dtype": self.dtype}
            other = {k: rec.get(k) for k in mine}
            if other != mine:
                return _Offer(0, None, f"record of another engine layout: {other} here "
                                       f"{mine}")
            blocks, uid = rec["blocks"], rec["uid"]
            # a client can send any record: bound it by this prompt before building keys
            most = -(-int(request.num_prompt_tokens) // self.block_size)
            if type(blocks) is not int or not 0 < blocks <= most:
                raise ValueError(f"blocks {blocks!r} for a prompt of at most {most}")
            if not isinstance(uid, str) or "|" in uid:
                raise ValueError(f"uid {uid!r}")
            if h.count != blocks * len(self.layers) * self.tp \
                    or h.first_key != _key(self.prefix, uid, 0, self.tp, self.layers[0], 0):
                raise ValueError("keys do not match the record")
        except (KeyError, TypeError, ValueError) as exc:
            return _Offer(0, None, f"bad record: {exc}")
        # the KV is of the prompt the prefill computed: a record sent with another prompt
        # (a mix-up, a replay, a hostile client) would load the KV of other tokens
        mine_digest = _prompt_digest(request, blocks * self.block_size)
        if mine_digest is None or rec.get("tokens") != mine_digest:
            return _Offer(0, None, "record of another prompt (tokens, cache salt, LoRA or "
                                   "multimodal inputs differ)")
        if self.stores is not None:
            try:
                allowed = _store_address(h.address) in self.stores
            except ValueError:
                allowed = False
            if not allowed:       # never connect there: HELLO would carry the door token
                return _Offer(0, None, f"store not allowed: {h.address!r} is not in "
                                       "'stores'")
        if h.expired:
            return _Offer(0, None, "pin expired")
        try:
            rc = self._client(normalize_address(h.address), "tcp", self.lookup_timeout)
            deadline = rc.call(lambda c: c.renew(h, self.load_ttl))
        except KvshmError as exc:
            return _Offer(0, None, f"prefill store unreachable: {exc}")
        if deadline is None:
            return _Offer(0, None, "pin gone (expired, unpinned or the store restarted)")
        usable = min(blocks * self.block_size,
                     (max(request.num_prompt_tokens - 1, 0) // self.block_size)
                     * self.block_size)
        return _Offer(usable, dict(rec, _blocks=blocks, _uid=uid, _handoff=h), "hit")

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.consumer:
            return 0, False
        rid = request.request_id
        o = self._offers.get(rid)
        if o is None:
            params = request.kv_transfer_params
            if not (isinstance(params, dict) and params.get("do_remote_prefill")
                    and RECORD_KEY in params):
                o = self._offers[rid] = _Offer(0, None, "no record")
            else:
                # the pin's renewal is a round trip to the prefill's store: never on the
                # scheduler's thread (a store that just died would hold every request up
                # for a timeout); vLLM asks again next step while it is under way
                f = self._asking.get(rid)
                if f is None:
                    f = self._asking[rid] = self._askers.submit(self._offer, request)
                try:
                    o = f.result(timeout=ASK_WAIT)
                except concurrent.futures.TimeoutError:
                    return None, False
                del self._asking[rid]
                self._offers[rid] = o
                if o.record is not None:
                    self._stats["offers"] += 1
                else:
                    why = o.reason.split(":")[0]
                    self._stats["misses"][why] = self._stats["misses"].get(why, 0) + 1
                    log.warning("KvshmPDConnector: request %s recomputes its prompt: %s",
                                rid, o.reason)
        o.local = num_computed_tokens
        return max(0, o.tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or not self.consumer:
            return
        o = self._offers.get(request.request_id)
        if o is None or o.record is None:
            return
        first = o.local // self.block_size
        n = num_external_tokens // self.block_size
        ids = list(blocks.get_block_ids()[0])[first:first + n]
        h: Handoff = o.record["_handoff"]
        self._stats["offered_tokens"] += n * self.block_size
        self._pending_loads.append(_Load(
            req_id=request.request_id, uid=o.record["_uid"],
            address=normalize_address(h.address), epoch=h.epoch, pin=h.pin, first=first,
            block_ids=ids, count=h.count, blocks=o.record["_blocks"]))
        # taken once: the load drops the pin and the keys, so a request that asks again
        # (preempted and resumed) computes the prompt itself
        self._offers[request.request_id] = _Offer(0, None, "taken")

    # ---- prefill

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = PDMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.producer:
            return meta
        for nr in scheduler_output.scheduled_new_reqs:
            params = (nr.sampling_params.extra_args or {}).get("kv_transfer_params") \
                if nr.sampling_params is not None else None
            if not (isinstance(params, dict) and params.get("do_remote_decode")):
                continue
            # no "|" in the uid (a key field; a decode refuses a uid with one): an id
            # holding one (vLLM takes a client's X-Request-Id) is written escaped
            uid = (f"{key_field(str(self.engine_id))}.{key_field(str(nr.req_id))}."
                   f"{os.urandom(6).hex()}")
            self._producing[nr.req_id] = _Producing(uid, len(nr.prompt_token_ids or ()),
                                                    list(nr.block_ids[0]))
            self._plan(meta, nr.req_id, nr.num_computed_tokens,
                       scheduler_output.num_scheduled_tokens.get(nr.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            p = self._producing.get(rid)
            if p is None:
                continue
            new = cached.new_block_ids[i]
            if new is not None:
                if rid in cached.resumed_req_ids:
                    p.block_ids = list(new[0])
                else:
                    p.block_ids.extend(new[0])
            self._plan(meta, rid, cached.num_computed_tokens[i],
                       scheduler_output.num_scheduled_tokens.get(rid, 0))
        return meta

    def _plan(self, meta: PDMetadata, rid: str, computed: int, scheduled: int) -> None:
        p = self._producing[rid]
        full = min(computed + scheduled, p.prompt_len) // self.block_size
        full = min(full, len(p.block_ids))
        if full > p.saved:
            meta.saves.append(_Save(p.uid, p.saved, p.block_ids[p.saved:full]))
            p.saved = full

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        o = self._offers.pop(request.request_id, None)
        self._asking.pop(request.request_id, None)
        if o is not None and o.record is not None:
            # offered (its pin renewed to load_ttl) but never loaded: aborted before its
            # blocks were allocated; no one else takes it: let it go now
            self._askers.submit(self._release, o.record)
        p = self._producing.pop(request.request_id, None) if self.producer else None
        if p is None or p.saved == 0:
            return False, None
        if str(getattr(request, "status", "")) in _NO_HANDOFF:
            # aborted (the client is gone) or failed: no decode will come for it; pin
            # nothing and drop what was written, off the scheduler's thread
            self._stats["handoff_none"] += 1
            self._askers.submit(self._drop_keys, p)
            return False, None
        # every write of this request finished in its step's wait_for_save: the blocks
        # can be freed now, whatever the pin finds
        rec = self._handoff(p, request)
        if rec is None:
            self._stats["handoff_none"] += 1
            return False, None
        return False, {"do_remote_prefill": True, "do_remote_decode": False,
                       RECORD_KEY: rec}

    def _release(self, rec: dict[str, Any]) -> None:
        h: Handoff = rec["_handoff"]
        keys = self._keys(rec["_uid"], range(rec["_blocks"]))
        try:
            rc = self._client(normalize_address(h.address), "tcp", self.lookup_timeout)
            rc.call(lambda c: c.unpin(h))
            if self.delete_after_read:
                rc.call(lambda c: c.delete(keys))
        except KvshmError as exc:      # the pin expires by itself
            log.info("KvshmPDConnector: releasing the handoff of %s: %s", rec["_uid"], exc)

    def _drop_keys(self, p: _Producing) -> None:
        keys = self._keys(p.uid, range(p.saved))
        try:
            self._client(self.url, "tcp", self.lookup_timeout).call(lambda c: c.delete(keys))
        except KvshmError as exc:      # they stay cached, unpinned, until evicted
            log.info("KvshmPDConnector: deleting the keys of %s: %s", p.uid, exc)

    def _handoff(self, p: _Producing, request: "Request") -> dict[str, Any] | None:
        rc = self._client(self.url, "tcp", self.lookup_timeout)
        blocks = p.saved
        while blocks > 0:
            keys = self._keys(p.uid, range(blocks))
            try:
                h = rc.call(lambda c: c.pin(keys, self.pin_ttl))
            except KvshmError as exc:
                missing = getattr(exc, "missing", None)
                if not missing:
                    log.warning("KvshmPDConnector: no handoff for %s: %s", p.uid, exc)
                    return None
                gone = {int(k.rsplit(b"|", 1)[1]) for k in missing}
                blocks = min(gone)          # the leading blocks all of whose keys are there
                self._stats["handoff_short"] += 1
                continue
            digest = _prompt_digest(request, blocks * self.block_size)
            if digest is None:
                log.warning("KvshmPDConnector: no handoff for %s: no prompt token ids",
                            p.uid)
                rc.call(lambda c: c.unpin(h))
                return None
            address = self.advertise or h.address
            compact = dataclasses.replace(h, address=address, keys=(), first_key=keys[0],
                                          count=len(keys))
            self._stats["handoffs"] += 1
            self._stats["handoff_blocks"] += blocks
            return {"v": RECORD_VERSION, "handoff": compact.to_dict(), "uid": p.uid,
                    "blocks": blocks, "block_size": self.block_size, "tp": self.tp,
                    "layers": _layers_digest(self.layers), "page_bytes": self.page_bytes,
                    "dtype": self.dtype, "tokens": digest}
        return None

