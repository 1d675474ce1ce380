"""examples/nanogpt_style.py, a nanoGPT-shaped loop (no DataLoader, random positions of a memory-mapped
token file, its own iter_num in session.keep): it runs at 1 and 2 processes, and a SIGTERM at a step
followed by the same command again ends at exactly --max-iters steps, with the weights of a run that
was never stopped, bit for bit, with and without accumulation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import EXAMPLES, run_phalanx
from tests.helpers.scripts import sigterm_drill

pytestmark = pytest.mark.multiprocess

EXAMPLE = EXAMPLES / "nanogpt_style.py"
MAX_ITERS = 16
ARGS = ["--max-iters", str(MAX_ITERS), "--eval-interval", "5", "--save-interval", "8", "--batch-size", "4"]

DRILL = sigterm_drill(str(EXAMPLE))  # the script unchanged, SIGTERM at $SIGTERM_AT


def _launch(cwd: Path, script: Path, out: str, nproc: int, *args: str, env: dict | None = None):
    return run_phalanx(
        "launch", "--cpu", "--nproc", str(nproc), str(script), *ARGS, "--out", out, *args,
        cwd=cwd, timeout=90, env=env,
    )  # fmt: skip


def _summary(out: Path) -> dict:
    return json.loads((out / "final.json").read_text())


def _same(a: Path, b: Path) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted 2-process runs, one per --grad-accum, made when first asked for."""
    made: dict[int, Path] = {}

    def get(grad_accum: int) -> Path:
        if grad_accum not in made:
            tmp = tmp_path_factory.mktemp(f"reference-{grad_accum}")
            result = _launch(tmp, EXAMPLE, "ref", 2, "--grad-accum", str(grad_accum))
            assert result.returncode == 0, result.output
            made[grad_accum] = tmp / "ref"
        return made[grad_accum]

    return get


@pytest.mark.timeout(150)
def test_runs_at_one_and_two_processes(tmp_path, reference):
    one = _launch(tmp_path, EXAMPLE, "one", 1)
    assert one.returncode == 0, one.output
    assert (tmp_path / "one" / "final.pt").is_file()
    # --grad-accum 2 (the default) is two micro-steps in one process, the accumulate() form...
    summary = _summary(tmp_path / "one")
    assert summary["iter_num"] == summary["step_count"] == MAX_ITERS and summary["accumulation_steps"] == 2
    assert "global batch 8 = micro batch 4 x 2 accumulation steps x 1 process" in one.output
    # ...and one in each of two processes, the backward() + step() form: the same global batch.
    two = reference(2)
    assert (two / "final.pt").is_file() and (two / "train.bin").is_file()
    summary = _summary(two)
    assert summary["iter_num"] == summary["step_count"] == MAX_ITERS and summary["accumulation_steps"] == 1


@pytest.mark.timeout(200)
@pytest.mark.parametrize("grad_accum", [2, 4], ids=["one-micro-step", "accumulation"])
def test_sigterm_then_the_same_command_ends_as_an_uninterrupted_run(tmp_path, reference, grad_accum):
    drill = tmp_path / "drill.py"
    drill.write_text(DRILL)
    args = ("--grad-accum", str(grad_accum))
    stopped = _launch(tmp_path, drill, "run", 2, *args, env={"SIGTERM_AT": "3", "STEP_PAUSE": "0.25"})
    assert stopped.returncode == 75, stopped.output
    assert "pre-empted: checkpoint" in stopped.output and not (tmp_path / "run" / "final.pt").exists()

    again = _launch(tmp_path, drill, "run", 2, *args)  # the same command, no signal this time
    assert again.returncode == 0, again.output
    assert "resumed from" in again.output
    summary = _summary(tmp_path / "run")
    assert summary["iter_num"] == summary["step_count"] == MAX_ITERS, summary
    assert summary["accumulation_steps"] == grad_accum // 2
    assert _same(tmp_path / "run" / "final.pt", reference(grad_accum) / "final.pt")
