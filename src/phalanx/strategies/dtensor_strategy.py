"""What fsdp and tp share: parameters that are DTensors (shards, splits), so their state dicts go
through torch.distributed.checkpoint's state-dict functions, full tensors are cut locally, and the
gradient norm counts each piece once over the mesh."""

from __future__ import annotations

import torch
from torch import nn

from phalanx.strategies import dtensor_state
from phalanx.strategies.base import Strategy
from phalanx.strategies.mesh_norms import squared_norm_over_mesh


class DTensorStrategy(Strategy):
    checkpoint_layout = "dcp"

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
