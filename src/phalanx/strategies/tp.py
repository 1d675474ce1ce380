"""Tensor parallelism (``torch.distributed.tensor.parallel``): each of ``strategy.tp.size`` peers
holds a slice of the layers the plan splits (tp_plan.py), and the peers see the same batch; the
slices exchange activations in every split layer. Where the world holds several groups of peers,
the groups are data-parallel replicas whose gradients are averaged after the synchronising
backward (fsdp with ``strategy.tp.size`` shards them instead: the 2-D layout)."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from phalanx.strategies import dtensor_state, tp_plan
from phalanx.strategies.base import Sharding, Strategy
from phalanx.strategies.mesh_norms import clip_over_mesh, squared_norm_over_mesh
from phalanx.strategies.plan_rows import PlanRow


class TensorParallel(Strategy):
    name = "tp"
    axes = ("dp_replicate", "tp")
    tp_by_default = True
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
    # Its replicas all-reduce gradients as ddp does (2 volumes of a peer's parameters, none without
    # replicas); the planner adds the activations its split layers all-reduce (plan/traffic.py).
    plan_rows = (PlanRow("tp", traffic=2),)
    advice: ClassVar[dict[str, str]] = {
        "precision.mode": "(its loss scaling cannot unscale split and whole gradients together); use bf16",
    }

    def __init__(self, config, topology):
        super().__init__(config, topology)
        self.tp_plan: tp_plan.TPPlan | None = None
        self._replaced = dtensor_state.ReplacedParameters(self.name)
        self._models: list[nn.Module] = []
        self._syncing = True  # False inside no_sync(): accumulation's other micro-steps

    def wrap_model(self, model: nn.Module) -> nn.Module:
        main, before = self.topology.is_main, self._replaced.before(model)
        plan, given = self.config.strategy.tp.plan, self.given_tp_plan
        self.tp_plan = tp_plan.split(model, self.mesh["tp"], plan, given, main=main)
        self._replaced.after(model, before)
        model.register_load_state_dict_pre_hook(dtensor_state.shard_full_tensors)
        self._models.append(model)
        return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return self._not_syncing()

    @contextlib.contextmanager
    def _not_syncing(self):
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def backward(self, loss: torch.Tensor, precision, accumulation_steps: int) -> torch.Tensor:
        reported = super().backward(loss, precision, accumulation_steps)
        if self._syncing and self.layout.dp_replicate > 1:
            grads = [p.grad for m in self._models for p in m.parameters() if p.grad is not None]
            average_over(grads, self.data_group, self.layout.dp_replicate)
        return reported

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
        split = f", {self.tp_plan.describe()}" if self.tp_plan is not None else ""
        return f"tp over {self.layout.describe()}{split}"


def average_over(grads: list[torch.Tensor], group: Any, size: int) -> None:
    """Average the gradients' local pieces over the data-parallel ``group`` of ``size`` ranks: one
    all-reduce per dtype, through a flat buffer."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        by_dtype.setdefault(local.dtype, []).append(local)
    for pieces in by_dtype.values():
        flat = torch.cat([p.reshape(-1) for p in pieces])
        dist.all_reduce(flat, group=group)
        flat /= size
        offset = 0
        for piece in pieces:
            piece.copy_(flat[offset : offset + piece.numel()].view_as(piece))
            offset += piece.numel()
