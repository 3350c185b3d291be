#!/usr/bin/env python3
"""Single-key calls of the AsyncClient: put, get, get_into, exists, delete.

    python examples/async_single_key.py [--address HOST:PORT]

Without --address it starts a small store server in this process.
"""

import argparse
import asyncio
import contextlib

import kvshm


async def main(address: str) -> None:
    async with kvshm.AsyncClient(address, timeout=5) as c:
        await c.put("session/42/prompt-hash", b"cached prefix bytes", checksum=True)
        print(await c.get("session/42/prompt-hash", verify=True))

        buf = bytearray(64)
        n = await c.get_into("session/42/prompt-hash", buf)
        print(f"{n} bytes into a caller buffer: {bytes(buf[:n])!r}")

        print("exists:", await c.exists("session/42/prompt-hash"))
        try:
            await c.get("session/42/other")
        except kvshm.KeyNotFound as exc:
            print("miss:", exc)

        # many single-key gets at once share one connection
        await asyncio.gather(*(c.put(f"k{i}", str(i).encode()) for i in range(100)))
        got = await asyncio.gather(*(c.get(f"k{i}") for i in range(100)))
        assert got == [str(i).encode() for i in range(100)]
        print("deleted:", await c.delete([f"k{i}" for i in range(100)]))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", help="a running server (default: start one here)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        if args.address is None:
            srv = stack.enter_context(
                kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.25))
            args.address = srv.address
        asyncio.run(main(args.address))
    print("ok")
