"""Clients of kvshm and its peers running bench_peers' workload (see perf/bench_peers.py).

Run by bench_peers in each peer's own venv, so it imports only the standard library,
numpy and the peer's client package (and ``perf/_common.py``):

    python perf/peer_clients.py worker PEER SPEC_JSON      # prints "RESULT {json}"

(Mooncake's segment holder is kvshm/replay/peer_client.py's, started by
kvshm.replay.peers.start_mooncake.)

Each adapter exposes the operations its store has, the best path of each kind (``into`` a
caller's buffer, ``fresh`` bytes); a missing one is a "-" in the table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common  # noqa: E402
from _common import pct  # noqa: E402

# The peers' client calls are kvshm/replay/peer_client.py's (shared with `kvshm replay
# --backend`), loaded by path: a peer's venv has no kvshm to import.
if TYPE_CHECKING:
    from kvshm.replay import peer_client as wire
else:
    _spec = importlib.util.spec_from_file_location(
        "kvshm_peer_client", os.path.join(HERE, "..", "kvshm", "replay", "peer_client.py"))
    wire = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(wire)

LAT_CAP_S = 20.0     # seconds a peer's 4 KiB latency loop may take (then fewer samples)


def pattern(seed: int, size: int) -> Any:
    """A value whose every 8-byte word differs by position and seed (numpy uint8)."""
    import numpy as np

    words = (np.arange(size // 8 + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             ^ np.uint64(seed * 0x100000001B3 + 1))
    return words.view(np.uint8)[:size].copy()


# --------------------------------------------------------------------------- adapters
#
# put(key, array); put_batch(keys, arrays); get_into(key, array) -> size;
# get_batch_into(keys, arrays); get(key) -> bytes-like; get_batch(keys) -> list.


class Adapter:
    name = ""
    paths: dict[str, str] = {}
    put: Callable[..., Any] | None = None
    put_batch: Callable[..., Any] | None = None
    get: Callable[..., Any] | None = None
    get_into: Callable[..., Any] | None = None
    get_batch: Callable[..., Any] | None = None
    get_batch_into: Callable[..., Any] | None = None

    def delete(self, keys: list[str]) -> None:
        pass

    def close(self) -> None:
        pass


class KvshmAdapter(Adapter):
    def __init__(self, address: str, transport: str) -> None:
        import kvshm

        self.c = kvshm.Client(address, transport=transport, timeout=120)
        if self.c.transport != transport:
            raise RuntimeError(f"asked for {transport}, got {self.c.transport}")
        c = self.c
        self.put, self.put_batch = c.put, c.put_batch
        self.get, self.get_into = c.get, c.get_into
        self.get_batch, self.get_batch_into = c.get_batch, c.get_batch_into
        self.paths = {"put": "put / put_batch", "into": "get_into / get_batch_into",
                      "fresh": "get / get_batch"}

    def delete(self, keys: list[str]) -> None:
        self.c.delete(keys)

    def close(self) -> None:
        self.c.close()


class RedisAdapter(Adapter):
    def __init__(self, port: int) -> None:
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=port)
        r = self.r

        def put(key: str, a: Any) -> None:
            r.set(key, memoryview(a))

        def put_batch(keys: list[str], arrays: list[Any]) -> None:
            p = r.pipeline(transaction=False)
            for k, a in zip(keys, arrays):
                p.set(k, memoryview(a))
            p.execute()

        self.put, self.put_batch = put, put_batch
        self.get, self.get_batch = r.get, r.mget
        self.paths = {"put": "SET / pipelined SET", "into": "none (no read into a buffer)",
                      "fresh": f"GET / MGET ({_common.redis_parser()})"}

    def delete(self, keys: list[str]) -> None:
        self.r.delete(*keys)

    def close(self) -> None:
        self.r.close()


class LmServerAdapter(Adapter):
    """LMCache's lm-server through LMCache's own wire messages on one socket
    (kvshm/replay/peer_client.py's LmServerWire)."""

    def __init__(self, port: int) -> None:
        self.w = w = wire.LmServerWire(port, "bench")

        def one(a: Any) -> memoryview:
            return memoryview(a).cast("B")

        def read_into(keys: list[str], arrays: list[Any]) -> list[int]:
            views = [one(a) for a in arrays]
            sizes = w.read_into(keys, views)
            for k, n, v in zip(keys, sizes, views):
                if n < 0:
                    raise KeyError(f"lm-server: miss {k}")
                if n > v.nbytes:
                    raise RuntimeError(f"lm-server: {k} has {n} bytes, the buffer {v.nbytes}")
            return sizes

        def read_fresh(keys: list[str]) -> list[bytearray]:
            got = w.read_fresh(keys)
            for k, g in zip(keys, got):
                if g is None:
                    raise KeyError(f"lm-server: miss {k}")
            return got  # type: ignore[return-value]

        def put(k: str, a: Any) -> None:
            w.put([k], [one(a)])               # PUT has no reply

        def put_batch(keys: list[str], arrays: list[Any]) -> None:
            w.put(keys, [one(a) for a in arrays])

        def get_into(k: str, a: Any) -> int:
            return read_into([k], [a])[0]

        def get(k: str) -> bytearray:
            return read_fresh([k])[0]

        def get_batch_into(keys: list[str], arrays: list[Any]) -> None:
            read_into(keys, arrays)             # pipelined

        self.put, self.put_batch, self.get, self.get_into = put, put_batch, get, get_into
        self.get_batch, self.get_batch_into = read_fresh, get_batch_into
        self.paths = {"note": "the server writes a reply's header and value in two sends "
                      "without TCP_NODELAY, so a value shorter than a segment waits for the "
                      "client's delayed ACK (~40 ms); LMCache's own connector sees the same. "
                      "A PUT has no reply: it is done when the socket took the bytes (no "
                      "acknowledged write)",
                      "put": "PUT (no reply) / 100 PUTs",
                      "into": "GET + recv_into (as LMCServerConnector) / 100 pipelined GETs",
                      "fresh": "GET + recv_into a new bytearray / 100 pipelined GETs"}

    def close(self) -> None:
        self.w.close()


class MooncakeAdapter(Adapter):
    """Mooncake Store client that mounts no memory: every byte goes to the holder over TCP."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.st = st = wire.mooncake_connect(spec)

        def ptr(a: Any) -> int:
            # the caller passes views of an arena registered with register()
            return int(a.ctypes.data)

        def put(k: str, a: Any) -> None:
            rc = st.put_from(k, ptr(a), a.nbytes)
            if rc != 0:
                raise RuntimeError(f"mooncake put_from {k}: {rc}")

        def put_batch(keys: list[str], arrays: list[Any]) -> None:
            rcs = st.batch_put_from(keys, [ptr(a) for a in arrays], [a.nbytes for a in arrays])
            if any(rc != 0 for rc in rcs):
                raise RuntimeError(f"mooncake batch_put_from: {sorted(set(rcs))}")

        def get_into(k: str, a: Any) -> int:
            n = st.get_into(k, ptr(a), a.nbytes)
            if n < 0:
                raise KeyError(f"mooncake get_into {k}: {n}")
            return int(n)

        def get_batch_into(keys: list[str], arrays: list[Any]) -> None:
            ns = st.batch_get_into(keys, [ptr(a) for a in arrays], [a.nbytes for a in arrays])
            if any(n < 0 for n in ns):
                raise KeyError(f"mooncake batch_get_into: {sorted(set(ns))}")

        self.put, self.put_batch, self.get_into = put, put_batch, get_into
        self.get_batch_into = get_batch_into
        self.get, self.get_batch = st.get, st.get_batch
        self.paths = {"put": "put_from / batch_put_from (registered buffers)",
                      "into": "get_into / batch_get_into (registered buffers)",
                      "fresh": "get / get_batch"}

    def register(self, arena: Any) -> None:
        wire.mooncake_register(self.st, arena.ctypes.data, arena.nbytes)

    def delete(self, keys: list[str]) -> None:
        # Nothing: a read takes a lease (the master's default 10 s) that a remove must wait
        # out, and a shorter lease fails reads that outlast it (-707); every rep uses fresh
        # keys and the holder's segment is sized for all of them.
        pass

    def close(self) -> None:
        self.st.close()


# --------------------------------------------------------------------------- workload


def _views(arena: Any, size: int, n: int) -> list[Any]:
    return [arena[i * size:(i + 1) * size] for i in range(n)]


def run_workload(ad: Adapter, count: int, reps: int, lat_iters: int,
                 sizes: tuple[tuple[int, str], ...]) -> dict[str, Any]:
    import numpy as np

    res: dict[str, list[float]] = {}
    total = sum(s for s, _ in sizes) * count
    src_arena = np.empty(total + 4096, np.uint8)
    out_arena = np.zeros(total + 4096, np.uint8)
    if isinstance(ad, MooncakeAdapter):
        ad.register(src_arena)
        ad.register(out_arena)
    off = 0
    plan = []
    for size, tag in sizes:
        srcs = _views(src_arena[off:], size, count)
        outs = _views(out_arena[off:], size, count)
        for i, s in enumerate(srcs):
            s[:] = pattern(size + i, size)
        plan.append((size, tag, srcs, outs, [s.tobytes() for s in srcs]))
        off += size * count

    def timed(metric: str, nbytes: int, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        r = fn()
        res.setdefault(metric, []).append(nbytes / (time.perf_counter() - t) / 1e6)
        return r

    def check(what: str, got: list[Any], want: list[bytes]) -> None:
        bad = sum(bytes(g) != w for g, w in zip(got, want)) + abs(len(got) - len(want))
        if bad:
            raise RuntimeError(f"{what}: {bad} values came back wrong")

    put1, putb, get1, get1_into = ad.put, ad.put_batch, ad.get, ad.get_into
    getb, getb_into = ad.get_batch, ad.get_batch_into
    for rep in range(reps):
        for size, tag, srcs, outs, want in plan:
            nb = size * count
            k1 = [f"s{tag}r{rep}-{i}" for i in range(count)]
            kb = [f"b{tag}r{rep}-{i}" for i in range(count)]
            if put1 is not None:
                timed(f"put1_{tag}", nb, lambda: [put1(k, a) for k, a in zip(k1, srcs)])
            if putb is not None:
                timed(f"putB_{tag}", nb, lambda: putb(kb, srcs))
            if get1_into is not None:
                for o in outs:
                    o[:] = 0                    # every byte, so a short read cannot pass
                timed(f"get1_{tag}_into", nb,
                      lambda: [get1_into(k, o) for k, o in zip(k1, outs)])
                check(f"single get {tag} into", outs, want)
            if getb_into is not None:
                for o in outs:
                    o[:] = 0                    # every byte, so a short read cannot pass
                timed(f"getB_{tag}_into", nb, lambda: getb_into(kb, outs))
                check(f"x{count} get {tag} into", outs, want)
            if get1 is not None:
                got = timed(f"get1_{tag}_fresh", nb, lambda: [get1(k) for k in k1])
                check(f"single get {tag} fresh", got, want)
            if getb is not None:
                got = timed(f"getB_{tag}_fresh", nb, lambda: getb(kb))
                check(f"x{count} get {tag} fresh", got, want)
                del got
            ad.delete(k1 + kb)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in res.items()}
    # 4 KiB latency: one key, lat_iters calls of each read kind
    small = src_arena[off:off + 4096]
    small[:] = pattern(4, 4096)
    want4 = small.tobytes()
    buf = out_arena[off:off + 4096]
    if put1 is not None:
        put1("lat-4k", small)
    elif putb is not None:
        putb(["lat-4k"], [small])
    reads: list[tuple[str, Callable[[], Any] | None]] = [
        ("into", None if get1_into is None else (lambda: get1_into("lat-4k", buf))),
        ("fresh", None if get1 is None else (lambda: get1("lat-4k")))]
    for kind, fn in reads:
        if fn is None:
            continue
        lat: list[float] = []
        bad = 0
        cap = time.monotonic() + LAT_CAP_S
        for i in range(lat_iters + lat_iters // 10):
            if time.monotonic() > cap and len(lat) >= 20:
                break                          # a slow peer: fewer samples, said below
            buf[:] = 0
            t = time.perf_counter()
            r = fn()
            dt = time.perf_counter() - t
            bad += (bytes(buf) if kind == "into" else bytes(r)) != want4
            if i >= lat_iters // 10:
                lat.append(dt)
        if bad:
            raise RuntimeError(f"4 KiB get {kind}: {bad} reads came back wrong")
        lat.sort()
        out[f"lat4k_{kind}_p50"] = pct(lat, 0.5) * 1e6
        out[f"lat4k_{kind}_p99"] = pct(lat, 0.99) * 1e6
        out[f"lat4k_{kind}_n"] = len(lat)
    ad.delete(["lat-4k"])
    out["paths"] = ad.paths
    return out


def worker(peer: str, spec: dict[str, Any]) -> None:
    """In the peer's venv: run the workload against the server the parent started."""
    sizes = tuple(tuple(s) for s in spec["sizes"])
    if peer in ("kvshm-shm", "kvshm-tcp"):
        ad: Adapter = KvshmAdapter(spec["address"], peer.split("-")[1])
    elif peer == "redis":
        ad = RedisAdapter(spec["port"])
    elif peer == "lm-server":
        ad = LmServerAdapter(spec["port"])
    elif peer == "mooncake":
        ad = MooncakeAdapter(spec)
    else:
        raise SystemExit(f"no worker for {peer}")
    try:
        res = run_workload(ad, spec["count"], spec["reps"], spec["lat_iters"],
                           sizes)  # type: ignore[arg-type]
    finally:
        ad.close()
    print("RESULT " + json.dumps(res), flush=True)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "worker":
        worker(argv[1], json.loads(argv[2]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
