"""Workers for the noise-scale tests (run inside phalanx.spawn): linear least squares on Gaussian
data, where the true gradient and the per-sample gradient covariance have closed forms.

With x ~ N(0, I_d), y = w*.x + s e (e ~ N(0, 1)), the loss 1/2 (w.x - y)^2 and d = w - w*, the
per-sample gradient is g = (x.d - s e) x, so G = E[g] = d and (Isserlis) E[g g^T] = |d|^2 I +
2 d d^T + s^2 I: tr(Sigma) = (D + 1)|d|^2 + D s^2 and B_noise = tr(Sigma) / |d|^2. The weights are
held at w = 0 (lr 0), so every step estimates the same quantities."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session

DIM, NOISE_STD, TARGET = 16, 0.5, 0.5  # w* = 0.5 everywhere


def truth() -> float:
    d2 = DIM * TARGET**2
    return ((DIM + 1) * d2 + DIM * NOISE_STD**2) / d2


def estimate(global_batch: int, micro_batch: int, steps: int, strategy: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(global_batch * steps, DIM, generator=g)
    y = x @ torch.full((DIM,), TARGET) + NOISE_STD * torch.randn(global_batch * steps, generator=g)
    session = Session(
        Config(),
        strategy=strategy,
        batch={"global_batch_size": global_batch, "micro_batch_size": micro_batch},
        # hook: without accumulation, ddp and zero1 measure in a Python comm hook only when asked.
        train={
            "progress": False,
            "metrics": False,
            "noise_scale": "hook",
            "noise_scale_every": 1,
            "noise_scale_smoothing": 0.999,
        },
    )
    model = nn.Linear(DIM, 1, bias=False)
    nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer, loader = session.setup(
        model, optimizer, DataLoader(TensorDataset(x, y), batch_size=global_batch, shuffle=True)
    )
    for xb, yb in loader:
        with session.accumulate(model):
            session.backward(0.5 * (model(xb).squeeze(1) - yb).pow(2).mean())
    out = {"noise_scale": session.noise.value, "small": session.noise.estimate.small, "big": session.noise.estimate.big}
    session.close()
    return out
