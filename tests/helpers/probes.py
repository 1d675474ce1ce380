"""Single-purpose Session runs that report one measured thing (predictions, the lr each step used,
bytes held per rank, the clipped norm, compute dtypes, ...), in the test process or inside
phalanx.spawn processes (so they live in an importable module)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session
from tests.helpers.models import make_data, make_model


def evaluate(n: int, batch_size: int) -> dict:
    """Predictions and accuracy over an evaluation loader whose length the world size may not divide."""
    session = Session(Config(), train={"progress": False})
    model = make_model()
    data = make_data(n)
    labels = (data.tensors[1][:, 0] > 0).long()
    loader = DataLoader(TensorDataset(data.tensors[0], labels), batch_size=batch_size, shuffle=False)
    model, loader = session.setup(model, loader)
    model.eval()
    preds, hits = [], []
    with torch.no_grad():
        for x, y in loader:
            out = model(x)[:, 0]
            preds.append(session.gather_for_metrics(out))
            hits.append(session.gather_for_metrics(((out > 0).long() == y).float()))
    preds, hits = torch.cat(preds), torch.cat(hits)
    total = session.reduce(float(len(hits)), "sum")
    session.close()
    return {"preds": preds, "accuracy": hits.mean().item(), "count": len(hits), "reduced_sum": total}


def seen_lrs(global_bs: int, steps: int, **optim) -> dict:
    """The lr the optimizer actually used at each step, and the scheduler's own lr after it."""
    session = Session(Config(), batch={"global_batch_size": global_bs}, optim=optim, train={"progress": False})
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    used = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    loader = DataLoader(make_data(global_bs * steps), batch_size=16, shuffle=True)  # reference batch 16
    model, optimizer, loader = session.setup(model, optimizer, loader)
    for x, y in loader:
        with session.accumulate(model):
            session.backward(F.mse_loss(model(x), y))
    after = optimizer.param_groups[0]["lr"]
    session.close()
    return {"used": used, "after": after}


def held_bytes(strategy: str, **sections) -> dict:
    """Per-rank bytes of parameters, gradients and Adam state after one step and one more backward."""
    session = Session(
        Config(), strategy=strategy, batch={"global_batch_size": 16}, train={"progress": False}, **sections
    )
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = session.setup(model, optimizer)
    x = torch.randn(16 // session.world_size, 64)
    with session.accumulate(model):
        session.backward(model(x).pow(2).mean())
    session.backward(model(x).pow(2).mean())  # gradients present, not yet stepped
    held = session.strategy.held_bytes(model, optimizer)
    session.close()
    return held


def clipped_norm(strategy: str) -> float:
    """The global gradient norm that clip_grad_norm_ reports for the same global batch."""
    session = Session(Config(), strategy=strategy, batch={"global_batch_size": 16}, train={"progress": False})
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(make_data(16), batch_size=16, shuffle=False)
    model, optimizer = session.setup(model, optimizer)
    loader = session.setup_loader(loader, train=True)
    norm = None
    for x, y in loader:
        with session.accumulate(model):
            session.backward(F.mse_loss(model(x), y))
            norm = float(session.clip_grad_norm_(1e9))
    session.close()
    return norm


def compute_dtypes(strategy: str, precision: str) -> dict:
    """The dtype a Linear layer computes in, and the dtype the model hands back."""
    session = Session(Config(), strategy=strategy, precision=precision, train={"progress": False})
    model = make_model()
    seen = []
    model[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    model = session.setup(model)
    out = model(torch.randn(4, 8))
    session.close()
    return {"inside": str(seen[0]), "output": str(out.dtype)}


def pipeline_eval_and_clip(schedule: str) -> dict:
    """Evaluation outputs and the clipped global norm under the pipeline strategy."""
    session = Session(
        Config(),
        strategy={"name": "pipeline", "pipeline": {"schedule": schedule, "microbatches": 2}},
        train={"progress": False},
    )
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = session.setup(model, optimizer)
    x, y = make_data(16).tensors
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train()
    with session.accumulate(model):
        loss = F.mse_loss(model(x), y)
        session.backward(loss)
        norm = float(session.clip_grad_norm_(1e9))
    result = {"loss": loss.item(), "norm": norm, "out": out.cpu()}
    session.close()
    return result


def dcp_roundtrip(strategy: str, directory: str) -> dict:
    """Save the sharded state dict with torch.distributed.checkpoint, spoil the weights, load it back."""
    import torch.distributed.checkpoint as dcp

    session = Session(Config(), strategy=strategy, batch={"global_batch_size": 16}, train={"progress": False})
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = session.setup(model, optimizer)
    x, y = make_data(16).tensors
    with session.accumulate(model):
        session.backward(
            F.mse_loss(
                model(x if strategy == "pipeline" else x[: 16 // session.world_size]),
                y if strategy == "pipeline" else y[: 16 // session.world_size],
            )
        )
    before = session.model_state_dict()
    dcp.save(session.strategy.sharded_model_state_dict(model), checkpoint_id=directory)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = session.strategy.sharded_model_state_dict(model)
    dcp.load(state, checkpoint_id=directory)
    session.strategy.load_sharded_model_state_dict(model, state)
    after = session.model_state_dict()
    session.close()
    return {"before": before, "after": after}


def pipeline_eval_sizes() -> list:
    """Evaluation outputs of the pipeline for batches of 16, 6 and 1 sample, and a reduce."""
    session = Session(
        Config(), strategy={"name": "pipeline", "pipeline": {"microbatches": 4}}, train={"progress": False}
    )
    model = session.setup(make_model())
    model.eval()
    x = make_data(16).tensors[0]
    with torch.no_grad():
        outs = [model(x[:n]).cpu() for n in (16, 6, 1)]
    total = session.reduce(3.0, "sum")
    session.close()
    return outs + [total]
