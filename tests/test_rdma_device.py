"""RDMA on a real device (pytest marker ``rdma_device``). Skipped, with the reason, where
pyverbs cannot list a device with an active port: these have not run on this project's
development hosts (see docs/RDMA.md, "What has run where").

``KVSHM_RDMA_DEV`` (and ``KVSHM_RDMA_PORT``, ``KVSHM_RDMA_GID_INDEX``) choose the device;
default: the first device whose port 1 is active. Both ends run on this host (loopback
through the NIC).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvshm import Client
from kvshm.rdma import CompletionError, RdmaOptions

pytestmark = pytest.mark.rdma_device


def _pick() -> tuple[str | None, str]:
    try:
        from kvshm.rdma.device import open_port
        from kvshm.rdma.verbs import PyverbsBackend

        backend = PyverbsBackend()
        names = backend.device_names()
    except Exception as exc:
        return None, f"no RDMA device can be listed here: {exc}"
    if not names:
        return None, "pyverbs lists no RDMA device"
    want = os.environ.get("KVSHM_RDMA_DEV")
    port = int(os.environ.get("KVSHM_RDMA_PORT", "1"))
    gid = os.environ.get("KVSHM_RDMA_GID_INDEX")
    try:
        p = open_port(backend, want, port, gid_index=int(gid) if gid else None)
    except Exception as exc:
        return None, f"no usable RDMA port: {exc}"
    name = p.device
    p.close()
    return name, ""


DEV, WHY = _pick()
if DEV is None:
    pytest.skip(WHY, allow_module_level=True)

PORT = int(os.environ.get("KVSHM_RDMA_PORT", "1"))
GID = os.environ.get("KVSHM_RDMA_GID_INDEX")
FLAGS = ["--dev-name", DEV, "--ib-port", str(PORT)] + (["--gid-index", GID] if GID else [])
OPTS = RdmaOptions(dev_name=DEV, ib_port=PORT, gid_index=int(GID) if GID else None)


def test_endpoint_and_mover_without_a_server():
    """The verbs path alone: a numpy 'pool' registered by the server endpoint, a client
    link connected to it through accept(), RDMA WRITE and READ byte-exact."""
    from kvshm.rdma import ClientLink
    from kvshm.rdma.qp import QpInfo
    from kvshm.rdma.server import ServerEndpoint

    pool = np.zeros(16 << 20, np.uint8)
    ep = ServerEndpoint.open(DEV, ib_port=PORT, gid_index=OPTS.gid_index,
                             pool_bytes=pool.nbytes)
    link = ClientLink(OPTS, on_broken=lambda: None)
    try:
        ep.register_pool(pool.__array_interface__["data"][0], pool.nbytes)
        offer = link.prepare()
        reply = ep.hello_hook(b"c" * 16, {"rdma": offer})["rdma"]
        assert "error" not in reply, reply
        mover = link.connect(reply, "loopback")
        src = [np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
               for i, n in enumerate([64 << 10, 1 << 20, 3, 5 << 20])]
        offs = [0, 1 << 20, 3 << 20, 4 << 20]
        mover.write(offs, [memoryview(s) for s in src], [b"a", b"b", b"c", b"d"])
        for o, s in zip(offs, src):
            assert np.array_equal(pool[o:o + s.nbytes], s)
        outs = [np.zeros_like(s) for s in src]
        mover.read_into(offs, [s.nbytes for s in src], outs, [b"a", b"b", b"c", b"d"])
        assert all(np.array_equal(a, b) for a, b in zip(src, outs))
        assert mover.read_bytes([offs[2]], [3], [b"c"]) == [src[2].tobytes()]
        assert QpInfo.from_wire(reply["qp"]).link_layer == link.port.link_layer
        # a QP the server dropped: the next transfer fails with a completion error
        ep.drop(b"c" * 16)
        with pytest.raises(CompletionError) as ei:
            mover.read_into([0], [4096], [np.zeros(4096, np.uint8)], [b"gone"])
        assert ei.value.key == b"gone"
        mover.close()
    finally:
        link.close()
        ep.close()


def test_server_and_client_over_the_device():
    from servers import ServerProcess

    with ServerProcess(*FLAGS, prealloc_size=0.25) as srv:
        assert f"rdma {DEV}:{PORT}" in srv.ready_line
        with Client(srv.address, transport="rdma", timeout=10, rdma=OPTS) as c:
            assert c.transport == "rdma"
            for n, size in ((32, 64 << 10), (8, 1 << 20)):
                keys = [f"k{size}/{i}" for i in range(n)]
                vals = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
                        for i in range(n)]
                c.put_batch(keys, vals)
                outs = [np.zeros(size, np.uint8) for _ in range(n)]
                assert c.get_batch_into(keys, outs) == [size] * n
                assert all(np.array_equal(a, b) for a, b in zip(vals, outs))
                assert c.get_batch(keys[:2]) == [v.tobytes() for v in vals[:2]]
        with Client(srv.address, transport="tcp") as t:
            assert t.get("k65536/0") is not None
        assert srv.stop() == 0


def test_reconnect_after_a_server_restart():
    from servers import ServerProcess

    srv = ServerProcess(*FLAGS, prealloc_size=0.25)
    try:
        c = Client(srv.address, transport="rdma", timeout=10, rdma=OPTS)
        c.put("k", b"1" * 100_000)
        port = srv.port
        srv.stop()
        srv = ServerProcess(*FLAGS, prealloc_size=0.25, service_port=port)
        c.put("k", b"2" * 100_000)
        assert c.get("k") == b"2" * 100_000 and c.transport == "rdma"
        c.close()
    finally:
        srv.stop()
        srv.remove_segment()
