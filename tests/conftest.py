"""Shared test fixtures: unique shm names, and checks that no test leaks segments or processes.

Every shared-memory name a test uses must come from the ``shm_name`` fixture (prefix
``kvshm-test-<pid of the pytest process>-``): the leak checks scan ``/dev/shm`` for that
prefix, so test runs of several engineers on one machine never see each other's segments.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest

from servers import shm_segments

SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvshm-test-"


def session_shm_prefix() -> str:
    """Prefix of every segment name made in this pytest process (and its children)."""
    return f"{SHM_PREFIX}{os.getpid()}-"


def _unlink_all(names: list[str]) -> None:
    for n in names:
        try:
            os.unlink(os.path.join(SHM_DIR, n))
        except FileNotFoundError:
            pass


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_segments() -> Iterator[None]:
    """Fail the session if a segment named with this session's prefix is left in /dev/shm."""
    prefix = session_shm_prefix()
    yield
    left = shm_segments(prefix)
    _unlink_all(left)  # clean up, then report: the next run starts clean either way
    assert not left, f"shared-memory segments left in {SHM_DIR}: {left}"


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A shm name unique to this test, e.g. ``kvshm-test-1234-9f8e7d6c``.

    A test that needs several names derives them from this one (``shm_name + "-b"``): at the
    end of the test every segment whose name starts with it must be gone, else the test
    errors (and the segments are removed).
    """
    name = f"{session_shm_prefix()}{uuid.uuid4().hex[:8]}"
    yield name
    left = shm_segments(name)
    _unlink_all(left)
    assert not left, f"test left shared-memory segments in {SHM_DIR}: {left}"


@pytest.fixture
def no_local_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients made in this test (and its child processes) read through the server even
    on the same host (no lock-free reads of the shared index): for tests of the
    protocol's own read path (pins, leases, cancellation, timeouts)."""
    monkeypatch.setenv("KVSHM_NO_LOCAL_READS", "1")


# ----------------------------------------------------------------------------- processes


def _children(pid: int) -> list[int] | None:
    """Child pids of ``pid`` from /proc/<pid>/task/*/children; None where the kernel lacks it."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out  # exited meanwhile
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended
            return None  # no CONFIG_PROC_CHILDREN
        except OSError:
            continue
    return out


def _parent_map() -> dict[int, list[int]]:
    """ppid -> child pids for every process (the slow way, from /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat:
                children.setdefault(stat[1], []).append(int(entry))
    return children


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1])


def live_descendants(pid: int | None = None) -> set[int]:
    """Pids of the living (not zombie) descendants of ``pid`` (default: this process)."""
    root = os.getpid() if pid is None else pid
    table: dict[int, list[int]] | None = None
    found: set[int] = set()
    todo = [root]
    while todo:
        p = todo.pop()
        kids = _children(p) if table is None else table.get(p, [])
        if kids is None:
            table = _parent_map()
            kids = table.get(p, [])
        for c in kids:
            if c not in found:
                found.add(c)
                todo.append(c)
    live = set()
    for p in found:
        stat = _stat(p)
        if stat and stat[0] not in ("Z", "X"):
            live.add(p)
    return live


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


# helpers that a library starts once per process and keeps on purpose
_ALLOWED_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


@pytest.fixture(autouse=True)
def _no_leaked_processes() -> Iterator[None]:
    """Fail a test that leaves a process it started (or a descendant of one) alive.

    Leftovers are killed (SIGKILL) before the failure is reported, so one bad test does not
    make the following ones fail too.
    """
    before = live_descendants()
    yield
    new = live_descendants() - before
    if new:  # a child that is just exiting gets a moment
        deadline = time.monotonic() + 2.0
        while new and time.monotonic() < deadline:
            time.sleep(0.02)
            _reap(new)
            new &= live_descendants()
    leaked = {p: _cmdline(p) for p in new}
    leaked = {p: c for p, c in leaked.items() if not any(h in c for h in _ALLOWED_HELPERS)}
    for p in leaked:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5.0
    while leaked and time.monotonic() < deadline and set(leaked) & live_descendants():
        _reap(set(leaked))
        time.sleep(0.01)
    _reap(set(leaked))
    assert not leaked, f"test left processes alive (killed now): {leaked}"


def _reap(pids: set[int]) -> None:
    """waitpid(WNOHANG) those of ``pids`` that are our own children."""
    for p in pids:
        try:
            os.waitpid(p, os.WNOHANG)
        except ChildProcessError:  # not our child, or already reaped
            pass
