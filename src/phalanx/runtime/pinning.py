"""Whether a loader's batches go through page-locked (pinned) host memory.

Pinning is only for batches that come out of the loader on the CPU: torch's DataLoader calls
``pin_memory()`` on every tensor of a batch, which raises for a tensor already on a GPU (a dataset
that holds CUDA tensors, or a collate_fn that moves the batch, as ported single-GPU loops often
do). Where the batches are built in this process (no loader workers), a batch of the dataset's
first sample is built to look, and the random generators are put back afterwards, so the run
draws the same numbers as without the look. With workers the batches are
taken to be on the CPU: the dataset is not touched in this process, since many open their files
lazily in each worker, and torch advises against CUDA tensors in worker processes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from phalanx.checkpoint import rng
from phalanx.errors import ConfigError
from phalanx.util.tree import map_tensors


def choose_pin(setting: bool | None, device: torch.device, peek: Callable[[], Any] | None) -> bool:
    """The rebuilt DataLoader's ``pin_memory`` for ``data.pin_memory`` = ``setting`` on ``device``;
    ``peek`` builds one batch as the loader would (None where batches come from workers)."""
    if setting is False:
        return False
    if device.type != "cuda":
        return bool(setting)  # nothing to copy to: torch ignores pinning without an accelerator
    if peek is None:
        return True
    elsewhere = devices_of(peek()) - {"cpu"}
    if setting and elsewhere:
        raise ConfigError(
            "data.pin_memory is true, but the DataLoader's batches already hold tensors on "
            f"{', '.join(sorted(elsewhere))} (the dataset or its collate_fn puts them there) and only CPU tensors "
            "can be pinned; "
            "set data.pin_memory: null (pins only batches on the CPU) or false"
        )
    return not elsewhere


def devices_of(batch: Any) -> set[str]:
    """The devices the tensors inside a batch (nested dicts, lists, tuples) are on, e.g. {"cpu"}."""
    found: set[str] = set()
    map_tensors(batch, lambda t: found.add(str(t.device)))
    return found


def first_batch(dataset: Any, collate_fn: Callable[[list], Any], device: torch.device) -> Any:
    """A batch of the dataset's first sample, built as torch's fetcher builds one, without moving
    any random generator (a dataset's augmentations draw from them)."""
    state = rng.capture(device)
    try:
        fetch = getattr(dataset, "__getitems__", None)
        return collate_fn(fetch([0]) if fetch else [dataset[0]])
    finally:
        rng.restore(state, device)
