"""Tensor parallelism's harness: a small GPT (phalanx's demo model, dropout 0) trained by a plain
one-process loop, and the same loop through a Session under tp or fsdp x tp (or ddp, for what the
data-parallel collectives give), followed by an evaluation pass whose dataset no process count
divides; and a tiny Hugging Face Llama trained the same two ways through its own tp_plan."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session
from phalanx.demo.gpt import TinyGPT

VOCAB, DIM, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16
GLOBAL_BATCH, STEPS = 8, 4
EVAL, EVAL_BATCH = 11, 2  # no data-parallel size of 2 or 4 divides 11: the samplers pad, the gather cuts
HF_STEPS = 3


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, seq=SEQ)


def tokens(steps: int = STEPS) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH * steps, SEQ + 1), generator=g)


def eval_tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (EVAL, SEQ + 1), generator=g)


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def sample_losses(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean token loss."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").mean(1)


def eval_reference(state: dict) -> torch.Tensor:
    """The evaluation set's per-sample losses under ``state``, in one process."""
    model = build()
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return sample_losses(model, eval_tokens())


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


def train(
    strategy: str,
    tp: int,
    micro: int | None = None,
    steps: int = STEPS,
    plan: dict | None = None,
    given: dict | None = None,
    **sections,
) -> dict:
    """Train through a Session; ``micro``: the micro-batch (accumulation where it is below the
    data-parallel share); ``plan``: strategy.tp.plan; ``given``: a plan for session.set_tp_plan."""
    sections.setdefault("checkpoint", {"dir": "checkpoints", "resume": "never"})
    session = Session(
        Config(),
        strategy={"name": strategy, "tp": {"size": tp, "plan": plan or {}}},
        batch={"global_batch_size": GLOBAL_BATCH, "micro_batch_size": micro},
        train={"progress": False, "seed": 0, "metrics": False},
        **sections,
    )
    if given:
        session.set_tp_plan(given)
    model = build()
    model, opt = session.setup(model, optimizer(model.parameters()))
    loader = session.setup_loader(DataLoader(TensorDataset(tokens(steps)), batch_size=GLOBAL_BATCH), train=True)
    losses, rows = [], []
    for _ in session.epochs():
        for (batch,) in loader:
            with session.accumulate(model):
                loss = lm_loss(model, batch)
                session.backward(loss)
            rows.append(session.reduce(len(batch), "sum"))  # the global batch's rows of this micro-step
            if session.sync_gradients and session.accumulation_steps == 1:
                losses.append(session.reduce(loss.item()))
    state = {k: v.detach().cpu() for k, v in session.model_state_dict().items()}
    plan = getattr(session.strategy, "tp_plan", None)
    out = {
        "state": state,
        "losses": losses,
        "rows": rows,
        "steps": session.step_count,
        "accumulation": session.accumulation_steps,
        "dp": session.strategy.data_parallel_size,
        "batch": dataclasses.asdict(session.batch),
        "describe": session.strategy.describe(),
        "plan": plan.source if plan is not None else None,
        **evaluate(session, model),
    }
    session.close()
    return out


def evaluate(session: Session, model: torch.nn.Module) -> dict:
    """Per-sample losses of the evaluation set through an evaluation loader (each data-parallel
    share padded to the same length), gathered in dataset order; their max and min reduced from
    each rank's own; each data-parallel rank's index, gathered as numbers."""
    data = TensorDataset(torch.arange(EVAL), eval_tokens())
    loader = session.setup_loader(DataLoader(data, batch_size=EVAL_BATCH), train=False)
    model.eval()
    ids, losses, local = [], [], []
    with torch.no_grad():
        for index, batch in loader:
            per_sample = sample_losses(model, batch)
            ids.append(session.gather_for_metrics(index))
            losses.append(session.gather_for_metrics(per_sample))
            local.append(per_sample)
    mine = torch.cat(local)
    return {
        "ids": torch.cat(ids).tolist(),
        "eval_losses": torch.cat(losses),
        "eval_max": session.reduce(mine.max().item(), "max"),
        "eval_min": session.reduce(mine.min().item(), "min"),
        "dp_ranks": session.gather_for_metrics(float(session.strategy.data_parallel_rank)).tolist(),
    }


def run(args: tuple, kwargs: dict) -> dict:
    return train(*args, **kwargs)


# -- a Hugging Face model through its own tp_plan ------------------------------------------------


def hf_tokens(steps: int = HF_STEPS) -> torch.Tensor:
    from tests.helpers import hf_models

    g = torch.Generator().manual_seed(2)
    return torch.randint(0, hf_models.VOCAB, (GLOBAL_BATCH * steps, hf_models.SEQUENCE), generator=g)


def hf_reference(steps: int = HF_STEPS) -> dict:
    """hf_models' tiny Llama (fp32, no dropout), a plain one-process SGD loop."""
    from tests.helpers import hf_models

    model = hf_models.build("llama")
    opt = optimizer(model.parameters())
    for ids in hf_tokens(steps).split(GLOBAL_BATCH):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_train(tp: int, steps: int = HF_STEPS) -> dict:
    """The same loop through a Session under strategy tp, the plan left to the model."""
    from tests.helpers import hf_models

    model = hf_models.build("llama")
    session = Session(
        Config(),
        strategy={"name": "tp", "tp": {"size": tp}},
        batch={"global_batch_size": GLOBAL_BATCH},
        train={"progress": False, "seed": 0, "metrics": False},
        checkpoint={"dir": "checkpoints", "resume": "never"},
    )
    model, opt = session.setup(model, optimizer(model.parameters()))
    loader = session.setup_loader(DataLoader(TensorDataset(hf_tokens(steps)), batch_size=GLOBAL_BATCH), train=True)
    for _ in session.epochs():
        for (ids,) in loader:
            with session.accumulate(model):
                session.backward(model(input_ids=ids, labels=ids).loss)
    out = {
        "state": {k: v.detach().cpu() for k, v in session.model_state_dict().items()},
        "steps": session.step_count,
        "plan": session.strategy.tp_plan.source,
        "split": sorted(session.strategy.tp_plan.split()),
        "describe": session.strategy.describe(),
    }
    session.close()
    return out
