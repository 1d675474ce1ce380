"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded
over processes; parameters are all-gathered per shard unit for forward and backward."""

from __future__ import annotations

import contextlib
from typing import ClassVar, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

from phalanx._torch_compat import fsdp_measuring_reduce_scatter
from phalanx.config.sections import Section
from phalanx.errors import ConfigError, PhalanxError
from phalanx.runtime.noise_scale import LocalNorms
from phalanx.strategies.base import Sharding, Strategy
from phalanx.strategies.construction import is_deferred, whole_model_refusal
from phalanx.strategies.fsdp_units import shard_groups
from phalanx.strategies.plan_rows import PlanRow
from phalanx.util.optim import rebuild_arguments
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


class FSDP(Strategy):
    name = "fsdp"
    options_key = "fsdp"
    options = FSDPConfig
    resume_counted = ("reduce_dtype",)
    needs_process_group = True
    handles_precision = True  # parameters are cast by FSDP's own mixed-precision policy
    checkpoint_layout = "dcp"
    precisions = frozenset({"fp32", "bf16"})
    supports_channels_last = False
    shards = Sharding(parameters=True, gradients=True, optimizer=True)
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
        self._new_params: dict[int, nn.Parameter] = {}
        # This rank's gradient before the reduce-scatter averages it, for the noise scale's small
        # batch: measured in a reduce-scatter of FSDP's own kind that looks at each input first.
        measure = config.train.noise_scale and topology.world_size > 1
        self.local_norms: LocalNorms | None = LocalNorms() if measure else None

    @classmethod
    def sharding(cls, settings) -> Sharding:
        if settings.fsdp.reshard_after_forward:
            return cls.shards  # ZeRO-3-like
        return Sharding(gradients=True, optimizer=True, keeps_gathered=True)  # ZeRO-2-like

    @classmethod
    def check_settings(cls, config, world_size, device) -> None:
        if config.strategy.fsdp.cpu_offload and device == "cpu":
            raise ConfigError(
                "strategy.fsdp.cpu_offload needs CUDA devices (it keeps the shards in CPU memory between their uses "
                "on the GPU; CPU processes hold them there already); set strategy.fsdp.cpu_offload: false, "
                "or launch on GPUs"
            )

    def place(self, model: nn.Module) -> nn.Module:
        # A deferred model stays on meta: wrap_model materialises each unit just before sharding it.
        if not is_deferred(model):
            return super().place(model)
        build = self.materializer(model, in_place=False)  # names taken now, before activation checkpointing
        if build.needs_whole_model_init():  # it would run on the sharded model: refused before any work
            raise PhalanxError(whole_model_refusal(self.name, build.inits.label(), "one shard unit at a time"))
        return model

    def wrap_model(self, model: nn.Module) -> nn.Module:
        # Imported here: torch.distributed.fsdp costs a second at `import phalanx` otherwise.
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        opts = self.config.strategy.fsdp
        before = dict(model.named_parameters())
        kwargs = {"reshard_after_forward": opts.reshard_after_forward}
        if self.config.precision.mode == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=_DTYPES[opts.reduce_dtype]
            )
        if opts.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
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
        model.register_load_state_dict_pre_hook(_shard_full_tensors)
        # fully_shard replaces every parameter with a sharded one; optimizers built on the old
        # ones are rebuilt in wrap_optimizer through this map.
        after = dict(model.named_parameters())
        self._new_params.update({id(p): after[name] for name, p in before.items()})
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

    def gradient_sq(self, models: list[nn.Module]) -> torch.Tensor:
        # Each rank holds disjoint shards: the sum of every rank's is the whole gradient's.
        local = super().gradient_sq(models).to(self.topology.comm_device)
        if self.topology.world_size > 1:
            dist.all_reduce(local)
        return local

    def _shard_groups(self, model: nn.Module) -> list[list[nn.Module]]:
        opts = self.config.strategy.fsdp
        return shard_groups(model, opts.wrap, opts.min_params, "strategy.fsdp.wrap")

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not self._new_params:
            raise ConfigError("strategy fsdp: pass the model to setup() together with (or before) its optimizer")
        for group in optimizer.param_groups:
            missing = [p for p in group["params"] if id(p) not in self._new_params]
            if missing:
                raise ConfigError(
                    "strategy fsdp: the optimizer holds parameters that are not in the model given to setup()"
                )
            group["params"] = [self._new_params[id(p)] for p in group["params"]]
        # Same group dicts, so a scheduler built on the user's optimizer still steers this one.
        return type(optimizer)(optimizer.param_groups, **rebuild_arguments(optimizer))

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return _gradient_sync_off(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        norm = super().clip_grad_norm_(model, max_norm)
        # The norm of sharded gradients is a DTensor reduced over every shard: the global norm.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full weights on CPU, on rank 0 (other ranks get an empty dict, as torch does)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def sharded_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model)

    def load_sharded_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def put_weight(self, slot: torch.Tensor, value: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if not isinstance(slot, DTensor):
            return super().put_weight(slot, value)
        # Every rank has the full tensor: its shard is cut locally, with the sharding's own rule,
        # and cast as it is copied in (a cast of the whole tensor would be a second full copy).
        value = value.to(device=slot.device)
        share = distribute_tensor(value, slot.device_mesh, slot.placements, src_data_rank=None).to_local()
        with torch.no_grad():
            slot.to_local().copy_(share)

    def optimizer_state_dict(self, model, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer)

    def load_optimizer_state_dict(self, model, optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state)

    def describe(self) -> str:
        mode = "ZeRO-3-like" if self.config.strategy.fsdp.reshard_after_forward else "ZeRO-2-like"
        return f"fsdp over {plural(self.topology.world_size, 'process')} ({mode})"


def shard_units(model: nn.Module, opts: FSDPConfig, setting: str = "strategy.fsdp.wrap") -> list[nn.Module]:
    """The submodules ``fully_shard`` makes shard units of under ``opts`` (a ``strategy.fsdp``
    section), innermost first; the model itself, wrapped last, is not among them. Public so that
    ``phalanx plan`` counts the units training will have; ``setting`` names ``opts.wrap`` in errors.
    A unit that shares a tied weight with modules elsewhere is sharded together with them
    (fsdp_units.py); it stands here for its group, whose other modules hold that weight."""
    return [group[0] for group in shard_groups(model, opts.wrap, opts.min_params, setting)]


def _shard_full_tensors(module: nn.Module, state: dict, prefix: str, *_: object) -> None:
    """A plain (full) tensor given for a sharded parameter becomes this rank's shard of it, cut
    locally: load_state_dict of a plain dict means every rank holds the whole tensor, so no
    collective is needed (and calling it on one rank alone cannot hang)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in module.named_parameters():
        value = state.get(prefix + name)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            local = value.detach().to(param.device)
            state[prefix + name] = distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)


@contextlib.contextmanager
def _gradient_sync_off(model: nn.Module):
    # Gradients accumulate unsharded until the last micro-step, which then reduce-scatters once.
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
