"""Issue 13's newest same-host paths, attacked from other containers and hostile clients,
and hosts that vanish mid-pipeline (helper "contain", session 23).

Each test that reproduces a finding says so and failed on the code before its fix; the
others keep what was attacked and held (each can fail).

Held (attacked, nothing found; kept so that a change that breaks them is seen):

* The shared index (kvshm/_shmindex.pyx, layout 4) is a 0600 segment of the server's
  user: every same-user process (a container running as the same uid, user namespaces
  mapping its root to it included) can open it read-write, whatever the readers' own
  ``PROT_READ`` mapping. The server, its only writer, reads slots back from it; a wide
  record index scribbled into a long key's slot is refused by the writer's key compare
  (an index past the table's wide records finds no key), so an overwrite or delete
  of that key goes to a new slot and the forged one is dead to readers: no write past
  the mapping, the keys read back right.
"""

from __future__ import annotations

import mmap
import os
import struct

import posix_ipc
import pytest

from kvshm import Client
from servers import ServerProcess

pytestmark = pytest.mark.timeout(120)

SLOT, HEADER, WIDE_FLAG, LIVE = 128, 4096, 2, 1


def _index_map(srv: ServerProcess) -> mmap.mmap:
    """The server's shared index, mapped writable as any same-user process may."""
    shm = posix_ipc.SharedMemory("/" + srv.shm_name.lstrip("/") + "-index")
    try:
        return mmap.mmap(shm.fd, shm.size)
    finally:
        shm.close_fd()


def _wide_slots(m: mmap.mmap) -> list[int]:
    """Byte offsets of the live slots of the table in use that have a wide record."""
    nslots, base = struct.unpack_from("<Q", m, 24)[0], struct.unpack_from("<Q", m, 144)[0]
    out = []
    for i in range(base, base + nslots):
        off = HEADER + i * SLOT
        state, = struct.unpack_from("<I", m, off + 16)
        if state == LIVE and m[off + 23] & WIDE_FLAG:
            out.append(off)
    return out


@pytest.mark.parametrize("then", ["overwrite", "delete"])
@pytest.mark.parametrize("index", [0xFFFFFFF0, 7])
def test_scribbled_wide_record_index_cannot_crash_the_server(then, index):
    """A same-user process sets the wide record index of a long key's slot in the
    shared index (past the wide records, or inside them but not the key's); the key is
    then overwritten, or deleted and other long keys written (were the index trusted,
    the server would write the runs there or hand it out again). The server stays up,
    the keys read back right through the lock-free path and the server's, and the
    table keeps taking long keys."""
    long_a = b"A" * 120          # over 88 bytes: kept in a wide record
    long_b = b"B" * 130
    with ServerProcess("--block-size", "4") as srv, Client(srv.address) as c:
        c.put(long_a, b"first")
        m = _index_map(srv)
        try:
            slots = _wide_slots(m)
            assert len(slots) == 1, slots
            struct.pack_into("<I", m, slots[0] + 24, index)     # the scribble
        finally:
            m.close()
        if then == "overwrite":
            c.put(long_a, b"second")
        else:
            c.delete(long_a)
            c.put(long_b, b"other")
            c.put(long_b + b"2", b"other2")
        assert srv.alive(), srv.stderr_text
        with Client(srv.address, transport="tcp") as t:
            if then == "overwrite":
                assert c.get(long_a) == b"second" and t.get(long_a) == b"second"
            else:
                assert not c.exists(long_a) and not t.exists(long_a)
                assert c.get(long_b) == b"other" and t.get(long_b) == b"other"
                assert c.get(long_b + b"2") == b"other2"
            for i in range(20):                 # the table still takes long keys
                c.put(b"L%d" % i * 40, b"v%d" % i)
            assert all(c.get(b"L%d" % i * 40) == b"v%d" % i for i in range(20))
        assert srv.alive(), srv.stderr_text
