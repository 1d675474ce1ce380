"""Loops without an optimizer: a hand-written SGD update and learning-rate annealing, through a
Session and as the plain one-process loop it should match (runs inside phalanx.spawn too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from phalanx import Config, PhalanxError, Session
from tests.helpers.models import make_data, make_model


def lr_at(step: int) -> float:
    return 0.1 * 0.5 ** (step // 2)  # annealed by the script itself, as the word-language-model example does


def reference_manual(global_bs: int, steps: int) -> dict[str, torch.Tensor]:
    """The plain loop: zero the gradients, backward, update every parameter by hand."""
    net = make_model()
    for step, (x, y) in enumerate(DataLoader(make_data(global_bs * steps), batch_size=global_bs)):
        net.zero_grad()
        F.mse_loss(net(x), y).backward()
        with torch.no_grad():
            for p in net.parameters():
                p.add_(p.grad, alpha=-lr_at(step))
    return net.state_dict()


def manual_sgd(strategy, global_bs: int, micro_bs: int | None, steps: int, zero_grad_each_batch: bool = False) -> dict:
    """The documented loop (docs/session.md, "Loops without an optimizer"): the update inside the
    accumulate block, when ``session.sync_gradients`` says the global batch is complete.
    ``zero_grad_each_batch``: also keep the one-GPU script's ``model.zero_grad()`` at the top."""
    session = Session(
        Config(),
        strategy=strategy,
        batch={"global_batch_size": global_bs, "micro_batch_size": micro_bs},
        train={"progress": False, "seed": 0, "epochs": 1},
        checkpoint={"resume": "never"},
    )
    model = session.setup(make_model())
    loader = session.setup_loader(DataLoader(make_data(global_bs * steps), batch_size=global_bs), train=True)
    updates, error = 0, None
    try:
        for _ in session.epochs():
            for x, y in loader:
                if zero_grad_each_batch:
                    model.zero_grad()
                with session.accumulate(model):
                    session.backward(F.mse_loss(model(x), y))
                    if session.sync_gradients:
                        lr = lr_at(session.step_count)
                        with torch.no_grad():
                            for p in model.parameters():
                                p.add_(p.grad, alpha=-lr)
                        updates += 1
    except PhalanxError as err:
        error = str(err)
    result = {
        "state": {k: v.detach().cpu() for k, v in session.model_state_dict().items()},
        "steps": session.step_count,
        "updates": updates,
        "accumulation": session.accumulation_steps,
        "grads_left": [p.grad is not None for p in model.parameters()],
        "error": error,
    }
    session.close(sync=error is None)
    return result
