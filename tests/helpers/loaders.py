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
