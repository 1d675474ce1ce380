"""Fault injection through `phalanx launch`: kill -9 and restart, SIGTERM pre-emption, a crashing
rank, a hang, resuming each strategy, a two-node job over loopback. Every resumed or restarted run
must end with the weights of an uninterrupted one, bit for bit."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.cli import run_phalanx

pytestmark = pytest.mark.multiprocess

# 12 steps per epoch, 2 epochs; dropout makes every step draw from the RNG a checkpoint restores.
SCRIPT = textwrap.dedent(
    """
    import os, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import phalanx

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(192, 8, generator=g), torch.randn(192, 2, generator=g))
    session = phalanx.Session(batch={"global_batch_size": 16}, train={"epochs": 2, "progress": False, "metrics": False})
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.5)
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader, scheduler = session.setup(model, optimizer, loader, scheduler)
    kill_at, sleep = int(os.environ.get("KILL_AT", "0")), float(os.environ.get("STEP_SLEEP", "0"))
    for _ in session.epochs():
        for x, y in session.progress(loader):
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(x), y))
            time.sleep(sleep)
            if session.step_count == kill_at and session.rank == 1 and session.topology.restart_count == 0:
                os.kill(os.getpid(), 9)
    state = session.model_state_dict()
    if session.is_main:
        torch.save(state, os.environ["OUT"])
    session.close()
    """
)


def _launch(tmp_path: Path, out: str, *args: str, env: dict | None = None, timeout: float = 120):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return run_phalanx(
        "launch",
        "--cpu",
        *args,
        str(script),
        cwd=tmp_path,
        timeout=timeout,
        env={"OUT": str(tmp_path / out), **(env or {})},
    )


def _same(a: Path, b: Path) -> bool:
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 2-process ddp run; saves every 6 steps (keeping the last 3). Its replicas are
    compared every 4 steps: with dropout drawn per rank, they must never be found apart."""
    tmp = tmp_path_factory.mktemp("reference")
    settings = ("checkpoint.save_every=6", "checkpoint.resume=never", "faults.replica_check_every=4")
    result = _launch(tmp, "ref.pt", "--nproc", "2", *(arg for s in settings for arg in ("--set", s)))
    assert result.returncode == 0, result.output
    return tmp


def test_kill9_restart_resumes_to_the_same_weights(tmp_path, reference):
    kill_at = random.Random(4).randint(5, 20)
    result = _launch(
        tmp_path,
        "out.pt",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        "--set",
        "checkpoint.save_every=3",
        env={"KILL_AT": str(kill_at)},
    )
    assert result.returncode == 0, result.output
    saved = kill_at - kill_at % 3
    if kill_at % 12 == 0:
        # The epoch's last step (12 a epoch): its save is written after the epoch's closing code, at the
        # next call into the Session (the checkpoint is then the next epoch's start); the kill came first.
        saved -= 3
    assert "restart 1 after a failure" in result.output
    assert f"resumed from {tmp_path / 'checkpoints' / f'step-{saved:08d}'}" in result.output
    assert _same(tmp_path / "out.pt", reference / "ref.pt")


@pytest.mark.timeout(240)
def test_sigterm_preemption_checkpoints_then_resumes(tmp_path, reference):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OUT": str(tmp_path / "out.pt"), "STEP_SLEEP": "0.15"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "launch", "--cpu", "--nproc", "2", str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "runs").glob("*/logs/rank1.log")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.5)  # some steps into training
        proc.send_signal(signal.SIGTERM)  # to the launcher only, as a scheduler would
        out, err = proc.communicate(timeout=90)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 75, out + err
    assert "pre-empted: checkpoint" in err and "run the same command again to resume" in err
    result = _launch(tmp_path, "out.pt", "--nproc", "2")
    assert result.returncode == 0, result.output
    assert "resumed from" in result.output
    assert _same(tmp_path / "out.pt", reference / "ref.pt")


@pytest.mark.parametrize("strategy", ["zero1", "fsdp", "pipeline"])
def test_each_strategy_resumes_exactly_and_exports(tmp_path, strategy):
    first = _launch(
        tmp_path, "full.pt", "--nproc", "2", "--set", f"strategy.name={strategy}", "--set", "checkpoint.save_every=12"
    )
    assert first.returncode == 0, first.output
    # A second run that starts from the mid-run checkpoint, as if the first had died after step 12.
    (tmp_path / "resume").mkdir()
    os.rename(tmp_path / "checkpoints" / "step-00000012", tmp_path / "resume" / "step-00000012")
    again = _launch(
        tmp_path,
        "resumed.pt",
        "--nproc",
        "2",
        "--set",
        f"strategy.name={strategy}",
        "--set",
        "checkpoint.dir=resume",
        "--set",
        "checkpoint.save_every=100",
    )
    assert again.returncode == 0, again.output
    assert "resumed from" in again.output and "step 12" in again.output
    assert _same(tmp_path / "resumed.pt", tmp_path / "full.pt")
    export = run_phalanx("checkpoint", "export", "checkpoints", "export.pt", cwd=tmp_path, timeout=60)
    assert export.returncode == 0, export.output
    assert _same(tmp_path / "export.pt", tmp_path / "full.pt")
    bare = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 2)).eval()
    bare.load_state_dict(torch.load(tmp_path / "export.pt"))
    reference = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 2)).eval()
    reference.load_state_dict(torch.load(tmp_path / "full.pt"))
    x = torch.randn(5, 8)
    assert torch.equal(bare(x), reference(x))


def test_resume_with_another_process_count_keeps_batch_and_position(tmp_path, reference):
    (tmp_path / "checkpoints").mkdir()
    os.symlink(reference / "checkpoints" / "step-00000018", tmp_path / "checkpoints" / "step-00000018")
    result = _launch(tmp_path, "out.pt", "--nproc", "1")
    assert result.returncode == 0, result.output
    assert "global batch 16 = micro batch 16 x 1 accumulation step x 1 process" in result.output
    assert "resumed from" in result.output and "step 18, epoch 2, 96 samples into the epoch" in result.output
    assert "rank 0 keeps its random generators" in result.output
    a, b = torch.load(tmp_path / "out.pt"), torch.load(reference / "ref.pt")
    assert all(a[k].shape == b[k].shape for k in a)


@pytest.mark.serial  # a time limit
def test_crashing_rank_stops_the_job_within_seconds(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        textwrap.dedent(
            """
        import time
        import phalanx
        session = phalanx.Session()
        session.barrier()
        if session.rank == 1:
            time.sleep(1)
            open("crashed", "w").write(str(time.time()))
            raise ValueError("boom on rank 1")
        time.sleep(120)  # rank 0 is busy in its own code, in no collective
        """
        )
    )
    result = run_phalanx("launch", "--cpu", "--nproc", "2", str(script), cwd=tmp_path, timeout=90)
    ended = time.time()
    assert result.returncode == 1, result.output
    assert ended - float((tmp_path / "crashed").read_text()) < 10
    assert "rank 1 failed first (exit code 1): ValueError: boom on rank 1" in result.stderr


@pytest.mark.serial  # a hang timeout and a time limit
def test_hang_is_detected_and_every_rank_stack_printed(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent(
            """
        import time
        import torch
        import phalanx
        session = phalanx.Session(faults={"hang_timeout": 3})
        for step in range(1000):
            session.barrier()  # progress, until rank 1 stops coming
            if step == 3 and session.rank == 1:
                time.sleep(600)
        """
        )
    )
    started = time.monotonic()
    result = run_phalanx("launch", "--cpu", "--nproc", "2", str(script), cwd=tmp_path, timeout=90)
    assert result.returncode == 124, result.output
    assert time.monotonic() - started < 3 + 25  # the timeout, start-up and the dumps
    err = result.stderr
    assert "phalanx: hang: the watchdog stopped the job" in err
    assert "rank 0:" in err and "collective barrier" in err
    assert "rank 1:" in err and f"<module> at {script}:9" in err
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in (run_dir / "hang" / "attempt0").iterdir()) == ["rank0.txt", "rank1.txt"]


def test_user_error_is_not_retried(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import phalanx\nphalanx.Session(batch={'global_batch_size': 15})\n")
    result = run_phalanx(
        "launch", "--cpu", "--nproc", "2", "--max-restarts", "3", str(script), cwd=tmp_path, timeout=90
    )
    assert result.returncode == 2, result.output
    assert result.stderr.count("phalanx: error:") == 1 and "Traceback" not in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(200)
def test_two_nodes_on_loopback_match_one_node(tmp_path, reference):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = _free_port()
    env = {**os.environ, "OUT": str(tmp_path / "out.pt")}
    common = [
        "--nproc",
        "1",
        "--nnodes",
        "2",
        "--master",
        f"127.0.0.1:{port}",
        "--set",
        "checkpoint.save_every=12",
        "--set",
        "checkpoint.resume=never",
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "phalanx", "launch", "--cpu", *common, "--node-rank", str(rank), str(script)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "node 0 of 2, static rendezvous at 127.0.0.1" in outputs[0]
    assert "ddp over 2 processes" in outputs[0]
    assert _same(tmp_path / "out.pt", reference / "ref.pt")
