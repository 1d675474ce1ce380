"""A small model with BatchNorm1d and BatchNorm2d, trained through a Session with its BatchNorm
layers synced (torch.nn.SyncBatchNorm.convert_sync_batchnorm before setup()) or not, in the test
process or inside phalanx.spawn processes (so it lives in an importable module)."""

from __future__ import annotations

import contextlib
import io

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from phalanx import Config, Session
from tests.helpers.models import image_data, make_optimizer


class BatchNormNet(nn.Module):
    """Conv -> BatchNorm2d -> ReLU -> pool -> Linear -> BatchNorm1d -> ReLU -> Linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn2d = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6 * 2 * 2, 12)
        self.bn1d = nn.BatchNorm1d(12)
        self.head = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.adaptive_avg_pool2d(F.relu(self.bn2d(self.conv(x))), 2).flatten(1)
        return self.head(F.relu(self.bn1d(self.fc(h))))


def plain_keys() -> list[str]:
    return list(BatchNormNet().state_dict())


def train(
    strategy: str,
    global_bs: int,
    micro_bs: int | None,
    steps: int,
    *,
    sync: bool,
    shuffle: bool = True,
) -> dict:
    """Train ``steps`` optimizer steps; returns the full state dict (parameters and running
    statistics), the BatchNorm layers' classes as the strategy left them, and the lines setup()
    printed about BatchNorm (rank 0 prints them)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        session = Session(
            Config(),
            strategy=strategy,
            batch={"global_batch_size": global_bs, "micro_batch_size": micro_bs},
            train={"progress": False, "seed": 0, "metrics": False},
            checkpoint={"dir": "checkpoints", "resume": "never"},
        )
        net = BatchNormNet()
        if sync:
            net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        opt = make_optimizer("sgd", net.parameters())
        loader = DataLoader(image_data(global_bs * steps), batch_size=global_bs, shuffle=shuffle)
        net, opt, loader = session.setup(net, opt, loader)
    bare = session.unwrap(net)
    for _ in session.epochs():
        for x, y in loader:
            with session.accumulate(net):
                session.backward(F.mse_loss(net(x), y))
    result = {
        "state": {k: v.detach().cpu().double() for k, v in session.model_state_dict().items()},
        "classes": sorted({type(m).__name__ for m in bare.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}),
        "notes": [line for line in printed.getvalue().splitlines() if "BatchNorm" in line],
        "steps": session.step_count,
        "accumulation": session.accumulation_steps,
        "world": session.world_size,
    }
    session.close()
    return result


def run(args: tuple, kwargs: dict) -> dict:
    """``train(*args, **kwargs)``, for phalanx.spawn (which passes positional arguments only)."""
    return train(*args, **kwargs)


def parameters(state: dict) -> dict:
    """The entries of a BatchNormNet state dict that are parameters (not running statistics)."""
    return {k: v for k, v in state.items() if k.endswith(("weight", "bias"))}
