"""The shared index's fast local paths (issue 13's local figures): the batch lookups done
in one C loop (keys copied out, the GIL released for large batches), the get that copies
straight into new bytes, and a reader made before fork() sending a child's reads to the
server."""

from __future__ import annotations

import os
import time

import pytest

from kvshm._shmindex import FALLBACK, MISS
from test_shmindex import Table


def _filled(name: str, n: int, **kw) -> tuple[Table, list[bytes]]:
    t = Table(name, blocks=n + 8, **kw)
    keys = [b"k-%08d" % i for i in range(n)]
    for i, k in enumerate(keys):
        t.writer.publish(k, 1, [(i, 1)])
    return t, keys


@pytest.mark.parametrize("n", [1, 100, 5000])     # 5000: the loop without the GIL
def test_batch_lookups_answer_as_single_ones(shm_name, n):
    t, keys = _filled(shm_name, n)
    try:
        r = t.reader
        gone = [b"gone-%d" % i for i in range(n)]
        mixed = [k for pair in zip(keys, gone) for k in pair]
        assert r.exists_batch(keys) == [True] * n
        assert r.exists_batch(tuple(keys)) == [True] * n
        assert r.exists_batch(mixed) == [True, False] * n
        assert r.exists_batch(iter(keys)) == [True] * n       # any iterable
        assert r.match_prefix(keys) == n
        assert r.match_prefix(keys + gone) == n
        assert r.match_prefix(keys[: n // 2] + gone[:1] + keys[n // 2:]) == n // 2
        assert r.match_prefix(gone) == 0
        # str keys are looked up by their UTF-8
        assert r.exists_batch([k.decode() for k in keys]) == [True] * n
    finally:
        t.close()


def test_batch_lookups_of_empty_and_odd_keys(shm_name):
    t, keys = _filled(shm_name, 10)
    try:
        r = t.reader
        assert r.exists_batch([]) == []
        assert r.match_prefix([]) == 0
        long_key = b"x" * 1000                 # never in the table: the server answers
        for odd in (long_key, b"", 7, None):
            assert r.exists_batch(keys + [odd]) is None
            assert r.match_prefix(keys + [odd]) == FALLBACK
            # also after a miss: the client's general path must see the odd key (and
            # raise for one it refuses, as it does without the shared index)
            assert r.match_prefix(keys[:3] + [b"gone", odd]) == FALLBACK
            assert r.match_prefix([odd] + keys) == FALLBACK
    finally:
        t.close()


def test_batch_lookups_with_misses_not_final(shm_name):
    t, keys = _filled(shm_name, 3000, misses_final=False)
    try:
        r = t.reader
        assert r.exists_batch(keys) == [True] * 3000           # all hits: answered
        assert r.exists_batch(keys + [b"gone"]) is None        # a miss: the server
        assert r.match_prefix(keys) == 3000
        assert r.match_prefix(keys + [b"gone"]) == FALLBACK
    finally:
        t.close()


def test_batch_lookups_after_unpublish_and_rebuild(shm_name):
    t, keys = _filled(shm_name, 4000)
    try:
        for k in keys[::2]:
            t.writer.unpublish(k)              # tombstones on the probe paths
        want = [bool(i % 2) for i in range(4000)]
        assert t.reader.exists_batch(keys) == want
        assert t.reader.match_prefix(keys[1::2]) == 2000
    finally:
        t.close()


def test_get_copies_values_large_and_small(shm_name):
    t = Table(shm_name, blocks=256)
    try:
        big = bytes(range(256)) * 1024 * 2                      # 512 KiB: the GIL released
        t.pool.write(0, big)
        t.writer.publish(b"big", len(big), [(0, len(big) // 4096)])
        t.pool.write(len(big), b"small")
        t.writer.publish(b"small", 5, [(len(big) // 4096, 1)])
        assert t.reader.get(b"big") == big
        assert t.reader.get(b"small") == b"small"
        assert t.reader.get(b"none") is None
        assert t.reader.get_into(b"none", bytearray(8)) == MISS
    finally:
        t.close()


def test_reader_made_before_fork_sends_the_childs_reads_to_the_server(shm_name):
    t, keys = _filled(shm_name, 10)
    try:
        assert t.reader.exists_batch(keys) == [True] * 10
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                                           # pragma: no cover (child)
            try:
                rd = t.reader
                got = (rd.usable, rd.get(keys[0]), rd.exists_batch(keys),
                       rd.match_prefix(keys), rd.get_into(keys[0], bytearray(4096)))
                ok = got == (False, FALLBACK, None, FALLBACK, FALLBACK)
                os.write(w, b"ok" if ok else repr(got).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            out = f.read()
        os.waitpid(pid, 0)
        assert out == b"ok", out
        assert t.reader.usable and t.reader.exists_batch(keys) == [True] * 10
    finally:
        t.close()


# ---------------------------------------------------------------- write behind


def test_write_behind_put_after_the_server_restarted_goes_to_the_new_server():
    """A write-behind client idle while its server was replaced: the next put sees the
    old server gone before writing into its pool (no PLACE sent into the void), says
    HELLO to the new server and stores there; the old server's unanswered PLACEs are
    reported by a later call."""
    from servers import ServerProcess
    from test_faults import free_port

    from kvshm import Client
    from kvshm.errors import WritesLost
    from kvshm.zmq_ctrl.serverwatch import IDLE_S

    port = free_port()
    srv = ServerProcess(service_port=port, prealloc_size=1 / 64)
    srv2 = None
    c = None
    try:
        c = Client(srv.address, write_behind=True, timeout=5)
        c.put("warm", b"w" * 9000)
        c.flush()
        srv.kill()
        srv.remove_segment()
        srv2 = ServerProcess(service_port=port, prealloc_size=1 / 64)
        time.sleep(IDLE_S * 2)                  # idle: the next put checks first
        c.put("fresh", b"f" * 9000)
        c.flush()
        with Client(srv2.address) as other:
            assert other.get("fresh") == b"f" * 9000
            assert not other.exists("warm")
        assert c.get("fresh") == b"f" * 9000
    except WritesLost:                          # (none was outstanding: not expected)
        raise
    finally:
        if c is not None:
            c.close()
        srv.kill()
        if srv2 is not None:
            srv2.stop()


def test_write_behind_put_to_a_killed_server_raises_instead_of_queueing():
    from servers import ServerProcess

    import kvshm
    from kvshm import Client
    from kvshm.zmq_ctrl.serverwatch import IDLE_S

    srv = ServerProcess(prealloc_size=1 / 64)
    c = None
    try:
        c = Client(srv.address, write_behind=True, timeout=10)
        c.put("warm", b"w" * 9000)
        c.flush()
        srv.kill()
        time.sleep(IDLE_S * 2)
        with pytest.raises(kvshm.ServerUnavailable):
            c.put("lost", b"l" * 9000)          # (before the check: no error at all)
    finally:
        if c is not None:
            c.close()
        srv.kill()
        srv.remove_segment()


def _ref_hash(key: bytes) -> int:
    """kvx_hash as first written (the tail word made by memcpy, little-endian): servers
    and clients of other builds must agree on every key's slot."""
    m = (1 << 64) - 1
    n = len(key)
    h = 0x9E3779B97F4A7C15 ^ ((n * 0xC2B2AE3D27D4EB4F) & m)
    i = 0
    while n - i >= 8:
        w = int.from_bytes(key[i:i + 8], "little")
        h ^= (w * 0x87C37B91114253D5) & m
        h = ((h << 31) | (h >> 33)) & m
        h = (h * 0x4CF5AD432745937F) & m
        i += 8
    w = int.from_bytes(key[i:], "little")
    h ^= (w * 0x87C37B91114253D5) & m
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & m
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & m
    h ^= h >> 33
    return h


def test_the_key_hash_is_unchanged():
    from kvshm._shmindex import key_hash

    for n in range(0, 40):
        key = bytes((7 * i + n) % 256 for i in range(n))
        assert key_hash(key) == _ref_hash(key), n
    assert key_hash("ключ") == _ref_hash("ключ".encode())


def test_batch_lookups_from_threads_at_once(shm_name):
    """Batches of several threads on one reader at once (each but the first takes its
    own scratch buffers), and a batch much larger than the one before it."""
    import threading

    t, keys = _filled(shm_name, 6000)
    try:
        r = t.reader
        errors: list[object] = []

        def run(seed: int) -> None:
            for j in range(30):
                ks = keys[: 100 + (seed * 997 + j * 331) % 5900]
                if r.exists_batch(ks) != [True] * len(ks) or r.match_prefix(ks) != len(ks):
                    errors.append((seed, j))

        ths = [threading.Thread(target=run, args=(s,)) for s in range(4)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(60)
        assert not errors
        long_keys = [k * 10 for k in keys[:100]]              # longer than the estimate
        assert r.exists_batch(long_keys) == [False] * 100
    finally:
        t.close()
