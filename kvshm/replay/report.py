"""What a replay reports: :class:`ReplayResult`, the human-readable summary
(:func:`format_summary`) and the plot (:func:`plot`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvshm.replay.options import GiB

__all__ = ["ReplayResult", "format_summary", "plot"]


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


def format_summary(s: dict[str, Any]) -> str:
    """The human-readable summary of a replay."""
    pct = lambda v: f"{100 * v:.2f} %"  # noqa: E731
    who = f"{s['backend']} ({s['transport']})"
    lines = [
        f"kvshm replay: {s['requests']} requests, {s['blocks']} blocks of {s['block_bytes']} "
        f"bytes, backend {who}, {s['clients']} client{'s' if s['clients'] > 1 else ''}"
        + (f" ({s['split']})" if s["clients"] > 1 else ""),
        f"  capacity   {s['capacity_bytes'] / GiB:.4g} GiB = {s['capacity_blocks']} blocks "
        f"(block size {s['block_size']} bytes)",
        f"  hit rate   {pct(s['hit_rate'])}   exact LRU {pct(s['lru_hit_rate'])}   "
        f"unbounded (bound) {pct(s['bound_hit_rate'])}",
        f"  evictions  {s['evictions']} (exact LRU {s['lru_evictions']})",
        f"  checked    {s['blocks_read']} blocks read, {s['mismatches']} mismatches, "
        f"{s['errors']} errors" + (f", {s['lost']} lost between match and read"
                                    if s["lost"] else ""),
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
        hr.append(100 * ser["matched"][a:b].sum() / blk)
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
