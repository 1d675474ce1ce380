"""A numbered data set and the loader phalanx builds from it in one process, for the data pipeline tests."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.config.schema import DataConfig
from phalanx.runtime.data import shard_loader

CPU = torch.device("cpu")


def numbered(n: int = 40) -> TensorDataset:
    return TensorDataset(torch.arange(n), torch.arange(n) * 10)


def sharded(
    data=None, *, workers: int = 0, batch_size: int = 4, device=CPU, **options
) -> "phalanx.runtime.data.DeviceLoader":
    loader = DataLoader(data or numbered(), batch_size=batch_size, shuffle=True, num_workers=workers)
    return shard_loader(
        loader,
        train=True,
        rank=0,
        world_size=1,
        batch_size=batch_size,
        multiple_of=batch_size,
        seed=3,
        device=device,
        options=DataConfig(**options),
    )


def ordered_training(nprocs_micro: int) -> dict:
    """Inside phalanx.spawn: an ordered (shuffle=False) loader of 32 given to setup() with an
    optimizer and ``batch.micro_batch_size``; what each rank drew and what the plan says."""
    import torch.nn.functional as F

    session = phalanx.Session(
        phalanx.Config(),
        strategy="ddp",
        batch={"micro_batch_size": nprocs_micro},
        train={"progress": False, "metrics": False},
        checkpoint={"resume": "never"},
    )
    model = torch.nn.Linear(1, 1)
    loader = DataLoader(TensorDataset(torch.arange(128.0).unsqueeze(1)), batch_size=32, shuffle=False)
    model, _, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=1e-4), loader)
    drawn = []
    for (x,) in loader:
        drawn.append(x.squeeze(1).long().tolist())
        with session.accumulate(model):
            session.backward(F.mse_loss(model(x), x))
    plan = session.batch
    out = {"drawn": drawn, "plan": (plan.global_batch_size, plan.micro_batch_size, plan.accumulation_steps)}
    out["steps"] = session.step_count
    session.close()
    return out
