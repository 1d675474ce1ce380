"""Classic model parallelism: one process, the model's blocks spread over the GPUs it sees, and
activations moved to the next block's device by forward hooks. The user subclasses nothing.

The units placed are the model's children, with a child ModuleList/Sequential expanded into its
elements (the usual home of transformer blocks or network stages). Units go in order to devices,
balanced by parameter count; the model's own parameters go with the first unit.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.runtime.transfer import to_device
from phalanx.strategies.base import Strategy
from phalanx.strategies.placement import assign, placement_units, refuse_shared_across


class ModelParallel(Strategy):
    name = "model_parallel"
    processes_per_node = 1
    # Without CUDA its one device is the CPU: the hooks and placement logic still run.
    drives_every_gpu = True
    supports_compile = False
    advice: ClassVar[dict[str, str]] = {"launch.nproc": "or use strategy ddp"}

    def __init__(self, config, topology):
        super().__init__(config, topology)
        self.placement: list[tuple[str, torch.device]] = []

    def place(self, model: nn.Module) -> nn.Module:
        # wrap_model puts each unit on its own device; the model need not fit on one. The names that
        # seed each module's init are taken now, before activation checkpointing wraps modules.
        self.materializer(model)
        return model

    def wrap_model(self, model: nn.Module) -> nn.Module:
        devices = self.devices
        units = placement_units(model)
        if not units:
            raise ConfigError("strategy model_parallel: the model has no child modules to place on devices")
        assignment = assign(units, len(devices))
        refuse_shared_across(units, assignment)
        build = self.materializer(model)  # moves a built unit, materialises a deferred one
        for (name, unit), index in zip(units, assignment):
            build.materialize(unit, devices[index])
            unit.register_forward_pre_hook(_move_inputs(devices[index]), with_kwargs=True)
            self.placement.append((name, devices[index]))
        build.materialize_own(model, devices[assignment[0]])
        # Outputs come back to the first device, where the batch's targets are.
        model.register_forward_hook(lambda module, args, out: to_device(out, self.topology.device))
        return model

    def describe(self) -> str:
        used = [str(d) for d in sorted({d for _, d in self.placement}, key=lambda d: (d.type, d.index or 0))] or [
            str(self.topology.device)
        ]
        return f"model_parallel over {', '.join(used)} ({len(self.placement)} units)"


def _move_inputs(device: torch.device):
    def hook(module, args, kwargs):
        return to_device(args, device), to_device(kwargs, device)

    return hook
