"""benchmarks/gpu_check.sh on a machine without CUDA: it must stop at once, non-zero, with a line
naming CUDA, instead of "passing" with every CUDA test skipped (issue 40)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the script would run the check")


@pytest.mark.parametrize("which", [[], ["1"], ["2"]])
def test_without_cuda_the_check_stops_at_once_naming_cuda(which, tmp_path):
    results = tmp_path / "results"
    done = subprocess.run(
        ["bash", str(SCRIPT), *which, "--out", str(results)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PY": sys.executable},
    )
    assert done.returncode != 0
    assert f"gpu_check.sh: no CUDA device: torch {torch.__version__} sees none" in done.stderr
    assert not results.exists()  # nothing ran, so nothing is recorded


def test_an_unknown_argument_is_refused_with_the_usage():
    done = subprocess.run(["bash", str(SCRIPT), "3"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage: bash benchmarks/gpu_check.sh [1|2|all] [--out DIR]" in done.stderr
