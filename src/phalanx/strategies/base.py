"""The surface every strategy offers the Session; a new strategy is one small subclass."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from phalanx.config.schema import Config
from phalanx.errors import ConfigError
from phalanx.topology import Topology


class Strategy:
    name: ClassVar[str]
    # How many processes per node the launcher starts: None means one per device.
    processes_per_node: ClassVar[int | None] = None

    def __init__(self, config: Config, topology: Topology):
        self.config = config
        self.topology = topology
        self._owns_process_group = False

    # -- launcher side --------------------------------------------------------------------
    @classmethod
    def check_world(cls, world_size: int) -> None:
        """Refuse a process count this strategy cannot use, before anything starts."""
        if cls.processes_per_node is not None and world_size != cls.processes_per_node:
            raise ConfigError(
                f"strategy '{cls.name}' runs in {cls.processes_per_node} process, not {world_size}; "
                f"launch with --set strategy.name={cls.name} (so the launcher starts one process) or --nproc {cls.processes_per_node}, or use strategy ddp"
            )

    # -- worker side ----------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        """Processes that each take a different share of the global batch."""
        return self.topology.world_size

    @property
    def data_parallel_rank(self) -> int:
        return self.topology.rank

    def setup_environment(self) -> None:
        """Join (or create) the process group when there is more than one process."""
        self.check_world(self.topology.world_size)
        if self.topology.world_size > 1 and not dist.is_initialized():
            backend = "gloo" if self.topology.device.type != "cuda" else "cpu:gloo,cuda:nccl"
            kwargs: dict[str, Any] = {}
            if self.topology.device.type == "cuda":
                torch.cuda.set_device(self.topology.device)
                kwargs["device_id"] = self.topology.device
            dist.init_process_group(backend, rank=self.topology.rank, world_size=self.topology.world_size, **kwargs)
            self._owns_process_group = True

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context in which backward does not synchronise gradients (all but the last micro-step)."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full state dict of the bare model: loadable into a plain ``nn.Module``, no ``module.`` prefix."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.unwrap(model).load_state_dict(state)

    def teardown(self) -> None:
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False

    def describe(self) -> str:
        return self.name
