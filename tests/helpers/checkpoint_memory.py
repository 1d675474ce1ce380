"""Workers for the checkpoint-memory test (run inside phalanx.spawn, so they live in a module): one
that saves a checkpoint large enough to measure, and one that loads it and reports how much memory
this process needed while it did, next to the load as it was before (every file read whole)."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from phalanx import Config, Session
from phalanx.checkpoint.safe import load_file
from phalanx.runtime.memory_cap import MemoryCap

WIDTH = 4096  # two 4096x4096 fp32 layers: 128 MiB of weights, 256 MiB of Adam state
_STATUS = Path("/proc/self/status")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False))


def _session(strategy: str, ckpt: Path) -> tuple[Session, nn.Module, torch.optim.Optimizer]:
    session = Session(
        Config(),
        strategy=strategy,
        batch={"global_batch_size": 4},
        train={"progress": False, "seed": 0},
        checkpoint={"dir": str(ckpt), "resume": "never"},
    )
    model = _model()
    model, optimizer = session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    return session, model, optimizer


def save_large(ckpt: str) -> str:
    """One Adam step (so the optimizer has its state) under ddp, then a checkpoint."""
    session, model, optimizer = _session("ddp", Path(ckpt))
    with session.accumulate(model):
        session.backward(F.mse_loss(model(torch.randn(2, WIDTH)), torch.zeros(2, WIDTH)))
    path = session.save()
    session.close()
    return str(path)


def _anon() -> int:
    """Resident memory that no file backs (this process's private heap, tensors included)."""
    for line in _STATUS.read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _measure(work: Callable[[], Any]) -> dict[str, int]:
    """Growth of this process's memory while ``work`` runs: ``peak_rss`` (VmHWM, through the memory
    cap's peak tracking: exact, but file-backed pages count too), ``peak_anon`` (RssAnon, sampled
    every millisecond) and ``anon_after``."""
    gc.collect()
    start = _anon()
    peak = MemoryCap(1 << 62, torch.device("cpu"))  # resets VmHWM to the current resident size
    highest = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            highest[0] = max(highest[0], _anon())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    gc.collect()
    after = _anon()
    return {
        "peak_rss": peak.used_bytes() or 0,
        "peak_anon": max(highest[0], after) - start,
        "anon_after": after - start,
    }


def _read_whole(session: Session, model: nn.Module, optimizer, path: Path) -> None:
    """The plain-layout load before checkpoints were memory-mapped, step for step: both files read
    whole into this process, the model's dict still referenced while the optimizer's is read."""
    strategy = session.strategy
    for state in load_file(path / "model.pt"):
        strategy.load_model_state_dict(model, state)
    for state in load_file(path / "optimizer.pt"):
        strategy.load_optimizer_state_dict(model, optimizer, state)


def _storages_bytes(state: dict) -> int:
    seen: dict[int, int] = {}
    for per_param in state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(seen.values())


def _still_mapped(path: Path) -> list[str]:
    names = {str((path / name).resolve()) for name in ("model.pt", "optimizer.pt")}
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if line.split()[-1] in names]


def load_measured(strategy: str, path: str) -> dict[str, Any]:
    """Load ``path`` through session.load(), then as before; the figures of both, and what the rank holds."""
    path = Path(path)
    session, model, optimizer = _session(strategy, path.parent / "unused")
    mapped = _measure(lambda: session.load(path))
    held = _storages_bytes(session.strategy.optimizer_state(optimizer))
    left = _still_mapped(path)
    first = next(iter(session.strategy.optimizer_state(optimizer).values()))["exp_avg"].clone()
    whole = _measure(lambda: _read_whole(session, model, optimizer, path))
    same = torch.equal(first, next(iter(session.strategy.optimizer_state(optimizer).values()))["exp_avg"])
    session.close()
    return {"mapped": mapped, "whole": whole, "held": held, "left_mapped": left, "same_state": same}
