"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded
over processes; parameters are all-gathered per shard unit for forward and backward."""

from __future__ import annotations

import contextlib
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from phalanx._torch_compat import fsdp_measuring_reduce_scatter
from phalanx.config.sections import Section
from phalanx.errors import ConfigError, PhalanxError
from phalanx.runtime.noise_scale import LocalNorms
from phalanx.strategies import dtensor_state
from phalanx.strategies.base import Sharding
from phalanx.strategies.construction import is_deferred, whole_model_refusal
from phalanx.strategies.dtensor_strategy import DTensorStrategy
from phalanx.strategies.fsdp_units import shard_groups
from phalanx.strategies.mesh_norms import clip_over_mesh
from phalanx.strategies.plan_rows import PlanRow
from phalanx.util.words import plural

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class FSDPConfig(Section):
    reshard_after_forward: bool = Field(
        True,
        description=(
            "free gathered parameters after forward (ZeRO-3-like); "
            "false keeps them until backward (ZeRO-2-like: more memory, less communication)"
        ),
    )
    wrap: list[str] = Field(
        default_factory=list,
        description=(
            "module class names that each become a shard unit, e.g. [TransformerBlock] (empty: automatic by size)"
        ),
    )
    min_params: int = Field(
        100_000,
        gt=0,
        description=(
            "automatic wrapping: a submodule with at least this many parameters of its own becomes a shard unit"
        ),
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype of gradient reduction under bf16 precision"
    )
    cpu_offload: bool = Field(
        False,
        description=(
            "keep sharded parameters, gradients and optimizer state in CPU memory "
            "(slow; for models that do not fit otherwise)"
        ),
    )


class FSDP(DTensorStrategy):
    name = "fsdp"
    options_key = "fsdp"
    options = FSDPConfig
    resume_counted = ("reduce_dtype",)
    needs_process_group = True
    handles_precision = True  # parameters are cast by FSDP's own mixed-precision policy
    precisions = frozenset({"fp32", "bf16", "fp64"})
    supports_channels_last = False
    # Sharded over the data-parallel axis, and split by the tensor-parallel plan as well in the 2-D
    # layout (strategy.tp.size > 1: TP within a node, FSDP across the data-parallel ranks).
    shards = Sharding(parameters=("dp_shard", "tp"), gradients=("dp_shard", "tp"), optimizer=("dp_shard", "tp"))
    axes = ("dp_shard", "tp")
    # Without resharding, gradients are reduce-scattered and parameters all-gathered once (2);
    # resharding all-gathers them again for backward (3).
    plan_rows = (
        PlanRow("fsdp-zero2", traffic=2, options={"reshard_after_forward": False}),
        PlanRow("fsdp-zero3", traffic=3, options={"reshard_after_forward": True}),
    )
    local_micro_step_gradients = False  # they accumulate unsharded inside FSDP until the reduce-scatter
    advice: ClassVar[dict[str, str]] = {
        "precision.mode": "(its loss scaling would need a sharded inf check); use bf16",
        "compute.channels_last": (
            "(FSDP2 cannot shard channels-last weights); use ddp or zero1, or set compute.channels_last: false"
        ),
    }

    def __init__(self, config, topology):
        super().__init__(config, topology)
        # This rank's gradient before the reduce-scatter averages it, for the noise scale's small
        # batch: measured in a reduce-scatter of FSDP's own kind that looks at each input first.
        # Not in the 2-D layout: there a reduce-scatter's input is one tensor peer's slice of the
        # gradient, alongside copies of the unsplit layers, and no rank sees its whole own gradient.
        measure = config.train.noise_scale and topology.world_size > 1 and self.layout.tp == 1
        self.local_norms: LocalNorms | None = LocalNorms() if measure else None

    @classmethod
    def sharding(cls, settings) -> Sharding:
        if settings.fsdp.reshard_after_forward:
            return cls.shards  # ZeRO-3-like
        # ZeRO-2-like: the gathered copy is whole over the data axis, still split by the TP plan.
        return Sharding(
            parameters=("tp",), gradients=cls.shards.gradients, optimizer=cls.shards.optimizer, keeps_gathered=True
        )

    @classmethod
    def check_settings(cls, config, world_size, device) -> None:
        if config.strategy.fsdp.cpu_offload and device == "cpu":
            raise ConfigError(
                "strategy.fsdp.cpu_offload needs CUDA devices (it keeps the shards in CPU memory between their uses "
                "on the GPU; CPU processes hold them there already); set strategy.fsdp.cpu_offload: false, "
                "or launch on GPUs"
            )

    @property
    def splits_by_tp_plan(self) -> bool:
        return self.layout.tp > 1

    def place(self, model: nn.Module) -> nn.Module:
        # A deferred model stays on meta: wrap_model materialises each unit just before sharding it.
        # In the 2-D layout it is materialised whole first: the tensor-parallel split needs real
        # weights to cut, with the values a 1-process run draws.
        if not is_deferred(model) or self.layout.tp > 1:
            return super().place(model)
        build = self.materializer(model, in_place=False)  # names taken now, before activation checkpointing
        if build.needs_whole_model_init():  # it would run on the sharded model: refused before any work
            raise PhalanxError(whole_model_refusal(self.name, build.inits.label(), "one shard unit at a time"))
        return model

    def wrap_model(self, model: nn.Module) -> nn.Module:
        # Imported here: torch.distributed.fsdp costs a second at `import phalanx` otherwise.
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        opts = self.config.strategy.fsdp
        before = self._replaced.before(model)
        kwargs = {"reshard_after_forward": opts.reshard_after_forward}
        if self.config.precision.mode == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=_DTYPES[opts.reduce_dtype]
            )
        if opts.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        if self.splits_by_tp_plan:  # 2-D: split layers over the tensor peers, then shard over the data axis
            self.split_tensor_parallel(model)
            kwargs["mesh"] = self.mesh["dp_shard"]
        # A deferred model is materialised one unit at a time, each sharded at once: the set-up peak
        # is this rank's shards plus one whole unit, never the whole model.
        build = self.materializer(model, in_place=False) if is_deferred(model) else None
        for group in self._shard_groups(model):
            if build is not None:
                for module in group:  # in the model's order: a tie's first holder initialises it, as under ddp
                    build.materialize(module, self.topology.device)
                build.settle()  # what no initialiser wrote is found while the unit is whole on every rank
            # A tied weight's holders are one group (torch's advice for shared parameters).
            fully_shard(group if len(group) > 1 else group[0], **kwargs)
        if build is not None:
            build.materialize(model, self.topology.device)  # what no unit claimed: embeddings, head, norms
            build.settle()
        fully_shard(model, **kwargs)
        self._measure_reduce_scatters(model)
        # model.load_state_dict() takes the user's plain weights, as under every other strategy.
        model.register_load_state_dict_pre_hook(dtensor_state.shard_full_tensors)
        self._replaced.after(model, before)
        return model

    def _measure_reduce_scatters(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        norms = self.local_norms
        comm = fsdp_measuring_reduce_scatter(norms.add, lambda: norms.armed) if norms is not None else None
        if comm is None:
            self.local_norms = None
            return
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(comm)

    def _shard_groups(self, model: nn.Module) -> list[list[nn.Module]]:
        opts = self.config.strategy.fsdp
        return shard_groups(model, opts.wrap, opts.min_params, "strategy.fsdp.wrap")

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return _gradient_sync_off(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        if self.layout.tp > 1:  # split layers' gradients live on the 2-D mesh, the others on the data axis
            world, device = self.topology.world_size, self.topology.comm_device
            return clip_over_mesh(list(model.parameters()), max_norm, world, device)
        norm = super().clip_grad_norm_(model, max_norm)
        # The norm of sharded gradients is a DTensor reduced over every shard: the global norm.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def describe(self) -> str:
        mode = "ZeRO-3-like" if self.config.strategy.fsdp.reshard_after_forward else "ZeRO-2-like"
        if self.layout.tp > 1:
            split = f", {self.tp_plan.describe()}" if self.tp_plan is not None else ""
            return f"fsdp x tp over {self.layout.describe()} ({mode}){split}"
        return f"fsdp over {plural(self.topology.world_size, 'process')} ({mode})"


def shard_units(model: nn.Module, opts: FSDPConfig, setting: str = "strategy.fsdp.wrap") -> list[nn.Module]:
    """The submodules ``fully_shard`` makes shard units of under ``opts`` (a ``strategy.fsdp``
    section), innermost first; the model itself, wrapped last, is not among them. Public so that
    ``phalanx plan`` counts the units training will have; ``setting`` names ``opts.wrap`` in errors.
    A unit that shares a tied weight with modules elsewhere is sharded together with them
    (fsdp_units.py); it stands here for its group, whose other modules hold that weight."""
    return [group[0] for group in shard_groups(model, opts.wrap, opts.min_params, setting)]


@contextlib.contextmanager
def _gradient_sync_off(model: nn.Module):
    # Gradients accumulate unsharded until the last micro-step, which then reduce-scatters once.
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
