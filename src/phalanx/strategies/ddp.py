"""DistributedDataParallel: one process per device, gradients all-reduced in buckets during backward."""

from __future__ import annotations

import contextlib
import inspect
from typing import ClassVar, Literal, Optional, Union

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.config.sections import Section
from phalanx.errors import ConfigError
from phalanx.runtime.noise_scale import LocalNorms
from phalanx.strategies.base import Strategy
from phalanx.strategies.plan_rows import PlanRow
from phalanx.strategies.unused import UnusedParameters
from phalanx.util.words import plural

_DDP_ARGS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)
_DDP_FIRST_BUCKET_MB = 1.0  # DistributedDataParallel's own first bucket, used by it only without bucket_cap_mb
ONE_TIB_IN_MIB = 1024.0 * 1024  # DDP turns bucket sizes into a byte count of C++'s int64


class DDPConfig(Section):
    bucket_cap_mb: float = Field(
        25.0,
        gt=0,
        le=ONE_TIB_IN_MIB,
        description="gradient bucket size in MiB; larger buckets mean fewer, bigger all-reduces",
    )
    first_bucket_cap_mb: Optional[float] = Field(
        None,
        gt=0,
        le=ONE_TIB_IN_MIB,
        description=(
            "size in MiB of the first bucket, the gradients ready first in backward, so communication starts sooner "
            "(null: DDP's own 1 MiB, or bucket_cap_mb where that is smaller; bucket_cap_mb: every bucket alike)"
        ),
    )
    gradient_as_bucket_view: bool = Field(
        True, description="gradients alias the communication buckets (saves one copy of the gradients)"
    )
    static_graph: bool = Field(
        False, description="the set of used parameters never changes between steps (enables DDP's graph optimisations)"
    )
    find_unused_parameters: Union[bool, Literal["auto"]] = Field(
        "auto",
        description=(
            "auto: find in the first step whether some parameter gets no gradient, then run at full speed (none) "
            "or keep searching every step (some: named once) | "
            "true: search every step (costs a graph traversal per step) | false: never"
        ),
    )
    broadcast_buffers: bool = Field(
        True, description="copy buffers (e.g. BatchNorm statistics) from rank 0 at every forward"
    )
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none",
        description=(
            "gradient compression for the all-reduce: "
            "none | fp16 | bf16 (NCCL only) | powersgd (low-rank, with error feedback)"
        ),
    )
    powersgd_rank: int = Field(
        1, gt=0, description="powersgd: rank of the low-rank approximation (higher: more accurate, more traffic)"
    )
    powersgd_start_step: int = Field(
        10, ge=2, description="powersgd: optimizer steps of uncompressed all-reduce before compression starts"
    )
    powersgd_warm_start: bool = Field(
        True, description="powersgd: reuse the last step's low-rank factors (cheaper, usually as accurate)"
    )

    @field_validator("find_unused_parameters", mode="before")
    @classmethod
    def _auto_or_bool(cls, value):
        if isinstance(value, bool) or value == "auto":
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError("find_unused_parameters must be auto, true or false")

    @model_validator(mode="after")
    def _first_bucket_fits(self):
        first, cap = self.first_bucket_cap_mb, self.bucket_cap_mb
        if first is not None and first > cap:
            raise ValueError(
                f"strategy.ddp.first_bucket_cap_mb ({first:g}) is larger than bucket_cap_mb ({cap:g}); "
                "the first bucket is meant to be small, so its all-reduce starts early: lower it or set it to null"
            )
        return self


class DDP(Strategy):
    name = "ddp"
    options_key = "ddp"
    options = DDPConfig
    resume_counted = ("comm_hook", "powersgd_rank", "powersgd_start_step", "powersgd_warm_start", "broadcast_buffers")
    # The comm hook is a setting of DDP's all-reduce; under another strategy it would do nothing.
    options_apply: ClassVar[dict[str, tuple[str, str]]] = {
        "comm_hook": ("ddp_buckets", "compresses DDP's gradient all-reduce")
    }
    # An all-reduce moves about twice the gradients (reduce-scatter, then all-gather).
    plan_rows = (PlanRow("ddp", traffic=2),)
    needs_process_group = True
    ddp_buckets = True
    local_forward = True  # the bare module under the DDP wrapper
    direct_calls = "no_grad"  # DDP's forward prepares the gradient all-reduce

    def __init__(self, config, topology):
        super().__init__(config, topology)
        self._unused: list[UnusedParameters] = []  # one per wrapped model
        # This rank's gradient before the all-reduce, for the noise scale's small batch: measured
        # in the comm hook, which sees each bucket before it is averaged. Wrapping a Python hook
        # the config asks for costs nothing more; putting one in place of DDP's built-in all-reduce
        # cost 8.7% of the step on 2 CPU processes (benchmarks/noise_overhead.py), so that takes
        # train.noise_scale: hook, or batch.adaptive, which cannot choose a batch without it.
        python_hook = (
            config.strategy.ddp.comm_hook != "none"
            or config.train.noise_scale == "hook"
            or config.batch.adaptive is not None
        )
        measure = bool(config.train.noise_scale) and topology.world_size > 1 and python_hook
        self.local_norms: LocalNorms | None = LocalNorms() if measure else None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        opts = self.config.strategy.ddp
        device = self.topology.device
        # torch 2.13 renamed the per-forward buffer sync; the old name still works but warns.
        buffers = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
        # auto starts with the search on, so the first step is right whatever the model does
        # (strategies/unused.py turns it off after that step when nothing needs it). With
        # static_graph DDP finds unused parameters itself in the first step.
        find = opts.find_unused_parameters
        if find == "auto":
            find = not opts.static_graph
        wrapped = DistributedDataParallel(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
            static_graph=opts.static_graph,
            find_unused_parameters=find,
            **_bucket_sizes(opts.bucket_cap_mb, opts.first_bucket_cap_mb),
            **{buffers: opts.broadcast_buffers},
        )
        if opts.comm_hook != "none" or self.local_norms is not None:
            self._register_hook(wrapped)
        self._unused.append(
            UnusedParameters(wrapped, opts.find_unused_parameters, self.topology.comm_device, self.topology.is_main)
        )
        return wrapped

    def backward(self, loss: torch.Tensor, precision, accumulation_steps: int) -> torch.Tensor:
        reported = super().backward(loss, precision, accumulation_steps)
        for watch in self._unused:
            watch.after_backward()
        return reported

    def _register_hook(self, model: DistributedDataParallel) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        opts = self.config.strategy.ddp
        register = model.register_comm_hook if self.local_norms is None else self._measuring(model)
        if opts.comm_hook == "none":
            register(None, default_hooks.allreduce_hook)  # what DDP does without a hook, in Python
        elif opts.comm_hook == "fp16":
            register(None, default_hooks.fp16_compress_hook)
        elif opts.comm_hook == "bf16":
            if self.topology.backend != "nccl":
                raise ConfigError("strategy.ddp.comm_hook=bf16 needs NCCL (CUDA devices); on gloo use fp16 or none")
            register(None, default_hooks.bf16_compress_hook)
        else:
            # Error feedback carries what the low-rank step dropped into the next step, so
            # training converges; its state is not in checkpoints (a resume restarts it).
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=opts.powersgd_rank,
                start_powerSGD_iter=opts.powersgd_start_step,
                warm_start=opts.powersgd_warm_start,
                use_error_feedback=True,
            )
            register(state, powerSGD_hook.powerSGD_hook)

    def _measuring(self, model: DistributedDataParallel):
        """register_comm_hook for ``model``, with the hook wrapped to measure the local gradient
        first (it composes with every hook: the compression hooks see the same buckets)."""
        norms = self.local_norms

        def register(state, hook):
            def measured(state, bucket):
                if norms.armed:
                    norms.add(bucket.buffer())
                return hook(state, bucket)

            model.register_comm_hook(state, measured)

        return register

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def describe(self) -> str:
        opts = self.config.strategy.ddp
        given = opts.first_bucket_cap_mb
        size = given if given is not None else first_bucket_mb(opts.bucket_cap_mb)
        first = f", first {size:g} MiB" if size != opts.bucket_cap_mb else ""
        hook = f", {opts.comm_hook} compression" if opts.comm_hook != "none" else ""
        return (
            f"ddp over {plural(self.topology.world_size, 'process')} (bucket {opts.bucket_cap_mb:g} MiB{first}{hook})"
        )


def _bucket_sizes(bucket_cap_mb: float, first_bucket_cap_mb: float | None) -> dict:
    """DDP's bucket arguments. A first bucket of its own goes through ``bucket_cap_mb_list``, whose
    last entry DDP reuses for every later bucket; the first bucket is the first to be filled in
    backward (after DDP rebuilds its buckets in execution order, at the second step)."""
    given = first_bucket_cap_mb is not None
    first = first_bucket_cap_mb if given else first_bucket_mb(bucket_cap_mb)
    if first == bucket_cap_mb:
        return {"bucket_cap_mb": bucket_cap_mb}
    if "bucket_cap_mb_list" not in _DDP_ARGS:
        if not given:  # this torch cannot take DDP's own first bucket with a size given: one size
            return {"bucket_cap_mb": bucket_cap_mb}
        raise ConfigError(
            "strategy.ddp.first_bucket_cap_mb needs a torch whose DistributedDataParallel takes bucket_cap_mb_list "
            f"(this is {torch.__version__}); set it to null"
        )
    return {"bucket_cap_mb_list": [first, bucket_cap_mb]}


def first_bucket_mb(bucket_cap_mb: float) -> float:
    """The first bucket under first_bucket_cap_mb null: DDP's own 1 MiB, which it uses only when no
    bucket size is given (phalanx always gives one). A single bucket of every gradient measured
    1.12-1.20x the hand-written loop's step on 2 CPU processes for a 1 ms model, where the
    all-reduce then waits for the whole backward (benchmarks/overhead.py)."""
    return min(_DDP_FIRST_BUCKET_MB, bucket_cap_mb)
