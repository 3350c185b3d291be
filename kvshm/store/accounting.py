"""Accounting of the store (mixed into :class:`kvshm.store.Store`): per-principal
budgets of blocks queued in replies, gauges, counters and the accounting check."""

from __future__ import annotations

from typing import Any, Sequence

from kvshm.index import Entry
from kvshm.store.parts import _StoreParts
from kvshm.store.sessions import _ALLOC, Session


class _Accounting(_StoreParts):
    """Budgets, counters and :meth:`stats`."""

    def _limit_blocks(self, nbytes: int) -> int:
        return max(1, nbytes // self.block_size) if nbytes else 0

    def send_budget(self, session: Session) -> int | None:
        """Blocks ``session``'s principal may still hold in GET replies not yet sent
        (None: no limit); LOOKUP pins count against the same limit."""
        limit = self._limit_blocks(self.config.max_client_pinned_bytes)
        if not limit:
            return None
        q = session.quota
        return max(0, limit - q.pinned - q.sending)

    def sending(self, session: Session, nblocks: int) -> None:
        """``nblocks`` of a GET reply to ``session`` are queued, not yet sent (zero-copy
        pins, or the server's copy): counted against its principal until :meth:`sent`."""
        session.quota.sending += nblocks
        session.sending += nblocks

    def sent(self, session: Session, nblocks: int, entries: Sequence[Entry] = ()) -> None:
        """A GET reply left (or was dropped): unpin its zero-copy ``entries`` and stop
        counting its ``nblocks``."""
        session.quota.sending -= nblocks
        session.sending -= nblocks
        for e in entries:
            self._unpin(e)

    @property
    def used_bytes(self) -> int:
        return self.alloc.num_used * self.block_size

    def stats(self, verify: bool = False) -> dict[str, Any]:
        """Counters and gauges. ``verify`` adds an accounting check (O(entries)).

        Keys (all ints unless noted): used_bytes, capacity_bytes, num_keys, pending,
        pinned (entries with a pin), pins (total pins), dead (replaced but still
        pinned), block_size, num_blocks, free_blocks, largest_free_run (blocks),
        usage (float 0..1), clients (principals holding blocks), sessions (open),
        grants, held_grants (lease run out, client alive) and the counters: hits, misses,
        evictions, evicted_bytes, bytes_in, bytes_out, puts, gets, commits, aborts,
        lease_expired_writes, lease_expired_pins, deletes, purged, pool_full, too_large,
        invalid_keys, quota_refusals, replaced_early, alloc_evictions (evictions made to
        place an ALLOC or PUT), free_blocks_at_evictions (free blocks summed over those
        evictions: space that fragmentation kept from use), fragmented_evictions (those
        made while the free blocks were as many as the value needed), split_values
        (values placed in several runs), relocations and relocated_bytes (live entries
        moved to join free space for a value, :meth:`_compact`), compactions_failed
        (attempts that found no window to clear). With ``verify``: entry_blocks (blocks held by live,
        pending, dead and promoting entries, counted one by one) and accounting_ok
        (entry_blocks == used blocks). ``pins`` includes the pins of spill writes in
        flight and of parked reads.

        With a shared index (same-host lock-free reads, kvshm.localread): ``shared_index``
        = {live, tombstones, slots, unpublished, rebuilds, skipped_records, reads_applied};
        lock-free reads are not in hits/gets (reads_applied counts those that reached the
        LRU), and with ``verify`` accounting_ok also needs every live key in the table or
        counted as unpublished.

        With a tier: ``tiers`` = {"pool": {...}, "ssd": {...}}, per tier entries, bytes,
        hits, spills, promotions, drops, checksum_failures and more (docs/SSD.md); with
        ``verify`` the SSD tier adds its own accounting_ok.
        """
        a = self.alloc
        s: dict[str, Any] = {
            "used_bytes": a.num_used * self.block_size,
            "capacity_bytes": self.pool.size,
            "num_keys": len(self.index),
            "pending": self._pending,
            "pinned": self._pinned_entries,
            "pins": self._pins,
            "dead": len(self._dead),
            "block_size": self.block_size,
            "num_blocks": a.num_blocks,
            "free_blocks": a.num_free,
            "largest_free_run": a.largest_free_run,
            "usage": a.num_used / a.num_blocks,
            "clients": sum(1 for q in self._quotas.values()
                           if q.pending or q.pinned or q.sending),
            "sessions": len(self._sessions),
            "grants": self._ngrants,
            "held_grants": self._held,
        }
        s.update(self.counters)
        if self.index.shared is not None:     # same-host lock-free reads (kvshm.localread)
            s["shared_index"] = self.index.shared.stats()
        if verify:
            blocks = sum(e.nblocks for e in self.index.lru())
            blocks += sum(e.nblocks for sess in self._sessions.values()
                          for g in sess.grants.values() if g.kind == _ALLOC
                          for e in g.entries[g.done:])
            blocks += sum(e.nblocks for e in self._dead)
            blocks += sum(p.entry.nblocks for p in self._promoting.values())
            if self.reservations is not None:
                blocks += self.reservations.blocks
            s["entry_blocks"] = blocks
            s["accounting_ok"] = blocks == a.num_used
            t = self.index.shared
            if t is not None and t.live + t.unpublished != len(self.index):
                s["accounting_ok"] = False
        if self.reservations is not None:      # kvshm.store.reserve
            s["reservations"] = self.reservations.stats(verify)
            if verify and not s["reservations"]["accounting_ok"]:
                s["accounting_ok"] = False
        if self.tier is not None:
            tc = self.tier_counters
            ssd = self.tier.stats(verify)
            ssd["hits"] = tc["ssd_hits"]
            s["tiers"] = {
                "pool": {"entries": len(self.index), "bytes": s["used_bytes"],
                         "hits": s["hits"] - tc["ssd_hits"], "spills": tc["demotions"],
                         "promotions": tc["promotions"], "drops": tc["dropped"],
                         "dropped_bytes": tc["dropped_bytes"], "checksum_failures": 0,
                         "dirty": len(self._dirty), "promoting": len(self._promoting)},
                "ssd": ssd,
            }
        return s
