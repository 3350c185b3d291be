"""The replay's client of a peer store, run INSIDE the peer's own venv (so it imports only
the standard library, numpy and the peer's client package, never kvshm):

    python peer_client.py lm-server SPEC_JSON        # a replay client of lm-server
    python peer_client.py mooncake SPEC_JSON         # a replay client of Mooncake Store
    python peer_client.py mooncake-holder SPEC_JSON  # mounts SPEC["segment"] bytes until EOF

A client prints ``ready`` and then answers one JSON line on stdout per JSON line on stdin
(:class:`kvshm.replay.peers.PeerBackend` is the other end). Values never cross the pipe:
they sit in a staging file in /dev/shm that both processes map (``["map", path, size]``);
the store reads into it and writes from it with its best path:

- ``["match", keys]`` -> ``{"n": leading keys held}``
- ``["get", keys, offsets, caps]`` -> ``{"sizes": [bytes read or -1 (miss)]}``
- ``["put", keys, offsets, sizes]`` -> ``{"refused": n, "codes": {rc: count}}``
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
from typing import Any


class Staging:
    def __init__(self) -> None:
        self.arr: Any = None
        self.path = ""

    def map(self, path: str, size: int) -> None:
        import numpy as np

        self.arr = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
        self.path = path


class LmServer:
    """lm-server through LMCache's own wire messages on one socket: EXIST for match,
    pipelined GETs read with recv_into into the staging buffer (as LMCServerConnector
    reads), PUT (no reply) for writes."""

    read_path = ("pipelined GETs on one socket, recv_into the caller's buffer (as "
                 "LMCache's LMCServerConnector); match = pipelined EXISTs; write = PUTs "
                 "(no reply)")

    def __init__(self, spec: dict[str, Any], st: Staging) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import (ClientCommand, ClientMetaMessage, ServerMetaMessage,
                                         ServerReturnCode)

        self.st = st
        self.s = socket.create_connection(("127.0.0.1", spec["port"]))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rlen = ServerMetaMessage.packlength()
        self.hdr = bytearray(self.rlen)
        self.SM, self.OK = ServerMetaMessage, ServerReturnCode.SUCCESS

        def key_of(k: str) -> Any:
            h = int.from_bytes(hashlib.blake2b(k.encode(), digest_size=7).digest(), "little")
            return CacheEngineKey("kvshm-replay", 1, 0, h, torch.uint8)

        empty = (MemoryFormat(1), torch.float16, torch.Size([0, 0, 0, 0]))
        self.msg = lambda cmd, k: ClientMetaMessage(cmd, key_of(k), 0, *empty).serialize()
        self.put_msg = lambda k, n: ClientMetaMessage(
            ClientCommand.PUT, key_of(k), n, MemoryFormat.KV_2LTD, torch.uint8,
            torch.Size([n])).serialize()
        self.GET, self.EXIST = ClientCommand.GET, ClientCommand.EXIST

    def _recv_exact(self, mv: memoryview) -> None:
        got, n = 0, mv.nbytes
        while got < n:
            r = self.s.recv_into(mv[got:], n - got)
            if not r:
                raise ConnectionError("lm-server closed the connection")
            got += r

    def _reply(self) -> tuple[bool, int]:
        self._recv_exact(memoryview(self.hdr))
        meta = self.SM.deserialize(bytes(self.hdr))
        return meta.code == self.OK, int(meta.length)

    def match(self, keys: list[str]) -> int:
        self.s.sendall(b"".join(self.msg(self.EXIST, k) for k in keys))
        n, counting = 0, True
        for _ in keys:                 # read every reply, count the leading hits
            ok, _len = self._reply()
            counting = counting and ok
            n += counting
        return n

    def get(self, keys: list[str], offs: list[int], caps: list[int]) -> list[int]:
        self.s.sendall(b"".join(self.msg(self.GET, k) for k in keys))
        mv = memoryview(self.st.arr)
        sizes = []
        for off, cap in zip(offs, caps):
            ok, n = self._reply()
            if not ok:
                sizes.append(-1)
                continue
            if n <= cap:
                self._recv_exact(mv[off:off + n])
            else:
                self._recv_exact(memoryview(bytearray(n)))
            sizes.append(n)
        return sizes

    def put(self, keys: list[str], offs: list[int], sizes: list[int]) -> dict[str, Any]:
        mv = memoryview(self.st.arr)
        for k, off, n in zip(keys, offs, sizes):
            self.s.sendall(self.put_msg(k, n))
            self.s.sendall(mv[off:off + n])
        return {"refused": 0, "codes": {}}

    def close(self) -> None:
        self.s.close()


class Mooncake:
    """A Mooncake Store client that mounts no memory (every byte crosses TCP to the
    segment holder): batch_is_exist, batch_get_into / batch_put_from on a registered
    buffer (the staging file)."""

    read_path = ("batch_get_into a registered buffer (TCP transfer engine); match = "
                 "batch_is_exist; write = batch_put_from")

    def __init__(self, spec: dict[str, Any], st: Staging) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.st = st
        self.m = MooncakeDistributedStore()
        rc = self.m.setup("127.0.0.1", spec["metadata"], 0, spec["local_buffer"], "tcp", "",
                          spec["master"])
        if rc != 0:
            raise RuntimeError(f"mooncake setup returned {rc}")
        self.base = 0
        self.size = 0

    def remap(self) -> None:
        if self.base:
            self.m.unregister_buffer(self.base)
        self.base, self.size = int(self.st.arr.ctypes.data), int(self.st.arr.nbytes)
        rc = self.m.register_buffer(self.base, self.size)
        if rc != 0:
            raise RuntimeError(f"mooncake register_buffer: {rc}")

    def match(self, keys: list[str]) -> int:
        n = 0
        for e in self.m.batch_is_exist(keys):
            if e != 1:
                break
            n += 1
        return n

    def get(self, keys: list[str], offs: list[int], caps: list[int]) -> list[int]:
        ns = self.m.batch_get_into(keys, [self.base + o for o in offs], caps)
        return [int(n) if n >= 0 else -1 for n in ns]

    def put(self, keys: list[str], offs: list[int], sizes: list[int]) -> dict[str, Any]:
        rcs = self.m.batch_put_from(keys, [self.base + o for o in offs], sizes)
        codes: dict[str, int] = {}
        for rc in rcs:
            if rc != 0:
                codes[str(rc)] = codes.get(str(rc), 0) + 1
        return {"refused": sum(codes.values()), "codes": codes}

    def close(self) -> None:
        self.m.close()


def serve(peer: str, spec: dict[str, Any]) -> None:
    st = Staging()
    cl: Any = LmServer(spec, st) if peer == "lm-server" else Mooncake(spec, st)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "read_path": cl.read_path}) + "\n")
    out.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg[0]
        try:
            if op == "map":
                st.map(msg[1], msg[2])
                if isinstance(cl, Mooncake):
                    cl.remap()
                r: Any = {}
            elif op == "match":
                r = {"n": cl.match(msg[1])}
            elif op == "get":
                r = {"sizes": cl.get(msg[1], msg[2], msg[3])}
            elif op == "put":
                r = cl.put(msg[1], msg[2], msg[3])
            elif op == "quit":
                break
            else:
                r = {"error": f"unknown op {op!r}"}
        except Exception as exc:           # reported to the replay, which counts it
            r = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(r) + "\n")
        out.flush()
    cl.close()


def mooncake_holder(spec: dict[str, Any]) -> None:
    """Mount ``spec["segment"]`` bytes into the store (the store's capacity), print
    ``ready``, wait for EOF on stdin."""
    from mooncake.store import MooncakeDistributedStore

    m = MooncakeDistributedStore()
    rc = m.setup("127.0.0.1", spec["metadata"], spec["segment"], 16 << 20, "tcp", "",
                 spec["master"])
    if rc != 0:
        raise SystemExit(f"mooncake holder setup returned {rc}")
    print("ready", flush=True)
    sys.stdin.read()
    m.close()


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] in ("lm-server", "mooncake"):
        serve(argv[0], json.loads(argv[1]))
        return 0
    if len(argv) == 2 and argv[0] == "mooncake-holder":
        mooncake_holder(json.loads(argv[1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
