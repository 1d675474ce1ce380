"""Tensor parallelism (``torch.distributed.tensor.parallel``): each of ``strategy.tp.size`` peers
holds a slice of the layers the plan splits (tp_plan.py), and the peers see the same batch; the
slices exchange activations in every split layer. Where the world holds several groups of peers,
the groups are data-parallel replicas whose gradients are averaged after the synchronising
backward (fsdp with ``strategy.tp.size`` shards them instead: the 2-D layout)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from phalanx.strategies import dtensor_state
from phalanx.strategies.base import Sharding
from phalanx.strategies.dtensor_state import local
from phalanx.strategies.dtensor_strategy import DTensorStrategy
from phalanx.strategies.mesh_norms import clip_over_mesh
from phalanx.strategies.plan_rows import PlanRow


class TensorParallel(DTensorStrategy):
    name = "tp"
    axes = ("dp_replicate", "tp")
    tp_by_default = True
    needs_process_group = True
    # fp16's loss scaling would unscale DTensor and plain gradients in one foreach call, which
    # DTensor refuses; bf16 autocast needs no scaler.
    precisions = frozenset({"fp32", "bf16", "fp64"})
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
        self._models: list[nn.Module] = []
        self._syncing = True  # False inside no_sync(): accumulation's other micro-steps

    @property
    def splits_by_tp_plan(self) -> bool:
        return True  # over one process too: a mesh of one device, the plan applied

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if self.topology.world_size > 1:
            # As DDP does: a script that changes weights on rank 0 only (a load of its own) trains
            # one model. Split layers are cut from each peer group's first rank; the rest would
            # otherwise stay as each rank built it.
            broadcast_from_first(list(model.parameters()) + list(model.buffers()))
        before = self._replaced.before(model)
        self.split_tensor_parallel(model)
        self._replaced.after(model, before)
        model.register_load_state_dict_pre_hook(dtensor_state.shard_full_tensors)
        self._models.append(model)
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer = super().wrap_optimizer(optimizer)
        if mixes_kinds(optimizer):
            step_whole_as_replicated(optimizer)
        return optimizer

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
        if self._syncing:
            params = [p for m in self._models for p in m.parameters() if p.requires_grad]
            settle_partial(params)
            if self.layout.dp_replicate > 1:
                average_over(params, self.data_group, self.layout.dp_replicate)
        return reported

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_over_mesh(list(model.parameters()), max_norm, self.topology.world_size, self.topology.comm_device)

    def describe(self) -> str:
        split = f", {self.tp_plan.describe()}" if self.tp_plan is not None else ""
        return f"tp over {self.layout.describe()}{split}"


def mixes_kinds(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer holds split parameters (DTensors) and whole ones (the modules the plan
    leaves as they are) together."""
    kinds = {hasattr(p, "placements") for group in optimizer.param_groups for p in group["params"]}
    return len(kinds) > 1


def step_whole_as_replicated(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's step treats whole parameters as replicated over the tensor axis, which they
    are (every peer holds the same values and, after the split layers' all-reduces, the same
    gradients). Without it torch's foreach and fused kernels, its default for CUDA tensors, take
    DTensors and plain tensors in one call and refuse it ("got mixed torch.Tensor and DTensor").
    Split parameters stay split and whole ones whole, so checkpoints and the plan are unchanged."""
    from torch.distributed.tensor.experimental import implicit_replication

    step = optimizer.step

    @functools.wraps(step)
    def stepping(*args, **kwargs):
        with implicit_replication():
            return step(*args, **kwargs)

    optimizer.step = stepping


def settle_partial(params: list[nn.Parameter]) -> None:
    """A gradient left as a per-peer partial sum (a sequence-parallel norm's weight) becomes the
    whole sum on every peer: what clipping, the norm and the update read as the gradient."""
    for p in params:
        placements = getattr(p.grad, "placements", None)
        if placements and any(q.is_partial() for q in placements):
            from torch.distributed.tensor import Replicate

            p.grad = p.grad.redistribute(placements=[Replicate() if q.is_partial() else q for q in placements])


def average_over(params: list[nn.Parameter], group: Any, size: int) -> None:
    """Average the parameters' gradients (their local pieces) over the data-parallel ``group`` of
    ``size`` ranks: one all-reduce per dtype through a flat buffer, with every parameter in the
    same place on every rank. A rank whose data left a parameter without a gradient sends zeros for
    it, as DDP does; one that no rank's data reached keeps no gradient (a count per parameter says)."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for same in by_dtype.values():
        pieces = [local(p.grad) if p.grad is not None else None for p in same]
        parts = [local(p).new_zeros(local(p).numel()) if g is None else g.reshape(-1) for p, g in zip(same, pieces)]
        counts = local(same[0]).new_tensor([0.0 if g is None else 1.0 for g in pieces])
        flat = torch.cat([*parts, counts])
        dist.all_reduce(flat, group=group)
        *averaged, had = flat.split([*(part.numel() for part in parts), len(same)])
        # Only a rank that lacks a gradient must learn whether another rank had one (a read of the
        # device); one that has it knows the count is at least its own.
        counts = had.tolist() if any(g is None for g in pieces) else [1.0] * len(same)
        for p, piece, mean, count in zip(same, pieces, averaged, counts):
            if count == 0:
                continue
            mean = mean.view(local(p).shape) / size
            if piece is None:
                p.grad = _like(p, mean)
            else:
                piece.copy_(mean)


def broadcast_from_first(tensors: list[torch.Tensor]) -> None:
    """Every rank takes global rank 0's values of ``tensors`` (one broadcast per dtype and device)."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            dist.broadcast(flat, src=0)
            for t, part in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(part.view_as(t))


def _like(param: nn.Parameter, piece: torch.Tensor) -> torch.Tensor:
    """A gradient for ``param`` from its local piece: a DTensor of the same placements where it is one."""
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(piece, param.device_mesh, param.placements, run_check=False)
    return piece
