"""break11: hostile review of the shared index's layout 3 (incremental growth between two
halves of the segment). Each test failed on main before its fix."""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest

from kvshm import Pool
from kvshm._shmindex import IndexReader, IndexWriter, default_slots

BS = 4096
EPOCH = 77
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _allocated(name: str) -> int:
    return os.stat("/dev/shm/" + name.lstrip("/")).st_blocks * 512


class Table:
    def __init__(self, name: str, blocks: int, slots: int = 0, initial: int = 64,
                 **kw) -> None:
        self.pool = Pool.create(name, blocks * BS, BS)
        self.writer = IndexWriter.create(name + "-index", name + "-reads",
                                         slots or default_slots(blocks), epoch=EPOCH,
                                         block_size=BS, num_blocks=blocks,
                                         token=self.pool.token, initial_slots=initial,
                                         **kw)
        self.reader = IndexReader(self.writer.name, self.writer.reads_name, self.pool, EPOCH)

    def close(self) -> None:
        self.reader.close()
        self.writer.unlink()
        self.pool.close()
        self.pool.unlink()


def _write_records(reads_name: str, slots: list[int]) -> None:
    """What a hostile same-user client can do: the reads ring is writable."""
    fd = os.open("/dev/shm/" + reads_name.lstrip("/"), os.O_RDWR)
    try:
        m = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    head = struct.unpack_from("<Q", m, 64)[0]
    nrec = (len(m) - 256) // 16
    for i, slot in enumerate(slots):
        t = head + i
        struct.pack_into("<QII", m, 256 + 16 * (t % nrec), t + 1, slot, 0)
    struct.pack_into("<Q", m, 64, head + len(slots))
    m.close()


def test_ring_records_of_unreserved_slots_do_not_make_the_server_reserve_them(shm_name):
    """drain() looked at any slot below 2 x capacity: a client's records of slots the
    table does not use faulted their pages in (16 MiB of /dev/shm from 4,096 records here;
    the whole segment at most; a SIGBUS in the server when /dev/shm is full)."""
    t = Table(shm_name, blocks=1024, slots=1 << 19, initial=64)
    w = t.writer
    try:
        w.publish(b"a", 4, [(0, 1)])
        before = _allocated(w.name)
        _write_records(w.reads_name, [64 + 32 * i for i in range(4096)])
        assert w.drain() == []
        assert _allocated(w.name) <= before
        # a record of a slot in use still counts
        r = t.reader
        assert r.get(b"a") is not None
        assert w.drain() == [b"a"]
    finally:
        t.close()


def test_validate_of_a_token_of_a_table_given_back_does_not_fault_it_in(shm_name):
    """validate() read the version of any token's slot below 2 x capacity: a token taken
    before a growth pointed into the old half, whose pages the growth gave back; reading
    it faulted the page in again (reserved in /dev/shm, a SIGBUS when it is full)."""
    t = Table(shm_name, blocks=4096, slots=8192, initial=1024)
    w, r = t.writer, t.reader
    try:
        keys = [b"v-%05d" % i for i in range(700)]
        for i, k in enumerate(keys):
            assert w.publish(k, 4, [(i, 1)]) >= 0
        toks = r.locate(keys)[2]
        assert r.validate(toks)
        for i in range(700, 900):                      # grows: the table moves
            w.publish(b"v-%05d" % i, 4, [(i, 1)])
        for _ in range(8):
            w.publish(b"extra", 1, [(0, 1)])
        assert w.stats()["phase"] == 0 and r.header["base"] != 0
        before = _allocated(w.name)
        assert not r.validate(toks)
        assert _allocated(w.name) <= before
        assert not r.validate([(-1, 0)]) and not r.validate([(1 << 40, 0)])
    finally:
        t.close()


_FULL_SHM = textwrap.dedent(r"""
    import mmap, os, struct, sys
    sys.path.insert(0, sys.argv[1])
    from kvshm import Pool
    from kvshm._shmindex import IndexWriter
    pool = Pool.create("b11full", 64 * 4096, 4096)
    w = IndexWriter.create("b11full-index", "b11full-reads", 1 << 12, epoch=1,
                           block_size=4096, num_blocks=64, token=pool.token,
                           initial_slots=64, ring_records=1024)
    w.publish(b"a", 4, [(0, 1)])
    fd = os.open("/dev/shm/filler", os.O_CREAT | os.O_WRONLY)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError:
        pass
    rfd = os.open("/dev/shm/b11full-reads", os.O_RDWR)
    m = mmap.mmap(rfd, os.fstat(rfd).st_size)
    struct.pack_into("<QII", m, 256, 1, 6000, 0)      # a slot of the unused half
    struct.pack_into("<Q", m, 64, 1)
    print(w.drain(), flush=True)
    print("survived", flush=True)
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root for a private small tmpfs on /dev/shm")
def test_a_hostile_ring_record_does_not_crash_the_server_when_dev_shm_is_full(tmp_path):
    script = tmp_path / "full.py"
    script.write_text(_FULL_SHM)
    cmd = (f"mount -t tmpfs -o size=16m tmpfs /dev/shm && "
           f"{sys.executable} {script} {ROOT}")
    p = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True,
                       timeout=60)
    if "mount" in p.stderr and p.returncode != 0 and "survived" not in p.stdout:
        if "permission" in p.stderr.lower() or "not permitted" in p.stderr.lower():
            pytest.skip("cannot mount a tmpfs here")
    assert p.returncode == 0 and "survived" in p.stdout, (p.returncode, p.stdout, p.stderr)


_FULL_THEN_FREED = textwrap.dedent(r"""
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    from kvshm import Pool
    from kvshm._shmindex import IndexReader, IndexWriter
    pool = Pool.create("b11room", 64 * 4096, 4096)
    w = IndexWriter.create("b11room-index", "b11room-reads", 1 << 15, epoch=1,
                           block_size=4096, num_blocks=64, token=pool.token,
                           initial_slots=64, ring_records=1024)
    fd = os.open("/dev/shm/filler", os.O_CREAT | os.O_WRONLY)
    while True:                                   # leave 64 KiB: a table of ~300 slots
        st = os.statvfs("/dev/shm")
        left = st.f_bavail * st.f_frsize - 65536
        if left <= 0:
            break
        try:
            os.write(fd, b"x" * min(left, 1 << 20))
        except OSError:
            break
    refused = 0
    for i in range(3000):
        refused += w.publish(b"k%d" % i, 4, [(1, 1)]) < 0
    small = w.nslots
    assert refused > 0, (refused, w.stats())
    for i in range(3000):
        w.unpublish(b"k%d" % i)                   # tombstones, and the refused keys
    os.ftruncate(fd, 0)                           # space again
    time.sleep(1.2)
    got = 0
    for i in range(3000):
        got += w.publish(b"n%d" % i, 4, [(1, 1)]) >= 0
    print(small, w.nslots, got, w.unpublished, flush=True)
    assert got == 3000 and w.unpublished == 0 and w.nslots > small, w.stats()
    print("grew again", flush=True)
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root for a private small tmpfs on /dev/shm")
def test_a_table_that_dev_shm_had_no_room_for_grows_again_once_there_is_room(tmp_path):
    """Once a growth's posix_fallocate failed, the table never grew nor dropped its
    tombstones again (its capacity was cut to its size for the server's life): after one
    moment of a full /dev/shm, new keys were refused for good (every read of them, and
    every miss, went to the server) even with the space back and the table all tombstones."""
    script = tmp_path / "room.py"
    script.write_text(_FULL_THEN_FREED)
    cmd = (f"mount -t tmpfs -o size=24m tmpfs /dev/shm && "
           f"{sys.executable} {script} {ROOT}")
    p = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "grew again" in p.stdout, (p.returncode, p.stdout, p.stderr)


_VALIDATE_CLOSED = textwrap.dedent(r"""
    import sys
    sys.path.insert(0, sys.argv[1])
    from kvshm import Pool
    from kvshm._shmindex import IndexReader, IndexWriter
    name = sys.argv[2]
    pool = Pool.create(name, 64 * 4096, 4096)
    w = IndexWriter.create(name + "-index", name + "-reads", 4096, epoch=1,
                           block_size=4096, num_blocks=64, token=pool.token)
    try:
        r = IndexReader(w.name, w.reads_name, pool, 1)
        w.publish(b"a", 4, [(0, 1)])
        tok = r.lookup(b"a")[0]
        r.close()                              # (another thread's re-HELLO, say)
        print("validate", r.validate([tok]), flush=True)
    finally:
        w.unlink()
        pool.close()
        pool.unlink()
""")


def test_validate_after_the_reader_is_closed_is_false_not_a_segfault(shm_name, tmp_path):
    """validate() read the token's slot version through the table's mapping without
    checking it was still mapped: after close() (between a locate and its validate) it
    read unmapped memory (SIGSEGV)."""
    script = tmp_path / "closed.py"
    script.write_text(_VALIDATE_CLOSED)
    p = subprocess.run([sys.executable, str(script), ROOT, shm_name], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "validate False" in p.stdout, (p.returncode, p.stdout,
                                                                p.stderr)
