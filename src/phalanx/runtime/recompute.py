"""Activation checkpointing: chosen blocks keep only their inputs and recompute their activations
during backward, trading compute for memory. Applied from outside, to any strategy's model."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from phalanx.util.modules import submodules_of


def apply_activation_checkpointing(
    model: nn.Module, class_names: list[str], setting: str = "strategy.activation_checkpointing"
) -> int:
    """Recompute the forward of every submodule whose class name is listed; returns how many.
    ``setting`` names where the list came from, for the error message."""
    if not class_names:
        return 0
    found = submodules_of(model, class_names, setting)
    for module in found:
        module.forward = _checkpointed(module.forward)
    return len(found)


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        # Non-reentrant checkpointing works with keyword arguments, DDP and FSDP.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
