"""Engine-integration tests (LMCache, SGLang, vLLM), all marked ``integration``.

Run them in the integration venv, from the repository root, after ``pip install -e .``
built kvshm's extensions in place::

    scripts/integration-env.sh
    PYTHONPATH=$PWD /root/.cache/kvshm-ci/integration-venv/bin/python -m pytest \\
        tests/integrations -m integration

Elsewhere (the main ``.venv``) each engine's module skips with the reason, without
importing any engine package (see ``_engines.py``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
for p in (HERE, TESTS):            # _engines, and tests/servers.py
    if p not in sys.path:
        sys.path.insert(0, p)

from _support import stop_server  # noqa: E402
from servers import ServerProcess  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    # third-party deprecations seen when the engines import (not kvshm's)
    for mod in ("opentelemetry", "torch.jit", "torch._dynamo", "transformers"):
        config.addinivalue_line("filterwarnings", f"ignore::DeprecationWarning:{mod}.*")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if str(item.fspath).startswith(HERE + os.sep):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module")
def kvshm_server() -> Iterator[ServerProcess]:
    """A real ``kvshm serve`` (free port, unique segment) shared by one test module;
    tests purge it as they need."""
    srv = ServerProcess(prealloc_size=0.25)
    try:
        yield srv
    finally:
        stop_server(srv)
