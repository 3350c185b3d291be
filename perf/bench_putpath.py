#!/usr/bin/env python3
"""In-process Store.put of a 100 k-key batch in the server's 2048-key slices (no wire).

    N=100000 REPS=10 S=2048 [AB=module:FLAG] python perf/bench_putpath.py

Thread CPU ns per key of ``Store.put`` (``kvshm._index.put_packed``: alloc, dict and LRU,
copy, shared-table publish, old values freed) for an overwrite of N keys of 64 bytes with
4 KiB blocks and a shared table, fresh key objects each batch (as the decoder gives).
``AB=kvshm._index:PUT_PREFETCH`` alternates that module flag False/True rep by rep: an
A/B in one process, on one store.
"""
import os, sys, time, statistics, uuid
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import pattern
from kvshm import Pool, _index, _batch
from kvshm._pool import PackedValues
from kvshm._shmindex import IndexWriter, default_slots
from kvshm.limits import Limits
from kvshm.store import Store, StoreConfig
import msgpack

N = int(os.environ.get("N", "100000")); REPS = int(os.environ.get("REPS", "10")); S = int(os.environ.get("S", "2048"))
BS = 4096
blocks = int(2.5 * N) + 8192
name = "bp2m-" + uuid.uuid4().hex[:8]
pool = Pool.create(name, blocks * BS, BS)
w = IndexWriter.create(name + "-index", name + "-reads", default_slots(blocks), epoch=3, block_size=BS,
                       num_blocks=blocks, token=b"t" * 16)
store = Store(pool, StoreConfig(limits=Limits(max_key_bytes=200, max_batch=200_000)))
store.index.attach_shared(w)
keys = [f"batch-{i:012d}".encode() for i in range(N)]
vals = [pattern(i, 64).tobytes() for i in range(N)]
sizes, frames, counts = _batch.pack_values(keys, vals, 1 << 30, 0, None, ValueError)
def onebatch():
    # fresh key objects each time, as the decoder gives
    ks = msgpack.unpackb(msgpack.packb(keys))
    pv = PackedValues.of(frames, counts, list(sizes))
    t0 = time.thread_time()
    for a in range(0, N, S):
        store.put(ks[a:a+S], pv[a:a+S])
    return time.thread_time() - t0
onebatch()
AB = os.environ.get("AB")  # "module:ATTR"
if AB:
    mod, attr = AB.split(":")
    import importlib; m = importlib.import_module(mod)
    res = {False: [], True: []}
    for r in range(REPS):
        for v in (False, True) if r % 2 else (True, False):
            setattr(m, attr, v); res[v].append(onebatch())
    for v in (False, True):
        ts = res[v]
        print(f"{attr}={v}: put slices of {S}: median {statistics.median(ts)/N*1e9:.0f} ns/key  best {min(ts)/N*1e9:.0f} ns/key  load {os.getloadavg()[0]:.2f}")
else:
    ts = [onebatch() for _ in range(REPS)]
    print(f"put slices of {S}: median {statistics.median(ts)/N*1e9:.0f} ns/key  best {min(ts)/N*1e9:.0f} ns/key  load {os.getloadavg()[0]:.2f}")
print({k: v for k, v in w.stats().items() if not isinstance(v, (list, dict))})
w.close() if hasattr(w, "close") else None
pool.close() if hasattr(pool, "close") else None
for f in (name, name + "-index", name + "-reads"):
    try: os.unlink("/dev/shm/" + f)
    except FileNotFoundError: pass
