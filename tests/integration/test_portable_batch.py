"""Issue 14, friction 3 (portable tuned settings): the config tune writes at 2 processes for a global
batch of 20 (a per-device limit of 10, where it used to write the exact micro-batch 10) launches at 1
and 4 CPU processes with the same global batch and no error; the exact size stops at 4."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import run_phalanx

SCRIPT = """
import torch
import phalanx

session = phalanx.Session()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
loader = torch.utils.data.DataLoader(data, batch_size=20, shuffle=True)
model, optimizer, loader = session.setup(model, optimizer, loader)
for epoch in session.epochs():
    for x, y in loader:
        with session.accumulate(model):
            session.backward(torch.nn.functional.mse_loss(model(x), y))
session.print(f"steps {session.step_count}")
"""


def _launch(tmp_path, nproc: int, config: str):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "phalanx.yaml").write_text(config)
    return run_phalanx(
        "launch", "--cpu", "--nproc", str(nproc), "--set", "train.progress=false", "train.py", cwd=tmp_path, timeout=150
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_tuned_limit_runs_at_one_and_four_processes_with_the_same_global_batch(tmp_path):
    tuned = "batch:\n  max_micro_batch_size: 10\n"
    for nproc, micro, steps in ((1, 10, 2), (4, 5, 1)):
        (tmp_path / str(nproc)).mkdir()
        result = _launch(tmp_path / str(nproc), nproc, tuned)
        assert result.returncode == 0, result.output
        (facts,) = (tmp_path / str(nproc) / "runs").glob("*/session.json")
        batch = json.loads(facts.read_text())["batch"]
        assert (batch["global_batch_size"], batch["micro_batch_size"], batch["accumulation_steps"]) == (
            20,
            micro,
            steps,
        ), result.output
        assert "steps 2" in result.stdout  # 40 samples, global batch 20: two optimizer steps either way
    (tmp_path / "exact").mkdir()
    result = _launch(tmp_path / "exact", 4, "batch:\n  micro_batch_size: 10\n")  # what tune used to write
    assert result.returncode != 0
    assert "global_batch_size 20 is not a multiple of micro_batch_size 10 x 4 processes" in result.output
