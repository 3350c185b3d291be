#!/usr/bin/env python3
"""kvshm with the sync Client: put and get a batch of KV pages, paged tensors too.

    python examples/sync_client.py [--address HOST:PORT]

Without --address it starts a small store server in this process.
"""

import argparse
import contextlib

import numpy as np

import kvshm


def main(address: str) -> None:
    with kvshm.Client(address) as c:                   # shm on this host, else TCP
        print(f"connected to {address} over {c.transport}")

        # a batch of values: one ALLOC, one copy into the pool, one COMMIT
        keys = [f"model/rank0/chunk{i}" for i in range(8)]
        values = [np.full(256 * 1024, i, np.uint8) for i in range(8)]
        c.put_batch(keys, values)
        print("prefix held:", c.match_prefix(keys + ["model/rank0/chunk-missing"]))

        # read back into caller buffers; -1 marks a miss, never an exception
        outs = [np.empty(256 * 1024, np.uint8) for _ in keys]
        sizes = c.get_batch_into(keys, outs)
        assert sizes == [256 * 1024] * 8 and all((o == i).all() for i, o in enumerate(outs))

        # vLLM-style paged KV of one layer: [2, num_blocks, block_size, heads, head_size]
        kv = np.random.default_rng(0).standard_normal((2, 64, 16, 8, 128)).astype(np.float16)
        page_ids = [3, 17, 42]
        page_keys = [f"model/rank0/layer0/page{p}" for p in page_ids]
        c.put_pages(page_keys, kv, page_ids)           # one scatter into the pool
        restored = np.zeros_like(kv)
        assert c.get_pages_into(page_keys, restored, page_ids) == [True] * 3
        assert np.array_equal(restored[:, page_ids], kv[:, page_ids])

        st = c.stats()
        print(f"{st['num_keys']} keys, {st['used_bytes'] / 2**20:.1f} MiB used")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", help="a running server (default: start one here)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        if args.address is None:
            srv = stack.enter_context(
                kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.25))
            args.address = srv.address
        main(args.address)
    print("ok")
