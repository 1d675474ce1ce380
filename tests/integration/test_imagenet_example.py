"""PyTorch's ImageNet example and a newcomer's phalanx port of it (examples/imagenet/, issue 41): the
port keeps the script's DistributedSampler, its validation with its own all-reduce and its StepLR
stepped once per epoch; it trains at 2 processes as at 1 (its BatchNorm converted to SyncBatchNorm),
a SIGTERM in the middle of an epoch followed by the same command again ends on the weights of a run
that was never stopped, bit for bit, and it changes fewer lines than Lightning Fabric's port (140)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import EXAMPLES, REPO, run_phalanx
from tests.helpers.scripts import sigterm_drill

pytestmark = pytest.mark.multiprocess

FOLDER = EXAMPLES / "imagenet"
PORT = FOLDER / "main_phalanx.py"
# 48 training images in global batches of 8: 6 steps an epoch, 12 in all; 21 validation images, which
# 2 processes split 10 + 10 with the script's own pass over the last one.
ARGS = ["--dummy", "--fake-sizes", "48", "21", "--epochs", "2", "-b", "8", "-j", "0", "-p", "100"]
LAST = "checkpoints/step-00000012/model.pt"
FABRIC_CHANGED_LINES = 140  # the count for the Lightning Fabric port of the same script

DRILL = sigterm_drill(str(PORT))  # the script unchanged, SIGTERM at $SIGTERM_AT


def _launch(cwd: Path, nproc: int, script: Path = PORT, env: dict | None = None):
    return run_phalanx("launch", "--cpu", "--nproc", str(nproc), str(script), *ARGS, cwd=cwd, timeout=120, env=env)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)[0]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """An uninterrupted 2-process run of the port: its directory."""
    cwd = tmp_path_factory.mktemp("two")
    result = _launch(cwd, 2)
    assert result.returncode == 0, result.output
    assert "taken as split, its batch_size 4 is per process, so the global batch is 8" in result.output
    assert "does not shuffle" not in result.output
    return cwd


@pytest.mark.timeout(300)
def test_the_port_trains_at_two_processes_as_at_one(tmp_path, two_processes):
    one = _launch(tmp_path, 1)
    assert one.returncode == 0, one.output
    assert "global batch 8 = micro batch 8 x 1 accumulation step x 1 process" in one.output
    a, b = _weights(tmp_path / LAST), _weights(two_processes / LAST)
    assert list(a) == list(b)
    worst = max(float((a[k].float() - b[k].float()).norm() / (a[k].float().norm() + 1e-12)) for k in a)
    assert worst < 1e-5, worst


@pytest.mark.timeout(300)
def test_a_sigterm_mid_epoch_then_the_same_command_ends_as_an_uninterrupted_run(tmp_path, two_processes):
    drill = tmp_path / "drill.py"
    drill.write_text(DRILL)
    stopped = _launch(tmp_path, 2, drill, env={"SIGTERM_AT": "8", "STEP_PAUSE": "0.3"})
    assert stopped.returncode == 75, stopped.output
    assert "pre-empted: checkpoint" in stopped.output and not (tmp_path / LAST).exists()
    again = _launch(tmp_path, 2, drill)
    assert again.returncode == 0, again.output
    assert "resumed from" in again.output and "epoch 2" in again.output, again.output
    a, b = _weights(tmp_path / LAST), _weights(two_processes / LAST)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_the_port_changes_fewer_lines_than_fabric():
    spec = importlib.util.spec_from_file_location("porting_lines", REPO / "benchmarks" / "porting_lines.py")
    counter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counter)
    added, removed = counter.changed(counter.code_lines(FOLDER / "main_original.py"), counter.code_lines(PORT))
    assert added + removed < FABRIC_CHANGED_LINES, (added, removed)
