"""A DataLoader the script already split over processes with torch's ``DistributedSampler`` (what a
DDP script builds): taken as split. phalanx puts its own sharded sampler in its place, over the same
dataset, with the sampler's shuffle, seed and drop_last, so the position is saved and a resumed run
goes on mid-epoch. What changes is the batch arithmetic: such a loader's ``batch_size`` is per
process, so the global batch is ``batch_size`` times the data-parallel processes, as it was under DDP.
The script's own ``sampler.set_epoch(epoch)`` calls reach its sampler, which nothing reads any more:
harmless."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch.utils.data import DataLoader, DistributedSampler


@dataclass(frozen=True)
class Split:
    """The settings of the script's DistributedSampler that phalanx's sampler keeps."""

    shuffle: bool
    seed: int
    drop_last: bool


def presplit(loader: DataLoader) -> Split | None:
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        return Split(bool(sampler.shuffle), int(sampler.seed), bool(sampler.drop_last))
    return None


def given_global_batch(loader: DataLoader, data_parallel_size: int, say: Callable[[str], None]) -> int | None:
    """The global batch a training loader's ``batch_size`` stands for: itself, or, for a loader the
    script split with a DistributedSampler, itself times the data-parallel processes (said in one line)."""
    if presplit(loader) is None or loader.batch_size is None:
        return loader.batch_size
    total = loader.batch_size * data_parallel_size
    say(
        f"phalanx: the training DataLoader has a DistributedSampler: taken as split, its batch_size "
        f"{loader.batch_size} is per process, so the global batch is {total} ({loader.batch_size} x "
        f"{data_parallel_size} data-parallel processes); phalanx shards the dataset itself with the sampler's "
        "shuffle, seed and drop_last"
    )
    return total
