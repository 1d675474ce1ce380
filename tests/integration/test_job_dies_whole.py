"""A job dies whole: SIGKILL of the launcher's process group (what the OOM killer, a scheduler
after its grace period or a closed terminal does) ends every worker and every worker's children
(data-loader processes) within seconds, whether the ranks were computing, blocked in a collective
or writing a checkpoint. torch elastic starts each worker in a session of its own, so before
faults/lifeline.py the workers trained on as orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from phalanx.checkpoint import files
from phalanx.checkpoint.lock import DirectoryLock
from tests.helpers.processes import kill_tagged, new_tag, tagged, wait_gone

# serial: the verdicts depend on wall-clock timeouts, which a second test process would stretch.
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]

SCRIPT = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import phalanx

    mode, out = os.environ["MODE"], Path(os.environ["OUT"])
    session = phalanx.Session(
        batch={"global_batch_size": 8},
        train={"epochs": 1000, "progress": False, "metrics": False},
        checkpoint={"dir": str(out / "ckpt"), "resume": "never", "keep_last": 2},
    )
    width = 1024 if mode == "save" else 16
    model = torch.nn.Linear(width, width)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    loader = DataLoader(TensorDataset(torch.randn(256, width)), batch_size=4, num_workers=1)
    model, optimizer, loader = session.setup(model, optimizer, loader)
    for _ in session.epochs():
        for (x,) in session.progress(loader):
            with session.accumulate(model):
                session.backward(model(x).square().mean())
            if session.step_count == 3:
                (out / f"ready{session.rank}").write_text(str(os.getpid()))
                if mode == "collective" and session.rank == 1:
                    time.sleep(3600)  # rank 0 waits in the next step's all-reduce meanwhile
            if mode == "save" and session.step_count >= 3:
                session.save()
    """
)


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, dict[str, str]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    tag = new_tag()
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "launch", "--cpu", "--nproc", "2", str(script)],
        cwd=tmp_path,
        env={**os.environ, **tag, "MODE": mode, "OUT": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, so the test can kill the group as a terminal would
    )
    return proc, tag


def _wait_for(condition, proc: subprocess.Popen, what: str, within: float = 90) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the job ended before {what}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {within:g} s")
        time.sleep(0.01)


def _kill_group_and_wait(proc: subprocess.Popen, tag: dict[str, str]) -> tuple[float, list[int]]:
    job = tagged(tag)
    assert len(job) - 1 >= 4, "expected 2 workers and their loader processes besides the launcher"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    return wait_gone(tag, within=5, known=job)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["step", "collective"])
def test_sigkill_of_the_launcher_ends_every_worker_and_loader_process(tmp_path, mode):
    proc, tag = _start(tmp_path, mode)
    try:
        needed = ["ready1"] if mode == "collective" else ["ready0", "ready1"]
        _wait_for(lambda: all((tmp_path / n).exists() for n in needed), proc, "training step 3")
        if mode == "collective":
            time.sleep(1.0)  # rank 0 is inside the all-reduce rank 1 never joins
        seconds, alive = _kill_group_and_wait(proc, tag)
        assert not alive, f"still alive 5 s after the launcher's SIGKILL: pids {alive}"
        print(f"{mode}: every process of the job gone {seconds:.2f} s after the kill")
    finally:
        kill_tagged(tag)


@pytest.mark.timeout(180)
def test_sigkill_mid_save_ends_the_job_and_leaves_a_loadable_checkpoint_and_a_free_directory(tmp_path):
    proc, tag = _start(tmp_path, "save")
    ckpt = tmp_path / "ckpt"
    try:
        _wait_for(lambda: files.latest(ckpt) is not None, proc, "a first checkpoint")
        _wait_for(lambda: any(ckpt.glob(".incomplete-*/*")), proc, "a save in progress")
        seconds, alive = _kill_group_and_wait(proc, tag)
        assert not alive, f"still alive 5 s after the launcher's SIGKILL: pids {alive}"
    finally:
        kill_tagged(tag)
    found = files.latest(ckpt)
    manifest = files.read_manifest(found)
    names = files.data_files(found)
    assert files.verify(found, manifest, names) is None  # the last complete one is whole
    with DirectoryLock(ckpt, None) as lock:  # the kernel released the dead job's lock
        assert lock.held
