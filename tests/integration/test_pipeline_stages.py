"""Five pipeline stages under the default strategy.pipeline.microbatches (null: one per stage, so
5 here): torch's 1F1B schedule, which raised with the old default of 4, trains like one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from tests.helpers.training import rel_diff

pytestmark = pytest.mark.multiprocess

STEPS, BATCH = 3, 20


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(5)))  # a stage per layer


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(STEPS * BATCH, 4, generator=g), torch.randn(STEPS * BATCH, 4, generator=g))


def five_stages() -> dict:
    session = phalanx.Session(
        phalanx.Config(), strategy="pipeline", batch={"global_batch_size": BATCH}, train={"progress": False}
    )
    model = _model()
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = session.setup_loader(DataLoader(_data(), batch_size=BATCH, shuffle=False), train=True)
    for x, y in loader:
        with session.accumulate(model):
            session.backward(F.mse_loss(model(x), y))
    out = {"steps": session.step_count, "microbatches": session.strategy.microbatches}
    out["state"] = session.model_state_dict()
    session.close()
    return out


@pytest.mark.timeout(300)
def test_five_stages_train_under_the_default_microbatches():
    out = phalanx.spawn(five_stages, nprocs=5, cpu=True, timeout=240)[0]
    assert out["steps"] == STEPS and out["microbatches"] == 5
    net = _model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in DataLoader(_data(), batch_size=BATCH):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    assert list(out["state"]) == list(net.state_dict())
    assert rel_diff(out["state"], net.state_dict()) < 1e-5
