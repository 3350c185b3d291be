"""The stores a replay drives, behind one small interface: ``match(keys)`` (leading keys
held), ``read_into(keys, outs)`` (sizes, -1 for a miss), ``write(keys, values)``,
``counts()`` (evictions), ``delete(keys)``, ``close()``.

:class:`KvshmBackend` is a :class:`kvshm.Client` (shm or tcp mover); :class:`RedisBackend`
uses redis-py (EXISTS pipeline, MGET, MSET). :class:`BackendSpec` is what a spawned client
process needs to open its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvshm.replay.options import split_address

__all__ = ["KvshmBackend", "RedisBackend", "BackendSpec"]


class KvshmBackend:
    name = "kvshm"

    def __init__(self, address: str, transport: str, timeout: float) -> None:
        from kvshm.client import Client

        self.client = Client(address, transport=transport, timeout=timeout)
        self.transport = self.client.transport
        self.match = self.client.match_prefix
        self.read_into = self.client.get_batch_into
        self.write = self.client.put_batch

    def capacity(self) -> tuple[int, int, int]:
        """(pool bytes, SSD tier bytes, block size): the pool's from the server's HELLO,
        its SSD tier's (0: none) from STATS."""
        pool = self.client.server_info["pool"]
        ssd = self.client.stats().get("tiers", {}).get("ssd", {}).get("capacity_bytes", 0)
        return int(pool["size"]), int(ssd), int(pool["block_size"])

    def counts(self) -> dict[str, int | None]:
        """``evictions``: entries that left the pool (to the SSD tier or dropped), as the
        simulator counts them: LRU evictions, plus the old copies of keys being rewritten
        that a full pool freed first (Store._allocate; the simulator evicts those too, a
        little earlier). ``dropped``: entries that left the cache (pool drops + SSD tier
        drops; None without a tier)."""
        s = self.client.stats()
        tiers = s.get("tiers")
        dropped = None
        if tiers:
            dropped = int(tiers["pool"]["drops"]) + int(tiers["ssd"]["drops"])
        return {"evictions": int(s["evictions"]) + int(s.get("replaced_early", 0)),
                "dropped": dropped}

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.client.delete(keys)

    def close(self) -> None:
        self.client.close()


class RedisBackend:
    name = "redis"
    transport = "tcp"

    def __init__(self, address: str, timeout: float) -> None:
        import redis

        host, port = split_address(address, "--address")
        self.r = redis.Redis(host=host, port=port, socket_timeout=timeout,
                             socket_connect_timeout=timeout)
        self.r.ping()

    def match(self, keys: Sequence[bytes]) -> int:
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)          # EXISTS does not touch the LRU clock, as MATCH_PREFIX
        n = 0
        for found in pipe.execute():
            if not found:
                break
            n += 1
        return n

    def read_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int]:
        sizes = []
        values: list[Any] = self.r.mget(keys)  # type: ignore[assignment]
        for v, out in zip(values, outs):
            if v is None:
                sizes.append(-1)
                continue
            if len(v) <= len(out):
                out[:len(v)] = v
            sizes.append(len(v))
        return sizes

    def write(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> None:
        self.r.mset(dict(zip(keys, values)))

    def maxmemory(self) -> int:
        try:
            conf: Any = self.r.config_get("maxmemory")
            return int(conf.get("maxmemory", 0))
        except Exception:            # CONFIG may be renamed or refused
            return 0

    def counts(self) -> dict[str, int | None]:
        return {"evictions": int(self.r.info("stats")["evicted_keys"]), "dropped": None}

    def delete(self, keys: Sequence[bytes]) -> int:
        return int(self.r.unlink(*keys))

    def close(self) -> None:
        self.r.close()


@dataclass(frozen=True)
class BackendSpec:
    backend: str
    address: str
    timeout: float

    def open(self) -> Any:
        if self.backend == "redis":
            return RedisBackend(self.address, self.timeout)
        return KvshmBackend(self.address, "shm" if self.backend == "kvshm" else "tcp",
                             self.timeout)


# ---------------------------------------------------------------------- one client's share
