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


def test_the_batch_lookups_hash_is_the_key_hash():
    """A batch lookup hashes each key as it copies it (its tail word by whole loads,
    backwards from the key's end): the same hash as the writer's, and the same bytes."""
    from kvshm._shmindex import _batch_key_hash, key_hash

    for n in range(0, 300):
        for key in (bytes((7 * i + n) % 256 for i in range(n)), bytes([0xFF]) * n,
                    os.urandom(n)):
            h, copied = _batch_key_hash(key)
            assert h == key_hash(key) == _ref_hash(key), (n, key)
            assert copied == key


def test_the_batch_lookups_key_comparison():
    """The batch lookups' word-wise key comparison: equal keys are equal whatever
    follows them in the slot; a difference in any byte, the first, the last, the last
    of a word or one inside the last partial word, makes them differ; the bytes after
    the key (in the slot or in the batch's scratch) never count."""
    from kvshm._shmindex import _batch_key_equal

    for n in range(1, 97):
        key = bytes((5 * i + n) % 251 + 1 for i in range(n))
        room = (n + 7) // 8 * 8
        for junk in (b"\0", b"\xff", b"k"):
            slot = key + junk * (room - n + 16)
            assert _batch_key_equal(key, slot), n
            assert _batch_key_equal(key, slot[:room]), n
            for at in sorted({0, n - 1, n // 2, min(n - 1, 7), (n - 1) // 8 * 8}):
                other = bytearray(slot)
                other[at] ^= 0x01
                assert not _batch_key_equal(key, bytes(other)), (n, at)
                assert not _batch_key_equal(bytes(other[:n]), slot), (n, at)
    with pytest.raises(ValueError):
        _batch_key_equal(b"abcdefghi", b"abcdefghi")      # b shorter than 16 bytes
    with pytest.raises(ValueError):
        _batch_key_equal(b"", b"\0" * 8)


@pytest.mark.parametrize("n", range(1, 89))
def test_batch_lookups_of_every_key_length(shm_name, n):
    """Keys of every length a slot holds inline (1-88 bytes), beside keys one byte off
    from them in the last byte and in the last word: a batch lookup (slots prefetched,
    keys compared a word at a time) finds exactly the published ones, as one key at a
    time does."""
    t = Table(shm_name, blocks=300)
    try:
        keys = [bytes((3 * i + j + n) % 250 + 1 for j in range(n)) + b"" for i in range(120)]
        keys = list(dict.fromkeys(keys))
        for i, k in enumerate(keys):
            t.writer.publish(k, 1, [(i, 1)])
        near = []
        for k in keys:
            near.append(k[:-1] + bytes([k[-1] ^ 0x80]))
            near.append(bytes([k[0] ^ 0x40]) + k[1:])
        near = [k for k in near if k not in set(keys)]
        batch = [x for pair in zip(keys, near) for x in pair] + near[len(keys):]
        want = [k in set(keys) for k in batch]
        r = t.reader
        assert r.exists_batch(batch) == want
        assert r.exists_batch(batch * 20) == want * 20          # 2048+: without the GIL
        assert r.match_prefix(keys) == len(keys)
        assert r.match_prefix(keys + near[:1] + keys) == len(keys)
        r.fast_batch = False
        assert r.exists_batch(batch) == want
    finally:
        t.close()


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
