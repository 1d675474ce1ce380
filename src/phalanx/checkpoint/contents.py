"""What each file of a plain checkpoint must hold, checked after loading and before anything is
applied. The files match their manifest's SHA-256, so a mismatch here means a manifest rewritten
to fit other files (or a bug): one line naming the file, never a TypeError from deep in torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from phalanx.errors import PhalanxError


def _wrong(path: Path, what: str) -> PhalanxError:
    return PhalanxError(
        f"checkpoint file '{path}' does not hold what a phalanx checkpoint does ({what}); use an earlier checkpoint"
    )


def models(value: Any, count: int, path: Path) -> list[dict[str, torch.Tensor]]:
    """model.pt: one state dict (names to tensors) per model."""
    if not isinstance(value, list) or len(value) != count:
        raise _wrong(path, f"expected a list of {count} model state dict(s), found {_kind(value)}")
    for index, state in enumerate(value):
        if not isinstance(state, dict):
            raise _wrong(path, f"model {index} is {_kind(state)}, not a state dict")
        for key, tensor in state.items():
            if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
                raise _wrong(path, f"model {index} maps {key!r} to {_kind(tensor)}, not a tensor")
    return value


def optimizers(value: Any, count: int, path: Path) -> list[dict[str, Any]]:
    """optimizer.pt: one optimizer state dict per optimizer."""
    if not isinstance(value, list) or len(value) != count:
        raise _wrong(path, f"expected a list of {count} optimizer state dict(s), found {_kind(value)}")
    for index, state in enumerate(value):
        if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list):
            raise _wrong(path, f"optimizer {index} is {_kind(state)} without a list of param_groups")
    return value


_TRAINER_KEYS = {"step": int, "epoch": int, "data": list, "schedulers": list, "precision": dict}


def trainer(value: Any, path: Path) -> dict[str, Any]:
    """trainer.pt: the counters, data positions, schedulers and precision state."""
    if not isinstance(value, dict):
        raise _wrong(path, f"found {_kind(value)}, not a dict")
    for key, kind in _TRAINER_KEYS.items():
        if key not in value:
            raise _wrong(path, f"no '{key}'")
        if not isinstance(value[key], kind) or isinstance(value[key], bool):
            raise _wrong(path, f"'{key}' is {_kind(value[key])}, not a {kind.__name__}")
    return value


def rng(value: Any, path: Path) -> dict[str, Any]:
    """rng.pt: the world size that saved it and one generator state per rank."""
    if not isinstance(value, dict) or not isinstance(value.get("world_size"), int):
        raise _wrong(path, f"found {_kind(value)} without a world_size")
    ranks = value.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != value["world_size"]:
        raise _wrong(path, f"expected {value['world_size']} rank states, found {_kind(ranks)}")
    return value


def _kind(value: Any) -> str:
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"
