"""Workers for the token-weighted loss tests: a tiny next-token model over variable-length,
padded sequences (labels -100 at the padding), the loss a mean over each micro-batch's valid
tokens, trained through a Session with and without ``items``, and the one-process reference
that takes each global batch in one micro-batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from phalanx import Config, Session

VOCAB, WIDTH, LENGTH = 32, 16, 12
GLOBAL_BATCH, STEPS, LR = 8, 16, 0.5


class Sequences(Dataset):
    """Sequences of 1..LENGTH tokens, padded to LENGTH; lengths vary a lot, so means of means differ."""

    def __init__(self, n: int, seed: int = 0, uniform: bool = False, empty: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, LENGTH + 1), generator=g)
        self.lengths = torch.randint(1, LENGTH + 1, (n,), generator=g)
        if uniform:  # every sequence as long: a mean of means is then the mean over tokens
            self.lengths.fill_(LENGTH // 2)
        # The first ``empty`` sequences of every global batch are all padding: with an ordered loader,
        # rank 0's share (2 processes, empty = GLOBAL_BATCH // 2) has no token at all.
        for start in range(0, n, GLOBAL_BATCH):
            self.lengths[start : start + empty] = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.tokens[i, :-1].clone(), self.tokens[i, 1:].clone()
        labels[self.lengths[i] :] = -100
        ids[self.lengths[i] :] = 0
        return {"input_ids": ids, "labels": labels}


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The usual one-GPU loss: cross entropy averaged over the valid tokens, and their count."""
    logits = model(batch["input_ids"])
    labels = batch["labels"]
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    return loss, (labels != -100).sum()


def reference(steps: int = STEPS, *, clip: float | None = None, empty: int = 0) -> dict[str, torch.Tensor]:
    """One process, one micro-batch per global batch: the mean over the global batch's tokens."""
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(Sequences(GLOBAL_BATCH * steps, empty=empty), batch_size=GLOBAL_BATCH, shuffle=False)
    losses = []
    for batch in loader:
        loss, _ = token_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return {"state": model.state_dict(), "losses": losses}


def train(
    strategy: str,
    micro: int,
    weighted: bool,
    steps: int = STEPS,
    *,
    uniform: bool = False,
    noise: bool = False,
    ckpt: str | None = None,
    save_at: int | None = None,
    resume: str | None = None,
    sizes: bool = False,
    clip: float | None = None,
    comm_hook: str | None = None,
    manual: bool = False,
    empty: int = 0,
    tp: int | None = None,
) -> dict[str, Any]:
    """``weighted``: ``session.backward(loss, items=n)``; otherwise the plain contract. ``uniform``:
    sequences of one length; ``noise``: the gradient noise scale is estimated at every step;
    ``save_at``: a checkpoint into ``ckpt`` after that step (training goes on); ``resume``: the
    checkpoint to go on from; ``sizes``: the norm of each gradient as backward computes it (before
    any averaging or rescaling), in ``"sizes"``; ``clip``: optim.max_grad_norm; ``comm_hook``:
    strategy.ddp.comm_hook; ``manual``: no optimizer, the loop updates the weights itself;
    ``empty``: sequences of every global batch that are all padding (see Sequences); ``tp``:
    strategy.tp.size, with TinyLM's mix split colwise and its head rowwise."""
    measure = {"noise_scale": "hook", "noise_scale_every": 1, "noise_scale_smoothing": 0.9} if noise else {}
    settings: dict[str, Any] = {"name": strategy}
    if comm_hook is not None:
        settings["ddp"] = {"comm_hook": comm_hook}
    if tp is not None:
        settings["tp"] = {"size": tp, "plan": {"mix": "colwise", "head": "rowwise"}}
    session = Session(
        Config(),
        strategy=settings,
        optim={"max_grad_norm": clip},
        batch={"global_batch_size": GLOBAL_BATCH, "micro_batch_size": micro},
        train={"progress": False, "metrics": False, "seed": 0, **measure},
        checkpoint={"dir": ckpt or "checkpoints", "resume": "never"},
    )
    model = TinyLM()
    seen: list[float] = []
    if sizes:
        for p in model.parameters():
            p.register_hook(lambda g: seen.append(g.norm().item()))
    if manual:
        model = session.setup(model)
    else:
        model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    loader = session.setup_loader(
        DataLoader(
            Sequences(GLOBAL_BATCH * steps, uniform=uniform, empty=empty), batch_size=GLOBAL_BATCH, shuffle=False
        ),
        train=True,
    )
    if resume is not None:
        session.load(resume)
    losses, reduced, units, saved = [], [], [], None
    for batch in loader:
        with session.accumulate(model):
            loss, items = token_loss(model, batch)
            session.backward(loss, items=items if weighted else None)
            if session.sync_gradients:
                reduced.append(session.reduce(loss.detach(), items=items))  # NaN without tokens: weighs 0
                if manual:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(p.grad, alpha=-LR)
        if session.sync_gradients:
            losses.append(session._loss_value())
            units.append(session._items.unit)  # the scale of this step's backwards
            if session.step_count == save_at:
                saved = str(session.save())
    state = {k: v.detach().cpu() for k, v in session.model_state_dict().items()}
    out = {
        "state": state,
        "losses": losses,
        "reduced": [float(r) for r in reduced],
        "accumulation": session.accumulation_steps,
        "steps": session.step_count,
        "noise_scale": session.noise.value,
        "units": units,
        "sizes": seen,
        "saved": saved,
    }
    session.close()
    return out


def run(args: tuple, kwargs: dict) -> dict[str, Any]:
    """``train(*args, **kwargs)``, for phalanx.spawn (which passes positional arguments only)."""
    return train(*args, **kwargs)
