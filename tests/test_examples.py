"""Every example in examples/ runs to the end (exit 0) against a server of its own, and
against a running server given with --address (issue 5)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from servers import shm_segments
from servers import ServerProcess

EXAMPLES_DIR = os.path.join(os.path.dirname(__file__), "..", "examples")
EXAMPLES = sorted(f for f in os.listdir(EXAMPLES_DIR) if f.endswith(".py"))
TIMEOUT = 120


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-W", "error::ResourceWarning",
                             os.path.join(EXAMPLES_DIR, name), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{name} did not finish within {TIMEOUT} s\n{out}\n{err}")
    left = shm_segments(f"kvshm-0-{proc.pid}-")     # its own server's segment
    assert not left, f"{name} left {left}"
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{out}\n{err}"
    assert out.rstrip().endswith("ok"), out
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_all_four_are_there():
    assert {"sync_client.py", "async_client.py", "async_single_key.py",
            "layerwise_prefill_decode.py"} <= set(EXAMPLES)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_with_its_own_server(name):
    run_example(name)


@pytest.fixture(scope="module")
def server():
    with ServerProcess(prealloc_size=0.25) as s:
        yield s


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_against_a_running_server(server, name):
    run_example(name, "--address", server.address)
