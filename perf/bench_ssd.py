"""SSD tier figures (issue 8), in one command, each beside a baseline from the same run.

1. Promotion throughput. A ``kvshm serve`` with a pool of ``--pool-gib`` and an SSD tier
   of ``--ssd-gib`` in ``--dir``; ``--data-gib`` of values of ``--value-kib`` are put (so
   nearly all of them end up on SSD only), the pool is emptied (EVICT 0: every entry
   written down), then every value is read back with ``get_batch_into`` in batches of
   ``--batch-mib`` (shared memory mover): each read of an SSD-only key is a promotion
   (disk -> pool, checksum verified) followed by the client's copy out of the pool.
   Only the reads are timed (with a check of each value's index header); with one
   reader every byte is also compared, outside the timed part. The same again with
   ``--readers`` concurrent readers (threads with a Client each, as several inference
   workers), timed over the wall clock (the server verifies every value's checksum on
   promotion anyway). Baseline (the issue's): a plain sequential read of the same bytes
   of the data files, dd-like: 1 MiB reads, one thread, O_DIRECT when the tier uses it,
   into a private buffer in 4 KiB pages as ``dd bs=1M iflag=direct`` does (``real dd``
   is also run once, to show they agree). Second baseline: the same reads into a buffer
   in huge pages (the tier's own buffers are): on a virtio disk a direct read is cut
   into one segment per physically contiguous run of the buffer and a request takes at
   most 254, so how the baseline's pages lie can change its speed two- to three-fold
   (1.2 to 3.4 GB/s measured here); the promotions are held to the faster of the two
   as well. The baselines and the promotions alternate every ``--segment-mib`` over the
   same bytes (which goes first alternates too), so all meet the disk in the same
   state. ``--rounds`` times (the pool is emptied before each: EVICT 0 costs no I/O,
   promoted entries kept their SSD copy); every round is printed, and the medians.
2. Replay target. ``kvshm replay`` of the conversation trace with 64 KiB blocks, a pool of
   0.25 GiB and an SSD tier of 2 GiB: the hit rate beside the exact LRU of 2.25 GiB (the
   replay's simulator gets pool + SSD capacity), and the mismatches.

Usage::

    python perf/bench_ssd.py                      # both, data files in a temp dir here
    python perf/bench_ssd.py --skip-replay --value-kib 1024
    python perf/bench_ssd.py --dir /mnt/nvme/tmp  # put the files on that disk

Exit status 1 when a value read back differs, a replay reports a mismatch or an error.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kvshm  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10
_READY = re.compile(r"kvshm ready: service (?P<ep>tcp://[^,\s]+)")


class Serve:
    """A ``kvshm serve`` child: waits for the ready line, always stopped."""

    def __init__(self, *flags: str) -> None:
        cmd = [sys.executable, "-m", "kvshm", "serve", "--service-port", "0", "--no-manage",
               "--log-level", "WARNING", "--max-client-pending", "0",
               "--max-client-pinned", "0", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=ROOT, start_new_session=True)
        sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        line = b""
        deadline = time.monotonic() + 120
        while not line.endswith(b"\n"):
            if time.monotonic() > deadline or not sel.select(deadline - time.monotonic()):
                self.stop()
                raise RuntimeError("server not ready")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                self.stop()
                raise RuntimeError(f"server exited: {err}")
            line += chunk
        sel.close()
        self.ready = line.decode().strip()
        m = _READY.search(self.ready)
        assert m, self.ready
        self.address = m.group("ep")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def private_buffer(nbytes: int, huge: bool) -> tuple[mmap.mmap, memoryview]:
    """A private anonymous buffer (what ``dd`` reads into: ``malloc``), 2 MiB-aligned, in
    4 KiB pages (``huge`` False: MADV_NOHUGEPAGE, whatever the THP setting) or in
    transparent huge pages (``huge``: MADV_HUGEPAGE, where the kernel gives them).
    ``mmap.mmap(-1, n)`` would be a shared (shmem) mapping: 4 KiB pages, laid out however
    tmpfs happened to allocate them, which makes direct reads into it run anywhere
    between 1.2 and 3 GB/s from one run to the next on the virtio disk here."""
    import ctypes

    mem = mmap.mmap(-1, nbytes + 2 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    c = ctypes.c_char.from_buffer(mem)
    off = -ctypes.addressof(c) % (2 * MiB)
    del c
    try:
        mem.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE, off, nbytes)
    except (AttributeError, OSError):
        pass
    view = memoryview(mem)[off:off + nbytes]
    view[:] = bytes(nbytes)          # fault the pages in
    return mem, view


def real_dd(path: str, direct: bool, nbytes: int) -> float | None:
    """GB/s of ``dd if=path of=/dev/null bs=1M [iflag=direct]`` over ``nbytes`` (as dd
    itself reports it), to show that the dd-like baseline reads as dd does; None where
    dd is missing or fails."""
    dd = shutil.which("dd")
    if dd is None:
        return None
    cmd = [dd, f"if={path}", "of=/dev/null", "bs=1M", f"count={nbytes // MiB}"]
    if direct:
        cmd.append("iflag=direct")
    p = subprocess.run(cmd, capture_output=True, text=True, check=False,
                       env={**os.environ, "LC_ALL": "C"})
    m = re.search(r"(\d+) bytes .* copied, ([0-9.]+) s", p.stderr)
    if p.returncode != 0 or m is None or float(m.group(2)) <= 0:
        return None
    return int(m.group(1)) / float(m.group(2)) / 1e9


class SeqReader:
    """dd-like reads of the data files: ``chunk`` at a time, one thread, O_DIRECT when the
    tier uses it, into a private buffer in 4 KiB pages (as ``dd bs=1M iflag=direct``
    does) or, ``huge``, in transparent huge pages; the files are taken as one byte range
    in file order."""

    def __init__(self, paths: list[str], direct: bool, chunk: int = MiB,
                 huge: bool = False) -> None:
        flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
        self.fds = [os.open(p, flags) for p in paths]
        self.sizes = [os.fstat(fd).st_size for fd in self.fds]
        self.buf, self.view = private_buffer(chunk, huge)

    def read(self, start: int, nbytes: int) -> tuple[int, float]:
        """Read [start, start + nbytes) of the concatenated files; (bytes, seconds)."""
        done = 0
        t0 = time.perf_counter()
        pos = start
        end = start + nbytes
        base = 0
        for fd, size in zip(self.fds, self.sizes):
            while base <= pos < base + size and pos < end:
                n = os.preadv(fd, [self.view], pos - base)
                if n <= 0:
                    break
                done += n
                pos += n
            base += size
        return done, time.perf_counter() - t0

    def close(self) -> None:
        self.view.release()
        self.buf.close()
        for fd in self.fds:
            os.close(fd)


def promotion(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    vsize = args.value_kib * KiB
    n = int(args.data_gib * GiB) // vsize
    per_batch = max(1, args.batch_mib * MiB // vsize)
    seg = max(1, args.segment_mib * MiB // vsize // per_batch) * per_batch   # values
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, vsize, dtype=np.uint8)
    ssd_dir = os.path.join(workdir, "ssd")
    srv = Serve("--prealloc-size", str(args.pool_gib), "--block-size",
                str(min(args.block_kib, max(4, args.value_kib))), "--ssd-path", ssd_dir,
                "--ssd-size", str(args.ssd_gib), "--ssd-workers", str(args.ssd_workers),
                "--shm-name", f"kvshm-bench-ssd-{os.getpid()}")
    out: dict[str, Any] = {"ready": srv.ready, "values": n, "value_bytes": vsize,
                           "segment_bytes": seg * vsize, "batch_bytes": per_batch * vsize}
    readers = [kvshm.Client(srv.address, timeout=120) for _ in range(max(1, args.readers))]
    seqr = seqh = None
    try:
        c = readers[0]
        keys = [f"v{i}" for i in range(n)]
        vals = [base.copy() for _ in range(per_batch)]
        t0 = time.perf_counter()
        for b in range(0, n, per_batch):
            ks = keys[b:b + per_batch]
            for j, v in enumerate(vals[:len(ks)]):
                v[:8] = np.frombuffer(np.int64(b + j).tobytes(), np.uint8)
            c.put_batch(ks, vals[:len(ks)])
        out["put_gbps"] = n * vsize / (time.perf_counter() - t0) / 1e9
        outs = [[np.empty(vsize, np.uint8) for _ in range(per_batch)] for _ in readers]
        bad = missing = 0
        rounds: list[dict[str, float]] = []
        for rnd in range(args.rounds):
            for multi in ([False, True] if len(readers) > 1 else [False]):
                ssd = empty_pool(c)
                if seqr is None:
                    out["on_ssd"] = ssd["only_entries"]
                    out["direct"] = ssd["direct"]
                    paths = [os.path.join(ssd["path"], f"kvshm-ssd-{i}.dat")
                             for i in range(ssd["files"])]
                    seqr = SeqReader(paths, ssd["direct"])
                    seqh = SeqReader(paths, ssd["direct"], huge=True)
                    out["real_dd_gbps"] = real_dd(paths[0], ssd["direct"],
                                                  min(512 * MiB, n * vsize))
                t_seq = t_pro = t_huge = 0.0
                b_seq = b_pro = b_huge = 0
                active = readers if multi else readers[:1]
                for si, s0 in enumerate(range(0, n, seg)):
                    # The baselines and the promotions alternate, segment by segment,
                    # over the same bytes, so all meet the disk in the same mood, and
                    # which goes first alternates too.
                    batches = [(b, keys[b:min(b + per_batch, s0 + seg, n)])
                               for b in range(s0, min(s0 + seg, n), per_batch)]
                    for part in ((0, 2, 1) if si % 2 == 0 else (1, 2, 0)):
                        if part == 0:
                            nb, dt = seqr.read(s0 * vsize, min(seg, n - s0) * vsize)
                            b_seq += nb
                            t_seq += dt
                            continue
                        if part == 2:
                            assert seqh is not None
                            nb, dt = seqh.read(s0 * vsize, min(seg, n - s0) * vsize)
                            b_huge += nb
                            t_huge += dt
                            continue
                        nb, dt, bb, mm = read_batches(active, outs, batches, base, vsize,
                                                      full=not multi)
                        for r in active:
                            # settle the last reads' pins now: a live client's pins
                            # outlast their lease, and EVICT 0 must find nothing pinned
                            r.flush()
                        b_pro += nb
                        t_pro += dt
                        bad += bb
                        missing += mm
                rounds.append({"readers": len(readers) if multi else 1,
                               "seq_gbps": b_seq / t_seq / 1e9,
                               "seq_huge_gbps": b_huge / t_huge / 1e9,
                               "promotion_gbps": b_pro / t_pro / 1e9})
        st = c.stats(verify=True)
        out["mismatches"] = bad
        out["missing"] = missing
        out["promotions"] = st["tiers"]["pool"]["promotions"]
        out["accounting_ok"] = bool(st["accounting_ok"]
                                    and st["tiers"]["ssd"]["accounting_ok"])
    finally:
        for sr in (seqr, seqh):
            if sr is not None:
                sr.close()
        for r in readers:
            r.close()
        srv.stop()
    out["rounds"] = rounds
    for k in sorted({r["readers"] for r in rounds}):
        rs = [r for r in rounds if r["readers"] == k]
        out[f"readers_{k}"] = {
            "seq_gbps": float(np.median([r["seq_gbps"] for r in rs])),
            "promotion_gbps": float(np.median([r["promotion_gbps"] for r in rs])),
            "ratio": float(np.median([r["promotion_gbps"] / r["seq_gbps"] for r in rs])),
            "min_ratio": float(min(r["promotion_gbps"] / r["seq_gbps"] for r in rs)),
            "seq_huge_gbps": float(np.median([r["seq_huge_gbps"] for r in rs])),
            "ratio_huge": float(np.median([r["promotion_gbps"] / r["seq_huge_gbps"]
                                           for r in rs])),
        }
    return out


def read_batches(clients: list[Any], outs: list[list[Any]], batches: list[tuple[int, list[str]]],
                 base: Any, vsize: int, full: bool) -> tuple[int, float, int, int]:
    """Read ``batches`` with get_batch_into, batch j by client j % len(clients) (one
    thread per client). Returns (bytes, seconds of wall clock, bad, missing). Checks
    each value's index header inside the timed part; ``full`` (one client) also
    compares every byte, outside the timed part."""
    import threading

    counts = [[0, 0, 0, 0.0] for _ in clients]      # bytes, bad, missing, seconds
    go = threading.Barrier(len(clients) + 1) if len(clients) > 1 else None

    def run(i: int) -> None:
        c = clients[i]
        o = outs[i]
        if go is not None:
            go.wait()
        for j in range(i, len(batches), len(clients)):
            b, ks = batches[j]
            t = time.perf_counter()
            sizes = c.get_batch_into(ks, o[:len(ks)])
            for k, sz in enumerate(sizes):
                if sz < 0:
                    counts[i][2] += 1
                    continue
                counts[i][0] += sz
                if sz != vsize or int(o[k][:8].view(np.int64)[0]) != b + k:
                    counts[i][1] += 1
            counts[i][3] += time.perf_counter() - t
            if full:
                for k, sz in enumerate(sizes):
                    if sz == vsize and not np.array_equal(o[k][8:], base[8:]):
                        counts[i][1] += 1

    if go is None:
        run(0)
        dt = counts[0][3]
    else:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        go.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
    return (sum(int(x[0]) for x in counts), dt, sum(int(x[1]) for x in counts),
            sum(int(x[2]) for x in counts))


def empty_pool(c: Any) -> dict[str, Any]:
    """EVICT 0 until the pool is empty (every entry written down); the SSD stats."""
    deadline = time.monotonic() + 300
    while True:
        c.evict(0.0)
        st = c.stats()
        ssd = st["tiers"]["ssd"]
        if st["num_keys"] == 0 and ssd["writes_in_flight"] == 0:
            return ssd
        if time.monotonic() > deadline:
            raise RuntimeError("the pool did not empty")
        time.sleep(0.05)


def replay(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvshm", "replay", "--json", "--no-progress",
           "--block-bytes", "64K", "--pool-gib", "0.25", "--ssd-gib", "2",
           "--ssd-path", os.path.join(workdir, "replay-ssd")]
    if args.requests:
        cmd += ["--requests", str(args.requests)]
    print(f"# {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if p.returncode not in (0, 1) or not p.stdout.strip():
        raise RuntimeError(f"replay failed ({p.returncode}): {p.stderr[-2000:]}")
    s = json.loads(p.stdout.strip().splitlines()[-1])
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None,
                    help="directory for the SSD files (default: the system's temp "
                         "directory; put it on the disk to measure)")
    ap.add_argument("--pool-gib", type=float, default=0.25)
    ap.add_argument("--ssd-gib", type=float, default=2.0)
    ap.add_argument("--data-gib", type=float, default=1.5)
    ap.add_argument("--value-kib", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=64,
                    help="server block size in KiB (capped at the value size)")
    ap.add_argument("--batch-mib", type=int, default=8, help="MiB per get/put batch")
    ap.add_argument("--ssd-workers", type=int, default=4, help="server I/O threads")
    ap.add_argument("--readers", type=int, default=2,
                    help="also measure promotions with this many concurrent readers "
                         "(threads, one Client each; default 2; 1: only one reader)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of (empty the pool, read everything back); medians "
                         "are reported (default 3)")
    ap.add_argument("--segment-mib", type=int, default=128,
                    help="the baseline and the promotions alternate every this many MiB")
    ap.add_argument("--requests", type=int, default=None, help="replay: first N requests")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--skip-promotion", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="kvshm-bench-ssd-", dir=args.dir)
    report: dict[str, Any] = {}
    ok = True
    try:
        if not args.skip_promotion:
            p = promotion(args, workdir)
            report["promotion"] = p
            ok &= p["mismatches"] == 0 and p["missing"] == 0 and p["accounting_ok"]
            if not args.json:
                print(f"promotion: {p['values']} values of {p['value_bytes'] // KiB} KiB, "
                      f"{p['on_ssd']} on SSD only, O_DIRECT {p['direct']}, batches of "
                      f"{p['batch_bytes'] // MiB} MiB, baseline and promotions alternating "
                      f"every {p['segment_bytes'] // MiB} MiB")
                print(f"  put (with spills)      {p['put_gbps']:.2f} GB/s")
                dd = p.get("real_dd_gbps")
                print(f"  real dd bs=1M{' iflag=direct' if p['direct'] else ''} of the first "
                      f"file, once: " + (f"{dd:.2f} GB/s" if dd else "n/a"))
                for k in (1, args.readers):
                    r = p.get(f"readers_{k}")
                    if r is None or (k == args.readers and k == 1 and "printed" in p):
                        continue
                    p["printed"] = True
                    rs = [x for x in p["rounds"] if x["readers"] == k]
                    print(f"  {k} reader(s): promotion {r['promotion_gbps']:.2f} GB/s; "
                          f"dd-like read {r['seq_gbps']:.2f} GB/s, ratio {r['ratio']:.2f}x "
                          f"(lowest {r['min_ratio']:.2f}x; target >= 0.7); the same into "
                          f"huge pages {r['seq_huge_gbps']:.2f} GB/s, ratio "
                          f"{r['ratio_huge']:.2f}x (medians of {len(rs)} rounds)")
                    for j, x in enumerate(rs):
                        print(f"    round {j + 1}: promotion {x['promotion_gbps']:.2f}, "
                              f"dd-like {x['seq_gbps']:.2f} "
                              f"({x['promotion_gbps'] / x['seq_gbps']:.2f}x), huge pages "
                              f"{x['seq_huge_gbps']:.2f} "
                              f"({x['promotion_gbps'] / x['seq_huge_gbps']:.2f}x) GB/s")
                print(f"  mismatches {p['mismatches']}, missing {p['missing']}, "
                      f"accounting ok {p['accounting_ok']}")
        if not args.skip_replay:
            s = replay(args, workdir)
            report["replay"] = s
            ok &= s["mismatches"] == 0 and s["errors"] == 0
            if not args.json:
                print(f"replay: {s['requests']} requests, 64 KiB blocks, pool 0.25 GiB + "
                      f"SSD 2 GiB = {s['capacity_blocks']} blocks")
                print(f"  hit rate {100 * s['hit_rate']:.2f} %, exact LRU "
                      f"{100 * s['lru_hit_rate']:.2f} % (diff "
                      f"{100 * (s['hit_rate'] - s['lru_hit_rate']):+.2f} points, target "
                      f"within 0.5), mismatches {s['mismatches']}, errors {s['errors']}, "
                      f"{s['gbps']:.2f} GB/s, p50 {s['p50_ms']:.2f} ms, "
                      f"p99 {s['p99_ms']:.2f} ms")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
