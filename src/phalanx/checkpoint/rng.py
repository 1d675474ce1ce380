"""Every random number generator a training step draws from, as tensors and plain values (so the
state loads with ``weights_only=True``).

CUDA generators are kept for every device the strategy computes on (``Strategy.devices``: one,
or every GPU where one process drives several, as dp and model_parallel do). The first device's
state stays under ``"cuda"``, where checkpoints from before kept their only one; the others follow,
in order, under ``"cuda_more"``.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import numpy as np
import torch


def capture(devices: torch.device | Sequence[torch.device]) -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    cuda = _cuda(devices)
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state(cuda[0])
    if len(cuda) > 1:
        state["cuda_more"] = [torch.cuda.get_rng_state(d) for d in cuda[1:]]
    return state


def restore(state: dict[str, Any], devices: torch.device | Sequence[torch.device]) -> None:
    """Set every generator ``capture`` kept. A device the state has none for (a checkpoint of fewer
    devices) keeps its own; a state kept for more devices than there are now sets those that are."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": nps["key"].numpy().astype(np.uint32), "pos": nps["pos"]},
            "has_gauss": nps["has_gauss"],
            "gauss": nps["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    cuda = _cuda(devices)
    kept = ([state["cuda"]] if "cuda" in state else []) + list(state.get("cuda_more", []))
    for device, generator in zip(cuda, kept):
        torch.cuda.set_rng_state(generator, device)


def _cuda(devices: torch.device | Sequence[torch.device]) -> list[torch.device]:
    return [d for d in ([devices] if isinstance(devices, torch.device) else devices) if d.type == "cuda"]
