#!/usr/bin/env python3
"""In-process Store.put of a 100 k-key batch in the server's 2048-key slices (no wire).

    python perf/bench_putpath.py [--keys 100000] [--reps 10] [--slice 2048]
                                 [--ab kvshm._index:PUT_PREFETCH] [--new-keys]

Thread CPU ns per key of ``Store.put`` (``kvshm._index.put_packed``: alloc, dict and LRU,
copy, shared-table publish, old values freed) for an overwrite of --keys keys of 64 bytes
with 4 KiB blocks and a shared table, fresh key objects each batch (as the server's
decoder gives them). ``--new-keys``: each batch a key set not stored before instead
(the previous batch's keys deleted, untimed), the first put of a chunk's keys as an
engine's prefill gives it, rather than an overwrite. ``--ab MODULE:FLAG`` sets that module flag False / True in turn, rep
by rep (the order swapped every other rep): an A/B in one process, on one store. The
load average is printed beside each figure: read them against each other, not alone.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
import uuid
from typing import Any, Sequence, cast

import msgpack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import pattern  # noqa: E402

from kvshm import Pool, _batch  # noqa: E402
from kvshm._buffers import byte_view  # noqa: E402
from kvshm._pool import PackedValues  # noqa: E402
from kvshm._shmindex import IndexWriter, default_slots  # noqa: E402
from kvshm.limits import Limits  # noqa: E402
from kvshm.store import Store, StoreConfig  # noqa: E402

BS = 4096


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--slice", type=int, default=2048, help="keys a Store.put (the server's "
                    "slice of a large PUT)")
    ap.add_argument("--ab", default=None, metavar="MODULE:FLAG")
    ap.add_argument("--new-keys", action="store_true",
                    help="each batch new keys (the last batch's deleted, untimed)")
    args = ap.parse_args()
    n, s = args.keys, args.slice
    blocks = int(2.5 * n) + 8192
    name = "kvshm-putpath-" + uuid.uuid4().hex[:8]
    pool = Pool.create(name, blocks * BS, BS)
    w = IndexWriter.create(name + "-index", name + "-reads", default_slots(blocks), epoch=3,
                           block_size=BS, num_blocks=blocks, token=b"t" * 16)
    try:
        store = Store(pool, StoreConfig(limits=Limits(max_key_bytes=200, max_batch=200_000)))
        store.index.attach_shared(w)
        keys = [f"batch-{i:012d}".encode() for i in range(n)]
        vals = [pattern(i, 64).tobytes() for i in range(n)]
        sizes, frames, counts = _batch.pack_values(keys, vals, 1 << 30, 0, byte_view,
                                                   ValueError)
        packed_keys = msgpack.packb(keys)
        batches = [0]
        stored: list[list[bytes]] = []

        def one_batch() -> float:
            if args.new_keys:
                b = batches[0] = batches[0] + 1
                ks = msgpack.unpackb(msgpack.packb([b"n%d-" % b + k for k in keys]))
                for old in stored:                  # room for the new set, untimed
                    for a in range(0, n, s):
                        store.delete(old[a:a + s])
                stored[:] = [ks]
            else:
                ks = msgpack.unpackb(packed_keys)   # fresh key objects, as decoded
            pv = PackedValues.of(frames, counts, list(sizes))
            assert pv is not None, "the layout pack_values made is not a plain one"
            t0 = time.thread_time()
            for a in range(0, n, s):
                # (a PackedValues is what the server hands Store.put: values by index)
                store.put(ks[a:a + s], cast(Sequence[Any], pv[a:a + s]))
            return time.thread_time() - t0

        def line(label: str, ts: list[float]) -> str:
            return (f"{label}put{' (new keys)' if args.new_keys else ''} slices of {s}: median {statistics.median(ts) / n * 1e9:.0f} "
                    f"ns/key  best {min(ts) / n * 1e9:.0f} ns/key  "
                    f"load {os.getloadavg()[0]:.2f}")

        one_batch()                                 # the first fills the pool and table
        if args.ab:
            mod, attr = args.ab.split(":")
            m = importlib.import_module(mod)
            res: dict[bool, list[float]] = {False: [], True: []}
            for r in range(args.reps):
                for v in ((False, True) if r % 2 else (True, False)):
                    setattr(m, attr, v)
                    res[v].append(one_batch())
            for v in (False, True):
                print(line(f"{attr}={v}: ", res[v]))
        else:
            print(line("", [one_batch() for _ in range(args.reps)]))
    finally:
        w.close()
        pool.close()
        for f in (name, name + "-index", name + "-reads"):
            try:
                os.unlink("/dev/shm/" + f)
            except FileNotFoundError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
