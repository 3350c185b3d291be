"""Placement and fan-out: which members a batch goes to, and what to do with the answers.

Every cluster operation is a *plan*: a generator that yields one round of requests,
``{target: Call}`` (one call per member, all sent at once), receives
``{target: result or exception}`` and decides the next round or the result. The plans
know placement, suspects, fallback and metrics, and nothing about threads or event
loops; :class:`kvshm.ClusterClient` runs each round on its member
:class:`~kvshm.Client`\\ s in threads, :class:`kvshm.AsyncClusterClient` on its member
:class:`~kvshm.AsyncClient`\\ s with ``asyncio.gather``: one behaviour, two drivers.

Failure and change, as the reader of a cache wants them (a miss recomputes, an error
stalls the engine):

* a member gone from the view (its lease expired): its keys are misses;
* one :class:`~kvshm.errors.ServerUnavailable` from a member marks it *suspect* for its
  lease's TTL: reads from it are immediate misses, writes go to the next HRW choice;
  so at most one batch waits for the timeout;
* for ``fallback_window`` s after the member list changed, a miss at a key's first
  choice is tried at its second (with HRW the previous owner, after a join) and a hit
  there is copied home to the first choice.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any, Generator, NamedTuple, Sequence

from kvshm._buffers import byte_view
from kvshm.client import Key
from kvshm.cluster.follower import ViewState
from kvshm.cluster.metrics import ClusterMetrics
from kvshm.cluster.placement import Placement
from kvshm.cluster.view import View
from kvshm.errors import ServerUnavailable

__all__ = ["Call", "Fanout", "MemberLeft", "Plan", "key_bytes"]

log = logging.getLogger(__name__)


class Call(NamedTuple):
    """One request of a round: ``client.<method>(*args, **kwargs)``. ``method``
    ``"epoch"`` is the member's server epoch (from its HELLO)."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    bytes_out: int = 0


class MemberLeft(ServerUnavailable):
    """A call whose member left the view (or restarted) while it ran: its client was
    closed under it. The plans take it as the member gone (reads: misses; writes: the
    next choice); it marks no one suspect."""


#: A plan: yields rounds, receives their results, returns the operation's result.
Plan = Generator[dict[str, Call], dict[str, Any], Any]


def key_bytes(k: Key) -> bytes:
    return k.encode() if isinstance(k, str) else bytes(k)


class Fanout:
    """Plans of one cluster client (shared by the sync and async drivers).

    Parameters
    ----------
    state : ViewState
        The follower's view (read at the start of each plan).
    metrics : ClusterMetrics
    stripe, replicas, fallback_window, placement_key
        As :class:`kvshm.ClusterClient`.
    """

    def __init__(self, state: ViewState, metrics: ClusterMetrics, *, stripe: int,
                 replicas: int, fallback_window: float,
                 placement_key: Any = None) -> None:
        self.state = state
        self.m = metrics
        self.stripe = stripe
        self.replicas = replicas
        self.fallback_window = fallback_window
        self.placement_key = placement_key
        self._suspect: dict[str, float] = {}

    # ------------------------------------------------------------------ suspects

    def is_suspect(self, node_id: str) -> bool:
        until = self._suspect.get(node_id)
        if until is None:
            return False
        if time.monotonic() >= until:
            self._suspect.pop(node_id, None)
            return False
        return True

    def mark_suspect(self, node_id: str, exc: BaseException) -> None:
        m = self.state.view.get(node_id)
        ttl = m.ttl if m is not None else 5.0
        self._suspect[node_id] = time.monotonic() + ttl
        self.m.count("suspect_marks")
        self.m.error(node_id)
        log.warning("cluster member %s suspect for %.1f s: %s", node_id, ttl, exc)

    def suspects(self) -> list[str]:
        return [n for n in list(self._suspect) if self.is_suspect(n)]

    def view_changed(self, old: View, new: View) -> list[str]:
        """Forget suspect marks of members gone or back as another instance (new epoch:
        the mark was about the old one); returns the ids of members gone."""
        self.m.count("view_changes")
        for nid in list(self._suspect):
            m, was = new.get(nid), old.get(nid)
            if m is None or (was is not None and m.epoch != was.epoch):
                self._suspect.pop(nid, None)
        return [m.id for m in old.members if new.get(m.id) is None]

    def finished(self, target: str, call: Call, seconds: float,
                 result: Any) -> None:
        """Account one call (drivers call this for every call they ran)."""
        if isinstance(result, MemberLeft):
            self.m.error(target)
        elif isinstance(result, ServerUnavailable):
            if not target.startswith("@"):
                self.mark_suspect(target, result)
        elif not isinstance(result, BaseException):
            self.m.request(target, seconds, call.bytes_out)

    # ------------------------------------------------------------------ placement

    def pkeys(self, keys: Sequence[Key], placement_keys: Sequence[Key] | None
              ) -> list[bytes]:
        if placement_keys is not None:
            if len(placement_keys) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(placement_keys)} placement keys")
            return [key_bytes(k) for k in placement_keys]
        bkeys = [key_bytes(k) for k in keys]
        if self.placement_key is not None:
            return [self.placement_key(k) for k in bkeys]
        return bkeys

    def owners(self, keys: Sequence[Key], placement_keys: Sequence[Key] | None = None
               ) -> list[str | None]:
        return self.state.placement.owner_ids(self.pkeys(keys, placement_keys),
                                              self.stripe)

    def choices(self, pkeys: list[bytes], extra: int = 0) -> tuple[Placement, Any]:
        pl = self.state.placement
        k = min(len(pl), self.replicas + extra + len(self._suspect))
        return pl, (pl.owners(pkeys, self.stripe, max(1, k)) if len(pl) else None)

    # ------------------------------------------------------------------ writes

    def put(self, keys: Sequence[Key], values: Sequence[Any], *, checksum: bool,
            placement_keys: Sequence[Key] | None, depth: int = 0,
            avoid: frozenset[str] = frozenset()) -> Plan:
        """Each value at its owner(s); a write whose owner fails goes to the next HRW
        choice; the first error that could not be routed around is raised. ``avoid``:
        members that failed this write already (not asked again by it, whatever the
        view says meanwhile: one that left and came back is not suspect)."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return None
        pkeys = self.pkeys(keys, placement_keys)
        pl, own = self.choices(pkeys, extra=1 + len(avoid))
        if own is None:
            raise ServerUnavailable("no cluster member is up")
        groups: dict[str, list[int]] = defaultdict(list)
        for i, row in enumerate(own.tolist()):
            placed = 0
            for j in row:
                if j < 0:
                    break
                nid = pl.ids[j]
                if nid in avoid or self.is_suspect(nid):
                    continue
                groups[nid].append(i)
                placed += 1
                if placed == self.replicas:
                    break
            if not placed:
                groups[pl.ids[row[0]]].append(i)    # every choice suspect: try the best
        calls = {}
        for node, idx in groups.items():
            vals = [values[i] for i in idx]
            calls[node] = Call("put_batch", ([keys[i] for i in idx], vals),
                               {"checksum": checksum},
                               sum(byte_view(v).nbytes for v in vals))
        res = yield calls
        errors: list[BaseException] = []
        redo: list[int] = []
        failed = set(avoid)
        for node, r in res.items():
            if isinstance(r, ServerUnavailable):
                redo.extend(groups[node])
                failed.add(node)
            elif isinstance(r, BaseException):
                errors.append(r)
        if redo and depth >= len(pl):
            raise ServerUnavailable(f"no cluster member took the write of {len(redo)} keys")
        if redo:      # the owner just became suspect: its keys go to the next choice
            self.m.count("rerouted_writes", len(redo))
            yield from self.put([keys[i] for i in redo], [values[i] for i in redo],
                                checksum=checksum, placement_keys=[pkeys[i] for i in redo],
                                depth=depth + 1, avoid=frozenset(failed))
        if errors:
            raise errors[0]
        return None

    # ------------------------------------------------------------------ reads

    def get(self, keys: Sequence[Key], *, verify: bool,
            placement_keys: Sequence[Key] | None) -> Plan:
        """Values from their owners (None per miss), one request per owner per round."""
        n = len(keys)
        out: list[bytes | None] = [None] * n
        if not n:
            return out
        pkeys = self.pkeys(keys, placement_keys)
        fallback = time.monotonic() - self.state.changed_at < self.fallback_window
        pl, own = self.choices(pkeys, extra=1)
        if own is None:
            self.m.miss("peer_down", n)
            return out
        # per key: the choices to try, best first, suspects left out (a suspect first
        # choice is a miss there at once; a write made meanwhile went to the next one)
        depth = self.replicas if not fallback else max(2, self.replicas)
        suspect = {nid for nid in pl.ids if self.is_suspect(nid)}
        cands: list[list[str]] = []
        for row in own.tolist():
            c = []
            for rank, j in enumerate(row):
                if j < 0:
                    break
                nid = pl.ids[j]
                if nid in suspect:
                    if rank == 0:
                        self.m.miss("suspect")
                    continue
                c.append(nid)
            cands.append(c[:depth + (1 if row and pl.ids[row[0]] in suspect else 0)])
        todo = list(range(n))
        for rank in range(max((len(c) for c in cands), default=0)):
            groups: dict[str, list[int]] = defaultdict(list)
            for i in todo:
                if rank < len(cands[i]):
                    groups[cands[i][rank]].append(i)
            if not groups:
                break
            res = yield {node: Call("get_batch", ([keys[i] for i in idx],),
                                    {"verify": verify})
                         for node, idx in groups.items()}
            hits: list[int] = []
            for node, r in res.items():
                idx = groups[node]
                if isinstance(r, BaseException):
                    if not isinstance(r, ServerUnavailable):
                        raise r
                    if rank == 0:
                        self.m.miss("peer_down", len(idx))
                    continue
                nbytes = 0
                for i, v in zip(idx, r):
                    if v is not None:
                        out[i] = v
                        nbytes += len(v)
                        hits.append(i)
                    elif rank == 0:
                        self.m.miss("absent")
                self.m.bytes_in(node, nbytes)
            if rank > 0 and hits:
                self.m.count("fallback_hits", len(hits))
                if fallback:
                    yield from self._copy_home(
                        pl, [(i, pl.ids.index(cands[i][0])) for i in hits
                             if own[i, 0] >= 0 and pl.ids[own[i, 0]] == cands[i][0]],
                        keys, out)
            todo = [i for i in todo if out[i] is None]
            if not todo:
                break
        return out

    def _copy_home(self, pl: Placement, items: list[tuple[int, int]], keys: Sequence[Key],
                   out: list[Any]) -> Plan:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, j in items:
            if j >= 0 and not self.is_suspect(pl.ids[j]):
                groups[pl.ids[j]].append(i)
        if not groups:
            return None
        res = yield {node: Call("put_batch", ([keys[i] for i in idx], [out[i] for i in idx]),
                                {}, sum(len(out[i]) for i in idx))
                     for node, idx in groups.items()}
        for node, r in res.items():
            if isinstance(r, BaseException):
                log.debug("copy home to %s failed: %s", node, r)
            else:
                self.m.count("fallback_copies", len(groups[node]))
        return None

    def exists(self, keys: Sequence[Key], *, placement_keys: Sequence[Key] | None
               ) -> Plan:
        """Whether each key is stored at its first owner (suspect or gone: False)."""
        n = len(keys)
        if not n:
            return []
        pkeys = self.pkeys(keys, placement_keys)
        pl, own = self.choices(pkeys)
        found = [False] * n
        if own is None:
            return found
        groups: dict[str, list[int]] = defaultdict(list)
        for i, j in enumerate(own[:, 0].tolist()):
            if not self.is_suspect(pl.ids[j]):
                groups[pl.ids[j]].append(i)
        if not groups:
            return found
        res = yield {node: Call("exists_batch", ([keys[i] for i in idx],))
                     for node, idx in groups.items()}
        for node, r in res.items():
            if isinstance(r, BaseException):
                if not isinstance(r, ServerUnavailable):
                    raise r
                continue
            for i, f in zip(groups[node], r):
                found[i] = f
        return found

    def match_prefix(self, keys: Sequence[Key], *,
                     placement_keys: Sequence[Key] | None) -> Plan:
        """How many leading keys the cluster holds (at their owners)."""
        found = yield from self.exists(keys, placement_keys=placement_keys)
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    def delete(self, keys: Key | Sequence[Key]) -> Plan:
        """Remove keys from every up member that may hold them (their owners and, in
        the fallback window, second choices). Returns entries removed."""
        if isinstance(keys, (str, bytes)):
            keys = [keys]
        pkeys = self.pkeys(keys, None)
        pl, own = self.choices(pkeys, extra=1)
        if own is None:
            return 0
        groups: dict[str, set[int]] = defaultdict(set)
        for i, row in enumerate(own.tolist()):
            for j in row:
                if j >= 0 and not self.is_suspect(pl.ids[j]):
                    groups[pl.ids[j]].add(i)
        if not groups:
            return 0
        res = yield {node: Call("delete", ([keys[i] for i in sorted(s)],))
                     for node, s in groups.items()}
        return sum(r for r in res.values() if isinstance(r, int))
