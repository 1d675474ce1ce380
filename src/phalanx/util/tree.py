"""Apply a function to every tensor inside nested dicts, lists, tuples and named tuples."""

from __future__ import annotations

from typing import Any, Callable

import torch


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, map_tensors(v, fn)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


class NotConcatenable(Exception):
    """A batch holds something other than tensors with a batch dimension."""


def concat_batches(batches: list[Any]) -> Any:
    """One batch of the samples of ``batches`` (the same layout each, see layout), in order: their
    tensors joined on the first dimension."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, dict):
        return type(first)((k, concat_batches([b[k] for b in batches])) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(concat_batches(list(parts)) for parts in zip(*batches)))
    return type(first)(concat_batches(list(parts)) for parts in zip(*batches))


def layout(batch: Any) -> Any:
    """What must agree for batches to be joined: the structure, and each tensor's shape past the
    batch dimension, dtype and device. Raises NotConcatenable, naming the first leaf that is not a
    tensor with a batch dimension (a string, a number, a 0-d tensor): its meaning for a larger
    batch is the script's, not phalanx's."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise NotConcatenable("a 0-d tensor")
        return (tuple(batch.shape[1:]), batch.dtype, batch.device)
    if isinstance(batch, dict):
        return {k: layout(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch), [layout(v) for v in batch]
    raise NotConcatenable(f"a {type(batch).__name__}")


def same_layout(first: Any, batches: list[Any]) -> bool:
    """Whether every one of ``batches`` has the layout ``first`` (a layout() result)."""
    try:
        return all(layout(b) == first for b in batches)
    except NotConcatenable:
        return False
