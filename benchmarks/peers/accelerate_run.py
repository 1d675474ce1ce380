"""Hugging Face Accelerate as its quick tour shows it: ``prepare()`` the model, optimizer and loader,
``accelerator.backward(loss)``. Benchmark-only dependency (pyproject extra ``peers``).

Run under torchrun by benchmarks/compare.py; on CPU Accelerate takes DDP over gloo.
"""

from __future__ import annotations

import functools

import accelerate
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from peers.common import Job, Prepared, main
from peers.workloads import SeededOrder


@functools.cache
def _accelerator() -> Accelerator:
    return Accelerator(cpu=True)  # one per process: its state is process-wide


def prepare(job: Job) -> Prepared:
    accelerator = _accelerator()
    model = job.recipe.model()
    optimizer = job.recipe.make_optimizer(model.parameters())
    # The global order every contender uses; Accelerate deals its batches out to the processes in
    # turn, so each optimizer step sees the same samples as the others' steps.
    loader = DataLoader(job.train, batch_size=job.micro_batch, sampler=SeededOrder(len(job.train)))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, job.lr_multiplier) if job.lr_multiplier else None
    loss_fn = job.recipe.loss

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        accelerator.backward(loss_fn(model(x), y))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()

    precision = "fp32" if accelerator.mixed_precision == "no" else str(accelerator.mixed_precision)
    info = {"micro_batch": job.micro_batch, "accumulation": 1, "precision": precision, "wrapper": type(model).__name__}
    return Prepared(model, loader, step, loader.set_epoch, job.micro_batch * accelerator.num_processes, info)


if __name__ == "__main__":
    main(prepare, versions={"accelerate": accelerate.__version__})
