"""The shared index's fast batch lookups (kvshm/_shmindex.pyx, ``IndexReader.exists_batch``
and ``match_prefix``: keys hashed first, slots prefetched ahead, keys whose probe goes on
put aside, the header's tables read once per chunk) against the one-key-at-a-time path
(``fast_batch = False``, what ``KVSHM_NO_FAST_BATCH_READS`` selects) on the same tables:
keys of every length the table holds (wide records from 89 bytes), tombstones, tables in
the middle of a migration, and writers overwriting and deleting meanwhile (reader
processes, which share no GIL with the writer). A fallback (None / FALLBACK) is always
allowed; a wrong answer never is."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvshm import Pool
from kvshm._shmindex import (BATCH_CHUNK, BATCH_SEGMENT, BATCH_SEGMENT_BYTES, ENV_NO_FAST_BATCH,
                             FALLBACK, GROWTH, KEY_MAX, IndexReader, IndexWriter, default_slots)
from servers import unique_shm_name

BS = 4096
EPOCH = 113
SUBPROCESS_TIMEOUT = 60


class Tables:
    """A pool, a writer, a fast reader and a slow one (the same table)."""

    def __init__(self, name: str, blocks: int, slots: int = 0, initial: int = 4096,
                 **kw) -> None:
        self.pool = Pool.create(name, blocks * BS, BS)
        self.writer = IndexWriter.create(name + "-index", name + "-reads",
                                         slots or default_slots(blocks), epoch=EPOCH,
                                         block_size=BS, num_blocks=blocks,
                                         token=self.pool.token, initial_slots=initial, **kw)
        self.fast = IndexReader(self.writer.name, self.writer.reads_name, self.pool, EPOCH)
        self.slow = IndexReader(self.writer.name, self.writer.reads_name, self.pool, EPOCH)
        self.slow.fast_batch = False
        assert self.fast.fast_batch

    def close(self) -> None:
        self.fast.close()
        self.slow.close()
        self.writer.unlink()
        self.pool.close()
        self.pool.unlink()


def _prefix(keys: list, present: set) -> int:
    for i, k in enumerate(keys):
        if k not in present:
            return i
    return len(keys)


def _agree(t: Tables, keys: list, present: set) -> None:
    """Both readers answer ``keys`` as the model says (no writer runs meanwhile)."""
    want = [k in present for k in keys]
    assert t.fast.exists_batch(keys) == want
    assert t.slow.exists_batch(keys) == want
    assert t.fast.match_prefix(keys) == _prefix(keys, present)
    assert t.slow.match_prefix(keys) == _prefix(keys, present)


def _key(i: int, n: int) -> bytes:
    """A key of ``n`` bytes (1..KEY_MAX) unique to ``i``."""
    head = b"%d:" % i
    return (head + b"k" * n)[:n] if n > len(head) else bytes([i % 251 + 1]) * n


def test_the_switch_is_read_when_a_reader_is_made(shm_name):
    code = textwrap.dedent("""
        import sys
        from kvshm import Pool
        from kvshm._shmindex import IndexReader
        pool = Pool.attach(sys.argv[1])
        r = IndexReader(sys.argv[1] + "-index", sys.argv[1] + "-reads", pool, int(sys.argv[2]))
        print(int(r.fast_batch)); r.close(); pool.close()
    """)
    t = Tables(shm_name, blocks=64)
    try:
        got = {}
        for val in ("", "0", "1"):
            env = dict(os.environ)
            env[ENV_NO_FAST_BATCH] = val
            out = subprocess.run([sys.executable, "-c", code, shm_name, str(EPOCH)], env=env,
                                 capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
            assert out.returncode == 0, out.stderr
            got[val] = out.stdout.strip()
        assert got == {"": "1", "0": "1", "1": "0"}
    finally:
        t.close()


def test_keys_of_every_length_wide_records_and_tombstones(shm_name):
    """Every key length 1..KEY_MAX (a wide record from 89 bytes, or earlier with a
    checksum and many runs), some deleted (tombstones), asked in batches below and above
    the GIL-release size and the chunk size, shuffled, with absent keys of the same
    lengths and str keys; fast and slow agree with the model."""
    t = Tables(shm_name, blocks=8192, initial=8192)
    try:
        w = t.writer
        present: set = set()
        keys = []
        blk = 0
        for rep in range(20):
            for n in range(1, KEY_MAX + 1):
                k = _key(rep * 1000 + n, n)
                runs = [(blk + j, 1) for j in range(1 + (n + rep) % 8)]
                blk = (blk + 8) % 8000
                assert w.publish(k, 10, runs, (n * 7 + rep) if rep % 3 == 0 else None) >= 0
                keys.append(k)
                present.add(k)
        for k in keys[::5]:
            assert w.unpublish(k)
            present.discard(k)
        absent = [b"absent-" + k for k in keys[::3] if len(k) + 7 <= KEY_MAX]
        allk = keys + absent
        rnd = random.Random(5)
        for size in (1, 7, BATCH_CHUNK - 1, BATCH_CHUNK + 1, 2047, 2048, 5000, len(allk)):
            batch = rnd.sample(allk, min(size, len(allk)))
            _agree(t, batch, present)
        live = [k for k in keys if k in present]
        _agree(t, live, present)                         # every key a hit
        assert len(live) > 2048
        for stop in (0, 1, BATCH_CHUNK - 1, BATCH_CHUNK, 2048, len(live) - 1):
            q = live[:stop] + [b"nowhere"] + live[stop:]
            assert t.fast.match_prefix(q) == t.slow.match_prefix(q) == stop
        # str keys: their UTF-8 is the key
        s = [k.decode() for k in live if k.isascii()][:300] + ["nowhere-é"]
        assert t.fast.exists_batch(s) == t.slow.exists_batch(s) == [True] * 300 + [False]
        # keys the table cannot hold: the whole batch goes to the server (None / FALLBACK)
        for bad in ([live[0], b""], [live[0], b"x" * (KEY_MAX + 1)], [live[0], 7],
                    [live[0], "\udcff"], [live[0], bytearray(b"k")]):
            assert t.fast.exists_batch(bad) is None and t.slow.exists_batch(bad) is None
            assert t.fast.match_prefix(bad) == t.slow.match_prefix(bad) == FALLBACK
        assert t.fast.exists_batch([]) == [] and t.fast.match_prefix([]) == 0
        assert t.fast.exists_batch(tuple(live[:5])) == [True] * 5
    finally:
        t.close()


def test_both_agree_at_every_step_of_a_migration(shm_name):
    """The table grows (and moves between the segment's halves) a step per publish:
    at each step while both tables are named, batches larger than a chunk and than the
    GIL-release size get the same answers from both readers, overwrites and deletions
    of keys still in the old table included."""
    t = Tables(shm_name, blocks=16384, slots=16384, initial=4096, migrate_step=16)
    w = t.writer
    try:
        keys = [_key(i, 8 + i % 140) for i in range(4200)]
        present: set = set()
        start = 4096 * GROWTH[0] // 16                     # a growth starts here
        for i, k in enumerate(keys[:start]):
            assert w.publish(k, 4, [(i, 1)]) >= 0
            present.add(k)
        seen = 0
        rnd = random.Random(3)
        for i in range(start, len(keys)):
            assert w.publish(keys[i], 4, [(i % 16000, 1)]) >= 0
            present.add(keys[i])
            if not t.fast.header["old_nslots"]:
                continue
            seen += 1
            if seen % 9 == 0:                              # a deletion, an overwrite
                gone = rnd.choice(keys[:start])
                if gone in present:
                    assert w.unpublish(gone)
                    present.discard(gone)
                again = keys[rnd.randrange(start)]
                assert w.publish(again, 4, [(16001, 1)]) >= 0
                present.add(again)
            if seen % 5 == 0:
                _agree(t, keys[:i + 1] + [b"nowhere"], present)
                order = keys[:i + 1]
                assert t.fast.match_prefix(order) == _prefix(order, present)
        assert seen > 50
    finally:
        t.close()


class BatchModel(RuleBasedStateMachine):
    """Publish, overwrite and delete keys of any length in a table that starts small
    (it grows and is rebuilt for its tombstones, step by step); after every step both
    readers answer batches as the model does."""

    def __init__(self) -> None:
        super().__init__()
        self.t = Tables(unique_shm_name("localx-"), blocks=2048, slots=4096, initial=64,
                        migrate_step=4)
        self.present: set = set()
        self.universe = [_key(i, 1 + (i * 37) % KEY_MAX) for i in range(600)]

    @rule(i=st.integers(0, 599), runs=st.integers(1, 8), sum_=st.booleans())
    def put(self, i: int, runs: int, sum_: bool) -> None:
        k = self.universe[i]
        if self.t.writer.publish(k, 5, [(i * 3 % 2000 + j, 1) for j in range(runs)],
                                 i if sum_ else None) >= 0:
            self.present.add(k)

    @rule(lo=st.integers(0, 599), n=st.integers(1, 80))
    def put_many(self, lo: int, n: int) -> None:
        for i in range(lo, min(600, lo + n)):
            if self.t.writer.publish(self.universe[i], 5, [(i, 1)]) >= 0:
                self.present.add(self.universe[i])

    @rule(lo=st.integers(0, 599), n=st.integers(1, 80))
    def delete_many(self, lo: int, n: int) -> None:
        for i in range(lo, min(600, lo + n)):
            k = self.universe[i]
            assert self.t.writer.unpublish(k) == (k in self.present)
            self.present.discard(k)

    @rule(seed=st.integers(0, 1 << 30), n=st.integers(0, 600))
    def ask(self, seed: int, n: int) -> None:
        batch = random.Random(seed).sample(self.universe, n)
        _agree(self.t, batch, self.present)

    @invariant()
    def answers_agree(self) -> None:
        _agree(self.t, self.universe, self.present)
        live = [k for k in self.universe if k in self.present]
        _agree(self.t, live, self.present)

    def teardown(self) -> None:
        self.t.close()


TestBatchModel = BatchModel.TestCase
TestBatchModel.settings = settings(max_examples=30, stateful_step_count=40, deadline=None,
                                   suppress_health_check=list(HealthCheck))


_BATCH_READER = textwrap.dedent("""
    import sys, time
    from kvshm import Pool
    from kvshm._shmindex import IndexReader, FALLBACK
    pool = Pool.attach(sys.argv[1])
    r = IndexReader(sys.argv[1] + "-index", sys.argv[1] + "-reads", pool, int(sys.argv[2]))
    r.fast_batch = sys.argv[5] == "1"
    nstable, seconds = int(sys.argv[3]), float(sys.argv[4])
    stable = [(b"stable-%d-" % i) + (b"w" * (i % 140)) for i in range(nstable)]
    gone = [(b"gone-%d-" % i) + (b"w" * (i % 140)) for i in range(nstable)]
    wrong = asked = falls = 0
    print("ready", flush=True)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        got = r.exists_batch(stable)
        asked += 1
        if got is None:
            falls += 1
        elif not all(got):
            wrong += 1
        got = r.exists_batch(gone + stable[:64])
        if got is not None and (any(got[:nstable]) or not all(got[nstable:])):
            wrong += 1
        m = r.match_prefix(stable)
        if m != FALLBACK and m != nstable:
            wrong += 1
        m = r.match_prefix(stable[:100] + gone[:1] + stable)
        if m != FALLBACK and m != 100:
            wrong += 1
    r.close(); pool.close()
    print(asked, wrong, falls, flush=True)
""")


def test_reader_processes_never_answer_wrong_while_keys_are_overwritten_and_deleted(
        shm_name):
    """Reader processes (fast and slow) ask batches of keys that stay stored but are
    overwritten all the time (their slots' versions change under the readers) and of
    keys deleted before they start, while other keys come and go and the table grows
    and is rebuilt step by step: a stored key is never reported missing, a deleted one
    never present (a fallback is allowed)."""
    nstable, blocks = 2500, 32768
    t = Tables(shm_name, blocks=blocks, slots=1 << 16, initial=4096, migrate_step=8)
    w = t.writer

    def skey(i: int) -> bytes:
        return (b"stable-%d-" % i) + (b"w" * (i % 140))

    for i in range(nstable):
        assert w.publish(skey(i), 16, [(i, 1)]) >= 0
        k = (b"gone-%d-" % i) + (b"w" * (i % 140))
        assert w.publish(k, 16, [(i, 1)]) >= 0
        assert w.unpublish(k)
    procs = [subprocess.Popen([sys.executable, "-c", _BATCH_READER, shm_name, str(EPOCH),
                               str(nstable), "3", fast], stdout=subprocess.PIPE, text=True)
             for fast in ("1", "1", "0")]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 3
        i = 0
        live: list[bytes] = []
        while time.monotonic() < deadline:
            i += 1
            s = i % nstable
            assert w.publish(skey(s), 16, [((s + i) % (blocks - 1), 1)],
                             i if i % 3 else None) >= 0          # an overwrite
            k = b"other-%d" % i
            assert w.publish(k, 1, [(i % (blocks - 1), 1)]) >= 0
            live.append(k)
            if len(live) > 20_000:                 # tombstones pile up: rebuilds
                for old in live[:5000]:
                    w.unpublish(old)
                del live[:5000]
            if i % 256 == 0:
                w.drain()
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=SUBPROCESS_TIMEOUT)
            results.append(tuple(map(int, out.split())))
        print(results, w.stats())
        assert all(wrong == 0 for _, wrong, _ in results), results
        assert all(asked > 0 for asked, *_ in results), results
        assert w.rebuilds >= 1, w.stats()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        t.close()


def test_a_reader_made_before_the_table_grew_answers_its_next_batches(shm_name):
    """The readers attach to a table of INITIAL_SLOTS; the writer then grows it (and
    migrates it) many times over: the next batches (>= 2048 keys: the reader first
    maps the pages of the table it now sees, kvshm._shmindex.IndexReader._prefault) and
    the ones after answer as the model, fast and slow, the list's bools counted right."""
    t = Tables(shm_name, blocks=65536, initial=4096)
    try:
        w = t.writer
        keys = [b"grow-%08d" % i for i in range(40_000)]
        present = set()
        for step in (3000, 12_000, 40_000):         # grown between the batches
            for i, k in enumerate(keys[len(present):step], len(present)):
                assert w.publish(k, 10, [(i % 65000, 1)]) >= 0
                present.add(k)
            asked = keys[:step] + [b"none-%08d" % i for i in range(3000)]   # and misses
            got = t.fast.exists_batch(asked)
            assert got == [k in present for k in asked]
            refs = sys.getrefcount(True), sys.getrefcount(False)
            del got                                 # gives back one reference an item
            assert (refs[0] - sys.getrefcount(True), refs[1] - sys.getrefcount(False)) == \
                (step, 3000)
            _agree(t, asked, present)
            assert t.fast.match_prefix(asked) == step
        assert w.nslots > 4096
    finally:
        t.close()


def test_batches_of_many_segments_agree_and_a_bad_key_is_never_hidden(shm_name):
    """Batches of several segments (BATCH_SEGMENT keys, or fewer long keys: at most
    BATCH_SEGMENT_BYTES of key bytes a segment), misses at and around the segments'
    edges: fast = slow = model. A key the table cannot hold (another type, empty,
    longer than KEY_MAX) anywhere, after a miss that stops match_prefix in an earlier
    segment too: None / FALLBACK from both readers (the general path raises for it or
    asks the server), never an answer that hides it."""
    t = Tables(shm_name, blocks=65536, initial=4096)
    try:
        w = t.writer
        seg = BATCH_SEGMENT
        long_per_seg = BATCH_SEGMENT_BYTES // (KEY_MAX + 8)
        short = [b"seg-%08d" % i for i in range(3 * seg + 17)]
        long = [_key(i, KEY_MAX) for i in range(4 * long_per_seg + 3)]
        present = set()
        for i, k in enumerate(short + long):
            assert w.publish(k, 10, [(i % 65000, 1)]) >= 0
            present.add(k)
        for keys, per in ((short, seg), (long, long_per_seg)):
            _agree(t, keys, present)
            for at in (0, 1, per - 1, per, per + 1, 2 * per, len(keys) - 1):
                asked = keys[:at] + [b"missing-%d" % at] + keys[at:]
                _agree(t, asked, present)
                assert t.fast.match_prefix(asked) == at
                for bad in (None, 7, b"", "", b"x" * (KEY_MAX + 1), bytearray(b"seg-1")):
                    for where in (at + 1, len(asked) - 1, len(asked)):
                        worse = asked[:where] + [bad] + asked[where:]
                        for r in (t.fast, t.slow):
                            assert r.exists_batch(worse) is None
                            assert r.match_prefix(worse) == FALLBACK
    finally:
        t.close()


def test_a_list_changed_by_another_thread_during_a_batch(shm_name):
    """The GIL is released for each segment of a large batch: another thread that
    shrinks and regrows the list meanwhile (its items array reallocated) gets no crash
    and no wrong answer: None / FALLBACK (the list's length changed), or the answer for
    the list as each segment read it (every key here is present)."""
    import threading

    t = Tables(shm_name, blocks=65536, initial=4096)
    try:
        keys = [b"mut-%08d" % i for i in range(6 * BATCH_SEGMENT)]
        for i, k in enumerate(keys):
            assert t.writer.publish(k, 10, [(i % 65000, 1)]) >= 0
        shared = list(keys)
        stop = threading.Event()

        def mutate() -> None:
            while not stop.is_set():
                del shared[len(keys) // 2:]
                shared.extend(keys[len(keys) // 2:])
                shared.extend(keys)          # (grown past its size: moved)
                del shared[len(keys):]

        th = threading.Thread(target=mutate)
        th.start()
        try:
            for _ in range(100):
                got = t.fast.exists_batch(shared)
                assert got is None or got == [True] * len(got)
                m = t.fast.match_prefix(shared)
                assert m == FALLBACK or 0 <= m <= 2 * len(keys)
        finally:
            stop.set()
            th.join()
    finally:
        t.close()
