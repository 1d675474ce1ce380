"""The worked language-model example (examples/word_lm/): the phalanx port trains, at 2 processes,
to the weights of the one-device original, and it changes fewer lines than the Accelerate and
Fabric ports of the same script (docs/porting.md quotes the count)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import REPO, run_phalanx

pytestmark = pytest.mark.multiprocess

FOLDER = REPO / "examples" / "word_lm"
# 14 optimizer steps (96,000 tokens / 200 columns / bptt 35); no dropout, so ranks draw nothing.
ARGS = ["--epochs", "1", "--dropout", "0", "--batch-size", "200"]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.timeout(300)
def test_the_port_at_two_processes_matches_the_one_device_script(tmp_path):
    single = subprocess.run(
        [sys.executable, str(FOLDER / "lm_single.py"), *ARGS, "--save", str(tmp_path / "single.pt")],
        cwd=tmp_path, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert single.returncode == 0, single.stderr
    ported = run_phalanx(
        "launch", "--cpu", "--nproc", "2", str(FOLDER / "lm_phalanx.py"), *ARGS, "--save", str(tmp_path / "ported.pt"),
        cwd=tmp_path, timeout=200,
    )  # fmt: skip
    assert ported.returncode == 0, ported.output
    assert "(layout fixed)" in ported.output and "test ppl" in ported.stdout
    a, b = _weights(tmp_path / "single.pt"), _weights(tmp_path / "ported.pt")
    assert list(a) == list(b)  # the user's own state_dict keys
    worst = max(float((a[k] - b[k]).norm() / a[k].norm()) for k in a)
    assert worst < 1e-5, worst
    # The layout is fixed: a global batch that would mix time steps is refused before training.
    refused = run_phalanx(
        "launch", "--cpu", "--nproc", "2", "--set", "batch.global_batch_size=100", str(FOLDER / "lm_phalanx.py"),
        *ARGS, cwd=tmp_path, timeout=200,
    )  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.output, refused.output


def test_the_phalanx_port_changes_fewer_lines_than_accelerate_and_fabric():
    spec = importlib.util.spec_from_file_location("porting_lines", REPO / "benchmarks" / "porting_lines.py")
    counter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counter)
    original = counter.code_lines(FOLDER / "lm_single.py")
    total = {name: sum(counter.changed(original, counter.code_lines(FOLDER / f))) for name, f in counter.PORTS.items()}
    assert total["phalanx"] < min(total["Accelerate"], total["Lightning Fabric"]), total
