"""``kvshm replay``: replay a real request trace against a store and check every byte.

For each request of the trace, in order: ``match_prefix`` of its block keys, a
``get_batch_into`` of the leading blocks found (each checked byte for byte), and a
``put_batch`` of every block after the first miss. A block's bytes derive from its hash
id (:mod:`kvshm.trace`), so nothing written has to be remembered to be checked.

The same command runs an exact LRU cache and an unbounded cache over the same requests
(:func:`kvshm.trace.simulate_lru`, :func:`kvshm.trace.unbounded_hits`), so the store's hit
rate is shown beside what its eviction should reach and what no cache can beat.

Backends: ``kvshm`` (its own server, or ``--address``; bytes through shared memory),
``kvshm-tcp`` (bytes in the messages), ``redis`` (a redis-server started here with
``maxmemory`` = the same capacity and ``allkeys-lru``, or ``--address``).

With ``--address`` the replay's keys (``kvshm-replay/<run id>/<hash id>``) are deleted
at the end; a server started here is stopped, whatever happens.

``--clients K`` runs K processes (spawned); request ``i`` of the trace goes to client
``i % K`` (round robin), each client replays its share in trace order, all at once.
Left free, the clients drift thousands of requests apart (one gets more CPU than the
others) and the store then sees another access order than the trace's; so by default a
client starts request ``i`` only once every request before ``i - 4K`` has finished
(``--window``; 0 lets them run free). Requests near each other in the trace still run
at the same time: a request may miss blocks that a request just before it is still
writing (the exact LRU assumes that one finished), and writes the same blocks again.

Python use::

    from kvshm.replay import ReplayOptions, run_replay
    result = run_replay(ReplayOptions(requests=1000, block_bytes=4096, pool_gib=0.01))
    print(result.summary["hit_rate"], result.summary["lru_hit_rate"])

Modules, one concept each: :mod:`~kvshm.replay.options` (what to replay),
:mod:`~kvshm.replay.servers` (servers started for the replay),
:mod:`~kvshm.replay.backends` (the stores, behind one interface),
:mod:`~kvshm.replay.runner` (one client's share, every byte checked),
:mod:`~kvshm.replay.clients` (K client processes, paced),
:mod:`~kvshm.replay.run` (the whole replay), :mod:`~kvshm.replay.report` (summary, plot),
:mod:`~kvshm.replay.cli` (``kvshm replay``); the reference caches are in
:mod:`kvshm.trace`.
"""

from __future__ import annotations

from kvshm.replay.cli import add_parser
from kvshm.replay.options import BACKENDS, ReplayError, ReplayOptions, UsageError
from kvshm.replay.report import ReplayResult, format_summary
from kvshm.replay.run import run_replay

__all__ = ["ReplayOptions", "ReplayResult", "ReplayError", "UsageError", "run_replay",
           "add_parser", "format_summary", "BACKENDS"]
