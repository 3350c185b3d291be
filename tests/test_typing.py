"""mypy passes on the typed core, and the stubs of the compiled modules say what they do.

For now mypy checks the stubs, kvshm/errors.py, kvshm/__init__.py, kvshm/store/, the clients
(kvshm/client.py, kvshm/aio.py, kvshm/zmq_ctrl/channel.py) and every perf/ script:
modules these import are analysed but their own errors are not reported
(``--follow-imports=silent``), so that modules in the middle of an edit do not fail this
test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["kvshm/_bitmap.pyi", "kvshm/_pool.pyi", "kvshm/_shmindex.pyi", "kvshm/localread.py",
           "kvshm/zmq_ctrl/_zmqc.pyi", "kvshm/zmq_ctrl/_zmtp.pyi", "kvshm/zmq_ctrl/_fastpath.pyi",
           "kvshm/zmq_ctrl/_zmtpsrv.pyi",
           "kvshm/_index.pyi",
           "kvshm/_batch.pyi",
           "kvshm/errors.py", "kvshm/__init__.py",
           # the store's parts share their state through kvshm/store/parts.py
           "kvshm/store/",
           # the clients and their control channel (session 28)
           "kvshm/client.py", "kvshm/aio.py", "kvshm/zmq_ctrl/channel.py"]

Mypy = Callable[..., "tuple[str, int]"]


@pytest.fixture(scope="module")
def mypy(tmp_path_factory: pytest.TempPathFactory) -> Mypy:
    """Run mypy with the project's config in a child process; returns (output, exit
    status). Not in this process: mypy's in-process run leaves its whole build graph
    behind (and gc thresholds of its own), after which every gc.collect() of the test
    process took ~11 s and a later test waiting on a collection timed out."""
    cache = tmp_path_factory.mktemp("mypy-cache")

    def run(*args: str) -> tuple[str, int]:
        p = subprocess.run(
            [
                sys.executable, "-m", "mypy",
                "--config-file", str(ROOT / "pyproject.toml"),
                "--cache-dir", str(cache),
                "--follow-imports=silent",
                "--show-error-codes",
                "--no-error-summary",
                *args,
            ],
            capture_output=True, text=True, cwd=ROOT, timeout=900)
        return p.stdout + p.stderr, p.returncode

    return run


def test_mypy_passes_on_the_typed_core(mypy: Mypy) -> None:
    out, status = mypy(*(str(ROOT / f) for f in CHECKED))
    assert status == 0, out


def test_mypy_passes_on_perf(mypy: Mypy) -> None:
    """Every benchmark script under perf/ (and the peers' client they share with the
    replay, kvshm/replay/peer_client.py), with the same settings."""
    scripts = sorted(str(p) for p in (ROOT / "perf").glob("*.py"))
    assert len(scripts) > 10
    out, status = mypy(*scripts, str(ROOT / "kvshm/replay/peer_client.py"))
    assert status == 0, out


GOOD = """
    import numpy as np
    from kvshm import BitmapAllocator, Pool

    a = BitmapAllocator(1024)
    start: int = a.alloc(4)
    starts: list[int] = a.alloc_many([1, 2]) + a.alloc_many(np.array([3], dtype=np.int64))
    a.free(start, 4)
    ok: bool = a.is_free(0) and a.num_free + a.num_used + a.largest_free_run > len(a)

    with Pool.create("x", 1 << 20, block_size=4096, token=bytes(16)) as p:
        n: int = p.write(0, b"abc") + p.write(8, np.zeros(4)) + p.write(16, memoryview(b"x"))
        n += p.read_into(0, bytearray(3)) + p.read_into(0, np.empty(2), 8)
        n += p.scatter(b"abcd", [0, 8], np.array([2, 2]), src_offsets=range(0, 4, 2))
        n += p.gather(range(2), [1, 1], bytearray(2), dst_offsets=None)
        n += p.write_many([0, 8], [b"a", bytearray(b"b")]) + p.read_many_into([0], [bytearray(1)])
        v: memoryview = p.view(0, 16, readonly=True)
        data: bytes = p.read_bytes(0, 4) + b"".join(p.read_bytes_many([0], [4]))
        name: str = p.name
        flags: bool = p.owner or p.closed
        sizes: int = p.size + p.block_size + p.num_blocks + p.address + p.num_views
        q = Pool.attach(name, populate=False)
        token: bytes = q.token
        pid: int = q.creator_pid
        q.close()
        p.unlink()
"""

BAD = {
    "alloc takes an int": "a.alloc('4')",
    "alloc returns an int": "s: str = a.alloc(4)",
    "free takes a start and a count": "a.free(0)",
    "no such method": "a.allocate(1)",
    "num_free is read-only": "a.num_free = 3",
    "create takes a size": "Pool.create('x')",
    "names are str": "Pool.attach(b'x')",
    "write takes a buffer": "p.write(0, 'text')",
    "read_into takes an offset first": "p.read_into(bytearray(3), 0)",
    "view returns a memoryview": "b: bytes = p.view(0, 1)",
    "block_size is read-only": "p.block_size = 4096",
    "token is keyword-only": "Pool.create('x', 4096, 4096, bytes(16))",
}


def test_stubs_accept_real_usage(mypy: Mypy, tmp_path: Path) -> None:
    src = tmp_path / "good.py"
    src.write_text(textwrap.dedent(GOOD))
    out, status = mypy(str(src))
    assert status == 0, out


@pytest.mark.parametrize("case", BAD)
def test_stubs_reject_misuse(mypy: Mypy, tmp_path: Path, case: str) -> None:
    src = tmp_path / "bad.py"
    src.write_text(
        "from kvshm import BitmapAllocator, Pool\n"
        "a = BitmapAllocator(8)\n"
        "p = Pool.attach('x')\n" + BAD[case] + "\n"
    )
    out, status = mypy(str(src))
    assert status == 1 and "bad.py:4: error" in out, out

