"""Checkpoints from other processes: `phalanx checkpoint info` and `export` as subprocesses, and a
saver killed with SIGKILL in the middle of its saves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from phalanx.checkpoint.export import export, open_checkpoint
from tests.helpers.checkpoints import saved_checkpoint
from tests.helpers.cli import run_phalanx


def test_cli_info_export_and_errors(tmp_path):
    path = saved_checkpoint(tmp_path)
    info = run_phalanx("checkpoint", "info", str(path), cwd=tmp_path, timeout=60)
    assert info.returncode == 0, info.output
    assert "step 10, epoch 2" in info.stdout and "all match their SHA-256" in info.stdout
    out = run_phalanx("checkpoint", "export", str(path), str(tmp_path / "w.pt"), cwd=tmp_path, timeout=60)
    assert out.returncode == 0 and "wrote" in out.stdout, out.output
    (path / "rng.pt").write_bytes(b"garbage")
    bad = run_phalanx("checkpoint", "info", str(path), cwd=tmp_path, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "rng.pt' is truncated or damaged" in bad.stderr
    missing = run_phalanx("checkpoint", "export", str(tmp_path / "nope"), "x.pt", cwd=tmp_path, timeout=60)
    assert missing.returncode == 2 and "not found" in missing.stderr and "Traceback" not in missing.stderr


_SAVER = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    import phalanx

    checkpoint = {"dir": sys.argv[1], "resume": "never", "keep_last": 2}
    session = phalanx.Session(train={"progress": False}, checkpoint=checkpoint)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # ~2 MB of weights, 4 MB of Adam state
    optimizer = torch.optim.Adam(model.parameters())
    model, optimizer = session.setup(model, optimizer)
    session.save()
    print("ready", flush=True)
    while True:  # every step changes the weights, then a save
        with session.accumulate(model):
            session.backward(model(torch.randn(4, 512)).square().mean())
        session.save()
    """
)


@pytest.mark.timeout(240)
def test_kill_during_save_leaves_a_loadable_checkpoint(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    ckpt = tmp_path / "ckpt"
    delays = torch.Generator().manual_seed(7)
    interrupted = 0
    for trial in range(20):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(ckpt)], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            while proc.stdout.readline().strip() != "ready":
                assert proc.poll() is None, "the saver died before its first checkpoint"
            time.sleep(float(torch.rand(1, generator=delays)) * 0.4)
            if any(p.name.startswith(".incomplete-") for p in ckpt.iterdir()):
                interrupted += 1
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
        manifest = open_checkpoint(ckpt)  # verifies every file's size and SHA-256
        state = export(ckpt, tmp_path / "w.pt")[1]
        assert set(state) == {"0.weight", "0.bias", "1.weight", "1.bias"}, (trial, manifest["path"])
    assert interrupted >= 3  # the kills did land inside saves, not only between them
