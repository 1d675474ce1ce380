"""A nanoGPT-shaped loop for the resume tests: no DataLoader (random positions of a token tensor,
each rank its own draws), its own step counter and cosine learning rate written into the
optimizer's param_groups, ``session.backward(loss)`` then ``session.step()`` (no accumulate block,
no session.epochs())."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phalanx import Config, Session

VOCAB, BLOCK, WIDTH, BATCH, MAX_ITERS, LR = 64, 16, 32, 4, 12, 3e-3
TOKENS = torch.randint(0, VOCAB, (4096,), generator=torch.Generator().manual_seed(0))


def lr_at(it: int) -> float:
    return LR * 0.5 * (1 + math.cos(math.pi * it / MAX_ITERS))


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    # torch's own generator, as nanoGPT draws: phalanx seeds it per rank and restores it per rank.
    ix = torch.randint(len(TOKENS) - BLOCK - 1, (BATCH,))
    x = torch.stack([TOKENS[i : i + BLOCK] for i in ix])
    y = torch.stack([TOKENS[i + 1 : i + 1 + BLOCK] for i in ix])
    return x, y


def train(ckpt: str, *, stop_at: int | None = None, keep: bool = True, resume: str = "auto", **batch) -> dict[str, Any]:
    """Train to MAX_ITERS; ``stop_at``: save and return after that many steps (as a SIGTERM would);
    ``keep``: the counter lives in session.keep(); otherwise it starts at 0."""
    session = Session(
        Config(),
        batch={"global_batch_size": BATCH * int(__import__("os").environ.get("WORLD_SIZE", "1")), **batch},
        train={"progress": False, "metrics": False, "seed": 0},
        checkpoint={"dir": ckpt, "resume": resume},
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Dropout(0.1), nn.Linear(WIDTH, VOCAB))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = session.setup(model, optimizer)
    at_setup = session.state.step  # not session.step_count: reading it counts as following the count
    own = session.keep(iter_num=0) if keep else None
    iter_num, steps = (own.iter_num if own is not None else 0), 0
    while iter_num < MAX_ITERS:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(iter_num)
        for _ in range(session.accumulation_steps):
            x, y = get_batch()
            with session.accumulate(model) if session.accumulation_steps > 1 else _nothing():
                session.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        if session.accumulation_steps == 1:
            session.step()
        iter_num, steps = iter_num + 1, steps + 1
        if own is not None:
            own.iter_num = iter_num
        if stop_at is not None and iter_num == stop_at:
            session.save()
            break
    out = {
        "at_setup": at_setup,
        "steps": steps,
        "step_count": session.state.step,
        "weights": {k: v.clone() for k, v in session.model_state_dict().items()},
    }
    session.close()
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run(args: tuple, kwargs: dict) -> dict[str, Any]:
    return train(*args, **kwargs)
