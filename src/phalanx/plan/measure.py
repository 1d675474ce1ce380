"""Facts about a real model for the planner: its parameter count, and the activation memory of
one micro-batch, measured by counting the tensors autograd saves for backward."""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from phalanx._torch_compat import view_base
from phalanx.errors import PhalanxError
from phalanx.runtime.recompute import apply_activation_checkpointing

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Activations:
    """Bytes saved for backward: ``fixed + per_sample x micro_batch``. The fixed part holds what
    does not grow with the batch, such as autocast's low-precision copies of the weights."""

    per_sample: float
    fixed: float
    measured_on: str  # "meta" (nothing allocated) or "cpu"
    weight_copies: float = 0.0  # autocast's part of ``fixed``

    def at(self, micro_batch: int, *, autocast: bool = True) -> float:
        """``autocast=False`` for strategies that cast parameters themselves (fsdp): no autocast copies."""
        fixed = self.fixed if autocast else max(0.0, self.fixed - self.weight_copies)
        return fixed + self.per_sample * micro_batch


def load_factory(path: str) -> Callable[..., nn.Module]:
    """``package.module:factory`` -> the callable; errors name what did not resolve."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise PhalanxError(f"--model expects package.module:factory, e.g. mypkg.models:build, got '{path}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PhalanxError(
            f"--model {path}: cannot import '{module_name}' ({err}); check the name and that it is on PYTHONPATH"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise PhalanxError(f"--model {path}: '{module_name}' has no callable '{attr}'")
    return factory


def build(factory: Callable[..., nn.Module], kwargs: dict[str, Any], device: str) -> nn.Module:
    try:
        with torch.device(device):
            model = factory(**kwargs)
    except Exception as err:  # noqa: BLE001 - the user's factory: any failure is reported as one line
        raise PhalanxError(f"the model factory failed: {type(err).__name__}: {err}") from None
    if not isinstance(model, nn.Module):
        raise PhalanxError(f"the model factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def measure_activations(
    factory: Callable[..., nn.Module],
    kwargs: dict[str, Any],
    input_shape: tuple[int, ...],
    input_dtype: torch.dtype,
    precision: str,
    checkpoint_classes: list[str] = (),
) -> Activations:
    """Activation memory from two micro-batches (2 and 4 samples), on the meta device when the
    model runs there (nothing is allocated), else on the CPU."""
    last: Exception | None = None
    for device in ("meta", "cpu"):
        try:
            sizes = {}
            for batch in (2, 4):
                model = build(factory, kwargs, device)
                apply_activation_checkpointing(model, list(checkpoint_classes), setting="--checkpoint")
                sizes[batch] = _saved_bytes(
                    model, _example_input(input_shape, input_dtype, batch, device), precision, device
                )
            per_sample = max(0.0, (sizes[4] - sizes[2]) / 2)
            fixed = max(0.0, sizes[2] - 2 * per_sample)
            copies = 2.0 * count_parameters(model) if _AUTOCAST[precision] is not None else 0.0
            if device == "meta":
                # Autocast keeps a low-precision copy of the weights for the step; meta cannot run
                # autocast, so count one 2-byte copy per parameter (the CPU run measured its own).
                fixed += copies
            return Activations(per_sample, fixed, device, weight_copies=min(copies, fixed))
        except PhalanxError:
            raise
        except (NotImplementedError, RuntimeError, TypeError, ValueError, IndexError) as err:
            last = err
    raise PhalanxError(
        f"one micro-batch of shape {input_shape} does not run through the model: "
        f"{type(last).__name__}: {str(last).splitlines()[0]}"
    )


def _example_input(shape: tuple[int, ...], dtype: torch.dtype, batch: int, device: str) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(batch, *shape, device=device)
    return torch.zeros(batch, *shape, dtype=dtype, device=device)


def _saved_bytes(model: nn.Module, x: torch.Tensor, precision: str, device: str) -> int:
    params = list(model.parameters())
    param_ids = {id(p) for p in params}
    param_storages = {p.untyped_storage().data_ptr() for p in params} if device != "meta" else set()
    saved: dict[int, torch.Tensor] = {}  # holding the tensors keeps their ids unique

    def pack(t: torch.Tensor):
        # Parameters (and views of them) saved for backward are model state, not activations;
        # a tensor saved twice is stored once.
        base = view_base(t)
        base = t if base is None else base
        if id(t) in param_ids or id(base) in param_ids:
            return t
        if device != "meta" and t.untyped_storage().data_ptr() in param_storages:
            return t
        saved[id(base) if device == "meta" else t.untyped_storage().data_ptr()] = base
        return t

    dtype = _AUTOCAST[precision]
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None and device == "cpu" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(x)
    total = 0
    for t in saved.values():
        nbytes = t.untyped_storage().nbytes() if device != "meta" else t.numel() * t.element_size()
        if device == "meta" and dtype is not None and t.is_floating_point():
            # Autocast does not run on meta tensors: saved float activations take the compute dtype.
            nbytes = nbytes * torch.finfo(dtype).bits // 32
        total += nbytes
    return total
