#!/usr/bin/env python3
"""Layer-wise prefill on one side, background decode loading on the other.

    python examples/layerwise_prefill_decode.py [--address HOST:PORT]

The prefill instance computes layer by layer; after each layer it hands that layer's KV
pages to a LayerWriter and goes on with the next layer while the copy runs. The decode
instance prefetches each layer's pages into its own paged cache in a background thread
and tells its "scheduler" (a callback) when every block is in.

Without --address it starts a small store server in this process.
"""

import argparse
import contextlib
import threading

import numpy as np

import kvshm
from kvshm.layerwise import LayerWriter, prefetch_pages

LAYERS, BLOCKS = 8, 64
KV_SHAPE = (2, BLOCKS, 16, 8, 64)       # [K/V, blocks, block_size, kv heads, head size]


def prefill(address: str, request: str, page_ids: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    caches = [np.zeros(KV_SHAPE, np.float16) for _ in range(LAYERS)]
    keys = [[f"{request}/layer{layer}/page{j}" for j in range(len(page_ids))]
            for layer in range(LAYERS)]
    with kvshm.Client(address) as c, LayerWriter(c, keys) as writer:
        for layer in range(LAYERS):
            # "compute" layer i: fill its KV pages
            caches[layer][:, page_ids] = rng.standard_normal(
                (2, len(page_ids), *KV_SHAPE[2:])).astype(np.float16)
            writer.write(layer, caches[layer], page_ids)    # returns at once
        # leaving the blocks waits for every layer (and raises the first error)
    print(f"prefill: {LAYERS} layers of {len(page_ids)} pages stored")
    return caches


def decode(address: str, request: str, n_pages: int, expected: list[np.ndarray],
           src_ids: list[int]) -> None:
    caches = [np.zeros(KV_SHAPE, np.float16) for _ in range(LAYERS)]
    my_ids = list(range(BLOCKS - n_pages, BLOCKS))         # where this instance puts them
    all_in = threading.Event()
    remaining = [LAYERS]
    lock = threading.Lock()

    def layer_ready(handle) -> None:                       # runs in the loading thread
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                all_in.set()                               # tell the scheduler

    with kvshm.Client(address) as c:
        handles = []
        for layer in range(LAYERS):
            keys = [f"{request}/layer{layer}/page{j}" for j in range(n_pages)]
            h = prefetch_pages(c, keys, caches[layer], my_ids)
            h.add_done_callback(layer_ready)
            handles.append(h)
        assert all_in.wait(30), "the KV did not arrive"
        for h in handles:
            h.result()                                     # raises a load's error here
    for layer in range(LAYERS):
        assert np.array_equal(caches[layer][:, my_ids], expected[layer][:, src_ids])
    print(f"decode: all {LAYERS} layers loaded in the background; scheduler told")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", help="a running server (default: start one here)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        if args.address is None:
            srv = stack.enter_context(
                kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.25))
            args.address = srv.address
        page_ids = [5, 9, 10, 33]
        expected = prefill(args.address, "req-7", page_ids)
        decode(args.address, "req-7", len(page_ids), expected, page_ids)
    print("ok")
