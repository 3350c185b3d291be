"""``--clients K``: K spawned client processes share a replay, request ``i`` to client
``i % K``, kept near trace order by a :class:`Pacer` (``--window``).

The requests reach the clients through a private hand-off directory (a file, not the
spawn arguments); a replay that was killed leaves its directory behind, and the next one
removes it (:mod:`kvshm.replay.scratch`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import time
import traceback
from typing import Any, Callable, Sequence

from kvshm.replay.backends import BackendSpec
from kvshm.replay.options import ReplayError
from kvshm.replay.runner import Replayer, Share
from kvshm.replay.scratch import ScratchDir, remove_stale
from kvshm.replay.servers import die_with_parent
from kvshm.replay.workload import Workload

__all__ = ["Pacer", "worker_main", "run_processes"]


class Pacer:
    """Keeps K clients near trace order: request i starts only once every request
    before ``i - window`` has finished.

    ``shared[w]`` is the index of client w's next unfinished request (its requests are
    w, w + K, ...), so "every request before x has finished" is ``min(shared) >= x``.
    The client holding the minimum never waits, so the clients cannot deadlock.
    """

    def __init__(self, shared: Any, wid: int, k: int, window: int, parent: int) -> None:
        self.shared = shared
        self.wid = wid
        self.k = k
        self.window = window
        self.parent = parent
        self.waited = 0.0

    def wait(self, idx: int) -> None:
        floor = idx - self.window
        shared = self.shared
        if floor <= 0 or min(shared[:]) >= floor:
            return
        t0 = time.monotonic()
        spins = 0
        while min(shared[:]) < floor:
            spins += 1
            if spins % 5000 == 0 and os.getppid() != self.parent:
                raise SystemExit(1)
            time.sleep(0.0001 if spins < 100 else 0.0005)
        self.waited += time.monotonic() - t0

    def done(self, idx: int) -> None:
        self.shared[self.wid] = idx + self.k

    def finish(self) -> None:
        self.shared[self.wid] = 1 << 62


def worker_main(wid: int, k: int, spec: BackendSpec, requests_file: str,
                 workload: Workload, key_prefix: bytes, q: Any, go: Any,
                 parent: int, shared: Any, window: int | None) -> None:
    """Body of one spawned client process: load its share (requests wid, wid + k, ...),
    connect, say ready, wait for go, replay."""
    die_with_parent()
    if os.getppid() != parent:      # the parent died before prctl took hold
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the parent decides; it sends SIGTERM

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    be = None
    pacer = None if window is None else Pacer(shared, wid, k, window, parent)
    try:
        with open(requests_file, "rb") as f:
            requests, lengths = pickle.load(f)
        items = [(i, requests[i], lengths[i]) for i in range(wid, len(requests), k)]
        del requests, lengths
        be = spec.open()
        q.put(("ready", wid, None))
        while not go.wait(1.0):
            if os.getppid() != parent:
                return
        last = [time.monotonic(), 0]

        def progress(n: int) -> None:
            last[1] += n
            now = time.monotonic()
            if now - last[0] >= 0.2:
                q.put(("progress", wid, last[1]))
                last[0], last[1] = now, 0

        try:
            sh = Replayer(be, workload, key_prefix).run(items, progress, pacer)
        finally:
            if pacer is not None:
                pacer.finish()      # never hold the others back, whatever happened
        if pacer is not None:
            sh.paced_s = pacer.waited
        if last[1]:
            q.put(("progress", wid, last[1]))
        be.close()
        be = None
        q.put(("done", wid, sh))
    except SystemExit:
        pass
    except BaseException:
        q.put(("fail", wid, traceback.format_exc(limit=6)))
    finally:
        if be is not None:
            with contextlib.suppress(Exception):
                be.close()


def run_processes(spec: BackendSpec, requests: Sequence[Sequence[int]],
                  lengths: Sequence[int | None], k: int, workload: Workload,
                  key_prefix: bytes, progress: Callable[[int], None] | None,
                  window: int | None) -> tuple[list[Share], float, float]:
    """Run K spawned clients, request i to client i % K. Returns shares, t_go, t_end.

    The requests go to the clients in a file, not in the spawn arguments: a child that
    dies before reading a spawn payload larger than a pipe would block ``start()``
    forever."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    go = ctx.Event()
    shared = ctx.Array("q", list(range(k)), lock=False)   # next unfinished request each
    procs = []
    shares: dict[int, Share] = {}
    remove_stale()
    handoff = ScratchDir("handoff")
    try:
        requests_file = os.path.join(handoff.path, "requests.pickle")
        with open(requests_file, "wb") as f:
            pickle.dump(([list(r) for r in requests], list(lengths)), f,
                        protocol=pickle.HIGHEST_PROTOCOL)
        for w in range(k):
            p = ctx.Process(target=worker_main, name=f"kvshm-replay-{w}", daemon=True,
                            args=(w, k, spec, requests_file, workload, key_prefix, q,
                                  go, os.getpid(), shared, window))
            p.start()
            procs.append(p)
        ready: set[int] = set()
        t_go = t_done = 0.0
        suspect: dict[int, int] = {}
        while len(shares) < k:
            try:
                kind, wid, payload = q.get(timeout=0.5)
            except queue.Empty:
                for w, p in enumerate(procs):
                    if w not in shares and p.exitcode is not None:
                        suspect[w] = suspect.get(w, 0) + 1
                        if suspect[w] >= 3:     # its last message would have arrived
                            raise ReplayError(f"client process {w} died (exit status "
                                              f"{p.exitcode}) before it reported")
                continue
            if kind == "ready":
                ready.add(wid)
                if len(ready) == k:
                    t_go = time.monotonic()
                    go.set()
            elif kind == "progress":
                if progress is not None:
                    progress(payload)
            elif kind == "done":
                shares[wid] = payload
                t_done = time.monotonic()
            else:
                raise ReplayError(f"client process {wid} failed:\n{payload}")
        for p in procs:
            p.join(10)
        return [shares[w] for w in range(k)], t_go, t_done
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for p in procs:
            p.close()
        q.close()
        q.join_thread()
        handoff.close()
