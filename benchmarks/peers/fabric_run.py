"""Lightning Fabric as its docs show it: ``fabric.setup()``, ``setup_dataloaders()``,
``fabric.backward(loss)``. Benchmark-only dependency (pyproject extra ``peers``).

Run under torchrun by benchmarks/compare.py; Fabric sees torch elastic's environment and joins it.
"""

from __future__ import annotations

import functools

import lightning_fabric
import torch
from lightning_fabric import Fabric
from torch.utils.data import DataLoader

from peers.common import Job, Prepared, main, world
from peers.workloads import SeededOrder


@functools.cache
def _fabric() -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=world()[1])  # strategy "auto": ddp with several processes
    fabric.launch()
    return fabric


def prepare(job: Job) -> Prepared:
    fabric = _fabric()
    model = job.recipe.model()
    optimizer = job.recipe.make_optimizer(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    # The global order every contender uses; Fabric shards it as rank r taking every W-th sample.
    sampler = SeededOrder(len(job.train))
    loader = fabric.setup_dataloaders(DataLoader(job.train, batch_size=job.micro_batch, sampler=sampler))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, job.lr_multiplier) if job.lr_multiplier else None
    loss_fn = job.recipe.loss

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        fabric.backward(loss_fn(model(x), y))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()

    precision = str(getattr(fabric.strategy.precision, "precision", "?"))
    info = {
        "micro_batch": job.micro_batch,
        "accumulation": 1,
        "precision": "fp32" if precision == "32-true" else precision,
        "wrapper": type(fabric.strategy).__name__,
    }
    # Fabric sets the sampler's epoch itself at the start of each pass over the loader.
    return Prepared(model, loader, step, lambda epoch: None, job.micro_batch * fabric.world_size, info)


if __name__ == "__main__":
    main(prepare, versions={"lightning_fabric": lightning_fabric.__version__})
