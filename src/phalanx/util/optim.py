"""Rebuilding an optimizer of the user's class on other parameters (sharding, fused kernels)."""

from __future__ import annotations

import inspect

import torch


def rebuild_arguments(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's defaults that its class's constructor accepts (AdamW, for one, keeps
    ``decoupled_weight_decay`` in its defaults but takes no such argument)."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}
