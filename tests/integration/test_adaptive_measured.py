"""batch.adaptive with its step times measured (no batch.adaptive_step_times) on 2 CPU processes:
rank 0 times the steps, and every rank ends with its prior, its measured times and its choices, so
that a checkpoint written by any rank decides as rank 0 did."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.helpers.cli import run_phalanx

pytestmark = pytest.mark.multiprocess

SCRIPT = textwrap.dedent(
    """
    import os
    import time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import phalanx

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(0.004)  # a fixed cost per step that a larger batch amortises
            return super().step(closure)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 8, generator=g)
    y = x.sum(1, keepdim=True) + 10 * torch.randn(1024, 1, generator=g)  # noisy: a large noise scale
    session = phalanx.Session(
        batch={"global_batch_size": 16, "micro_batch_size": 4, "adaptive": "goodput", "adapt_every": 4,
               "adaptive_loss_check": False},
        train={"epochs": 2, "progress": False, "metrics": False, "noise_scale_every": 1},
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = SlowSGD(model.parameters(), lr=1e-3)
    model, optimizer, loader = session.setup(
        model, optimizer, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    )
    for _ in session.epochs():
        for xb, yb in loader:
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(xb), yb))
    torch.save(session.adaptive.state_dict(), os.environ["OUT"] + f".{session.rank}")
    session.close()
    """
)


@pytest.mark.timeout(240)
def test_every_rank_holds_rank_0s_measured_times_and_choices(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    result = run_phalanx(
        "launch", "--cpu", "--nproc", "2", "train.py", cwd=tmp_path, timeout=200, env={"OUT": str(tmp_path / "state")}
    )
    assert result.returncode == 0, result.output
    first, second = (torch.load(tmp_path / f"state.{rank}") for rank in (0, 1))
    assert first["history"], first  # it chose at least once
    measured = dict(first["measured"])
    assert 1 in measured and all(seconds > 0 for seconds in measured.values()), first
    assert {k for _, k in first["history"]} <= set(measured) | {first["k"]}  # each multiple left was timed
    assert first["model"] is not None
    assert {key: first[key] for key in ("k", "history", "measured", "model")} == {
        key: second[key] for key in ("k", "history", "measured", "model")
    }
