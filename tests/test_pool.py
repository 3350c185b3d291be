"""Pool: the shared-memory segment, its bounds checks, lifetime rules and copies."""

from __future__ import annotations

import array
import errno
import gc
import mmap
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc
import pytest

import kvshm
from kvshm import Pool
from kvshm._pool import HEADER_SIZE

ROOT = Path(__file__).resolve().parents[1]
KVSHM_HOME = Path(kvshm.__file__).resolve().parents[1]  # where this process imports it from
KIB = 1024
MIB = 1024 * KIB
SIZE = 64 * KIB  # data bytes of the small pool most tests use
BLOCK = 4 * KIB


def shm_path(name: str) -> str:
    return os.path.join("/dev/shm", name.lstrip("/"))


def run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (importing the kvshm under test); killed on timeout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(KVSHM_HOME), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-W", "error::ResourceWarning", "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def wait_child(pid: int, timeout: float = 30) -> int:
    """waitpid with a deadline; a hung child is killed and the test fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"child {pid} did not exit within {timeout} s")


@pytest.fixture
def hold() -> Iterator[Callable[[str], None]]:
    """Check that a segment's liveness lock is held, as ``Pool.create`` does.

    ``kvshm ctl cleanup`` and every server starting up remove kvshm segments whose
    creator holds no ``flock`` on them; the creating Pool holds it until unlink, so a
    server test of another session on this machine can never remove a test's pool.
    """
    from kvshm import segments

    def _hold(name: str) -> None:
        assert segments.is_held(name), f"{name} is not locked by its creator"

    yield _hold


def test_creator_holds_liveness_lock_until_unlink(shm_name: str) -> None:
    from kvshm import segments

    p = Pool.create(shm_name, SIZE, block_size=BLOCK)
    assert segments.is_held(shm_name)
    assert segments.cleanup(shm_name) == []          # a live pool is never removed
    assert os.path.exists(shm_path(shm_name))
    p.close()
    assert segments.is_held(shm_name)                # closed but not unlinked: still ours
    p.unlink()
    assert not os.path.exists(shm_path(shm_name))


@pytest.fixture
def pool(shm_name: str, hold: Callable[[str], None]) -> Iterator[Pool]:
    p = Pool.create(shm_name, SIZE, block_size=BLOCK)
    hold(shm_name)
    yield p
    p.close()
    p.unlink()


def contents(p: Pool) -> bytes:
    out = bytearray(p.size)
    p.read_into(0, out)
    return bytes(out)


def pattern(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# ------------------------------------------------------------------------- create / attach


def test_create_sets_geometry_and_header(shm_name: str) -> None:
    token = bytes(range(16))
    with Pool.create(shm_name, 8 * BLOCK, block_size=BLOCK, token=token) as p:
        assert p.name == "/" + shm_name
        assert (p.size, p.block_size, p.num_blocks) == (8 * BLOCK, BLOCK, 8)
        assert p.token == token and p.creator_pid == os.getpid() and p.owner
        assert p.address % 4096 == 0 and not p.closed and shm_name in repr(p)
        assert os.stat(shm_path(shm_name)).st_size == HEADER_SIZE + 8 * BLOCK
        q = Pool.attach(shm_name)
        try:
            assert (q.size, q.block_size, q.token) == (p.size, p.block_size, token)
            assert q.creator_pid == os.getpid() and not q.owner
        finally:
            q.close()
    assert p.closed and not os.path.exists(shm_path(shm_name))


def test_constructor_is_not_public() -> None:
    with pytest.raises(TypeError):
        Pool()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(size=0),
        dict(size=BLOCK + 1),
        dict(size=-BLOCK),
        dict(size=SIZE, block_size=1000),
        dict(size=SIZE, block_size=0),
        dict(size=SIZE, token=b"short"),
    ],
)
def test_create_rejects_bad_geometry(shm_name: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Pool.create(shm_name, **kwargs)
    assert not os.path.exists(shm_path(shm_name))


@pytest.mark.parametrize("bad", ["", "/", "a/b", "x" * 300, "a\0b"])
def test_bad_names(bad: str) -> None:
    with pytest.raises(ValueError):
        Pool.create(bad, SIZE)
    with pytest.raises(ValueError):
        Pool.attach(bad)
    with pytest.raises(TypeError):
        Pool.attach(123)  # type: ignore[arg-type]


def test_leading_slash_is_the_same_name(shm_name: str) -> None:
    with Pool.create("/" + shm_name, SIZE, block_size=BLOCK) as p:
        assert p.name == "/" + shm_name and os.path.exists(shm_path(shm_name))


def test_create_existing_name_fails(pool: Pool, shm_name: str) -> None:
    pool.write(0, b"keep")
    with pytest.raises(FileExistsError):
        Pool.create(shm_name, SIZE, block_size=BLOCK)
    assert contents(pool)[:4] == b"keep"  # the existing segment is untouched


def test_segment_mode_is_0600(shm_name: str) -> None:
    old = os.umask(0)  # the mode must not depend on a strict umask
    try:
        p = Pool.create(shm_name, SIZE, block_size=BLOCK)
    finally:
        os.umask(old)
    with p:
        assert os.stat(shm_path(shm_name)).st_mode & 0o777 == 0o600


def test_attach_missing_name(shm_name: str) -> None:
    with pytest.raises(FileNotFoundError):
        Pool.attach(shm_name)


def _foreign_segment(name: str, data: bytes, size: int) -> None:
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        with mmap.mmap(shm.fd, size) as m:
            m[: len(data)] = data
    finally:
        shm.close_fd()


def _header(magic: bytes = b"KVSHMPL1", version: int = 1, size: int = 4096, block: int = 4096) -> bytes:
    return struct.pack("<8sIIQQQQ16s", magic, version, 0, size, block, 1, 0, b"\0" * 16)


@pytest.mark.parametrize(
    "data,size",
    [
        (b"", 2 * 4096),  # zeros: no magic
        (b"not a kvshm pool", 2 * 4096),
        (b"", 100),  # smaller than a header
        (_header(magic=b"SOMEPOOL"), 2 * 4096),
        (_header(version=99), 2 * 4096),
        (_header(size=1 << 30), 2 * 4096),  # data size beyond the segment
        (_header(block=0), 2 * 4096),
        (_header(size=4096, block=3000), 2 * 4096),  # size not a multiple of the block
    ],
    ids=["zeros", "text", "tiny", "magic", "version", "oversize", "block0", "misaligned"],
)
def test_attach_foreign_segment(shm_name: str, data: bytes, size: int) -> None:
    _foreign_segment(shm_name, data, size)
    try:
        with pytest.raises(ValueError):
            Pool.attach(shm_name)
    finally:
        posix_ipc.unlink_shared_memory("/" + shm_name)


def test_a_good_forged_header_attaches(shm_name: str) -> None:
    """The foreign-segment cases fail for the reason they test, not for any header."""
    _foreign_segment(shm_name, _header(), 2 * 4096)
    try:
        p = Pool.attach(shm_name)
        assert (p.size, p.block_size, p.owner) == (4096, 4096, False)
        p.close()
    finally:
        posix_ipc.unlink_shared_memory("/" + shm_name)


def test_too_large_for_dev_shm_fails_before_allocating(shm_name: str) -> None:
    st = os.statvfs("/dev/shm")
    # more than the whole tmpfs: even a fallocate would be refused at once, never filled
    size = (st.f_blocks * st.f_frsize // MIB + 1024) * MIB
    with pytest.raises(OSError) as info:
        Pool.create(shm_name, size, block_size=MIB)
    assert info.value.errno == errno.ENOSPC
    assert "/dev/shm" in str(info.value) and str(HEADER_SIZE + size) in str(info.value)
    assert not os.path.exists(shm_path(shm_name))


def test_statvfs_is_checked_before_the_segment_exists(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pretend /dev/shm has 4 KiB free: a 1 MiB pool fails at once and creates nothing."""
    real = os.statvfs
    calls: list[str] = []

    def tiny(path: str) -> Any:
        calls.append(path)
        assert not os.path.exists(shm_path(shm_name)), "segment created before the check"
        st = real(path)
        return types.SimpleNamespace(
            f_bavail=1, f_bfree=1, f_frsize=4096, f_bsize=4096, f_blocks=st.f_blocks
        )

    monkeypatch.setattr(os, "statvfs", tiny)
    with pytest.raises(OSError) as info:
        Pool.create(shm_name, MIB, block_size=BLOCK)
    assert info.value.errno == errno.ENOSPC and calls
    assert not os.path.exists(shm_path(shm_name))


# ------------------------------------------------------------------------- across processes

CHILD = """
    import hashlib, sys
    from kvshm import Pool
    name, size, block, token, pid, digest = sys.argv[1:7]
    p = Pool.attach(name)
    assert p.size == int(size) and p.block_size == int(block), (p.size, p.block_size)
    assert p.token.hex() == token and p.creator_pid == int(pid) and not p.owner
    buf = bytearray(100_000)
    p.read_into(12_345, buf)
    assert hashlib.sha256(buf).hexdigest() == digest, "bytes differ in the child"
    p.write(500_000, bytes(reversed(buf)))
    try:
        p.unlink()
    except PermissionError:
        print("unlink refused")
    with p:  # a client's exit path closes and never unlinks
        pass
    print("child ok")
"""


def test_bytes_cross_processes(shm_name: str, hold: Callable[[str], None]) -> None:
    import hashlib

    data = pattern(100_000)
    with Pool.create(shm_name, 16 * 64 * KIB) as p:
        hold(shm_name)
        p.write(12_345, data)
        args = [shm_name, str(p.size), str(p.block_size), p.token.hex(), str(os.getpid())]
        res = run_python(CHILD, *args, hashlib.sha256(data).hexdigest())
        assert res.returncode == 0, res.stderr
        assert res.stdout.split("\n")[:2] == ["unlink refused", "child ok"]
        assert os.path.exists(shm_path(shm_name))  # the client did not unlink
        back = bytearray(100_000)
        p.read_into(500_000, back)
        assert bytes(back) == data[::-1]
    assert not os.path.exists(shm_path(shm_name))


def test_forked_child_is_not_owner(shm_name: str, hold: Callable[[str], None]) -> None:
    p = Pool.create(shm_name, SIZE, block_size=BLOCK)
    hold(shm_name)
    p.write(0, b"parent")
    pid = os.fork()
    if pid == 0:  # child: report through the exit code only, never return into pytest
        code = 1
        try:
            code = 2 if p.owner or p.creator_pid != os.getppid() else 3
            try:
                p.unlink()
            except PermissionError:
                code = 4
            if code == 4:
                p.write(0, b"child!")  # MAP_SHARED: the parent sees it
                p.__exit__(None, None, None)  # close; a non-owner does not unlink
                code = 0
        finally:
            os._exit(code)
    assert wait_child(pid) == 0
    assert p.owner
    assert os.path.exists(shm_path(shm_name))
    assert contents(p)[:6] == b"child!"
    p.close()
    p.unlink()
    assert not os.path.exists(shm_path(shm_name))


# ------------------------------------------------------------------------- lifetime


def test_unlink_only_by_creator(pool: Pool, shm_name: str) -> None:
    pool.write(0, b"still here")
    client = Pool.attach(shm_name)
    try:
        assert not client.owner
        with pytest.raises(PermissionError):
            client.unlink()
        assert os.path.exists(shm_path(shm_name))
        pool.unlink()
        pool.unlink()  # idempotent in the creator
        assert not os.path.exists(shm_path(shm_name))
        with pytest.raises(FileNotFoundError):
            Pool.attach(shm_name)
        buf = bytearray(10)  # the memory lives on while mapped
        client.read_into(0, buf)
        assert bytes(buf) == b"still here"
    finally:
        client.close()


def test_close_is_idempotent(pool: Pool) -> None:
    pool.close()
    pool.close()
    assert pool.closed
    with pytest.raises(ValueError):
        pool.write(0, b"x")
    with pytest.raises(ValueError):
        pool.read_into(0, bytearray(1))
    with pytest.raises(ValueError):
        pool.view(0, 1)
    with pytest.raises(ValueError):
        pool.gather([0], [1], bytearray(1))
    with pytest.raises(ValueError):
        pool.write_many([0], [b"x"])
    with pytest.raises(ValueError):
        pool.address  # noqa: B018


def test_close_refused_while_a_view_lives(pool: Pool) -> None:
    v = pool.view(100, 10)
    v[:] = b"0123456789"  # zero-copy: the pool sees it
    assert contents(pool)[100:110] == b"0123456789"
    assert pool.num_views == 1
    with pytest.raises(BufferError):
        pool.close()
    assert not pool.closed
    pool.write(100, b"abc")  # still open and usable
    assert bytes(v[:3]) == b"abc"
    arr = np.frombuffer(v, dtype=np.uint8)  # an array made from the view shares its export
    part = v[2:5]  # and so does a slice
    v.release()
    with pytest.raises(BufferError):
        pool.close()
    del arr
    with pytest.raises(BufferError):
        pool.close()
    assert bytes(part) == b"c34"
    part.release()
    assert pool.num_views == 0
    pool.close()
    assert pool.closed


def test_view_export_cannot_outlive_close(pool: Pool) -> None:
    v = pool.view(0, 8)
    exporter = v.obj
    v.release()
    pool.close()
    with pytest.raises(BufferError):
        memoryview(exporter)


def test_readonly_view(pool: Pool) -> None:
    pool.write(0, b"abc")
    v = pool.view(0, 3, readonly=True)
    assert v.readonly and bytes(v) == b"abc"
    with pytest.raises(TypeError):
        v[0] = 1
    v.release()


def _collect_others_garbage() -> None:
    """Collect what earlier tests left in reference cycles (an unclosed asyncio client's
    sockets warn when collected) before a test that expects exactly its own warning."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def test_unclosed_pool_warns_and_is_cleaned_up(shm_name: str) -> None:
    p = Pool.create(shm_name, SIZE, block_size=BLOCK)
    _collect_others_garbage()
    with pytest.warns(ResourceWarning, match="never closed"):
        del p
        gc.collect()
    assert not os.path.exists(shm_path(shm_name))  # the creator's finalizer unlinks


def test_unclosed_client_warns_and_leaves_the_segment(pool: Pool, shm_name: str) -> None:
    client = Pool.attach(shm_name)
    _collect_others_garbage()
    with pytest.warns(ResourceWarning, match="never closed"):
        del client
        gc.collect()
    assert os.path.exists(shm_path(shm_name))


def test_cleanup_happens_even_when_the_warning_is_an_error(shm_name: str) -> None:
    p = Pool.create(shm_name, SIZE, block_size=BLOCK)
    seen: list[Any] = []
    old_hook = sys.unraisablehook
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        sys.unraisablehook = seen.append
        try:
            del p
            gc.collect()
        finally:
            sys.unraisablehook = old_hook
    assert any(isinstance(u.exc_value, ResourceWarning) for u in seen)
    assert not os.path.exists(shm_path(shm_name))


# ------------------------------------------------------------------------- bounds


@pytest.mark.parametrize("offset,n", [(SIZE - 3, 4), (SIZE, 1), (SIZE + BLOCK, 1), (-1, 1), (-8, 4)])
def test_write_out_of_range(pool: Pool, shm_name: str, offset: int, n: int) -> None:
    pool.write(0, pattern(SIZE))
    before = contents(pool)
    with pytest.raises(IndexError):
        pool.write(offset, b"\xff" * n)
    assert contents(pool) == before
    other = Pool.attach(shm_name)  # the header in front of the data is intact too
    assert other.token == pool.token and other.size == SIZE
    other.close()


def test_write_up_to_the_end(pool: Pool) -> None:
    assert pool.write(SIZE - 4, b"last") == 4
    assert pool.write(SIZE, b"") == 0
    assert contents(pool)[-4:] == b"last"


def test_huge_offsets(pool: Pool) -> None:
    top = 2**63 - 1  # offset + size overflows int64: must still be refused, not wrap
    with pytest.raises(IndexError):
        pool.write(top, b"x")
    with pytest.raises(IndexError):
        pool.read_into(top, bytearray(1))
    with pytest.raises(IndexError):
        pool.gather([top], [1], bytearray(1))
    with pytest.raises(IndexError):
        pool.scatter(b"x", [top], [1])
    with pytest.raises((IndexError, OverflowError)):
        pool.write(2**63, b"x")


def test_read_into_out_of_range(pool: Pool) -> None:
    pool.write(0, pattern(SIZE))
    dst = bytearray(b"\x00" * 8)
    with pytest.raises(IndexError):
        pool.read_into(SIZE - 3, dst, 4)
    with pytest.raises(IndexError):
        pool.read_into(SIZE - 3, dst)  # default size: all 8 bytes of dst
    with pytest.raises(IndexError):
        pool.read_into(-1, dst, 1)
    with pytest.raises(ValueError):
        pool.read_into(0, dst, 9)  # larger than dst
    with pytest.raises(ValueError):
        pool.read_into(0, dst, -2)  # negative (only -1 means "all of dst")
    assert dst == bytearray(8)
    assert pool.read_into(SIZE - 8, dst) == 8 and dst == contents(pool)[-8:]
    assert pool.read_into(0, dst, 0) == 0


def test_view_out_of_range(pool: Pool) -> None:
    with pytest.raises(IndexError):
        pool.view(SIZE - 3, 4)
    with pytest.raises(IndexError):
        pool.view(-1, 1)
    with pytest.raises(ValueError):
        pool.view(0, -1)
    assert pool.num_views == 0
    v = pool.view(SIZE, 0)
    assert len(v) == 0
    v.release()


def test_scatter_checks_every_piece_first(pool: Pool) -> None:
    pool.write(0, bytes(SIZE))
    src = b"abcdefgh"
    with pytest.raises(IndexError):
        pool.scatter(src, [0, SIZE - 2], [4, 4])  # the second piece runs past the end
    with pytest.raises(IndexError):
        pool.scatter(src, [0, 100], [4, 5])  # 9 bytes asked of an 8-byte src
    with pytest.raises(IndexError):
        pool.scatter(src, [0, 100], [4, 4], src_offsets=[0, 5])
    with pytest.raises(IndexError):
        pool.scatter(src, [0], [4], src_offsets=[-1])
    with pytest.raises(IndexError):
        pool.scatter(src, [-4], [4])
    with pytest.raises(ValueError):
        pool.scatter(src, [0, 100], [4])
    with pytest.raises(ValueError):
        pool.scatter(src, [0], [4], src_offsets=[0, 4])
    with pytest.raises(ValueError):
        pool.scatter(src, [0], [-1])
    assert contents(pool) == bytes(SIZE)  # nothing moved


def test_gather_checks_every_piece_first(pool: Pool) -> None:
    pool.write(0, pattern(SIZE))
    dst = bytearray(8)
    with pytest.raises(IndexError):
        pool.gather([0, SIZE - 2], [4, 4], dst)
    with pytest.raises(IndexError):
        pool.gather([0, 100], [4, 5], dst)
    with pytest.raises(IndexError):
        pool.gather([0, 100], [4, 4], dst, dst_offsets=[0, 5])
    with pytest.raises(IndexError):
        pool.gather([0], [4], dst, dst_offsets=[-1])
    with pytest.raises(ValueError):
        pool.gather([0, 1], [4], dst)
    with pytest.raises(ValueError):
        pool.gather([0], [-4], dst)
    assert dst == bytearray(8)


def test_write_many_checks_every_buffer_first(pool: Pool) -> None:
    pool.write(0, bytes(SIZE))
    with pytest.raises(IndexError):
        pool.write_many([0, SIZE - 2], [b"abcd", b"abcd"])
    with pytest.raises(IndexError):
        pool.write_many([0, -1], [b"abcd", b"abcd"])
    with pytest.raises(ValueError):
        pool.write_many([0, 8], [b"abcd"])
    assert contents(pool) == bytes(SIZE)


def test_read_many_into_checks_every_buffer_first(pool: Pool) -> None:
    pool.write(0, pattern(SIZE))
    dsts = [bytearray(4), bytearray(4)]
    with pytest.raises(IndexError):
        pool.read_many_into([0, SIZE - 2], dsts)
    with pytest.raises(ValueError):
        pool.read_many_into([0, 8], dsts, sizes=[4, 5])  # larger than dst 1
    with pytest.raises(ValueError):
        pool.read_many_into([0, 8], dsts, sizes=[4, -1])
    with pytest.raises(ValueError):
        pool.read_many_into([0, 8], dsts, sizes=[4])
    with pytest.raises(ValueError):
        pool.read_many_into([0], dsts)
    assert dsts == [bytearray(4), bytearray(4)]


def test_read_bytes_checks_ranges(pool: Pool) -> None:
    pool.write(0, pattern(SIZE))
    with pytest.raises(IndexError):
        pool.read_bytes(SIZE - 3, 4)
    with pytest.raises(IndexError):
        pool.read_bytes(-1, 1)
    with pytest.raises(ValueError):
        pool.read_bytes(0, -1)
    with pytest.raises(IndexError):
        pool.read_bytes_many([0, SIZE - 3], [4, 4])
    with pytest.raises(ValueError):
        pool.read_bytes_many([0, 8], [4])
    with pytest.raises(ValueError):
        pool.read_bytes_many([0], [-4])
    assert pool.read_bytes(SIZE - 4, 4) == pattern(SIZE)[-4:]
    assert pool.read_bytes_many(np.array([SIZE - 4, 0]), [4, 0]) == [pattern(SIZE)[-4:], b""]
    pool.close()
    with pytest.raises(ValueError):
        pool.read_bytes(0, 1)
    with pytest.raises(ValueError):
        pool.read_bytes_many([0], [1])


# ------------------------------------------------------------------------- copies

OFFSET_KINDS: dict[str, Callable[[list[int]], Any]] = {
    "list": list,
    "tuple": tuple,
    "int64": lambda xs: np.array(xs, dtype=np.int64),
    "int32": lambda xs: np.array(xs, dtype=np.int32),
    "array_q": lambda xs: array.array("q", xs),
}


@pytest.mark.parametrize("kind", OFFSET_KINDS)
def test_scatter_gather_round_trip(pool: Pool, kind: str) -> None:
    as_ = OFFSET_KINDS[kind]
    src = pattern(1000)
    offsets, sizes = [SIZE - 100, 0, 5000], [100, 400, 500]
    assert pool.scatter(src, as_(offsets), as_(sizes)) == 1000
    data = contents(pool)
    assert data[SIZE - 100 :] == src[:100] and data[:400] == src[100:500]
    assert data[5000:5500] == src[500:]
    dst = bytearray(1000)
    assert pool.gather(as_(offsets), as_(sizes), dst) == 1000
    assert bytes(dst) == src
    # explicit buffer offsets: pieces in any order, with gaps
    dst2 = bytearray(1200)
    pool.gather(as_(offsets), as_(sizes), dst2, dst_offsets=as_([1100, 0, 600]))
    assert dst2[1100:] == src[:100] and dst2[:400] == src[100:500] and dst2[600:1100] == src[500:]
    pool.scatter(bytes(dst2), as_([0]), as_([100]), src_offsets=as_([1100]))
    assert contents(pool)[:100] == src[:100]


def test_write_many_read_many_into(pool: Pool) -> None:
    srcs: list[Any] = [
        pattern(100, 1),
        bytearray(pattern(200, 2)),
        memoryview(pattern(300, 3)),
        np.frombuffer(pattern(400, 4), dtype=np.float32),
        array.array("d", [1.5] * 10),
    ]
    offsets = [0, 1000, 2000, 3000, 4000]
    total = sum(memoryview(s).nbytes for s in srcs)
    assert pool.write_many(offsets, srcs) == total
    dsts: list[Any] = [bytearray(100), np.empty(50, np.int32), bytearray(300), np.empty(400, np.uint8)]
    dsts.append(memoryview(bytearray(80)))
    assert pool.read_many_into(offsets, dsts) == total
    for s, d in zip(srcs, dsts):
        assert memoryview(d).tobytes() == memoryview(s).tobytes()
    part = [bytearray(10), bytearray(10)]
    assert pool.read_many_into(np.array([0, 1000]), part, sizes=[3, 10]) == 13
    assert part[0][:3] == srcs[0][:3] and part[0][3:] == bytearray(7)
    assert pool.write_many([], []) == 0


DTYPES = [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64, np.float16,
          np.float32, np.float64, np.complex64, np.bool_]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_dtypes(pool: Pool, dtype: Any) -> None:
    raw = np.frombuffer(pattern(4096), dtype=np.uint8)
    src = (raw & 1).astype(np.bool_) if dtype is np.bool_ else raw.view(dtype)
    assert pool.write(BLOCK, src) == src.nbytes
    dst = np.zeros_like(src)
    assert pool.read_into(BLOCK, dst) == src.nbytes
    assert dst.tobytes() == src.tobytes()
    dst2 = np.zeros_like(src)
    pool.gather([BLOCK], [src.nbytes], dst2)
    assert dst2.tobytes() == src.tobytes()


@pytest.mark.parametrize("order", ["C", "F"])
def test_contiguous_2d_arrays(pool: Pool, order: Any) -> None:
    src = np.asarray(np.arange(60, dtype=np.float64).reshape(6, 10), order=order)
    pool.write(0, src)
    dst = np.zeros((6, 10), dtype=np.float64, order=order)
    pool.read_into(0, dst)
    np.testing.assert_array_equal(dst, src)


def non_contiguous() -> np.ndarray:
    a = np.arange(64, dtype=np.float32).reshape(8, 8)[:, ::2]
    assert not a.flags.c_contiguous and not a.flags.f_contiguous
    return a

NON_CONTIGUOUS_CALLS: dict[str, Callable[[Pool, Any], Any]] = {
    "write": lambda p, a: p.write(0, a),
    "read_into": lambda p, a: p.read_into(0, a),
    "scatter": lambda p, a: p.scatter(a, [0], [4]),
    "gather": lambda p, a: p.gather([0], [4], a),
    "write_many": lambda p, a: p.write_many([0], [a]),
    "read_many_into": lambda p, a: p.read_many_into([0], [a]),
}


@pytest.mark.parametrize("call", NON_CONTIGUOUS_CALLS)
def test_non_contiguous_numpy_is_refused(pool: Pool, call: str) -> None:
    before = contents(pool)
    with pytest.raises(ValueError, match="contiguous"):
        NON_CONTIGUOUS_CALLS[call](pool, non_contiguous())
    assert contents(pool) == before


def _readonly_array() -> np.ndarray:
    a = np.zeros(16, dtype=np.uint8)
    a.flags.writeable = False
    return a


READONLY_DSTS: dict[str, Callable[[], Any]] = {
    "bytes": lambda: bytes(16),
    "readonly_numpy": _readonly_array,
    "readonly_memoryview": lambda: memoryview(bytearray(16)).toreadonly(),
}


@pytest.mark.parametrize("kind", READONLY_DSTS)
def test_readonly_destination_is_a_type_error(pool: Pool, kind: str) -> None:
    make = READONLY_DSTS[kind]
    with pytest.raises(TypeError):
        pool.read_into(0, make())
    with pytest.raises(TypeError):
        pool.gather([0], [4], make())
    with pytest.raises(TypeError):
        pool.read_many_into([0, 16], [bytearray(16), make()])


def test_non_buffers_are_a_type_error(pool: Pool) -> None:
    with pytest.raises(TypeError):
        pool.write(0, "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pool.read_into(0, [0, 0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pool.write_many([0], [12])  # type: ignore[list-item]


TORCH_DTYPES = ["float32", "bfloat16", "float16", "int8", "uint8", "int64"]


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_cpu_tensors(pool: Pool, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    tdtype = getattr(torch, dtype)
    raw = torch.frombuffer(bytearray(pattern(2048)), dtype=torch.uint8)
    src = raw.view(tdtype).reshape(4, -1)
    assert pool.write(0, src) == 2048
    dst = torch.zeros_like(src)
    assert pool.read_into(0, dst) == 2048
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    out = torch.zeros(2048, dtype=torch.uint8).view(tdtype)
    pool.gather([1024, 0], [1024, 1024], out)  # halves swapped
    assert bytes(out.view(torch.uint8)[:1024].numpy()) == pattern(2048)[1024:]
    pieces = [torch.zeros(2, 128, dtype=torch.uint8).view(tdtype) for _ in range(2)]
    pool.read_many_into([0, 1024], pieces, sizes=[256, 256])
    assert bytes(pieces[1].view(torch.uint8).flatten().numpy()) == pattern(2048)[1024:1280]
    pool.scatter(src, [5000], [16])
    pool.write_many([6000], [src])
    assert contents(pool)[5000:5016] == pattern(2048)[:16]
    assert contents(pool)[6000:8048] == pattern(2048)


def test_torch_non_contiguous_is_refused(pool: Pool) -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(8, 8).t()
    with pytest.raises(ValueError, match="contiguous"):
        pool.write(0, t)
    with pytest.raises(ValueError, match="contiguous"):
        pool.read_into(0, t)


# ------------------------------------------------------------------------- threads

COPIES: dict[str, Callable[[Pool, np.ndarray], Any]] = {
    # every call moves the whole 64 MiB pool, in 1 MiB pieces where the call takes pieces
    "gather": lambda p, b: p.gather(range(0, p.size, MIB), [MIB] * 64, b),
    "scatter": lambda p, b: p.scatter(b, range(0, p.size, MIB), [MIB] * 64),
    "read_many_into": lambda p, b: p.read_many_into(range(0, p.size, MIB), b.reshape(64, MIB)),
    "write_many": lambda p, b: p.write_many(range(0, p.size, MIB), b.reshape(64, MIB)),
    "read_into": lambda p, b: p.read_into(0, b),
    "write": lambda p, b: p.write(0, b),
    "read_bytes": lambda p, b: p.read_bytes(0, p.size),
    "read_bytes_many": lambda p, b: p.read_bytes_many(range(0, p.size, MIB), [MIB] * 64),
}


@pytest.fixture
def big_pool(shm_name: str, hold: Callable[[str], None]) -> Iterator[Pool]:
    p = Pool.create(shm_name, 64 * MIB, block_size=MIB)
    hold(shm_name)
    yield p
    p.close()
    p.unlink()


@pytest.mark.parametrize("copy", COPIES)
def test_copies_release_the_gil(big_pool: Pool, copy: str) -> None:
    """Another Python thread makes progress while one thread copies 256 MiB.

    The switch interval is raised to 100 s for the test, so the copying thread is never
    made to hand over the GIL: the counter can only move while a copy has released it.
    The counting thread gives the GIL back after each step (a 0.1 ms sleep), so the copying
    thread never waits on it.
    """
    buf = np.ones(64 * MIB, dtype=np.uint8)
    counter = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counter[0] += 1
            time.sleep(0.0001)

    t = threading.Thread(target=count, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        t.start()
        while counter[0] == 0:
            time.sleep(0.001)
        run = COPIES[copy]
        before = counter[0]
        copied = 0
        while copied < 256 * MIB or (counter[0] == before and copied < 1024 * MIB):
            run(big_pool, buf)
            copied += 64 * MIB
        during = counter[0] - before
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        t.join(10)
    assert not t.is_alive()
    assert during > 0, f"no progress in another thread during {copied >> 20} MiB of {copy}"


CLOSE_WHILE_COPYING = """
    import sys, threading
    import numpy as np
    from kvshm import Pool
    name, MIB = sys.argv[1], 1 << 20
    refused = 0
    for attempt in range(20):
        p = Pool.create(f"{name}-{attempt}", 64 * MIB, block_size=MIB)
        buf = np.zeros(64 * MIB, np.uint8)
        ended = []
        started, stop = threading.Event(), threading.Event()

        def copier():
            started.set()
            try:
                while not stop.is_set():
                    p.gather(range(0, 64 * MIB, MIB), [MIB] * 64, buf)
                ended.append("stopped")
            except ValueError as exc:  # closed between two copies: refused cleanly
                ended.append(str(exc))

        t = threading.Thread(target=copier)
        t.start()
        started.wait()
        try:
            p.close()  # most often lands while the copier is inside memcpy
        except BufferError:
            refused += 1
            stop.set()
            t.join(30)
            p.close()
        t.join(30)
        p.unlink()
        assert not t.is_alive() and len(ended) == 1, ended
        assert ended[0] == "stopped" or "closed" in ended[0], ended
        if refused:
            break
    print("refused", refused)
"""


def test_close_waits_for_copies_in_other_threads(shm_name: str) -> None:
    """close() while another thread copies raises BufferError instead of unmapping under it."""
    res = run_python(CLOSE_WHILE_COPYING, shm_name, timeout=120)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert int(res.stdout.split()[-1]) > 0
