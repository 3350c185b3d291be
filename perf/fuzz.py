#!/usr/bin/env python3
"""A long fuzzing campaign of the server's message handling (tests/test_fuzz.py runs a
short one with the same strategies).

    python perf/fuzz.py [--examples 50000] [--seed N]

Every generated request must get a decodable reply with a known status, and after each
one the server must still answer STATS with exact accounting. Prints the examples run,
the statuses seen and the time; exits 1 with the failing frames on the first failure.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzzing import FuzzServer, requests  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    srv = FuzzServer()
    seen: collections.Counter[int] = collections.Counter()

    @settings(max_examples=args.examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def campaign(data):  # type: ignore[no-untyped-def]
        frames = data.draw(requests(srv.epoch))
        status, _, _ = srv.send(frames)
        seen[status] += 1
        srv.check_healthy()

    if args.seed is not None:
        campaign = seed(args.seed)(campaign)
    t = time.perf_counter()
    try:
        campaign()
    except Exception as exc:
        print(f"FAILED after {sum(seen.values())} examples: {exc!r}")
        return 1
    finally:
        srv.close()
    dt = time.perf_counter() - t
    from kvshm.zmq_ctrl.protocol import Status

    print(f"{sum(seen.values())} requests in {dt:.1f} s, no crash, every one answered, "
          "accounting exact after each")
    for st_, n in sorted(seen.items()):
        print(f"  {Status(st_).name:16s} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
