"""A client process on one host of the test bed (tests/bed.py, :class:`Agent`).

Reads one JSON command per line on stdin, answers one JSON line: {"result": ...} or
{"error": "..."}. Values are derived from (seed, index) so that any host can check
them byte for byte without shipping them.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback
from typing import Any

import kvshm
from kvshm.cluster.cli import op_view


def value(seed: str, i: int, size: int) -> bytes:
    h = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=32).digest()
    return (h * (size // 32 + 1))[:size]


class Agent:
    def __init__(self) -> None:
        self.cc: kvshm.ClusterClient | None = None

    def connect(self, address: str, **kw: Any) -> dict[str, Any]:
        self.cc = kvshm.ClusterClient(address, **kw)
        return {"members": [m.id for m in self.cc.view.members]}

    def wait_members(self, ids: list[str], timeout: float = 20.0) -> float:
        """Seconds until the view holds exactly ``ids``: the view the follower holds,
        pushed by the local server (no refresh here)."""
        assert self.cc is not None
        t0 = time.monotonic()
        while {m.id for m in self.cc.view.members} != set(ids):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"view is {[m.id for m in self.cc.view.members]}")
            time.sleep(0.01)
        return time.monotonic() - t0

    def owners(self, keys: list[str]) -> list[str | None]:
        assert self.cc is not None
        return self.cc.owners(keys)

    def put(self, prefix: str, n: int, size: int, pin_ttl: float | None = None) -> Any:
        assert self.cc is not None
        keys = [f"{prefix}/{i}" for i in range(n)]
        vals = [value(prefix, i, size) for i in range(n)]
        t0 = time.perf_counter()
        h = self.cc.put_batch(keys, vals, pin_ttl=pin_ttl)
        dt = time.perf_counter() - t0
        return {"seconds": dt, "handoff": h.to_dict() if h is not None else None}

    def check(self, prefix: str, n: int, size: int, handoff: Any = None) -> dict[str, Any]:
        """Read and verify; returns hits, corrupt count, seconds."""
        assert self.cc is not None
        keys = [f"{prefix}/{i}" for i in range(n)]
        t0 = time.perf_counter()
        if handoff is not None:
            got = self.cc.get_handoff(handoff)
        else:
            got = self.cc.get_batch(keys)
        dt = time.perf_counter() - t0
        hits = [v is not None for v in got]
        corrupt = sum(1 for i, v in enumerate(got) if v is not None and v != value(prefix, i, size))
        return {"hits": hits, "corrupt": corrupt, "seconds": dt}

    def read_loop(self, prefix: str, n: int, size: int, until_gone: str,
                  timeout: float = 60.0) -> dict[str, Any]:
        """get_batch repeatedly until ``until_gone`` leaves the view the follower holds
        (pushed by the local server: no refresh here). Per batch: seconds and whether
        it met a timeout (a suspect mark: only a call that got no reply gives one; a
        ``peer_down`` miss also counts a member that left the view while the batch was
        being placed, which waits for nothing); corrupt values; the view's revision before and after; then the hits of
        one more batch."""
        assert self.cc is not None
        keys = [f"{prefix}/{i}" for i in range(n)]
        t0 = time.monotonic()
        rev0 = self.cc.view.revision
        batches = []
        timed_out = []
        corrupt = 0
        while any(m.id == until_gone for m in self.cc.view.members):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{until_gone} never left the view")
            marks0 = self.cc.metrics()["suspect_marks"]
            b0 = time.perf_counter()
            got = self.cc.get_batch(keys)
            batches.append(time.perf_counter() - b0)
            timed_out.append(self.cc.metrics()["suspect_marks"] > marks0)
            corrupt += sum(1 for i, v in enumerate(got)
                           if v is not None and v != value(prefix, i, size))
        left = time.monotonic() - t0
        got = self.cc.get_batch(keys)
        corrupt += sum(1 for i, v in enumerate(got)
                       if v is not None and v != value(prefix, i, size))
        return {"batches": batches, "timed_out": timed_out, "left_after": left,
                "corrupt": corrupt, "revision_before": rev0,
                "revision_after": self.cc.view.revision,
                "members_after": [m.id for m in self.cc.view.members],
                "hits": [v is not None for v in got], "metrics": self.cc.metrics()}

    def read_from(self, prefix: str, n: int, size: int, only: str | None = None
                  ) -> dict[str, Any]:
        """Read keys (only those owned by ``only`` when given): seconds, bytes, misses,
        corrupt values and the requests each peer got for this read."""
        assert self.cc is not None
        keys = [f"{prefix}/{i}" for i in range(n)]
        idx = list(range(n))
        if only is not None:
            idx = [i for i, o in zip(idx, self.cc.owners(keys)) if o == only]
            keys = [keys[i] for i in idx]
        req0 = {p: v["requests"] for p, v in self.cc.metrics()["peers"].items()}
        t0 = time.perf_counter()
        got = self.cc.get_batch(keys)
        dt = time.perf_counter() - t0
        req = {p: v["requests"] - req0.get(p, 0)
               for p, v in self.cc.metrics()["peers"].items()}
        return {"seconds": dt, "bytes": sum(len(v) for v in got if v is not None),
                "misses": sum(v is None for v in got),
                "corrupt": sum(1 for i, v in zip(idx, got)
                               if v is not None and v != value(prefix, i, size)),
                "requests": {p: r for p, r in req.items() if r}}

    def server_stats(self) -> dict[str, Any]:
        assert self.cc is not None
        c = self.cc.local
        return c.run_op(op_view(c.session, stats=True))["stats"]  # type: ignore[no-any-return]

    def metrics(self) -> dict[str, Any]:
        assert self.cc is not None
        return self.cc.metrics()

    def exit(self) -> None:
        if self.cc is not None:
            self.cc.close()
        sys.stdout.write(json.dumps({"result": None}) + "\n")
        sys.stdout.flush()
        sys.exit(0)


def main() -> None:
    a = Agent()
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.pop("cmd")
        try:
            res = getattr(a, cmd)(**req)
            out = {"result": res}
        except SystemExit:
            raise
        except BaseException as exc:
            out = {"error": f"{exc!r}\n{traceback.format_exc()}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
