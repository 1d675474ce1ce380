"""Issue 23, through real processes: a checkpoint a SIGTERM wrote resumes under the same command,
and stops in one line, before any worker starts, the same command with one setting changed; under
plain torchrun (no phalanx launcher) every rank refuses it at setup, and none hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.cli import finish, run_phalanx
from tests.helpers.processes import new_tag

pytestmark = pytest.mark.multiprocess

# 2 processes, a tiny model, 12 steps; STEP_SLEEP leaves time for a SIGTERM mid-run.
SCRIPT = textwrap.dedent(
    """
    import os, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import phalanx

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 4), torch.randn(96, 1))
    session = phalanx.Session(batch={"global_batch_size": 8}, train={"progress": False, "metrics": False})
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = session.setup(model, optimizer, DataLoader(data, batch_size=8))
    sleep = float(os.environ.get("STEP_SLEEP", "0"))
    for _ in session.epochs():
        for x, y in session.progress(loader):
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(x), y))
            time.sleep(sleep)
            if session.is_main and session.step_count == 1 and os.environ.get("STARTED"):
                open(os.environ["STARTED"], "w").close()
    if session.is_main:
        print(f"finished at step {session.step_count}")
    session.close()
    """
)


def _popen(cmd: list[str], cwd: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


@pytest.mark.timeout(240)
def test_sigterm_checkpoint_resumes_the_same_command_and_refuses_a_changed_one(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    tag = new_tag()
    started = tmp_path / "started"
    env = {**os.environ, "STEP_SLEEP": "0.3", "STARTED": str(started), **tag}
    proc = _popen([sys.executable, "-m", "phalanx", "launch", "--cpu", "--nproc", "2", str(script)], tmp_path, env)
    try:
        deadline = time.monotonic() + 90
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # after the first step, to the launcher only, as a scheduler would
    finally:
        out, err = finish(proc, tag, 90)
    assert proc.returncode == 75, out + err
    (checkpoint,) = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-")]
    step = int(checkpoint.name.removeprefix("step-"))
    runs = sorted((tmp_path / "runs").iterdir())

    changed = run_phalanx("launch", "--cpu", "--nproc", "2", "--set", "train.seed=1", str(script), cwd=tmp_path)
    assert changed.returncode == 2, changed.output
    lines = changed.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in changed.output, changed.output
    assert f"checkpoint 'checkpoints/{checkpoint.name}' (step {step}, saved " in lines[0]
    assert "belongs to another run: train.seed: 0 -> 1;" in lines[0]
    assert "--set checkpoint.resume_any_run=true" in lines[0] and "--set checkpoint.dir=DIR" in lines[0]
    assert sorted((tmp_path / "runs").iterdir()) == runs  # no run directory: no worker started

    same = run_phalanx("launch", "--cpu", "--nproc", "2", str(script), cwd=tmp_path)
    assert same.returncode == 0, same.output
    assert f"resumed from {checkpoint}: step {step}" in same.output and "finished at step 12" in same.output


@pytest.mark.timeout(240)
def test_plain_torchrun_refuses_on_every_rank_at_setup(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = tmp_path / "phalanx.yaml"
    config.write_text("checkpoint: {save_every: 4}\ntrain: {max_steps: 4}\n")
    tag = new_tag()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **tag}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    first = _popen(torchrun, tmp_path, env)
    out, err = finish(first, tag, 120)
    assert first.returncode == 0 and "finished at step 4" in out, out + err

    config.write_text("checkpoint: {save_every: 4}\ntrain: {max_steps: 8, seed: 5}\n")  # max_steps does not count
    again = _popen(torchrun, tmp_path, env)
    out, err = finish(again, tag, 120)
    assert again.returncode != 0, out + err
    refusals = [line for line in (out + err).splitlines() if "belongs to another run: train.seed: 0 -> 5;" in line]
    assert len(refusals) == 2, out + err  # each rank's own PhalanxError, the same line
    assert "checkpoint.resume_any_run: true" in refusals[0] and "finished" not in out


# Issue 41: a script with its own arguments, as pytorch/examples' imagenet writes them. It saves
# where --ckpt-dir says (in code), else in checkpoint.dir's default.
ARGS_SCRIPT = textwrap.dedent(
    """
    import argparse
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import phalanx

    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("-p", "--print-freq", type=int, default=10)
    parser.add_argument("--resume", default="")
    parser.add_argument("--ckpt-dir", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    own = {"dir": args.ckpt_dir} if args.ckpt_dir else {}
    train = {"epochs": args.epochs, "progress": False, "metrics": False}
    session = phalanx.Session(batch={"global_batch_size": 8}, train=train, checkpoint=own)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer, loader = session.setup(model, optimizer, DataLoader(data, batch_size=8))
    for _ in session.epochs():
        for x, y in session.progress(loader):
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(x), y))
    session.save()
    if session.is_main:
        print(f"finished at step {session.step_count}")
    session.close()
    """
)


@pytest.mark.timeout(300)
def test_resume_follows_the_scripts_arguments_and_its_own_directory(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(ARGS_SCRIPT)

    def launch(*args: str):
        return run_phalanx("launch", "--cpu", "--nproc", "2", str(script), *args, cwd=tmp_path, timeout=120)

    first = launch("--epochs", "1", "--lr", "0.1")
    assert first.returncode == 0 and "finished at step 2" in first.output, first.output
    (saved,) = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-")]

    changed = launch("--epochs", "2", "--lr", "0.2")
    assert changed.returncode == 2, changed.output
    refusals = {line for line in changed.output.splitlines() if "belongs to another run" in line}
    assert len(refusals) == 1 and "Traceback" not in changed.output, changed.output
    assert "belongs to another run: script argument --lr 0.1 (checkpoint) vs --lr 0.2 (now);" in refusals.pop()

    # More epochs, a resume path, another print frequency, another order: the same run, trained on.
    longer = launch("-p", "5", "--lr=0.1", "--resume", "checkpoints", "--epochs", "2")
    assert longer.returncode == 0, longer.output
    assert f"resumed from {saved}: step 2" in longer.output and "finished at step 4" in longer.output

    # Its own directory, chosen in code: the default one's checkpoints are not its business.
    own = launch("--lr", "0.3", "--ckpt-dir", "own")
    assert own.returncode == 0 and "resumed from" not in own.output, own.output
    assert "finished at step 2" in own.output and (tmp_path / "own" / "latest").exists()
