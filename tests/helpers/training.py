"""The training harness: one plain PyTorch loop (the reference) and the same loop through a Session,
run in the test process or inside phalanx.spawn processes (so it lives in an importable module)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from phalanx import Config, PhalanxError, Session
from tests.helpers.models import MODELS, data_for, make_optimizer, step_schedule


def rel_diff(a: dict, b: dict) -> float:
    """The largest difference between two state dicts, relative to each tensor of ``b``."""
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)


def reference(
    global_bs: int, steps: int, *, model: str = "default", optimizer: str = "sgd", **optimizer_flags
) -> dict[str, torch.Tensor]:
    """A plain one-process loop over the same global batches, without phalanx."""
    net = MODELS[model]()
    opt = make_optimizer(optimizer, net.parameters(), **optimizer_flags)
    scheduler = step_schedule(opt)
    for x, y in DataLoader(data_for(model, global_bs * steps), batch_size=global_bs, shuffle=False):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
        scheduler.step()
    return net.state_dict()


def train(
    strategy,
    global_bs: int,
    micro_bs: int | None,
    steps: int,
    shuffle: bool = False,
    epochs: int = 1,
    *,
    model: str = "default",
    optimizer: str = "sgd",
    optimizer_flags: dict | None = None,
    head2_until: int | None = None,
    compiled_by_user: bool = False,
    short_form: bool = False,
    save_to: str | None = None,
    catch_errors: bool = False,
    **sections,
) -> dict:
    """Train through a Session and report what it did. ``optimizer_flags``: the optimizer's own
    constructor flags (foreach=True, ...); ``head2_until``: the loss uses head2 in steps before this
    one only; ``short_form``: the loop of a one-GPU script (``optimizer.zero_grad()``,
    ``session.backward(loss)``, ``session.step()``) instead of the ``accumulate()`` block;
    ``catch_errors``: a PhalanxError in the loop is returned as ``error``."""
    # Never resume from a ./checkpoints another run left in the working directory.
    sections["checkpoint"] = {"dir": save_to or "checkpoints", "resume": "never"}
    session = Session(
        Config(),
        strategy=strategy,
        batch={"global_batch_size": global_bs, "micro_batch_size": micro_bs},
        train={"progress": False, "seed": 0, "epochs": epochs},
        **sections,
    )
    net = MODELS[model](use_head2=head2_until is not None) if model == "two_heads" else MODELS[model]()
    bare = net
    if compiled_by_user:
        net = torch.compile(net)
    opt = make_optimizer(optimizer, net.parameters(), **(optimizer_flags or {}))
    scheduler = step_schedule(opt)
    loader = DataLoader(data_for(model, global_bs * steps), batch_size=global_bs, shuffle=shuffle)
    net, opt, scheduler = session.setup(net, opt, scheduler)
    inputs = []  # memory format of what the bare model's forward receives (None: called with keywords only)
    bare.register_forward_pre_hook(
        lambda _m, args: inputs.append(args[0].is_contiguous(memory_format=torch.channels_last) if args else None)
    )
    loader = session.setup_loader(loader, train=True)
    lrs, micro_steps, error = [], 0, None
    try:
        for _ in session.epochs():
            for x, y in loader:
                if head2_until is not None and session.step_count >= head2_until:
                    bare.use_head2 = False
                micro_steps += 1
                if short_form:
                    opt.zero_grad()
                    session.backward(F.mse_loss(net(x), y))
                    session.step()
                else:
                    with session.accumulate(net):
                        session.backward(F.mse_loss(net(x), y))
                if session.sync_gradients:
                    lrs.append(scheduler.get_last_lr()[0])
    except PhalanxError as err:
        if not catch_errors:
            raise
        error = str(err)
    ddp = getattr(session.strategy, "_unused", None)
    result = {
        "state": {k: v.detach().cpu() for k, v in session.model_state_dict().items()},
        "user_state_keys": list(net.state_dict()),
        "steps": session.step_count,
        "scheduler_steps": scheduler.last_epoch,
        "lrs": lrs,
        "lr": scheduler.get_last_lr()[0],
        "micro_steps": micro_steps,
        "accumulation": session.accumulation_steps,
        "world": session.world_size,
        "error": error,
        "searching": [bool(w.ddp.find_unused_parameters) for w in ddp] if ddp else None,
        "unused": [w.unused for w in ddp] if ddp else None,
        "optimizer": {k: opt.defaults.get(k) for k in ("foreach", "fused")},
        "group_flags": [{k: g.get(k) for k in ("foreach", "fused")} for g in opt.param_groups],
        "compiled": getattr(net, "_compiled_call_impl", None) is not None,
        "type": type(net).__name__,
        "channels_last_inputs": inputs[-1] if inputs else None,
        "channels_last_weights": [
            p.is_contiguous(memory_format=torch.channels_last) for p in session.unwrap(net).parameters() if p.dim() == 4
        ],
        "saved": str(session.save()) if save_to else None,
    }
    session.close(sync=error is None)
    return result


def run(args: tuple, kwargs: dict) -> dict:
    """``train(*args, **kwargs)``, for phalanx.spawn (which passes positional arguments only)."""
    return train(*args, **kwargs)
