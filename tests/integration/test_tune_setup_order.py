"""Issue 14, frictions 3 and 5 through a real tune: a script that sets up its model and optimizer
first and its training loader after (with setup_loader) is tuned on 2 CPU processes, and what tune
writes is a per-device limit that plans the same global batch at 1, 2 and 4 processes."""

from __future__ import annotations

import pytest
import yaml

from phalanx import Config
from phalanx.config.batch import plan_batch
from tests.helpers.cli import run_phalanx
from tests.helpers.tune import tune_json

MODEL_FIRST = """
import torch
import phalanx

session = phalanx.Session(train={"epochs": 10_000})
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = session.setup(model, optimizer)
data = torch.utils.data.TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
loader = session.setup_loader(torch.utils.data.DataLoader(data, batch_size=8), train=True)
for epoch in session.epochs():
    for x, y in loader:
        with session.accumulate(model):
            session.backward(torch.nn.functional.mse_loss(model(x), y))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_tune_finds_the_plan_of_a_script_that_sets_up_its_loader_last(tmp_path):
    (tmp_path / "train.py").write_text(MODEL_FIRST)  # and no phalanx.yaml: the loader alone sets the batch
    result = run_phalanx(
        "tune",
        "--cpu",
        "--nproc",
        "2",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--search",
        "micro-batch",
        "train.py",
        cwd=tmp_path,
        timeout=180,
    )
    assert result.returncode == 0, result.output
    assert "announced no batch plan" not in result.output
    # Global batch 8 on 2 processes: micro-batch 4 is the whole share, so one trial decides.
    (trial,) = tune_json(tmp_path)["trials"]
    assert (trial["micro_batch_size"], trial["global_batch_size"], trial["outcome"]) == (4, 8, "ok"), trial
    written = yaml.safe_load((tmp_path / "phalanx.yaml").read_text())
    assert written == {"batch": {"max_micro_batch_size": 4}}, written
    assert "wrote batch.max_micro_batch_size=4 into" in result.stdout
    config = Config.load(tmp_path / "phalanx.yaml")
    plans = {n: plan_batch(n, 8, config.batch.micro_batch_size, config.batch.max_micro_batch_size) for n in (1, 2, 4)}
    assert {n: (p.global_batch_size, p.micro_batch_size) for n, p in plans.items()} == {1: (8, 4), 2: (8, 4), 4: (8, 2)}
