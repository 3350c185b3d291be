#!/usr/bin/env python3
"""kvshm with the AsyncClient: many batch gets in flight on one connection.

    python examples/async_client.py [--address HOST:PORT] [--uvloop]

Without --address it starts a small store server in this process.
"""

import argparse
import asyncio
import contextlib

import numpy as np

import kvshm


async def main(address: str) -> None:
    async with kvshm.AsyncClient(address) as c:
        # 16 requests' KV, 4 chunks each, written concurrently
        requests = {f"req{r}": [f"req{r}/chunk{i}" for i in range(4)] for r in range(16)}
        await asyncio.gather(*(
            c.put_batch(keys, [np.full(128 * 1024, r, np.uint8) for _ in keys])
            for r, keys in enumerate(requests.values())))

        # read them all back at once: each reply goes to its own call
        results = await asyncio.gather(*(c.get_batch(keys) for keys in requests.values()))
        for r, values in enumerate(results):
            assert all(v == bytes([r]) * 128 * 1024 for v in values)
        print(f"{len(results)} batches read concurrently over {c.transport}")

        # a deadline: a cancelled call releases what it held on the server
        try:
            await asyncio.wait_for(c.get_batch(requests["req0"]), timeout=1e-6)
        except asyncio.TimeoutError:
            print("a get was cancelled by its deadline")
        st = await c.stats()                           # carries the queued release
        print(f"pinned entries after the cancel: {st['pinned']}")
        assert st["pinned"] == 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", help="a running server (default: start one here)")
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        if args.address is None:
            srv = stack.enter_context(
                kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.25))
            args.address = srv.address
        if args.uvloop:
            import uvloop

            uvloop.run(main(args.address))
        else:
            asyncio.run(main(args.address))
    print("ok")
