"""The server loop's hold on the process-wide garbage collector (kvshm.zmq_ctrl.router).

A ServiceLoop keeps the automatic collector to its young generations while it runs and
makes full collections itself; the thresholds are per process, so servers embedded in one
program (or a test run) must not leave full collections off when they stop in another
order than they started."""

from __future__ import annotations

import gc
import uuid

import kvshm


def _server() -> kvshm.Server:
    return kvshm.Server(service_port=0, manage_port=None, prealloc_size=0.02,
                        shm_name=f"kvshm-test-gc-{uuid.uuid4().hex[:10]}")


def test_servers_stopped_out_of_order_give_the_collector_back() -> None:
    before = gc.get_threshold()
    a = _server().start()
    b = _server().start()
    try:
        with kvshm.Client(a.address) as c:       # both loops are running
            c.put(b"k", b"v")
        with kvshm.Client(b.address) as c:
            c.put(b"k", b"v")
        assert gc.get_threshold()[2] > before[2]  # full collections held while they run
    finally:
        a.stop()        # the first started stops first
        b.stop()
    assert gc.get_threshold() == before


def test_one_server_gives_the_collector_back() -> None:
    before = gc.get_threshold()
    with _server() as s:
        with kvshm.Client(s.address) as c:
            c.put(b"k", b"v")
    assert gc.get_threshold() == before
