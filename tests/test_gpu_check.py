"""perf/gpu_check.py where there is no GPU: it measures nothing and says so, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_has_cuda(), reason="a CUDA device is here: run perf/gpu_check.py itself")
def test_without_cuda_it_exits_with_a_clear_message() -> None:
    p = subprocess.run([sys.executable, os.path.join(ROOT, "perf", "gpu_check.py")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "nothing measured" in p.stderr
    assert ("no CUDA device here" in p.stderr) or ("torch is not installed" in p.stderr)
    assert p.stdout == ""
