"""What tensor parallelism splits in a real model, for the plan's tp rows: the plan strategy tp
would apply (strategies/tp_plan.py, resolved the same way), the parameters it divides, the
degrees the devices allow, and, measured in the planner's forward, the activations it divides
and the activations its split layers all-reduce."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from phalanx.errors import ConfigError
from phalanx.strategies import tp_plan


@dataclass(frozen=True)
class TensorSplit:
    """``styles``: module name -> style of what the plan splits; ``parameters``: how many of the
    model's it divides among the peers; ``degrees``: the tp sizes offered on these devices;
    ``left_out``: why other degrees (or any) are not, one line each."""

    styles: dict[str, str]
    parameters: int
    degrees: tuple[int, ...]
    source: str = ""
    kept_whole: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()


def candidate_degrees(devices: int) -> tuple[int, ...]:
    """2 and every device (the whole node, as strategy tp takes by default), where they divide."""
    return tuple(d for d in sorted({2, devices}) if 1 < d <= devices and devices % d == 0)


def find_split(model: nn.Module, devices: int) -> TensorSplit:
    """The automatic (or the model's own) tensor-parallel plan of ``model`` and the degrees it
    splits evenly on ``devices``. ``plan`` does not read phalanx.yaml, so strategy.tp.plan plays no part."""
    try:
        plan = tp_plan.resolve(model, 1, {})
    except ConfigError:
        why = f"tp is left out: {type(model).__name__} has nothing the automatic plan splits (no MLP pair of nn.Linear)"
        return TensorSplit({}, 0, (), left_out=(why,))
    degrees, out = [], []
    for degree in candidate_degrees(devices):
        try:
            tp_plan.resolve(model, degree, {})
            degrees.append(degree)
        except ConfigError as err:
            why = str(err).split("; ")[0].removeprefix(f"{plan.source}: ")  # the fix names a config setting
            out.append(f"tp{degree} is left out: {why.replace('tensor-parallel peers', 'peers')}")
    if not candidate_degrees(devices):
        out.append(f"tp is left out: {devices} device, no tensor-parallel peers")
    styles = {name: style for name, style in plan.split().items() if isinstance(style, str)}
    return TensorSplit(
        styles, tp_plan.split_parameters(model, plan), tuple(degrees), plan.source, plan.kept_whole, tuple(out)
    )


@dataclass(frozen=True)
class SplitActivations:
    """The tensor-parallel part of one micro-batch's activations, in bytes: ``fixed + per_sample x
    micro_batch`` of the saved activations lie between a colwise layer and its rowwise one (each
    peer holds 1/tp of them), ``weight_copies`` of autocast's copies are of split weights; per
    sample, the rowwise layers' outputs (``forward``) and the colwise layers' inputs, whose
    gradients backward all-reduces (``backward``)."""

    per_sample: float = 0.0
    fixed: float = 0.0
    weight_copies: float = 0.0
    forward: float = 0.0
    backward: float = 0.0


class SplitWatch:
    """Module hooks over one forward that say which saved tensors the plan divides among the peers,
    and count the bytes its split layers exchange.

    Divided: what is saved after a colwise layer returns and before its rowwise layer does (the
    hidden activations of an MLP pair: its activation function's input, the rowwise layer's
    input), except inside a colwise layer, whose saved input is whole on every peer."""

    def __init__(self, model: nn.Module, styles: dict[str, str]):
        self._open = False
        self._inside = 0
        self._rowwise_input: Any = None
        self.forward = 0  # bytes of the rowwise outputs, all-reduced in forward
        self.backward = 0  # bytes of the colwise inputs, whose gradients are all-reduced in backward
        self._handles = []
        modules = dict(model.named_modules())
        for name, style in styles.items():
            if style in ("colwise", "rowwise") and name in modules:
                module = modules[name]
                self._handles.append(module.register_forward_pre_hook(self._enter(style)))
                self._handles.append(module.register_forward_hook(self._leave(style)))

    def _enter(self, style: str):
        def hook(module, args):
            self._inside += 1
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if style == "colwise" and first is not None:
                self.backward += _nbytes(first)
            if style == "rowwise":
                self._rowwise_input = first

        return hook

    def _leave(self, style: str):
        def hook(module, args, output):
            self._inside -= 1
            if style == "colwise":
                self._open = True
            else:
                self._open, self._rowwise_input = False, None
                if isinstance(output, torch.Tensor):
                    self.forward += _nbytes(output)

        return hook

    def divided(self, tensor: torch.Tensor, base: torch.Tensor) -> bool:
        """Whether ``tensor`` (a view of ``base``, or ``base`` itself), being saved now, is one the
        peers divide. A Linear layer saves a 2-D view of a 3-D input: its base is the input."""
        return (self._open and not self._inside) or any(self._rowwise_input is t for t in (tensor, base))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@contextlib.contextmanager
def watching(model: nn.Module, styles: dict[str, str] | None):
    """A SplitWatch over ``model`` for the duration (None without a plan)."""
    if not styles:
        yield None
        return
    watch = SplitWatch(model, styles)
    try:
        yield watch
    finally:
        watch.close()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
