"""``train.weights_trace``: every model's full weights after each optimizer step, written by rank 0
into one file per step, for ``phalanx verify`` to compare a run at N processes with one at 1.

The weights are gathered whole (a collective under sharded strategies, so every rank calls it at
the same step) and copied to the CPU. That is a full gather per step: for short verification runs
of models that fit one process, never for training.

A file holds ``{"step": int, "weights": {name: tensor}, "facts": {...}}``. The facts are what a
reader of the weights alone cannot know and a likely cause of a difference may be: the modules
that draw random numbers in training mode (a dropout at N processes draws other masks than at one),
and whether phalanx split the batches (a training DataLoader, or ``session.shard``): a script that
draws its own batches per rank trains N processes on other samples than one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch
from torch import nn

_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def trace_file(directory: Path, step: int) -> Path:
    return directory / f"step-{step:06d}.pt"


def random_modules(model: nn.Module) -> list[str]:
    """Names of the modules that draw random numbers when training: dropouts with p > 0."""
    return [name or type(m).__name__ for name, m in model.named_modules() if isinstance(m, _RANDOM_MODULES) and m.p > 0]


class WeightsTrace:
    def __init__(
        self,
        directory: str,
        is_main: bool,
        models: list[nn.Module],
        full_state: Callable[[nn.Module], dict[str, torch.Tensor]],
        bare: Callable[[nn.Module], nn.Module],
        splits_batches: Callable[[], bool],
    ):
        """``full_state``: a model's whole weights (the strategy's gather, on every rank); ``bare``:
        the user's model under the strategy's wrappers (for the facts)."""
        self.directory = Path(directory)
        self._is_main = is_main
        self._models = models
        self._full_state = full_state
        self._bare = bare
        self._splits_batches = splits_batches
        if is_main:
            self.directory.mkdir(parents=True, exist_ok=True)

    def start(self, step: int) -> None:
        """The weights training starts from, once setup() has them (a resume's included): before any
        forward, whose BatchNorm statistics would already count. A later setup(), load_weights() or
        load() writes them again."""
        if self._models:
            self.write(step)

    def write(self, step: int) -> None:
        weights: dict[str, torch.Tensor] = {}
        several = len(self._models) > 1
        for index, model in enumerate(self._models):
            state = self._full_state(model)  # every rank: a gather under sharding
            prefix = f"{index}." if several else ""
            weights.update({prefix + k: v.detach().to("cpu", copy=True) for k, v in state.items()})
        if not self._is_main:
            return
        facts = {
            "random_modules": [n for m in self._models for n in random_modules(self._bare(m))],
            "split_batches": self._splits_batches(),
        }
        path = trace_file(self.directory, step)
        partial = path.with_suffix(".partial")
        torch.save({"step": step, "weights": weights, "facts": facts}, partial)
        os.replace(partial, path)  # a reader never sees half a file
