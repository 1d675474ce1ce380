"""Per-step metrics from a real 2-process `phalanx launch` with one rank slowed down."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from phalanx.metrics.summary import read_records
from tests.helpers.cli import run_phalanx
from tests.helpers.metrics import FIELDS
from tests.helpers.scripts import tiny_training

# -- a real launch ----------------------------------------------------------------------------
# Rank 1 is slow before it reaches the gradient all-reduce.
SLOWED = tiny_training(320, before_step="time.sleep(0.05 if session.rank == 1 else 0)", optim={"max_grad_norm": 5.0})


@pytest.mark.multiprocess
@pytest.mark.serial  # the slowed rank is told apart by time
def test_launch_writes_records_and_names_the_slowed_rank(tmp_path):
    (tmp_path / "slowed.py").write_text(SLOWED)
    result = run_phalanx("launch", "--cpu", "--nproc", "2", "slowed.py", cwd=tmp_path, timeout=150)
    assert result.returncode == 0, result.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    records = read_records(run_dir / "metrics")
    assert sorted(records) == [0, 1]
    for rank, recs in records.items():
        assert [r["step"] for r in recs] == list(range(1, 21))
        for r in recs:
            assert list(r) == FIELDS and r["rank"] == rank
            assert r["samples"] == 16 and r["lr"] == pytest.approx(0.05) and r["peak_mem_bytes"] is None
            assert isinstance(r["loss"], float) and isinstance(r["grad_norm"], float)
            assert r["samples_per_s"] == pytest.approx(16 / r["step_time"])
    # Every rank has the same global gradient, so the same norm.
    assert [r["grad_norm"] for r in records[0]] == pytest.approx([r["grad_norm"] for r in records[1]])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["straggler"]["rank"] == 1
    assert "phalanx: straggler: rank 1:" in result.stdout and "work p50" in result.stdout
    if (run_dir / "tensorboard").is_dir():
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


# -- a script that never closes its Session -----------------------------------------------------
UNCLOSED = """
import sys
import torch
from torch import nn
import phalanx

session = phalanx.Session(train={"progress": False})
model = nn.Linear(4, 1)
model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(int(sys.argv[1])):
    with session.accumulate(model):
        session.backward(model(torch.randn(8, 4)).square().mean())
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("steps", [1, 7])
def test_a_script_that_never_closes_keeps_every_record_and_exits_quietly(tmp_path, steps):
    """phalanx closes the Session at exit. Under `phalanx launch` every record reaches the file; run
    as plain `python`, the last flush met the metrics thread's pool already shut down by the
    interpreter, which printed a traceback at every exit."""
    (tmp_path / "unclosed.py").write_text(UNCLOSED)
    result = run_phalanx("launch", "--cpu", "--nproc", "1", "unclosed.py", str(steps), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    assert "Traceback" not in result.output and "Exception ignored" not in result.output, result.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert [r["step"] for r in read_records(run_dir / "metrics")[0]] == list(range(1, steps + 1))
    plain = subprocess.run(
        [sys.executable, "unclosed.py", str(steps)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert plain.returncode == 0, plain.stderr
    assert "Traceback" not in plain.stderr and "Exception ignored" not in plain.stderr, plain.stderr
