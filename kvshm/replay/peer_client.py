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

The peers' client calls themselves (:class:`LmServerWire`, :func:`mooncake_connect`,
:func:`mooncake_register`) are also perf/bench_peers' (perf/peer_clients.py loads this
file by path in the peer's venv): one implementation for the replay and the benchmark.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
from typing import Any, Sequence


class Staging:
    def __init__(self) -> None:
        self.arr: Any = None
        self.path = ""

    def map(self, path: str, size: int) -> None:
        import numpy as np

        self.arr = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
        self.path = path


# ------------------------------------------------------------------ the peers' wire
# Shared with perf/peer_clients.py (which loads this file by path in the peer's venv):
# one implementation of each peer's client calls, used by the replay and bench_peers.


class LmServerWire:
    """LMCache's lm-server through LMCache's own wire messages on one TCP socket
    (``lmcache.v1.protocol``), as its LMCServerConnector speaks them: a 0-length-value
    message per GET / EXIST, a header + value per PUT (no reply). Requests of a batch are
    pipelined (all sent, then every reply read).

    Parameters
    ----------
    port : int
        lm-server's port on 127.0.0.1.
    namespace : str
        The ``CacheEngineKey`` model name the keys live under (a key is its 56-bit
        blake2b hash there).
    """

    def __init__(self, port: int, namespace: str) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import (ClientCommand, ClientMetaMessage, ServerMetaMessage,
                                         ServerReturnCode)

        self.s = socket.create_connection(("127.0.0.1", port))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._hdr = bytearray(ServerMetaMessage.packlength())
        self._meta, self._ok = ServerMetaMessage, ServerReturnCode.SUCCESS

        def key_of(k: str) -> Any:
            h = int.from_bytes(hashlib.blake2b(k.encode(), digest_size=7).digest(), "little")
            return CacheEngineKey(namespace, 1, 0, h, torch.uint8)

        empty = (MemoryFormat(1), torch.float16, torch.Size([0, 0, 0, 0]))
        get, exist = ClientCommand.GET, ClientCommand.EXIST
        self._get_msg = lambda k: ClientMetaMessage(get, key_of(k), 0, *empty).serialize()
        self._exist_msg = lambda k: ClientMetaMessage(exist, key_of(k), 0, *empty).serialize()
        self._put_msg = lambda k, n: ClientMetaMessage(
            ClientCommand.PUT, key_of(k), n, MemoryFormat.KV_2LTD, torch.uint8,
            torch.Size([n])).serialize()

    def _recv_exact(self, mv: memoryview) -> None:
        got, n = 0, mv.nbytes
        while got < n:
            r = self.s.recv_into(mv[got:], n - got)
            if not r:
                raise ConnectionError("lm-server closed the connection")
            got += r

    def _reply(self) -> tuple[bool, int]:
        """(hit, value bytes that follow) of the next reply header."""
        self._recv_exact(memoryview(self._hdr))
        meta = self._meta.deserialize(bytes(self._hdr))
        return meta.code == self._ok, int(meta.length)

    def exist(self, keys: Sequence[str]) -> list[bool]:
        """Pipelined EXISTs: whether each key is held."""
        self.s.sendall(b"".join(self._exist_msg(k) for k in keys))
        return [self._reply()[0] for _ in keys]

    def read_into(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int]:
        """Pipelined GETs, each value received (recv_into) into its byte view of
        ``outs``. Returns the bytes of each value, -1 for a miss; a value larger than
        its view is read past (into a scratch buffer) and its size returned."""
        self.s.sendall(b"".join(self._get_msg(k) for k in keys))
        sizes = []
        for mv in outs:
            ok, n = self._reply()
            if not ok:
                sizes.append(-1)
                continue
            self._recv_exact(mv[:n] if n <= mv.nbytes else memoryview(bytearray(n)))
            sizes.append(n)
        return sizes

    def read_fresh(self, keys: Sequence[str]) -> list[bytearray | None]:
        """Pipelined GETs, each value received into a new bytearray (None: a miss)."""
        self.s.sendall(b"".join(self._get_msg(k) for k in keys))
        out: list[bytearray | None] = []
        for _ in keys:
            ok, n = self._reply()
            buf = bytearray(n) if ok else None
            if buf is not None:
                self._recv_exact(memoryview(buf))
            out.append(buf)
        return out

    def put(self, keys: Sequence[str], values: Sequence[memoryview]) -> None:
        """A PUT per value (header, then the bytes). lm-server does not reply: a put
        is done when the socket took its bytes (no acknowledged write)."""
        for k, v in zip(keys, values):
            self.s.sendall(self._put_msg(k, v.nbytes))
            self.s.sendall(v)

    def close(self) -> None:
        self.s.close()


def mooncake_connect(spec: dict[str, Any], segment: int = 0,
                     local_buffer: int | None = None) -> Any:
    """A set-up ``MooncakeDistributedStore`` on the TCP transfer engine: ``segment``
    bytes mounted into the store (0: a client that holds nothing, every byte crosses
    TCP to the holder), ``local_buffer`` bytes of its own transfer buffer (default
    ``spec["local_buffer"]``). ``spec``: ``metadata`` (HTTP metadata URL) and
    ``master`` (host:port), from :func:`kvshm.replay.peers.start_mooncake`.
    Raises RuntimeError when setup returns non-zero."""
    from mooncake.store import MooncakeDistributedStore

    m = MooncakeDistributedStore()
    buf = spec["local_buffer"] if local_buffer is None else local_buffer
    rc = m.setup("127.0.0.1", spec["metadata"], segment, buf, "tcp", "", spec["master"])
    if rc != 0:
        raise RuntimeError(f"mooncake setup returned {rc}")
    return m


def mooncake_register(m: Any, ptr: int, nbytes: int) -> None:
    """Register ``nbytes`` at address ``ptr`` with the store ``m`` (reads into and
    writes from it go without a copy); RuntimeError on a non-zero return."""
    rc = m.register_buffer(ptr, nbytes)
    if rc != 0:
        raise RuntimeError(f"mooncake register_buffer: {rc}")


# ------------------------------------------------------------------ the replay's clients


class LmServer:
    """The replay's lm-server client: EXIST for match, pipelined GETs read with
    recv_into into the staging buffer (as LMCServerConnector reads), PUT (no reply) for
    writes."""

    read_path = ("pipelined GETs on one socket, recv_into the caller's buffer (as "
                 "LMCache's LMCServerConnector); match = pipelined EXISTs; write = PUTs "
                 "(no reply)")

    def __init__(self, spec: dict[str, Any], st: Staging) -> None:
        self.st = st
        self.w = LmServerWire(spec["port"], "kvshm-replay")

    def match(self, keys: list[str]) -> int:
        n = 0
        for ok in self.w.exist(keys):     # every reply read, the leading hits counted
            if not ok:
                break
            n += 1
        return n

    def get(self, keys: list[str], offs: list[int], caps: list[int]) -> list[int]:
        mv = memoryview(self.st.arr)
        return self.w.read_into(keys, [mv[o:o + c] for o, c in zip(offs, caps)])

    def put(self, keys: list[str], offs: list[int], sizes: list[int]) -> dict[str, Any]:
        mv = memoryview(self.st.arr)
        self.w.put(keys, [mv[o:o + n] for o, n in zip(offs, sizes)])
        return {"refused": 0, "codes": {}}

    def close(self) -> None:
        self.w.close()


class Mooncake:
    """A Mooncake Store client that mounts no memory (every byte crosses TCP to the
    segment holder): batch_is_exist, batch_get_into / batch_put_from on a registered
    buffer (the staging file)."""

    read_path = ("batch_get_into a registered buffer (TCP transfer engine); match = "
                 "batch_is_exist; write = batch_put_from")

    def __init__(self, spec: dict[str, Any], st: Staging) -> None:
        self.st = st
        self.m = mooncake_connect(spec)
        self.base = 0
        self.size = 0

    def remap(self) -> None:
        if self.base:
            self.m.unregister_buffer(self.base)
        self.base, self.size = int(self.st.arr.ctypes.data), int(self.st.arr.nbytes)
        mooncake_register(self.m, self.base, self.size)

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
    try:
        m = mooncake_connect(spec, segment=spec["segment"], local_buffer=16 << 20)
    except RuntimeError as exc:
        raise SystemExit(f"mooncake holder: {exc}") from None
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
