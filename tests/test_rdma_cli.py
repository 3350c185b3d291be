"""RDMA as a user meets it on a host without a device: `kvshm serve` with and without
--dev-name, and Client(transport="rdma"), with the real (pyverbs) backend."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvshm import Client, TransportError
from servers import ServerProcess, segment_exists, unique_shm_name


def _devices() -> list[str]:
    try:
        from kvshm.rdma.verbs import PyverbsBackend

        return PyverbsBackend().device_names()
    except Exception:
        return []


def _serve(*flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvshm", "serve", "--service-port", "0",
                           "--no-manage", "--prealloc-size", "0.0625", *flags],
                          capture_output=True, text=True, timeout=timeout)


def test_serve_with_a_missing_device_is_one_line_and_exit_2():
    devices = _devices()
    name = "mlx5_0" if "mlx5_0" not in devices else "kvshm_no_such_device0"
    shm = unique_shm_name("nodev-")
    r = _serve("--dev-name", name, "--shm-name", shm)
    assert r.returncode == 2, r
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith(f"kvshm serve: RDMA device {name}: "), line
    cause = line.split(f"RDMA device {name}: ", 1)[1]
    assert cause and "Traceback" not in r.stderr and r.stdout == ""
    if not devices:   # this host: say why there is no device at all
        assert ("no RDMA devices" in cause or "/dev/infiniband" in cause
                or "pyverbs is not importable" in cause or "listing" in cause)
    else:
        assert "no such device" in cause
    assert not segment_exists(shm)


@pytest.mark.parametrize("flags,word", [
    (["--dev-name", "mlx5_0", "--link-type", "fddi"], "--link-type"),
    (["--ib-port", "0"], "--ib-port"),
    (["--gid-index", "-3"], "--gid-index"),
])
def test_bad_rdma_flags_are_usage_errors(flags, word):
    r = _serve(*flags, "--shm-name", unique_shm_name("bad-"))
    assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr


def test_serve_without_dev_name_serves_shm_and_tcp_as_before():
    with ServerProcess(prealloc_size=0.0625) as srv:
        assert "rdma" not in srv.ready_line
        for transport in ("shm", "tcp"):
            with Client(srv.address, transport=transport) as c:
                c.put("k", b"v" * 1000)
                assert c.get("k") == b"v" * 1000
                assert "rdma" not in c.server_info
        assert srv.stop() == 0


@pytest.mark.skipif(bool(_devices()), reason="this host lists RDMA devices")
def test_client_rdma_without_a_device_names_the_cause():
    with ServerProcess(prealloc_size=0.0625) as srv:
        with pytest.raises(TransportError) as ei:
            Client(srv.address, transport="rdma", timeout=5)
        msg = str(ei.value)
        assert msg.startswith("RDMA"), msg
        assert ("no RDMA devices" in msg or "/dev/infiniband" in msg
                or "pyverbs is not importable" in msg or "listing" in msg)
        with pytest.raises(TransportError, match="RDMA device mlx5_0: "):
            Client(srv.address, transport="rdma", timeout=5, rdma={"dev_name": "mlx5_0"})
        # transport="auto" does not fail for it
        with Client(srv.address, transport="auto", timeout=5) as c:
            assert c.transport == "shm"


def test_missing_pyverbs_says_what_to_install(tmp_path):
    code = ("import kvshm.rdma.verbs as v, sys\n"
            "sys.modules['pyverbs'] = None\n"       # a plain `import pyverbs` fails
            "v.pyverbs_search_dirs = lambda: []\n"  # and no distribution copy is found
            "try:\n"
            "    v.load_pyverbs()\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("DeviceError RDMA: pyverbs is not importable")
    assert "apt-get install python3-pyverbs" in r.stdout
