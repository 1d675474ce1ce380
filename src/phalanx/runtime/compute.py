"""Compute knobs: torch.compile, the channels-last memory format and the optimizer's
implementation (for-loop, foreach or fused). One object chosen by config, like Precision; the
Session calls it around the strategy's wrapping, in the order each knob needs."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

from phalanx._torch_compat import compiled_original, foreach_kernel_devices, fused_kernel_devices
from phalanx.config.schema import ComputeConfig
from phalanx.errors import ConfigError
from phalanx.util.optim import rebuild_arguments
from phalanx.util.tree import map_tensors


class Compute:
    def __init__(self, config: ComputeConfig):
        self.config = config
        self.notes: list[str] = []  # said once on rank 0 by the Session
        self.compiled = False
        self.implementations: list[str] = []  # what optimizer_impl chose, per optimizer

    def describe(self) -> list[str]:
        """Parts of the Session's start-up line."""
        parts = []
        if self.compiled:
            parts.append(f"torch.compile ({self.config.compile_mode})")
        if self.config.channels_last:
            parts.append("channels-last")
        parts.extend(f"{impl} optimizer" for impl in dict.fromkeys(self.implementations))
        return parts

    # -- models ---------------------------------------------------------------------------
    def take_compiled_apart(self, model: nn.Module) -> tuple[nn.Module, bool]:
        """A model the user passed through torch.compile: its original module, and True.

        Compiling before DDP wraps the model makes the whole backward one graph, so DDP's
        all-reduces cannot start until it ends; and the compiled wrapper's ``_orig_mod.`` prefix
        would end up in every checkpoint. phalanx compiles after wrapping instead."""
        original = compiled_original(model)
        if original is not None:
            self.notes.append(
                "phalanx: the model passed to setup() was already compiled; "
                "phalanx compiles it again after wrapping it "
                f"(mode {self.config.compile_mode}), "
                "so set compute.compile: true instead of calling torch.compile yourself"
            )
            return original, True
        return model, False

    def before_wrap(self, model: nn.Module) -> None:
        """Memory format of the placed model, before the strategy shares or shards its weights."""
        if not self.config.channels_last:
            return
        if not any(p.dim() == 4 for p in model.parameters()):
            raise ConfigError(
                f"compute.channels_last: {type(model).__name__} has no 4-D (convolution) weights, so the channels-last "
                "memory format changes nothing; set compute.channels_last: false"
            )
        model.to(memory_format=torch.channels_last)

    def after_wrap(self, wrapped: nn.Module, *, compile_anyway: bool = False) -> nn.Module:
        """Channels-last inputs and torch.compile, on the module the user will call.

        The strategy's module is compiled in place (``nn.Module.compile``): the user keeps the
        object phalanx returns, and its state dict has no ``_orig_mod.`` prefix. For DDP this is
        the order PyTorch documents: TorchDynamo's DDPOptimizer then splits the graph at DDP's
        bucket boundaries, so the all-reduce of a bucket overlaps the rest of the backward."""
        if self.config.channels_last:
            wrapped.register_forward_pre_hook(_channels_last_inputs, with_kwargs=True)
        if self.config.compile or compile_anyway:
            wrapped.compile(mode=self.config.compile_mode)
            self.compiled = True
        return wrapped

    # -- optimizers -----------------------------------------------------------------------
    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, wrap: Callable[[torch.optim.Optimizer], torch.optim.Optimizer]
    ) -> torch.optim.Optimizer:
        """The user's optimizer with the configured implementation, then wrapped by the strategy.

        It is rebuilt on the same group dicts, as the sharding strategies rebuild theirs, so an LR
        scheduler built on the user's optimizer keeps steering it; and the strategies that rebuild
        it again take the implementation along (it is in the groups and the defaults)."""
        flags = self.implementation_flags(optimizer)
        if flags:
            for group in optimizer.param_groups:
                group.update(flags)
            rebuilt = type(optimizer)(optimizer.param_groups, **{**rebuild_arguments(optimizer), **flags})
            if optimizer.state:
                rebuilt.load_state_dict(optimizer.state_dict())
            optimizer = rebuilt
        wrapped = wrap(optimizer)
        if flags:
            _keep_on_load(wrapped, flags)
        return wrapped

    def implementation_flags(self, optimizer: torch.optim.Optimizer) -> dict[str, bool]:
        """``{"foreach": ..., "fused": ...}`` for ``compute.optimizer_impl`` (empty: leave as built)."""
        impl = self.config.optimizer_impl
        if impl is None:
            return {}
        accepts = inspect.signature(type(optimizer).__init__).parameters
        has_foreach, has_fused = "foreach" in accepts, "fused" in accepts
        name = type(optimizer).__name__
        if impl == "auto":
            if optimizer.defaults.get("foreach") is not None or optimizer.defaults.get("fused") is not None:
                return {}  # the user chose in the constructor; auto keeps that choice
            if has_fused and _fusable(optimizer) is None:
                impl = "fused"
            elif has_foreach and _foreach_native(optimizer):
                impl = "foreach"
            else:
                return {}  # e.g. RMSprop on CPU, where foreach kernels are not faster than the loop
        if impl == "fused":
            if not has_fused:
                raise ConfigError(
                    f"compute.optimizer_impl=fused: {name} has no fused implementation "
                    "(in torch: Adam, AdamW, SGD, Adagrad); "
                    "use auto (fused where there is one) or foreach"
                )
            problem = _fusable(optimizer)
            if problem:
                raise ConfigError(f"compute.optimizer_impl=fused: {problem}; use auto or foreach")
        if impl == "foreach" and not has_foreach:
            raise ConfigError(f"compute.optimizer_impl=foreach: {name} has no foreach implementation; use auto or loop")
        self.implementations.append(impl)
        flags: dict[str, bool] = {}
        if has_foreach:
            flags["foreach"] = impl == "foreach"
        if has_fused:
            flags["fused"] = impl == "fused"
        return flags


def _keep_on_load(optimizer: torch.optim.Optimizer, flags: dict[str, bool]) -> None:
    """A checkpoint's param groups carry the implementation of the run that saved them; this run's
    setting wins (torch's loading also places Adam's step counters for the implementation in the groups)."""

    def hook(_optimizer, state_dict: dict) -> None:
        for group in state_dict.get("param_groups", []):
            group.update(flags)  # in place: ZeroRedundancyOptimizer reads these dicts after torch's part of the load

    optimizer.register_load_state_dict_pre_hook(hook)


def _foreach_native(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter is on a device with native foreach kernels (CUDA, not CPU: measured
    on CPU, foreach is no faster than the loop, which is why PyTorch keeps the loop there)."""
    devices = foreach_kernel_devices()
    return all(p.device.type in devices for group in optimizer.param_groups for p in group["params"])


def _fusable(optimizer: torch.optim.Optimizer) -> str | None:
    """Why torch's fused kernels cannot take this optimizer's parameters (None: they can)."""
    if optimizer.defaults.get("differentiable"):
        return "a differentiable optimizer has no fused implementation"
    devices = fused_kernel_devices()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.device.type not in devices or not torch.is_floating_point(p):
                return (
                    f"fused kernels need floating-point parameters on {', '.join(devices)}, "
                    f"not {p.dtype} on {p.device.type}"
                )
    return None


def _channels_last_inputs(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    return map_tensors(args, _to_channels_last), map_tensors(kwargs, _to_channels_last)


def _to_channels_last(tensor: torch.Tensor) -> torch.Tensor:
    # Only image-like batches: 4-D floating point (N, C, H, W). Indices and masks keep their layout.
    if tensor.dim() == 4 and tensor.is_floating_point():
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor
