"""Every random number generator a training step draws from, as tensors and plain values (so the
state loads with ``weights_only=True``)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture(device: torch.device) -> dict[str, Any]:
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
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore(state: dict[str, Any], device: torch.device) -> None:
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
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
