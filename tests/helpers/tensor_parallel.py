"""Tensor parallelism's harness: a small GPT (phalanx's demo model, dropout 0) trained by a plain
one-process loop, and the same loop through a Session under tp or fsdp x tp."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session
from phalanx.demo.gpt import TinyGPT

VOCAB, DIM, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
GLOBAL_BATCH, STEPS = 8, 4


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, seq=SEQ)


def tokens(steps: int = STEPS) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH * steps, SEQ + 1), generator=g)


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def optimizer(params) -> torch.optim.Optimizer:
    # SGD: Adam would turn the rounding noise of a gradient that is zero in exact arithmetic (the
    # key bias of attention) into steps of the learning rate, and no two layouts round alike.
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def reference(steps: int = STEPS, max_grad_norm: float | None = None) -> dict:
    model = build()
    opt = optimizer(model.parameters())
    losses = []
    for batch in tokens(steps).split(GLOBAL_BATCH):
        loss = lm_loss(model, batch)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


def train(strategy: str, tp: int, micro: int | None = None, steps: int = STEPS, **sections) -> dict:
    """Train through a Session; ``micro``: the micro-batch (accumulation where it is below the
    data-parallel share)."""
    sections.setdefault("checkpoint", {"dir": "checkpoints", "resume": "never"})
    session = Session(
        Config(),
        strategy={"name": strategy, "tp": {"size": tp}},
        batch={"global_batch_size": GLOBAL_BATCH, "micro_batch_size": micro},
        train={"progress": False, "seed": 0, "metrics": False},
        **sections,
    )
    model = build()
    model, opt = session.setup(model, optimizer(model.parameters()))
    loader = session.setup_loader(DataLoader(TensorDataset(tokens(steps)), batch_size=GLOBAL_BATCH), train=True)
    losses = []
    for _ in session.epochs():
        for (batch,) in loader:
            with session.accumulate(model):
                loss = lm_loss(model, batch)
                session.backward(loss)
            if session.sync_gradients and session.accumulation_steps == 1:
                losses.append(session.reduce(loss.item()))
    state = {k: v.detach().cpu() for k, v in session.model_state_dict().items()}
    out = {
        "state": state,
        "losses": losses,
        "steps": session.step_count,
        "accumulation": session.accumulation_steps,
        "dp": session.strategy.data_parallel_size,
        "describe": session.strategy.describe(),
    }
    session.close()
    return out


def run(args: tuple, kwargs: dict) -> dict:
    return train(*args, **kwargs)
