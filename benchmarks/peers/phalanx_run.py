"""phalanx as its README shows it: a Session, ``setup()``, ``accumulate()`` and ``backward()``.

Run under ``phalanx launch`` by benchmarks/compare.py; what differs between the phalanx
contenders ("phalanx", "phalanx-preset", "phalanx-tuned", "phalanx-time", "phalanx-adaptive",
"phalanx-schedule") is
only the config file they are launched with (``--config``, written by the driver).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import phalanx
from peers.common import Job, Prepared, main, world
from peers.targets import Task


def prepare(job: Job) -> Prepared:
    _, size = world()
    if size > 1 and not dist.is_initialized():
        # One process group for all the workloads this process trains, one Session each: phalanx
        # keeps a group it did not create, and a second group could not meet on torch elastic's
        # store in the same process. Only start-up differs; the steps are phalanx's own.
        dist.init_process_group("gloo")
    sections = {}
    if isinstance(job.recipe, Task):
        # The script's learning rate was tuned at this batch: phalanx's lr rule scales from here.
        sections["optim"] = {"reference_batch_size": job.recipe.reference_batch}
    session = phalanx.Session(**sections)
    model = job.recipe.model()
    optimizer = job.recipe.make_optimizer(model.parameters())
    loader = DataLoader(job.train, batch_size=job.global_batch, shuffle=True)  # the global batch
    model, optimizer, loader = session.setup(model, optimizer, loader)
    loss_fn = job.recipe.loss

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with session.accumulate(model):
            session.backward(loss_fn(model(x), y))

    config, plan = session.config, session.batch
    info = {
        "micro_batch": plan.micro_batch_size,
        "accumulation": plan.accumulation_steps,
        "precision": config.precision.mode,
        "wrapper": session.strategy.describe(),
        "lr": session.lr_scaling.describe(),
        # What differs from phalanx's defaults, and where it came from (file, preset, code, --set).
        "settings": {
            key: f"{config.flat()[key]} ({source.split()[0]})"
            for key, source in config.sources.items()
            if source != "default"
        },
    }

    def close() -> None:
        adaptive = session.adaptive
        if adaptive is not None and adaptive.base is not None:
            # The batches batch.adaptive chose (or batch.schedule took), for the report: "x1, x2 from step 30, ..."
            changes = "".join(f", x{k} from step {s}" for s, k in adaptive.history)
            joined = f" in forwards of {adaptive.merge} micro-batches" if adaptive.merge > 1 else ""
            mode = "schedule" if session.config.batch.schedule is not None else "adaptive"
            info["adaptive"] = (
                f"{mode} from global {adaptive.base.global_batch_size}: x1{changes}; "
                f"{session.batch.global_batch_size} at the end{joined}"
            )
        session.close()

    return Prepared(
        model,
        _Progress(session, loader),
        step,
        loader.set_epoch,
        plan.global_batch_size,
        info,
        close=close,
        accumulation=plan.accumulation_steps,
        # True after the micro-step that stepped the optimizer, for the plan in effect then.
        stepped=lambda: session.sync_gradients,
    )


class _Progress:
    """The README's loop: the batches through ``session.progress()``, which counts samples/s and
    draws rank 0's bar (the bar's cost is phalanx's, so it is measured)."""

    def __init__(self, session: phalanx.Session, loader):
        self.session, self.loader = session, loader

    def __iter__(self):
        return iter(self.session.progress(self.loader))


if __name__ == "__main__":
    main(prepare, versions={"phalanx": phalanx.__version__})
