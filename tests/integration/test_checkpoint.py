"""Checkpoints from other processes: `phalanx checkpoint info` and `export` as subprocesses, and a
saver process killed with SIGKILL in the middle of its saves."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
from torch import nn

import phalanx
from phalanx.checkpoint.export import export, open_checkpoint
from tests.helpers.checkpoints import saved_checkpoint
from tests.helpers.cli import run_phalanx


def test_cli_info_export_and_errors(tmp_path):
    path = saved_checkpoint(tmp_path)
    info = run_phalanx("checkpoint", "info", str(path), cwd=tmp_path, timeout=60)
    assert info.returncode == 0, info.output
    # Taken on the last step of the last epoch: it resumes after it (nothing left to train).
    assert "step 10, after epoch 2" in info.stdout and "all match their SHA-256" in info.stdout
    out = run_phalanx("checkpoint", "export", str(path), str(tmp_path / "w.pt"), cwd=tmp_path, timeout=60)
    assert out.returncode == 0 and "wrote" in out.stdout, out.output
    (path / "rng.pt").write_bytes(b"garbage")
    bad = run_phalanx("checkpoint", "info", str(path), cwd=tmp_path, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "rng.pt' is truncated or damaged" in bad.stderr
    missing = run_phalanx("checkpoint", "export", str(tmp_path / "nope"), "x.pt", cwd=tmp_path, timeout=60)
    assert missing.returncode == 2 and "not found" in missing.stderr and "Traceback" not in missing.stderr


def _saver(directory: str, ready) -> None:
    """Saves, trains a step and saves again, forever: a process to kill in the middle of a save."""
    checkpoint = {"dir": directory, "resume": "never", "keep_last": 2}
    session = phalanx.Session(train={"progress": False}, checkpoint=checkpoint)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # ~2 MB of weights, 4 MB of Adam state
    optimizer = torch.optim.Adam(model.parameters())
    model, optimizer = session.setup(model, optimizer)
    session.save()
    ready.set()
    while True:  # every step changes the weights, then a save
        with session.accumulate(model):
            session.backward(model(torch.randn(4, 512)).square().mean())
        session.save()


@pytest.mark.timeout(240)
def test_kill_during_save_leaves_a_loadable_checkpoint(tmp_path):
    # Each saver is forked from a server that has imported torch (as phalanx.spawn's ranks are):
    # twenty fresh interpreters cost twenty imports of torch, and the kill is the same SIGKILL.
    multiprocessing.set_forkserver_preload(["torch", "phalanx.session"])
    context = multiprocessing.get_context("forkserver")
    ckpt = tmp_path / "ckpt"
    delays = torch.Generator().manual_seed(7)
    interrupted = 0
    for trial in range(20):
        ready = context.Event()
        proc = context.Process(target=_saver, args=(str(ckpt), ready), daemon=True)
        proc.start()
        try:
            while not ready.wait(timeout=0.5):
                assert proc.is_alive(), "the saver died before its first checkpoint"
            time.sleep(float(torch.rand(1, generator=delays)) * 0.4)
            if any(p.name.startswith(".incomplete-") for p in ckpt.iterdir()):
                interrupted += 1
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.join(timeout=30)
        manifest = open_checkpoint(ckpt)  # verifies every file's size and SHA-256
        state = export(ckpt, tmp_path / "w.pt")[1]
        assert set(state) == {"0.weight", "0.bias", "1.weight", "1.bias"}, (trial, manifest["path"])
    assert interrupted >= 3  # the kills did land inside saves, not only between them
