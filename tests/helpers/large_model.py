"""Workers for the large-model tests (run inside phalanx.spawn): a 256 MiB model of 64 linear
layers, built whole or under ``session.init_module()``, given pretrained weights from a file,
trained a few steps under fsdp or pipeline and checkpointed, with the resident memory of each
phase measured in the process (VmHWM after a reset of it, /proc/self/clear_refs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session
from phalanx.runtime.memory_cap import track_live_memory

WIDTH, LAYERS = 1024, 64  # 64 x 4 MiB of fp32 weights (and 4 KiB of biases each): 256 MiB
GLOBAL_BATCH = 8
MiB = 1 << 20
_STATUS = Path("/proc/self/status")


def build() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def pretrained(path: str) -> None:
    """The 'pretrained' weights: a safetensors file written by the Hugging Face package."""
    from safetensors.torch import save_file

    torch.manual_seed(1)
    save_file({k: v.contiguous() for k, v in build().state_dict().items()}, path)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4 * GLOBAL_BATCH, WIDTH, generator=g)
    return DataLoader(TensorDataset(x, x.roll(1, dims=1)), batch_size=GLOBAL_BATCH, shuffle=True)


def _status(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _status("VmRSS")


def _session(strategy: str, ckpt: str | None, cap: str | None) -> Session:
    settings: dict[str, Any] = {"name": strategy}
    if strategy == "fsdp":
        settings["fsdp"] = {"wrap": ["Linear"]}  # 64 units of 4 MiB
    return Session(
        Config(),
        strategy=settings,
        train={"progress": False, "metrics": False, "seed": 0, "memory_cap": cap},
        checkpoint={"dir": ckpt, "resume": "never"} if ckpt else {},
    )


def train(
    strategy: str,
    weights: str,
    *,
    deferred: bool = True,
    steps: int = 4,
    cap: str | None = None,
    ckpt: str | None = None,
    save_at: int | None = None,
    resume: str | None = None,
) -> dict[str, Any]:
    """Build, load ``weights``, train ``steps`` optimizer steps; returns the peaks of set-up (from
    before the model is built to after its weights are in) and of training (from there), the full
    final weights (rank 0), and the out-of-memory message when the cap refused the run."""
    import torch.distributed.fsdp  # noqa: F401  imported before measuring: a library is not the model's memory
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    track_live_memory()  # as train.memory_cap does: resident memory follows live tensors
    session = _session(strategy, ckpt, cap)
    out: dict[str, Any] = {"rank": session.rank}
    base = _reset_peak() if cap is None else 0
    try:
        if deferred:
            with session.init_module():
                model = build()
        else:
            torch.manual_seed(5)
            model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer, loader = session.setup(model, optimizer, _data())
        session.load_weights(weights)
    except torch.OutOfMemoryError as err:
        out["refused"] = str(err)
        session.close()
        return out
    if cap is None:
        out["setup_peak"] = _status("VmHWM") - base
        base = _reset_peak()
    if resume:
        session.load(resume)
    while session.step_count < steps:
        for x, y in loader:
            with session.accumulate(model):
                session.backward(F.mse_loss(model(x), y))
            if save_at is not None and session.step_count == save_at:
                out["saved"] = str(session.save())
            if session.step_count >= steps:
                break
    if cap is None:
        out["train_peak"] = _status("VmHWM") - base
    state = session.model_state_dict(model)
    out["weights"] = {k: v.clone() for k, v in state.items()} if session.rank == 0 else None
    if ckpt and save_at is None:
        out["saved"] = str(session.save())
    session.close()
    return out


def train_with(strategy: str, weights: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """:func:`train` with its keyword arguments in one dict (phalanx.spawn passes positional ones)."""
    return train(strategy, weights, **kwargs)
