"""The floor: a hand-written PyTorch loop, DistributedDataParallel over gloo, no framework.

Run under torchrun (``python -m torch.distributed.run``) by benchmarks/compare.py. With one process
it is a plain loop: no process group and no DDP wrapper, as a user would write it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from peers.common import Job, Prepared, main, world


def prepare(job: Job) -> Prepared:
    rank, size = world()
    if size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    model = job.recipe.model()
    if size > 1:
        model = DistributedDataParallel(model)
    optimizer = job.recipe.make_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, job.lr_multiplier) if job.lr_multiplier else None
    sampler = DistributedSampler(job.train, num_replicas=size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(job.train, batch_size=job.micro_batch, sampler=sampler)
    loss_fn = job.recipe.loss

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()

    info = {
        "micro_batch": job.micro_batch,
        "accumulation": 1,
        "precision": "fp32",
        "wrapper": "DDP" if size > 1 else "none",
    }
    return Prepared(model, loader, step, sampler.set_epoch, job.micro_batch * size, info)


if __name__ == "__main__":
    main(prepare, versions={})
