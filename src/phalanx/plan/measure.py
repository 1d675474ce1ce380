"""Facts about a real model for the planner: its parameter count, and the activation memory of
one micro-batch, measured by counting the tensors autograd saves for backward.

The micro-batch is either made from one sample's shape (batch first, one tensor) or returned by the
user's own inputs function of the batch size, for a forward that takes several arguments (tokens and
a hidden state), keyword arguments, or another layout (sequence first)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from phalanx._torch_compat import view_base
from phalanx.errors import PhalanxError
from phalanx.plan.tensor_split import SplitActivations, TensorSplit, watching
from phalanx.runtime.recompute import apply_activation_checkpointing
from phalanx.strategies.fsdp import FSDPConfig
from phalanx.strategies.fsdp_units import shard_groups
from phalanx.util.tree import map_tensors

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# A function of the micro-batch size B returning the inputs of one micro-batch: a tensor (the one
# argument), a tuple or list (positional arguments) or a dict (keyword arguments).
InputsFn = Callable[[int], Any]


@dataclass(frozen=True)
class Activations:
    """Bytes saved for backward: ``fixed + per_sample x micro_batch``. The fixed part holds what
    does not grow with the batch, such as autocast's low-precision copies of the weights."""

    per_sample: float
    fixed: float
    measured_on: str  # "meta" (nothing allocated) or "cpu"
    weight_copies: float = 0.0  # autocast's part of ``fixed``
    split: SplitActivations = SplitActivations()  # what a tensor-parallel plan divides (none measured: nothing)

    def at(self, micro_batch: int, *, autocast: bool = True, tp: int = 1) -> float:
        """``autocast=False`` for strategies that cast parameters themselves (fsdp): no autocast copies.
        ``tp``: tensor peers, each holding 1/tp of what the plan's split layers save (and of
        autocast's copies of their weights); the rest of the activations is whole on every peer."""
        fixed = self.fixed if autocast else max(0.0, self.fixed - self.weight_copies)
        per_sample = self.per_sample
        if tp > 1:
            others = 1 - 1 / tp
            per_sample -= others * self.split.per_sample
            fixed -= others * (self.split.fixed + (self.split.weight_copies if autocast else 0.0))
        return max(0.0, fixed) + per_sample * micro_batch


def load_factory(
    path: str, flag: str = "--model", kind: str = "factory", example: str = "mypkg.models:build"
) -> Callable[..., Any]:
    """``package.module:factory`` -> the callable; errors name ``flag`` and what did not resolve."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise PhalanxError(f"{flag} expects package.module:{kind}, e.g. {example}, got '{path}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PhalanxError(
            f"{flag} {path}: cannot import '{module_name}' ({err}); check the name and that it is on PYTHONPATH"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise PhalanxError(f"{flag} {path}: '{module_name}' has no callable '{attr}'")
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


@dataclass(frozen=True)
class ShardUnits:
    """FSDP's shard units of a real model, chosen as strategy fsdp chooses them: what the set-up
    of deferred construction materialises at once, and load_weights()' largest single tensor."""

    count: int  # the units, the model itself (wrapped last, holding what no unit claimed) included
    largest: int  # parameters of the largest unit: its own, not those of a unit inside it
    largest_name: str  # its name in the model; "" for the model itself
    largest_class: str
    largest_parameter: int  # parameters of the largest single tensor
    rule: str  # how the units were chosen: "automatic, min_params 100,000" or "wrap: Block"


def count_shard_units(model: nn.Module, opts: FSDPConfig, setting: str = "strategy.fsdp.wrap") -> ShardUnits:
    """``opts``: the ``strategy.fsdp`` settings that choose the units; ``setting`` names ``opts.wrap``
    in the error for a class the model does not contain."""
    names = {id(m): name for name, m in model.named_modules()}
    claimed: set[int] = set()
    sizes: list[tuple[int, nn.Module]] = []
    # A group (a unit and the modules that share its tied weights) is one unit: its size counts all of them.
    for group in shard_groups(model, opts.wrap, opts.min_params, setting):
        own = [p for member in group for p in member.parameters() if id(p) not in claimed]
        own = list({id(p): p for p in own}.values())
        claimed.update(id(p) for p in own)
        sizes.append((sum(p.numel() for p in own), group[0]))
    sizes.append((sum(p.numel() for p in model.parameters() if id(p) not in claimed), model))
    largest, unit = max(sizes, key=lambda size: size[0])  # the first of equals, innermost
    rule = f"wrap: {', '.join(opts.wrap)}" if opts.wrap else f"automatic, min_params {opts.min_params:,}"
    return ShardUnits(
        count=len(sizes),
        largest=largest,
        largest_name=names.get(id(unit), ""),
        largest_class=type(unit).__name__,
        largest_parameter=max((p.numel() for p in model.parameters()), default=0),
        rule=rule,
    )


def measure_activations(
    factory: Callable[..., nn.Module],
    kwargs: dict[str, Any],
    input_shape: tuple[int, ...] | None,
    input_dtype: torch.dtype,
    precision: str,
    checkpoint_classes: list[str] = (),
    *,
    inputs: InputsFn | None = None,
    inputs_name: str = "",
    tensor: TensorSplit | None = None,
) -> Activations:
    """Activation memory from two micro-batches (2 and 4 samples), on the meta device when the
    model runs there (nothing is allocated), else on the CPU. ``inputs`` (named ``inputs_name`` in
    errors) makes each micro-batch instead of ``input_shape`` and ``input_dtype``. ``tensor``: a
    tensor-parallel plan of the model, whose share of the activations is measured too (``split``)."""
    last: Exception | None = None
    styles = tensor.styles if tensor is not None else None
    for device in ("meta", "cpu"):
        try:
            sizes: dict[int, _Saved] = {}
            for batch in (2, 4):
                model = build(factory, kwargs, device)
                apply_activation_checkpointing(model, list(checkpoint_classes), setting="--checkpoint")
                if inputs is None:
                    refuse_several_inputs(model)
                    args, kw = (_example_input(input_shape, input_dtype, batch, device),), {}
                else:
                    args, kw = user_inputs(inputs, inputs_name, batch, device, last_try=device == "cpu")
                sizes[batch] = _saved(model, args, precision, device, kw, styles)
            per_sample, fixed = _line(sizes[2].total, sizes[4].total)
            n_params = count_parameters(model)
            copies = 2.0 * n_params if _AUTOCAST[precision] is not None else 0.0
            if device == "meta":
                # Autocast keeps a low-precision copy of the weights for the step; meta cannot run
                # autocast, so count one 2-byte copy per parameter (the CPU run measured its own).
                fixed += copies
            copies = min(copies, fixed)
            split = SplitActivations()
            if tensor is not None and n_params:
                split_per_sample, split_fixed = _line(sizes[2].split, sizes[4].split)
                split = SplitActivations(
                    split_per_sample,
                    split_fixed,
                    copies * tensor.parameters / n_params,
                    _line(sizes[2].forward, sizes[4].forward)[0],
                    _line(sizes[2].backward, sizes[4].backward)[0],
                )
            return Activations(per_sample, fixed, device, weight_copies=copies, split=split)
        except PhalanxError:
            raise
        except (NotImplementedError, RuntimeError, TypeError, ValueError, IndexError) as err:
            last = err
    why = f"{type(last).__name__}: {(str(last).splitlines() or [''])[0]}"
    if inputs is not None:
        raise PhalanxError(f"the micro-batch from --inputs {inputs_name} does not run through the model: {why}")
    raise PhalanxError(
        f"one micro-batch of shape {input_shape} does not run through the model: {why}; for a forward that "
        "takes more than one argument, or inputs that are not batch-first, give --inputs MODULE:FUNCTION"
    )


def refuse_several_inputs(model: nn.Module) -> None:
    """--input-shape feeds the forward one tensor. A forward with more named parameters (defaults
    counted) may run another path without the rest: nanoGPT's ``forward(idx, targets=None)``
    returns the last position's logits only, so a measurement would quietly miss most of the
    training activations. Such a forward needs --inputs, which passes what training passes."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward without a readable signature: nothing to judge
        return
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    named = [p for p in signature.parameters.values() if p.kind not in variadic]
    if len(named) <= 1:
        return
    shown = ", ".join(p.name + ("=..." if p.default is not p.empty else "") for p in named)
    raise PhalanxError(
        f"--input-shape gives the model one tensor, but {type(model).__name__}.forward takes {len(named)} inputs "
        f"({shown}), and one left out can change what it computes (without targets nanoGPT's GPT returns only the "
        "last position's logits); give --inputs MODULE:FUNCTION, a function of the micro-batch size returning "
        "the inputs training passes"
    )


class _InputsFailed(RuntimeError):
    """The user's inputs function failed on the meta device: try the CPU."""


def user_inputs(
    inputs: InputsFn, name: str, batch: int, device: str, *, last_try: bool = True
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Call the inputs function for a micro-batch of ``batch`` samples, its tensors created on (or
    moved to) ``device``, and split what it returned into positional and keyword arguments."""
    try:
        with torch.device(device):
            value = inputs(batch)
        value = map_tensors(value, lambda t: t.to(device))
    except Exception as err:  # noqa: BLE001 - the user's function: any failure is one line
        if not last_try:
            raise _InputsFailed(str(err)) from err
        raise PhalanxError(
            f"--inputs {name} failed for a micro-batch of {batch}: {type(err).__name__}: {err}"
        ) from None
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    raise PhalanxError(
        f"--inputs {name} returned a {type(value).__name__}; return one micro-batch's inputs: a tensor, "
        "a tuple of positional arguments or a dict of keyword arguments"
    )


def _example_input(shape: tuple[int, ...], dtype: torch.dtype, batch: int, device: str) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(batch, *shape, device=device)
    return torch.zeros(batch, *shape, dtype=dtype, device=device)


def _line(at_2: float, at_4: float) -> tuple[float, float]:
    """Bytes per sample and fixed bytes from the measurements at micro-batches 2 and 4."""
    per_sample = max(0.0, (at_4 - at_2) / 2)
    return per_sample, max(0.0, at_2 - 2 * per_sample)


@dataclass(frozen=True)
class _Saved:
    """One forward's saved bytes (``split``: those a tensor-parallel plan divides among the peers)
    and the bytes its split layers exchange (see tensor_split.SplitWatch)."""

    total: int
    split: int = 0
    forward: int = 0
    backward: int = 0


def _saved_bytes(
    model: nn.Module, x: torch.Tensor | tuple, precision: str, device: str, kwargs: dict | None = None
) -> int:
    """``x``: the one input tensor, or a tuple of positional arguments (with ``kwargs``)."""
    return _saved(model, x, precision, device, kwargs).total


def _saved(
    model: nn.Module,
    x: torch.Tensor | tuple,
    precision: str,
    device: str,
    kwargs: dict | None = None,
    styles: dict[str, str] | None = None,
) -> _Saved:
    args = x if isinstance(x, tuple) else (x,)
    params = list(model.parameters())
    param_ids = {id(p) for p in params}
    param_storages = {p.untyped_storage().data_ptr() for p in params} if device != "meta" else set()
    saved: dict[int, torch.Tensor] = {}  # holding the tensors keeps their ids unique
    divided: set[int] = set()  # keys of those a tensor-parallel plan divides

    def pack(t: torch.Tensor):
        # Parameters (and views of them) saved for backward are model state, not activations;
        # a tensor saved twice is stored once.
        base = view_base(t)
        base = t if base is None else base
        if id(t) in param_ids or id(base) in param_ids:
            return t
        if device != "meta" and t.untyped_storage().data_ptr() in param_storages:
            return t
        key = id(base) if device == "meta" else t.untyped_storage().data_ptr()
        saved[key] = base
        if watch is not None and watch.divided(t, base):
            divided.add(key)
        return t

    dtype = _AUTOCAST[precision]
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None and device == "cpu" else contextlib.nullcontext()
    # Autocast does not run on meta tensors: float tensors there take the compute dtype's size.
    scale = torch.finfo(dtype).bits / 32 if device == "meta" and dtype is not None else 1
    with watching(model, styles) as watch:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            model(*args, **(kwargs or {}))
    total = split = 0
    for key, t in saved.items():
        nbytes = t.untyped_storage().nbytes() if device != "meta" else t.numel() * t.element_size()
        if t.is_floating_point():
            nbytes = int(nbytes * scale)
        total += nbytes
        split += nbytes if key in divided else 0
    if watch is None:
        return _Saved(total)
    return _Saved(total, split, int(watch.forward * scale), int(watch.backward * scale))
