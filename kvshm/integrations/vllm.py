"""kvshm as a secondary tier of vLLM's offloading connector (written against vLLM 0.33.0).

vLLM's ``OffloadingConnector`` with the ``TieringOffloadingSpec`` keeps a CPU primary tier
(a shared memory region its GPU workers copy KV chunks into and out of) and cascades chunks
to *secondary tiers* loaded by module path. ``KvshmTier`` is such a tier: it moves bytes
between the primary tier's chunk rows and the kvshm pool, one copy each way. No patch to
vLLM::

    vllm serve MODEL --kv-transfer-config '{
      "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KvshmTier",
                             "module_path": "kvshm.integrations.vllm",
                             "url": "127.0.0.1:12345"}]}}'

Tier options (keys of the tier's dict; vLLM passes them to the constructor):

``url``
    kvshm server: ``host:port``, ``tcp://host:port`` or ``kvshm://host:port``. Default
    ``127.0.0.1:12345``.
``transport``
    ``auto`` (default), ``shm``, ``tcp``, ``rdma``.
``timeout``, ``retry_interval``
    Seconds to wait for one reply (default 5); seconds during which calls fail at once
    after the server did not answer (default 1).
``key_prefix``
    First field of every key (default ``vllm``).
``lookup``
    ``"async"`` (default): a lookup answers RETRY and asks kvshm in the background, one
    batch per scheduler step (vLLM's ``AsyncLookupManager``, as its fs tier does); tier
    calls never wait on the server. ``"sync"``: one EXISTS round trip per lookup (about
    0.1 ms on the same host), answered in the same step.
``threads``
    Threads that copy (default 2).
``skip_existing``
    A store asks which chunks kvshm already holds and copies only the others (default
    true).

Keys
    ``{prefix}|{model}|{dtype}|{parallel}|{layout}|c{blocks_per_chunk}x{tokens_per_hash}|
    r{row bytes}|{OffloadKey hex}``. vLLM's OffloadKey (block hash + group index) covers the
    token prefix only; a primary row holds the chunk for *all* workers of the engine, laid
    out worker by worker, so the key names the parallel layout (``tp..pp..pcp..dcp..``,
    always, also when vLLM calls the layout parallelism-agnostic: such rows still differ
    byte for byte between TP sizes) rather than a rank. Engines of another parallel layout
    never share chunks. Where that form would be longer than the shared-memory index
    publishes (``kvshm._shmindex.KEY_MAX``, 152 bytes; a model given by a long path), the
    model field is ``%h`` + the base32 of its 16-byte BLAKE2b and the OffloadKey is in
    unpadded base64url (``_common.compact_fields``): same-host lookups stay lock-free.
    A prefix, dtype or layout holding ``|`` is written escaped (``_common.key_field``:
    ``%~`` + its percent-encoding), so no two configurations share a key.

Values
    One kvshm entry per chunk: the primary row's bytes as they are (``block_size_bytes``).
    A stored value of another size is a miss.

Failures
    While the server is down, stores and loads report failure (vLLM drops the store and
    recomputes what it could not load), lookups report MISS; the same tier works again
    after the server restarts.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Collection, Iterable
from typing import Any, ClassVar
from urllib.parse import quote

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvshm.errors import KvshmError
from kvshm.integrations._common import (
    ResilientClient,
    as_bool,
    compact_fields,
    compact_key,
    key_field,
    layout_field,
)

__all__ = ["KvshmTier"]

#: Bytes of a vLLM OffloadKey: a 32-byte block hash and a 4-byte group index
#: (vllm.v1.kv_offload.base.make_offload_key).
OFFLOAD_KEY_BYTES = 36

log = logging.getLogger(__name__)


class _KvshmLookups(AsyncLookupManager):
    """vLLM's async lookup state machine; the background batch is one EXISTS."""

    def __init__(self, tier: "KvshmTier", tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        t = self._tier
        bkeys = [t.store_key(k) for k in keys]
        try:
            return t._kv.call(lambda c: c.exists_batch(bkeys))  # type: ignore[no-any-return]
        except KvshmError as exc:       # server down: misses, at once (see ResilientClient)
            log.debug("kvshm lookup failed: %s", exc)
            return [False] * len(bkeys)


class KvshmTier(SecondaryTierManager):
    """vLLM ``SecondaryTierManager`` backed by a kvshm server (see the module docstring).

    Built by vLLM's ``SecondaryTierFactory`` as ``KvshmTier(offloading_spec=...,
    primary_kv_view=..., tier_type=..., backpressure_detector=..., **tier_options)``.
    Every method runs in the scheduler process under the tiering manager's lock and
    returns at once; copies run on the tier's threads.
    """

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, url: str = "127.0.0.1:12345",
                 transport: str = "auto", timeout: float = 5.0,
                 retry_interval: float = 1.0, key_prefix: str = "vllm",
                 lookup: str = "async", threads: int = 2, skip_existing: Any = True,
                 locality: Any = None, **unknown: Any) -> None:
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view,
                         tier_type=tier_type, backpressure_detector=backpressure_detector)
        if unknown:
            log.warning("KvshmTier: ignoring unknown options %s", sorted(unknown))
        if lookup not in ("async", "sync"):
            raise ValueError(f"KvshmTier lookup must be 'async' or 'sync', got {lookup!r}")
        self._kv = ResilientClient(url, transport=transport, timeout=float(timeout),
                                   retry_interval=float(retry_interval),
                                   label=f"vLLM tier {tier_type}")
        self.namespace = self._namespace(offloading_spec.config, key_prefix)
        self.skip_existing = as_bool(skip_existing)
        self._stride = self.block_size_bytes
        self._flat = primary_kv_view.cast("B")
        self._num_rows = self._flat.nbytes // self._stride
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, int(threads)), thread_name_prefix="kvshm-vllm-tier")
        self._done: list[JobResult] = []
        self._done_lock = threading.Lock()
        self._inflight = 0
        self._idle = threading.Condition(self._done_lock)
        self._load_keys: dict[int, list[OffloadKey]] = {}
        self._lookups = _KvshmLookups(self, tier_type) if lookup == "async" else None
        self._closed = False
        log.info("kvshm vLLM tier %s: server %s, namespace %s, %s lookups", tier_type,
                 self._kv.address, self.namespace, lookup)

    # ------------------------------------------------------------------ keys

    def _namespace(self, cfg: Any, prefix: str) -> str:
        # The parallel layout is always in the key. vLLM's is_parallelism_agnostic says
        # that a block's data concatenated across workers in rank order is the same
        # under any topology; a primary row is not that: it holds worker 0's slot (all
        # of its layers, its share of the heads), then worker 1's, so a TP=1 row and a
        # TP=2 row of the same tokens differ byte for byte (measured: 0 of 54 equal).
        # Even canonical rows are only certified per layer in the worker processes,
        # after this namespace is fixed; sharing across topologies would be a claim
        # nothing here checked.
        par = cfg.parallel
        parallel = f"tp{par.tp_size}pp{par.pp_size}pcp{par.pcp_size}dcp{par.dcp_size}"
        # (layout_field: a layout named "X+canonical" is not X with canonical rows)
        layout = layout_field(cfg.kv_cache_layout or "default", bool(cfg.canonical_layout),
                              bool(cfg.replicated_layout))
        # every field free of "|" (key_field: as it is unless it holds one): two
        # configurations never share a key, and today's keys stay as they were
        parts = [key_field(prefix), quote(cfg.model.name, safe=""),
                 key_field(str(cfg.model.dtype)), parallel, layout,
                 f"c{cfg.cache.blocks_per_chunk}x{cfg.cache.tokens_per_hash}",
                 f"r{self.block_size_bytes}"]
        ns, self._hex_keys = compact_fields(parts, 1, OFFLOAD_KEY_BYTES)
        self._ns = ns.encode()
        return ns

    def store_key(self, key: OffloadKey) -> bytes:
        """The kvshm key of a vLLM OffloadKey (see the module docstring, Keys)."""
        return compact_key(self._ns, self._hex_keys, bytes(key))

    def _rows(self, chunk_ids: Any) -> list[memoryview]:
        s = self._stride
        out = []
        for c in chunk_ids:
            c = int(c)
            if not 0 <= c < self._num_rows:
                raise IndexError(f"chunk id {c} outside the primary tier's {self._num_rows}")
            out.append(self._flat[c * s:(c + 1) * s])
        return out

    # ------------------------------------------------------------------ lookups

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._lookups is not None:
            r = self._lookups.lookup(key, req_context)
            if r is None:
                return LookupResult.RETRY
            return LookupResult.HIT if r else LookupResult.MISS
        k = self.store_key(key)
        try:
            return LookupResult.HIT if self._kv.call(lambda c: c.exists(k)) \
                else LookupResult.MISS
        except KvshmError as exc:
            log.debug("kvshm lookup failed: %s", exc)
            return LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._lookups is not None:
            self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._lookups is not None:
            self._lookups.flush()

    # ------------------------------------------------------------------ jobs

    def _submit(self, fn: Any, job: TransferJob) -> None:
        with self._done_lock:
            self._inflight += 1
        try:
            self._pool.submit(self._run, fn, job)
        except RuntimeError:             # shut down
            self._finish(JobResult(job_id=job.job_id, success=False))

    def _finish(self, result: JobResult) -> None:
        with self._done_lock:
            self._done.append(result)
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.notify_all()

    def _run(self, fn: Any, job: TransferJob) -> None:
        t0 = time.monotonic()
        try:
            result = fn(job)
        except Exception as exc:                      # a kvshm or copy failure
            log.warning("kvshm vLLM tier: job %d (%d chunks) failed: %s", job.job_id,
                        len(job.keys), exc)
            result = JobResult(job_id=job.job_id, success=False)
        result.transfer_time = time.monotonic() - t0
        self._finish(result)

    def _store(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        bkeys = [self.store_key(k) for k in keys]
        rows = self._rows(job.chunk_ids)
        todo = list(range(len(keys)))
        if self.skip_existing and todo:
            found = self._kv.call(lambda c: c.exists_batch(bkeys))
            todo = [i for i in todo if not found[i]]
        if todo:
            try:
                self._kv.call(lambda c: c.put_batch([bkeys[i] for i in todo],
                                                    [rows[i] for i in todo]))
            except KvshmError as exc:
                failed = getattr(exc, "failed", None)
                if failed is None:
                    raise
                log.warning("kvshm vLLM tier: %d of %d chunks not stored: %s",
                            len(failed), len(todo), exc)
                return JobResult(job_id=job.job_id, success=False,
                                 transfer_bytes=(len(todo) - len(failed)) * self._stride)
        return JobResult(job_id=job.job_id, success=True,
                         transfer_bytes=len(todo) * self._stride)

    def _load(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        bkeys = [self.store_key(k) for k in keys]
        rows = self._rows(job.chunk_ids)
        try:
            sizes = self._kv.call(lambda c: c.get_batch_into(bkeys, rows))
        except ValueError as exc:     # a stored value larger than a row
            log.warning("kvshm vLLM tier: %s", exc)
            sizes = [-1] * len(keys)
        ok = [k for k, n in zip(keys, sizes) if n == self._stride]
        if len(ok) == len(keys):
            return JobResult(job_id=job.job_id, success=True,
                             transfer_bytes=len(ok) * self._stride)
        bad = [n for n in sizes if n not in (-1, self._stride)]
        if bad:
            log.warning("kvshm vLLM tier: %d chunks hold %s bytes, not %d (another "
                        "model or layout?)", len(bad), sorted(set(bad)), self._stride)
        return JobResult(job_id=job.job_id, success=False,
                         successful_keys=tuple(ok) if ok else None,
                         transfer_bytes=len(ok) * self._stride)

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue a copy primary rows -> kvshm (chunks kvshm holds are skipped)."""
        self._submit(self._store, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue a copy kvshm -> primary rows."""
        self._load_keys[job_metadata.job_id] = list(job_metadata.keys)
        self._submit(self._load, job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._done_lock:
            done, self._done = self._done, []
        for r in done:
            keys = self._load_keys.pop(r.job_id, None)
            if keys is not None and not r.success and self._lookups is not None:
                # keys that did not load are misses from now on (vLLM's fs tier does
                # the same: a cached HIT would have the scheduler promote them forever)
                good = set(r.successful_keys or ())
                self._lookups.mark_miss([k for k in keys if k not in good])
        return done

    def has_pending_work(self) -> bool:
        with self._done_lock:
            return self._inflight > 0 or bool(self._done)

    def drain_jobs(self) -> None:
        """Wait until every submitted job finished (each copy is bounded by the client
        timeout; none is cut short)."""
        with self._idle:
            while self._inflight:
                self._idle.wait()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        if self._lookups is not None:
            self._lookups.shutdown()
        self._kv.close()
        self._flat.release()
