"""What fsdp and tp share: parameters that are DTensors (shards, splits), so their state dicts go
through torch.distributed.checkpoint's state-dict functions, full tensors are cut locally, the
gradient norm counts each piece once over the mesh, and an optimizer built on the user's model is
rebuilt on the parameters that replaced its own. Both split layers with the tensor-parallel plan
(tp always, fsdp in the 2-D layout)."""

from __future__ import annotations

import torch
from torch import nn

from phalanx.strategies import dtensor_state, tp_plan
from phalanx.strategies.base import Strategy
from phalanx.strategies.mesh_norms import squared_norm_over_mesh


class DTensorStrategy(Strategy):
    checkpoint_layout = "dcp"

    def __init__(self, config, topology):
        super().__init__(config, topology)
        self.tp_plan: tp_plan.TPPlan | None = None  # once the model is split over the tensor axis
        self._replaced = dtensor_state.ReplacedParameters(self.name)

    def split_tensor_parallel(self, model: nn.Module) -> None:
        """Split ``model`` over the tensor axis with its plan (rank 0 says what stays whole)."""
        plan, given, main = self.config.strategy.tp.plan, self.given_tp_plan, self.topology.is_main
        self.tp_plan = tp_plan.split(model, self.mesh["tp"], plan, given, main=main)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self._replaced.rebuild(optimizer)

    def gradient_sq(self, models: list[nn.Module]) -> torch.Tensor:
        grads = [p.grad for m in models for p in m.parameters() if p.grad is not None]
        return squared_norm_over_mesh(grads, self.topology.world_size, self.topology.comm_device)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return dtensor_state.full_model_state_dict(model)

    def sharded_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return dtensor_state.sharded_model_state_dict(model)

    def load_sharded_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        dtensor_state.load_sharded_model_state_dict(model, state)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        dtensor_state.load_full_model_state_dict(model, state)

    def put_weight(self, slot: torch.Tensor, value: torch.Tensor) -> None:
        if not dtensor_state.put_full_tensor(slot, value):
            super().put_weight(slot, value)

    def optimizer_state_dict(self, model, optimizer) -> dict:
        return dtensor_state.optimizer_state_dict(model, optimizer)

    def load_optimizer_state_dict(self, model, optimizer, state: dict) -> None:
        dtensor_state.load_optimizer_state_dict(model, optimizer, state)
