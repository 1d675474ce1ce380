"""Pipeline parallelism with torch.distributed.pipelining: the model's layers split into stages,
one per process; each micro-batch is cut into pipeline micro-batches that flow through the
stages under a GPipe or 1F1B schedule.

The model must be an ``nn.Sequential`` (its forward applies its children in order), so each
process can keep only its own run of children. ``model(x)`` returns a deferred output; the loss
code is replayed on the last stage by the schedule (see pipeline_output.py), so the training loop is the
same as for every other strategy.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

from phalanx.config.sections import Section
from phalanx.errors import ConfigError, PhalanxError
from phalanx.strategies.base import Sharding, Strategy
from phalanx.strategies.pipeline_output import DeferredOutput
from phalanx.strategies.placement import assign, placement_units, refuse_shared_across
from phalanx.strategies.plan_rows import LAST, PlanRow
from phalanx.strategies.surface import ModelSurface
from phalanx.util.optim import rebuild_arguments
from phalanx.util.words import plural

# strategy.pipeline.microbatches: null gives one pipeline micro-batch per stage, and never fewer
# than this: fewer would leave the stages idle for most of each step (the bubble).
MIN_DEFAULT_MICROBATCHES = 4


class PipelineConfig(Section):
    schedule: Literal["gpipe", "1f1b"] = Field(
        "1f1b", description="gpipe: all forwards, then all backwards; 1f1b: interleaved, fewer activations held"
    )
    microbatches: Optional[int] = Field(
        None,
        gt=0,
        description=(
            "pipeline micro-batches each micro-batch is cut into (must divide batch.micro_batch_size; "
            "null: one per stage, at least 4)"
        ),
    )
    split_points: list[str] = Field(
        default_factory=list,
        description="child names where a new stage begins, e.g. ['4', '8'] (empty: balanced by parameter count)",
    )


def pipeline_microbatches(settings: PipelineConfig, stages: int) -> int:
    """The pipeline micro-batches each micro-batch is cut into on ``stages`` stages: the user's
    strategy.pipeline.microbatches, or for null max(4, stages) (1F1B needs one per stage)."""
    if settings.microbatches is not None:
        return settings.microbatches
    return max(MIN_DEFAULT_MICROBATCHES, stages)


class Pipeline(Strategy):
    name = "pipeline"
    options_key = "pipeline"
    options = PipelineConfig
    needs_process_group = True
    checkpoint_layout = "dcp"
    precisions = frozenset({"fp32"})
    supports_compile = False
    # A stage holds about 1/N of the layers (assuming balanced stages): all three are divided.
    shards = Sharding(parameters=("pp",), gradients=("pp",), optimizer=("pp",))
    # Every stage sees the same batch (stage 0 its inputs, the last stage its targets): the
    # stages are the whole layout, with no data-parallel axis.
    axes = ("pp",)
    # It sends only activations between stages, but its stages idle in the pipeline bubble,
    # (N-1)/(M+N-1) of each step with M pipeline micro-batches: the plan lists it last.
    plan_rows = (PlanRow("pipeline", traffic=LAST, options={"schedule": "1f1b"}),)
    needs_sequential = True
    splits_layers = True
    local_micro_step_gradients = False  # each rank holds one stage's
    direct_calls = "none"
    advice: ClassVar[dict[str, str]] = {
        "precision.mode": "(fp32 only for now); set precision.mode fp32, or use fsdp or ddp for bf16/fp16",
        "items": (
            "its schedule replays the loss on each pipeline micro-batch and averages those means; drop items=, "
            "or use fsdp or ddp for a token-weighted loss"
        ),
    }
    weighs_items = False

    def __init__(self, config, topology):
        super().__init__(config, topology)
        self.stage_module: nn.Module | None = None
        self._units: list[tuple[str, nn.Module]] = []
        self._stage_of: list[int] = []
        self._schedule = None
        self._pending: tuple[DeferredOutput, torch.Tensor | None, int] | None = None
        self._losses: list[torch.Tensor] = []
        self._batch = 0  # the training micro-batch size the stages were built for
        self.microbatches = pipeline_microbatches(config.strategy.pipeline, topology.world_size)

    @classmethod
    def check_settings(cls, config, world_size, device) -> None:
        opts = config.strategy.pipeline
        if world_size is None:
            return
        # torch's 1F1B schedule raises this inside setup() otherwise; GPipe runs with fewer. null
        # is never fewer (see pipeline_microbatches).
        if opts.schedule == "1f1b" and opts.microbatches is not None and opts.microbatches < world_size:
            raise ConfigError(
                f"strategy.pipeline.microbatches={opts.microbatches} is fewer than the {world_size} pipeline stages "
                f"(one per process), but schedule 1f1b needs at least one per stage; set "
                f"strategy.pipeline.microbatches={world_size} or more (dividing the micro-batch), "
                "or strategy.pipeline.schedule=gpipe"
            )
        micro = config.batch.micro_batch_size
        if micro is not None and micro % pipeline_microbatches(opts, world_size):
            raise ConfigError(cannot_cut(micro, opts, world_size))

    @classmethod
    def micro_batch_multiple(cls, config, world_size) -> int:
        return pipeline_microbatches(config.strategy.pipeline, world_size)  # each micro-batch is cut into these

    def place(self, model: nn.Module) -> nn.Module:
        # wrap_model puts this rank's stage on the device; the others stay where they are. The names
        # that seed each module's init are taken now, before activation checkpointing wraps modules.
        self.materializer(model)
        return model

    @property
    def is_last(self) -> bool:
        return self.topology.rank == self.topology.world_size - 1

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if self.stage_module is not None:
            raise ConfigError("strategy pipeline splits one model per Session; set up a single model")
        if not isinstance(model, nn.Sequential):
            raise ConfigError(
                "strategy pipeline needs an nn.Sequential model (its forward must apply its children in order), "
                f"not {type(model).__name__}; "
                "express the model as nn.Sequential(embedding, *blocks, head) or use fsdp"
            )
        opts, stages = self.config.strategy.pipeline, self.topology.world_size
        self._units = placement_units(model)
        self._stage_of = _split(self._units, stages, opts.split_points)
        # A weight tied across stages would be updated as two untied copies.
        refuse_shared_across(self._units, self._stage_of)
        mine = [unit for (_, unit), stage in zip(self._units, self._stage_of) if stage == self.topology.rank]
        self.stage_module = nn.Sequential(*mine)
        # Only this stage goes onto the device (a deferred model's other stages never get memory).
        self.materializer(model).materialize(self.stage_module, self.topology.device)
        stage = PipelineStage(self.stage_module, self.topology.rank, stages, self.topology.device)
        schedule = ScheduleGPipe if opts.schedule == "gpipe" else Schedule1F1B
        # scale_grads would divide every gradient the stage holds, also those accumulated by
        # earlier micro-steps; the loss is divided instead (see _loss).
        self._schedule = schedule(stage, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)
        return _PipelineModel(self)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.stage_module is None:
            raise ConfigError("strategy pipeline: pass the model to setup() together with (or before) its optimizer")
        own = {id(p) for p in self.stage_module.parameters()}
        for group in optimizer.param_groups:  # same dicts: a scheduler on the user's optimizer still steers
            group["params"] = [p for p in group["params"] if id(p) in own]
        if not any(group["params"] for group in optimizer.param_groups):
            raise ConfigError(
                f"strategy pipeline: stage {self.topology.rank} holds no parameters; set strategy.pipeline.split_points"
            )
        return type(optimizer)(optimizer.param_groups, **rebuild_arguments(optimizer))

    def backward(self, loss: torch.Tensor, precision, accumulation_steps: int) -> torch.Tensor:
        if not isinstance(loss, DeferredOutput):
            raise PhalanxError(
                "strategy pipeline: session.backward() expects the loss computed from model(x), as loss_fn(model(x), y)"
            )
        (x, *_), batch = loss.inputs, loss.inputs[0].shape[0]
        # torch's stages size their buffers from the first batch; a later batch of another size
        # would be cut to those shapes, silently.
        self._batch = self._batch or batch
        if batch != self._batch:
            raise PhalanxError(
                f"strategy pipeline needs training micro-batches of one size: got {batch} samples after {self._batch}; "
                "use a map-style dataset (phalanx pads every epoch to whole batches) or drop the last partial batch"
            )
        if batch % self.microbatches:
            raise ConfigError(cannot_cut(batch, self.config.strategy.pipeline, self.topology.world_size))
        target = loss.target(batch)
        self._pending, self._losses = (loss, target, accumulation_steps), []
        rank = self.topology.rank
        # torch's schedule hands every chunk a target; a loss without one gets a placeholder.
        chunked = target if target is not None else torch.zeros(batch, device=self.topology.device)
        kwargs = {"target": chunked, "losses": self._losses} if self.is_last else {}
        self._schedule.step(*((x,) if rank == 0 else ()), **kwargs)
        # The schedule's losses are each chunk's mean / (steps x chunks): their sum x steps is the
        # micro-batch's mean loss.
        value = (
            torch.stack(self._losses).sum().detach() * accumulation_steps
            if self.is_last
            else torch.zeros((), device=self.topology.device)
        )
        dist.broadcast(value, src=self.topology.world_size - 1)  # every rank logs the same loss
        loss.value = value
        return value

    def _loss(self, output: torch.Tensor, target_chunk: torch.Tensor | None) -> torch.Tensor:
        deferred, target, steps = self._pending
        value = deferred.replay(output, target, target_chunk)
        # Each pipeline micro-batch's loss is a mean over its chunk: dividing by their number and
        # by the accumulation steps makes the summed gradients those of the whole global batch.
        return value / (steps * self.microbatches)

    def forward_only(self, *args: torch.Tensor) -> torch.Tensor:
        """Evaluation: the batch passes the stages one after the other (no schedule: torch's stages
        keep the shapes of their first batch, and evaluation batches come in any size); every
        rank gets the last stage's output."""
        rank, last = self.topology.rank, self.topology.world_size - 1
        if rank == 0:
            hidden = args[0]
        else:
            box: list = [None]
            dist.recv_object_list(box, src=rank - 1)
            hidden = box[0].to(self.topology.device)
        hidden = self.stage_module(hidden)
        if rank < last:
            dist.send_object_list([hidden.detach().cpu()], dst=rank + 1)
        box = [hidden.detach().cpu() if rank == last else None]
        dist.broadcast_object_list(box, src=last)
        return box[0].to(self.topology.device)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in self.stage_module.parameters() if p.grad is not None]
        local = (
            torch.stack([g.pow(2).sum() for g in grads]).sum()
            if grads
            else torch.zeros((), device=self.topology.device)
        )
        dist.all_reduce(local)  # the squares of every stage: the global norm
        norm = local.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale)
        return norm

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.stage_module

    def sharded_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """This stage's weights under the full model's names: what torch.distributed.checkpoint saves."""
        return self.stage_state_dict()

    def stage_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """This stage's entries under the full model's names (``model.state_dict()`` of what setup() returned)."""
        return {
            f"{prefix}{name}.{key}": value
            for name, unit in self._own_units()
            for key, value in unit.state_dict(keep_vars=keep_vars).items()
        }

    def load_sharded_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.load_stage_state_dict(state)

    def weight_slots(self, model: nn.Module) -> dict[str, torch.Tensor]:
        own = {id(unit) for _, unit in self._own_units()}
        # One placeholder per tensor, not per name: a tie inside another stage's unit stays one
        # slot, so every rank groups the names as the stage that holds them does (load_weights
        # walks the same tensors on every rank, in step with rank 0's broadcasts).
        placeholders: dict[int, torch.Tensor] = {}
        slots = {}
        for name, unit in self._units:
            for key, value in unit.state_dict(keep_vars=True).items():
                if id(unit) not in own:
                    if id(value) not in placeholders:
                        placeholders[id(value)] = torch.empty(value.shape, dtype=value.dtype, device="meta")
                    value = placeholders[id(value)]
                slots[f"{name}.{key}"] = value
        return slots

    def load_stage_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True, assign: bool = False) -> None:
        """Load this stage's entries of ``state`` (keyed by the full model's names; others are ignored)."""
        for name, unit in self._own_units():
            prefix = f"{name}."
            own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            unit.load_state_dict(own, strict=strict, assign=assign)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.load_sharded_model_state_dict(model, state)  # a full dict holds every stage's keys

    def _own_units(self) -> list[tuple[str, nn.Module]]:
        return [(name, unit) for (name, unit), stage in zip(self._units, self._stage_of) if stage == self.topology.rank]

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full weights on rank 0, gathered from every stage (other ranks get an empty dict)."""
        own = {k: v.detach().cpu() for k, v in self.sharded_model_state_dict(model).items()}
        parts: list = [None] * self.topology.world_size
        dist.all_gather_object(parts, own)
        if self.topology.rank != 0:
            return {}
        merged = {k: v for part in parts for k, v in part.items()}
        order = [f"{name}.{key}" for name, unit in self._units for key in unit.state_dict()]
        return {k: merged[k] for k in order}

    def optimizer_state_dict(self, model, optimizer) -> dict:
        """Optimizer state under the full model's parameter names, so it reshards to another stage
        split; the group settings (lr, betas, ...) are the same on every stage."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        local = get_optimizer_state_dict(self.stage_module, optimizer)
        rename = self._global_name
        return {
            "state": {rename(k): v for k, v in local["state"].items()},
            "groups": [{k: v for k, v in group.items() if k != "params"} for group in local["param_groups"]],
        }

    def load_optimizer_state_dict(self, model, optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        local = get_optimizer_state_dict(self.stage_module, optimizer)
        groups = [
            {**loaded, "params": group["params"]} for group, loaded in zip(local["param_groups"], state["groups"])
        ]
        own = {rename: k for k in local["state"] for rename in [self._global_name(k)]}
        set_optimizer_state_dict(
            self.stage_module,
            optimizer,
            {"state": {own[k]: v for k, v in state["state"].items() if k in own}, "param_groups": groups},
        )

    def _global_name(self, local: str) -> str:
        # The stage module is nn.Sequential(*own units): its child i is the i-th own unit.
        index, _, rest = local.partition(".")
        return f"{self._own_units()[int(index)][0]}.{rest}"

    def describe(self) -> str:
        opts = self.config.strategy.pipeline
        return (
            f"pipeline over {plural(self.topology.world_size, 'stage')} "
            f"({opts.schedule}, {self.microbatches} micro-batches)"
        )


class _PipelineModel(ModelSurface):
    """What setup() returns: calls give a deferred output in training, real outputs in evaluation.
    Other attributes are the user's model's (see surface.py); its state dict is this stage's."""

    def __init__(self, strategy: Pipeline):
        super().__init__()
        self.stage = strategy.stage_module  # this rank's layers: what optimizers and clipping see
        object.__setattr__(self, "_strategy", strategy)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            return DeferredOutput(args)
        with torch.no_grad():
            return self._strategy.forward_only(*args)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """This stage's entries under the user's model's names; the other stages' are on their own
        processes (``session.model_state_dict()`` gathers every stage)."""
        own = self._strategy.stage_state_dict(prefix, keep_vars)
        if destination is None:
            return own
        destination.update(own)
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads this stage's entries of a state dict of the user's whole model (the other keys are ignored)."""
        self._strategy.load_stage_state_dict(state_dict, strict=strict, assign=assign)


def cannot_cut(batch: int, settings: PipelineConfig, stages: int) -> str:
    """Why a micro-batch of ``batch`` samples cannot be cut into the pipeline micro-batches, and the fix."""
    if settings.microbatches is not None:
        return (
            f"the micro-batch of {batch} samples cannot be cut into strategy.pipeline.microbatches="
            f"{settings.microbatches}; choose a divisor of {batch}"
        )
    count = pipeline_microbatches(settings, stages)
    # Under 1F1B a divisor of the batch is enough only if it still gives every stage one.
    gpipe = " with strategy.pipeline.schedule=gpipe" if settings.schedule == "1f1b" and batch < stages else ""
    return (
        f"the micro-batch of {batch} samples cannot be cut into {count} pipeline micro-batches "
        f"(strategy.pipeline.microbatches is null: one per stage, at least {MIN_DEFAULT_MICROBATCHES}); "
        f"make batch.micro_batch_size a multiple of {count}, or set strategy.pipeline.microbatches to a divisor "
        f"of {batch}{gpipe}"
    )


def _split(units: list[tuple[str, nn.Module]], stages: int, split_points: list[str]) -> list[int]:
    names = [name for name, _ in units]
    if split_points:
        unknown = [p for p in split_points if p not in names]
        if unknown or len(split_points) != stages - 1:
            raise ConfigError(
                f"strategy.pipeline.split_points must name {stages - 1} of the model's children for {stages} stages "
                f"(unknown: {', '.join(unknown) or 'none'}); children: {', '.join(names)}"
            )
        starts = sorted(names.index(p) for p in split_points)
        if len(set(starts)) != len(starts) or starts[0] == 0:
            raise ConfigError(
                "strategy.pipeline.split_points must be distinct children after the first "
                f"({names[0]}), or a stage is left empty"
            )
        return [sum(i >= s for s in starts) for i in range(len(units))]
    if len(units) < stages:
        raise ConfigError(f"strategy pipeline: the model has {len(units)} children, fewer than the {stages} stages")
    stage_of = assign(units, stages)
    if len(set(stage_of)) < stages:
        raise ConfigError(
            "strategy pipeline: balancing by parameters left a stage empty; set strategy.pipeline.split_points"
        )
    return stage_of
