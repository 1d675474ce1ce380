"""`phalanx bench` for real: a script stopped after its steps, a failing run named with its log, and
the bench of the demo on 1 and 2 CPU processes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from phalanx.bench.chart import have_matplotlib
from phalanx.harness.figures import read_metrics, run_figures, steps_recorded
from tests.helpers.cli import run_phalanx

# Trains until stopped with one process; fails at once with two.
ENDLESS_OR_BROKEN = """
import torch
import phalanx

session = phalanx.Session(train={"epochs": 10_000})
if session.world_size > 1:
    raise RuntimeError("broken on purpose")
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
model, optimizer, loader = session.setup(model, optimizer, loader)
for epoch in session.epochs():
    for x, y in session.progress(loader):
        with session.accumulate(model):
            session.backward(torch.nn.functional.mse_loss(model(x), y))
"""


@pytest.mark.multiprocess
def test_a_script_is_stopped_after_the_steps_and_a_failing_run_is_named_with_its_log(tmp_path):
    (tmp_path / "train.py").write_text(ENDLESS_OR_BROKEN)
    result = run_phalanx(
        "bench", "--nproc-list", "1,2", "--steps", "6", "--warmup", "2", "--cpu", "train.py", cwd=tmp_path, timeout=150
    )
    (bench,) = (tmp_path / "runs").glob("*-bench")
    # The 1-process run never ends by itself: bench ended it through the Session's step limit once
    # it had its steps (issue 14: no longer like Ctrl-C, which ran the script's own handlers).
    log = (bench / "n1" / "launch.log").read_text()
    assert "train.max_steps=6 reached" in log and "stopped by signal" not in log, result.output
    (metrics,) = (bench / "n1").glob("*/metrics")
    assert steps_recorded(metrics) >= 6
    assert result.returncode == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("phalanx: error: the 2-process run failed (exit code 1): rank ")
    assert "RuntimeError: broken on purpose" in lines[0]
    assert lines[0].endswith(f"its output is in {bench / 'n2' / 'launch.log'}")
    assert not (bench / "bench.json").exists()


@pytest.mark.multiprocess
def test_bench_of_the_demo_on_one_and_two_processes(tmp_path):
    result = run_phalanx(
        "bench",
        "--demo",
        "--nproc-list",
        "1,2",
        "--steps",
        "8",
        "--warmup",
        "2",
        "--cpu",
        "--run-dir",
        "out",
        cwd=tmp_path,
        timeout=150,
    )
    assert result.returncode == 0, result.output
    (bench,) = (tmp_path / "out").glob("*-bench")
    document = json.loads((bench / "bench.json").read_text())
    assert document["device"] == "cpu" and document["machine"]["torch"]
    assert "--demo" in document["command"] and " ".join(document["reading"].split()) in " ".join(result.stdout.split())
    one, two = document["runs"]
    assert (one["nproc"], two["nproc"]) == (1, 2)
    assert two["global_batch"] == 2 * one["global_batch"]  # same micro-batch per process
    threads = document["settings"]["threads_per_process"]  # the same in both runs
    for n in (1, 2):
        assert f"{threads} thread{'s' if threads != 1 else ''} each" in (bench / f"n{n}" / "launch.log").read_text()
    assert two["efficiency"] == pytest.approx(two["samples_per_s"] / (2 * one["samples_per_s"]))
    for run in (one, two):
        metrics = read_metrics(Path(run["run_dir"]) / "metrics")
        assert sorted(metrics) == list(range(run["nproc"]))
        assert run["steps_measured"] == 6
        measured = run_figures(run["nproc"], metrics, warmup=2, name="check")
        assert math.isclose(run["samples_per_s"], measured.samples_per_s)
    assert "samples/s" in result.stdout and "efficiency" in result.stdout
    if have_matplotlib():
        assert (bench / "bench.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert "pip install phalanx[bench]" in result.stdout
