"""The hang watchdog and a slow first step: a first optimizer step that takes longer than
faults.hang_timeout (as one that compiles, autotunes or warms up NCCL does) runs under
faults.first_step_timeout instead, and a stall after it is still caught by hang_timeout."""

from __future__ import annotations

import textwrap
import time

import pytest

from tests.helpers.cli import run_phalanx

# serial: the verdicts depend on wall-clock timeouts, which a second test process would stretch.
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]

SCRIPT = textwrap.dedent(
    """
    import os, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import phalanx

    session = phalanx.Session(
        faults={"hang_timeout": 3, "first_step_timeout": 60}, train={"progress": False, "metrics": False}
    )
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)
    model, optimizer, loader = session.setup(model, optimizer, loader)
    stall_at = int(os.environ.get("STALL_AT", "-1"))
    for x, y in loader:
        with session.accumulate(model):
            if session.step_count == 0:
                time.sleep(6)  # twice hang_timeout: what a compiling first step looks like
            session.backward(nn.functional.mse_loss(model(x), y))
        if session.step_count == 1 and session.is_main:
            print("first step done", flush=True)
        if session.step_count == stall_at and session.rank == 1:
            time.sleep(600)
    print(f"rank {session.rank} finished {session.step_count} steps", flush=True)
    session.close()
    """
)


@pytest.mark.timeout(150)
def test_a_slow_first_step_is_not_a_hang(tmp_path):
    script = tmp_path / "slow_first.py"
    script.write_text(SCRIPT)
    result = run_phalanx("launch", "--cpu", "--nproc", "2", "--ranks", "all", str(script), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.output  # before first_step_timeout: killed as a hang, exit 124
    assert "phalanx: hang" not in result.output
    assert "rank 0 finished 8 steps" in result.output and "rank 1 finished 8 steps" in result.output


@pytest.mark.timeout(150)
def test_a_stall_after_the_first_step_is_still_caught_by_hang_timeout(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    result = run_phalanx(
        "launch", "--cpu", "--nproc", "2", str(script), cwd=tmp_path, timeout=120, env={"STALL_AT": "2"}
    )
    assert result.returncode == 124, result.output
    assert time.monotonic() - started < 6 + 3 + 40  # the first step, the timeout, start-up and the dumps
    assert "first step done" in result.output
    assert "no progress for" in result.stderr and "(faults.hang_timeout is 3 s)" in result.stderr
