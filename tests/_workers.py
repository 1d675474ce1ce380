"""Functions run inside phalanx.spawn processes (they must be importable by the children)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = torch.stack([x[:, :4].sum(1), x[:, 4:].prod(1)], dim=1) + 0.1 * torch.randn(n, 2, generator=g)
    return TensorDataset(x, y)


def make_optim(model: nn.Module):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return optimizer, scheduler


def reference(global_bs: int, steps: int) -> dict[str, torch.Tensor]:
    """A plain one-process loop over the same global batches, without phalanx."""
    model = make_model()
    optimizer, scheduler = make_optim(model)
    loader = DataLoader(make_data(global_bs * steps), batch_size=global_bs, shuffle=False)
    for x, y in loader:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    return model.state_dict()


def train(strategy: str, global_bs: int, micro_bs: int | None, steps: int, shuffle: bool = False, epochs: int = 1, **sections) -> dict:
    session = Session(
        Config(),
        strategy=strategy,
        batch={"global_batch_size": global_bs, "micro_batch_size": micro_bs},
        train={"progress": False, "seed": 0, "epochs": epochs},
        **sections,
    )
    model = make_model()
    optimizer, scheduler = make_optim(model)
    loader = DataLoader(make_data(global_bs * steps), batch_size=global_bs, shuffle=shuffle)
    model, optimizer, scheduler = session.setup(model, optimizer, scheduler)
    loader = session.setup_loader(loader, train=True)
    lrs, micro_steps = [], 0
    for _ in session.epochs():
        for x, y in loader:
            micro_steps += 1
            with session.accumulate(model):
                session.backward(F.mse_loss(model(x), y))
            if session.sync_gradients:
                lrs.append(scheduler.get_last_lr()[0])
    result = {
        "state": {k: v.detach().cpu() for k, v in session.model_state_dict().items()},
        "steps": session.step_count,
        "scheduler_steps": scheduler.last_epoch,
        "lrs": lrs,
        "micro_steps": micro_steps,
        "accumulation": session.accumulation_steps,
        "world": session.world_size,
    }
    session.close()
    return result


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
    session = Session(Config(), strategy=strategy, batch={"global_batch_size": 16}, train={"progress": False}, **sections)
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
    session = Session(Config(), strategy={"name": "pipeline", "pipeline": {"schedule": schedule, "microbatches": 2}}, train={"progress": False})
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
        session.backward(F.mse_loss(model(x if strategy == "pipeline" else x[: 16 // session.world_size]), y if strategy == "pipeline" else y[: 16 // session.world_size]))
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
    session = Session(Config(), strategy={"name": "pipeline", "pipeline": {"microbatches": 4}}, train={"progress": False})
    model = session.setup(make_model())
    model.eval()
    x = make_data(16).tensors[0]
    with torch.no_grad():
        outs = [model(x[:n]).cpu() for n in (16, 6, 1)]
    total = session.reduce(3.0, "sum")
    session.close()
    return outs + [total]
