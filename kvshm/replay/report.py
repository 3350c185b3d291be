"""What a replay reports: :class:`ReplayResult`, the human-readable summary
(:func:`format_summary`) and the plot (:func:`plot`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvshm.replay.options import GiB
from kvshm.replay.runner import KEEP_FIRST, Share
from kvshm.replay.workload import Workload

__all__ = ["ReplayResult", "summarize", "format_summary", "plot"]


@dataclass
class ReplayResult:
    """A finished replay: ``summary`` (what ``--json`` prints) and per-request series
    for plots, in completion order."""

    summary: dict[str, Any]
    series: dict[str, Any]

    @property
    def ok(self) -> bool:
        """No mismatch and no error."""
        return not (self.summary["mismatches"] or self.summary["errors"])


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _expectation(one_block: bool, clients: int, tier: bool) -> str:
    if not one_block:
        return ("not expected to be equal (equality is expected only in the one-block "
                "mode): values of other sizes than a block, batches, fragmentation")
    if clients > 1:
        return ("close, not equal: one-block mode, but K clients run neighbouring requests "
                "at once")
    if tier:
        return ("close, not equal: one-block mode, but the SSD tier keeps its own LRU "
                "(pool + tier is not one exact LRU); compare the pool evictions")
    return ("equal: one-block mode, one client (the same keys and sizes as the exact LRU, "
            "one block each)")


def summarize(run: dict[str, Any], wl: Workload, nkeys: Sequence[int], last: Sequence[int],
              shares: Sequence[Share], refs: dict[str, Any],
              counts: dict[str, int | None]) -> ReplayResult:
    """Merge what the clients measured (``shares``) with the reference caches (``refs``,
    over all requests, indexed by trace request) into a :class:`ReplayResult`.

    Hit rates are by keys (entries: blocks in one-block mode, chunks otherwise) and by
    bytes of values. The store's hits are leading keys read and verified; what
    ``match_prefix`` found but could not be read is ``lost``, counted apart.
    """
    import numpy as np

    def cat(name: str, dtype: Any) -> "np.ndarray":
        return np.concatenate([np.asarray(getattr(s, name), dtype=dtype) for s in shares])

    index = cat("index", np.int64)
    matched = cat("matched", np.int64)
    hits_r = cat("hits", np.int64)
    hit_bytes_r = cat("hit_bytes", np.int64)
    nblocks = cat("blocks", np.int64)
    req_bytes = cat("req_bytes", np.int64)
    moved = cat("moved", np.int64)
    latency = cat("latency", np.float64)
    t_end = cat("t_end", np.float64)
    order = np.argsort(t_end, kind="stable")
    skew = int(np.abs(index[order] - np.arange(len(index))).max()) if len(index) else 0
    seconds = run["seconds"]
    k = run["clients"]
    # Keys and bytes asked, over the requests replayed (a failed request asked them too).
    nk = np.asarray(nkeys, dtype=np.int64)
    ls = np.asarray(last, dtype=np.int64)
    blocks = int(nk[index].sum())
    total_bytes = int(sum(wl.prefix_bytes(int(nk[i]), int(ls[i]), int(nk[i])) for i in index))
    hits = int(hits_r.sum())
    tot = {f: sum(getattr(s, f) for s in shares)
           for f in ("bytes_read", "bytes_written", "blocks_read", "lost", "mismatches",
                     "errors")}
    good = latency[~np.isnan(latency)]
    lat_ms = good * 1e3

    def rates(sim: Any) -> tuple[float, float]:
        per = sim.per_request
        h = sum(per[i] for i in index)
        hb = sum(wl.prefix_bytes(int(nk[i]), int(ls[i]), per[i]) for i in index)
        return (h / blocks if blocks else 0.0, hb / total_bytes if total_bytes else 0.0)

    lru, bound = refs["lru"], refs["bound"]
    lru_rate, lru_brate = rates(lru)
    lru_hits = int(sum(lru.per_request[i] for i in index))
    bound_rate, bound_brate = rates(bound)
    blk = refs.get("lru_blocks")
    blk_rate, blk_brate = rates(blk) if blk is not None else (None, None)
    pool_ref = refs.get("lru_pool")
    # Like with like: the store's pool evictions beside an LRU of the pool's capacity
    # charged as the store charges; with a tier, what left the cache (both tiers)
    # beside an LRU of pool + tier.
    cache_ref = blk if blk is not None else lru
    lru_evictions = (pool_ref if pool_ref is not None else cache_ref).evictions
    summary: dict[str, Any] = {
        "backend": run["backend"],
        "transport": run["transport"],
        "clients": k,
        "split": "round-robin: request i to client i % clients" if k > 1 else "one client",
        "window": run["window"],
        "paced_seconds": sum(s.paced_s for s in shares),
        "max_order_skew": skew,
        "trace": run["trace"],
        "mode": "one-block" if wl.one_block else "chunks",
        "chunk_tokens": wl.chunk_tokens,
        "workload": wl.describe(),
        "lru_equal_expected": (wl.one_block and k == 1 and not run["ssd_bytes"]
                               and not run.get("capacity_note")),
        "lru_expected": (_expectation(wl.one_block, k, bool(run["ssd_bytes"]))
                         if not run.get("capacity_note") else
                         "not expected to be equal: a peer store with its own capacity and "
                         "eviction (see capacity!)"),
        "requests": len(index),
        "requests_asked": run["requests_asked"],
        "blocks": blocks,
        "bytes": total_bytes,
        "hits": hits,
        "hit_bytes": int(hit_bytes_r.sum()),
        "matched": int(matched.sum()),
        "hit_rate": hits / blocks if blocks else 0.0,
        "byte_hit_rate": int(hit_bytes_r.sum()) / total_bytes if total_bytes else 0.0,
        "lru_hits": lru_hits,
        "lru_hit_rate": lru_rate,
        "lru_byte_hit_rate": lru_brate,
        "lru_capacity": refs["lru_capacity"],
        "lru_blocks_hit_rate": blk_rate,
        "lru_blocks_byte_hit_rate": blk_brate,
        "bound_hit_rate": bound_rate,
        "bound_byte_hit_rate": bound_brate,
        "lost": tot["lost"],
        "blocks_read": tot["blocks_read"],
        "mismatches": tot["mismatches"],
        "errors": tot["errors"],
        "bytes_read": tot["bytes_read"],
        "bytes_written": tot["bytes_written"],
        "seconds": seconds,
        "gbps": (tot["bytes_read"] + tot["bytes_written"]) / seconds / 1e9,
        "requests_per_s": len(index) / seconds,
        "p50_ms": float(np.percentile(lat_ms, 50)) if len(lat_ms) else None,
        "p99_ms": float(np.percentile(lat_ms, 99)) if len(lat_ms) else None,
        "evictions": counts["evictions"],
        "lru_evictions": lru_evictions,
        "dropped": counts["dropped"],
        "lru_dropped": cache_ref.evictions if pool_ref is not None else None,
        "block_bytes": run["block_bytes"],
        "entry_bytes": wl.entry_bytes,
        "block_size": run["block_size"],
        "capacity_bytes": run["capacity_bytes"],
        "pool_bytes": run["pool_bytes"],
        "ssd_bytes": run["ssd_bytes"],
        "capacity_blocks": run["capacity_bytes"] // run["block_size"],
        "address": run["address"],
        "read_path": run.get("read_path"),
        "capacity_note": run.get("capacity_note"),
        "refused": run.get("refused"),
        "first_errors": [e for s in shares for e in s.first_errors][:KEEP_FIRST],
        "first_mismatches": [e for s in shares for e in s.first_mismatches][:KEEP_FIRST],
        "gave_up": next((s.gave_up for s in shares if s.gave_up), None),
    }
    series = {
        "index": index[order], "matched": matched[order], "hits": hits_r[order],
        "blocks": nblocks[order], "bytes": req_bytes[order], "moved": moved[order],
        "t_end": t_end[order] - run["t_go"],
        "lru": np.asarray(lru.per_request, dtype=np.int64)[index[order]],
        "bound": np.asarray(bound.per_request, dtype=np.int64)[index[order]],
    }
    return ReplayResult(summary, series)


def verdict(s: dict[str, Any]) -> str:
    """Whether the store agreed with the exact LRU, in counts (a hit rate equal to two
    decimals may hide a difference): hits and evictions of each, and, where equality is
    expected (one-block mode, one client, no tier, kvshm), "equal as expected" or
    "NOT equal (expected equal)"."""
    hits, ref = s["hits"], s.get("lru_hits")
    if ref is None:
        return "exact LRU hits not known"
    ev, ref_ev = s["evictions"], s["lru_evictions"]
    same = hits == ref and (ev is None or ev == ref_ev)
    text = (f"{hits} hits vs exact LRU {ref} ({hits - ref:+d})"
            + ("" if ev is None else f", {ev} evictions vs {ref_ev} ({ev - ref_ev:+d})"))
    if ev == 0 and ref_ev == 0:
        text += ("; nothing was evicted (the capacity never filled), so the store, the exact "
                 "LRU and the bound agree by construction: a larger run or a smaller pool "
                 "tests eviction")
    if not s.get("lru_equal_expected"):
        return text + " (equality not expected here)"
    return text + (": equal as expected" if same else ": NOT equal (expected equal)")


def format_summary(s: dict[str, Any]) -> str:
    """The human-readable summary of a replay."""
    pct = lambda v: f"{100 * v:.2f} %"  # noqa: E731
    who = f"{s['backend']} ({s['transport']})"
    peer_note = s.get("capacity_note")
    one = s["mode"] == "one-block"
    what = (f"{s['blocks']} blocks of {s['block_bytes']} bytes" if one else
            f"{s['blocks']} chunks of {s['chunk_tokens']} tokens ({s['entry_bytes']} bytes "
            f"each, the last of a request partial; {s['block_bytes']} bytes per 512 tokens)")
    lines = [
        f"kvshm replay: {s['requests']} requests, {what}, backend {who}, {s['clients']} "
        f"client{'s' if s['clients'] > 1 else ''}"
        + (f" ({s['split']})" if s["clients"] > 1 else ""),
        f"  capacity   {s['capacity_bytes'] / GiB:.4g} GiB = {s['capacity_blocks']} blocks "
        f"(block size {s['block_size']} bytes"
        + (f"; pool {s['pool_bytes'] / GiB:.4g} GiB + SSD tier {s['ssd_bytes'] / GiB:.4g} GiB"
           if s["ssd_bytes"] else "") + ")",
        f"  hit rate   {pct(s['hit_rate'])}   exact LRU {pct(s['lru_hit_rate'])}   "
        f"unbounded (bound) {pct(s['bound_hit_rate'])}   (of {'blocks' if one else 'chunks'})",
        f"  by bytes   {pct(s['byte_hit_rate'])}   exact LRU {pct(s['lru_byte_hit_rate'])}   "
        f"unbounded (bound) {pct(s['bound_byte_hit_rate'])}",
        f"  exact LRU  of equal capacity ({s['lru_capacity']})"
        + ("" if s["lru_blocks_hit_rate"] is None else
           f"; charged whole blocks as the store is: {pct(s['lru_blocks_hit_rate'])}, "
           f"{pct(s['lru_blocks_byte_hit_rate'])} by bytes"),
        f"  expected   store vs exact LRU: {s['lru_expected']}",
        f"  evictions  "
        + ("not reported by this store" if s["evictions"] is None else str(s["evictions"]))
        + f" (exact LRU {s['lru_evictions']})"
        + (" from the pool, each with the pool's capacity" if s["ssd_bytes"] else ""),
    ]
    lines.append("  verdict    " + verdict(s))
    if s.get("read_path"):
        lines.insert(1, f"  read path  {s['read_path']}")
    if peer_note:
        lines.insert(2, f"  capacity!  {peer_note}")
    if s.get("refused") is not None:
        r = s["refused"]
        lines.append(f"  refused    {r['writes']} writes the store refused (not stored)"
                     + (f", codes {r['codes']}" if r["codes"] else ""))
    if s["dropped"] is not None:
        lines.append(f"  dropped    {s['dropped']} left the cache (pool and SSD tier; exact "
                     f"LRU of pool + SSD capacity: {s['lru_dropped']})")
    lines += [
        f"  checked    {s['blocks_read']} {'blocks' if one else 'chunks'} read, "
        f"{s['mismatches']} mismatches, {s['errors']} errors; a hit is read and verified"
        + (f"; {s['lost']} matched but lost before the read (not hits)" if s["lost"] else ""),
        f"  moved      {_gb(s['bytes_read'])} read + {_gb(s['bytes_written'])} written in "
        f"{s['seconds']:.2f} s = {s['gbps']:.2f} GB/s ({s['requests_per_s']:.0f} requests/s)",
        (f"  latency    p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms per request"
         if s["p50_ms"] is not None else "  latency    n/a (no request succeeded)"),
    ]
    if s["clients"] > 1:
        pacing = (f"window {s['window']} requests, {s['paced_seconds']:.2f} s spent waiting "
                  "(all clients)" if s["window"] else "no window: clients run free")
        lines.append(f"  order      requests finished at most {s['max_order_skew']} places "
                     f"from trace order; {pacing}")
    for e in s["first_mismatches"]:
        lines.append(f"  MISMATCH   {e}")
    for e in s["first_errors"]:
        lines.append(f"  ERROR      {e}")
    if s["gave_up"]:
        lines.append(f"  STOPPED    {s['gave_up']}")
    return "\n".join(lines)


def plot(path: str, r: ReplayResult) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s, ser = r.summary, r.series
    n = len(ser["index"])
    windows = max(1, min(100, n // 10 or 1))
    edges = np.linspace(0, n, windows + 1).astype(int)
    x, hr, lru, bound, gbps = [], [], [], [], []
    for a, b in zip(edges[:-1], edges[1:]):
        if b <= a:
            continue
        blk = max(int(ser["blocks"][a:b].sum()), 1)
        x.append(b)
        hr.append(100 * ser["hits"][a:b].sum() / blk)
        lru.append(100 * ser["lru"][a:b].sum() / blk)
        bound.append(100 * ser["bound"][a:b].sum() / blk)
        t0 = ser["t_end"][a - 1] if a > 0 else 0.0
        dt = max(float(ser["t_end"][b - 1] - t0), 1e-9)
        gbps.append(ser["moved"][a:b].sum() / dt / 1e9)
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    ax1.plot(x, hr, label=f"{s['backend']} ({100 * s['hit_rate']:.1f} %)")
    ax1.plot(x, lru, label=f"exact LRU ({100 * s['lru_hit_rate']:.1f} %)", linestyle=":")
    ax1.plot(x, bound, label=f"unbounded ({100 * s['bound_hit_rate']:.1f} %)",
             linestyle="--", alpha=0.7)
    ax1.set_ylabel("prefix hit rate (%)")
    ax1.legend(loc="best", fontsize="small")
    ax1.grid(alpha=0.3)
    ax1.set_title(f"kvshm replay: {s['backend']} ({s['transport']}), {s['clients']} "
                  f"client(s), {s['block_bytes']} B blocks, {s['capacity_blocks']} blocks")
    ax2.plot(x, gbps, color="tab:green")
    ax2.set_ylabel("throughput (GB/s)")
    ax2.set_xlabel("requests completed")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
