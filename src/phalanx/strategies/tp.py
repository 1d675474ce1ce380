"""Tensor parallelism (``torch.distributed.tensor.parallel``): each process holds a slice of the
layers the plan splits (tp_plan.py) and every process sees the same batch; the slices exchange
activations in every split layer. With data-parallel ranks besides, use fsdp with
``strategy.tp.size`` (the 2-D layout)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from phalanx.strategies import dtensor_state, tp_plan
from phalanx.strategies.base import Sharding, Strategy
from phalanx.strategies.mesh_norms import clip_over_mesh, squared_norm_over_mesh
from phalanx.strategies.plan_rows import PlanRow


class TensorParallel(Strategy):
    name = "tp"
    axes = ("tp",)
    needs_process_group = True
    checkpoint_layout = "dcp"
    # fp16's loss scaling would unscale DTensor and plain gradients in one foreach call, which
    # DTensor refuses; bf16 autocast needs no scaler.
    precisions = frozenset({"fp32", "bf16"})
    supports_compile = False
    supports_channels_last = False
    shards = Sharding(parameters=("tp",), gradients=("tp",), optimizer=("tp",))
    # A split layer's gradient is a slice: no rank holds its own whole small-batch gradient.
    local_micro_step_gradients = False
    # Every process runs the same batch, so each split layer communicates twice per forward and
    # backward; the planner counts one activation all-reduce per split pair each way.
    plan_rows = (PlanRow("tp", traffic=0),)
    advice: ClassVar[dict[str, str]] = {
        "strategy.tp.size": (
            "strategy tp splits layers over every process and has no data-parallel axis; for data-parallel ranks "
            "besides, use strategy fsdp with strategy.tp.size (TP within a group, FSDP across the groups)"
        ),
        "precision.mode": "(its loss scaling cannot unscale split and whole gradients together); use bf16",
    }

    def __init__(self, config, topology):
        super().__init__(config, topology)
        self.tp_plan: tp_plan.TPPlan | None = None
        self._replaced = dtensor_state.ReplacedParameters(self.name)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        main, before = self.topology.is_main, self._replaced.before(model)
        plan, given = self.config.strategy.tp.plan, self.given_tp_plan
        self.tp_plan = tp_plan.split(model, self.mesh["tp"], plan, given, main=main)
        self._replaced.after(model, before)
        model.register_load_state_dict_pre_hook(dtensor_state.shard_full_tensors)
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self._replaced.rebuild(optimizer)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_over_mesh(list(model.parameters()), max_norm, self.topology.world_size, self.topology.comm_device)

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

    def describe(self) -> str:
        split = f" ({self.tp_plan.describe()})" if self.tp_plan is not None else ""
        return f"tp over {self.layout.describe()}{split}"
