"""A small Session that checkpoints into a directory, trained to the end or to a step, and a finished
run's last checkpoint, for the checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx


def checkpointed_session(ckpt: Path, hidden: int = 16, **kwargs) -> tuple:
    torch.manual_seed(0)
    session = phalanx.Session(
        batch={"global_batch_size": 8},
        train={"epochs": 2, "progress": False},
        checkpoint={"dir": str(ckpt), "resume": "never", **kwargs},
    )
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g))
    model = nn.Sequential(nn.Linear(4, hidden), nn.Dropout(0.2), nn.Linear(hidden, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)
    model, optimizer, loader, scheduler = session.setup(
        model, optimizer, DataLoader(data, batch_size=8, shuffle=True), scheduler
    )
    return session, model, loader


def train_through(session, model, loader, stop_at: int | None = None) -> dict:
    for _ in session.epochs():
        for x, y in session.progress(loader):
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(x), y))
            if session.step_count == stop_at:
                return {}
    return {k: v.clone() for k, v in session.model_state_dict().items()}


def saved_checkpoint(tmp_path: Path) -> Path:
    session, model, loader = checkpointed_session(tmp_path / "ckpt", save_every=5)
    train_through(session, model, loader)
    session.close()
    return tmp_path / "ckpt" / "step-00000010"
