"""Models and training functions for the performance-knob tests (run in one process or inside
phalanx.spawn processes, so they live in an importable module)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _workers import make_data
from phalanx import Config, PhalanxError, Session


class TwoHeads(nn.Module):
    """A body and two heads; the loss only sees ``head2`` while ``use_head2`` is set."""

    def __init__(self, use_head2: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.head = nn.Linear(32, 2)
        self.head2 = nn.Linear(32, 2)
        self.use_head2 = use_head2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + self.head2(h) if self.use_head2 else self.head(h)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))


def small_convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 2),
    )


MODELS = {"two_heads": TwoHeads, "mlp": mlp, "convnet": small_convnet}


def image_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, 8, 8, generator=g)
    return TensorDataset(x, torch.stack([x.mean((1, 2, 3)), x[:, 0].std((1, 2))], dim=1))


def _data(model: str, n: int) -> TensorDataset:
    return image_data(n) if model == "convnet" else make_data(n)


def _optimizer(name: str, params, **flags) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2, **flags)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-2, **flags)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, **flags)


def reference(model: str, global_bs: int, steps: int, optimizer: str = "sgd", **optimizer_flags) -> dict[str, torch.Tensor]:
    """One process, plain PyTorch, the same global batches, a StepLR schedule."""
    net = MODELS[model]()
    opt = _optimizer(optimizer, net.parameters(), **optimizer_flags)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for x, y in DataLoader(_data(model, global_bs * steps), batch_size=global_bs, shuffle=False):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
        scheduler.step()
    return net.state_dict()


def train(model: str, strategy, global_bs: int, micro_bs: int | None, steps: int, *, optimizer: str = "sgd",
          head2_until: int | None = None, compiled_by_user: bool = False, save_to: str | None = None, **sections) -> dict:
    """Train through a Session; ``head2_until``: the loss uses head2 in steps before this one only."""
    # Never resume from a ./checkpoints another run left in the working directory.
    sections["checkpoint"] = {"dir": save_to or "checkpoints", "resume": "never"}
    session = Session(
        Config(),
        strategy=strategy,
        batch={"global_batch_size": global_bs, "micro_batch_size": micro_bs},
        train={"progress": False, "seed": 0},
        **sections,
    )
    net = MODELS[model](use_head2=head2_until is not None) if model == "two_heads" else MODELS[model]()
    bare = net
    if compiled_by_user:
        net = torch.compile(net)
    opt = _optimizer(optimizer, net.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = DataLoader(_data(model, global_bs * steps), batch_size=global_bs, shuffle=False)
    net, opt, scheduler = session.setup(net, opt, scheduler)
    inputs = []  # memory format of what the bare model's forward receives
    bare.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    loader = session.setup_loader(loader, train=True)
    error = None
    try:
        for _ in session.epochs():
            for x, y in loader:
                if head2_until is not None and session.step_count >= head2_until:
                    bare.use_head2 = False
                with session.accumulate(net):
                    session.backward(F.mse_loss(net(x), y))
    except PhalanxError as err:
        error = str(err)
    ddp = getattr(session.strategy, "_unused", None)
    result = {
        "state": {k: v.detach().cpu() for k, v in session.model_state_dict().items()},
        "user_state_keys": list(net.state_dict()),
        "steps": session.step_count,
        "error": error,
        "searching": [bool(w.ddp.find_unused_parameters) for w in ddp] if ddp else None,
        "unused": [w.unused for w in ddp] if ddp else None,
        "optimizer": {k: opt.defaults.get(k) for k in ("foreach", "fused")},
        "group_flags": [{k: g.get(k) for k in ("foreach", "fused")} for g in opt.param_groups],
        "compiled": getattr(net, "_compiled_call_impl", None) is not None,
        "type": type(net).__name__,
        "channels_last_inputs": inputs[-1] if inputs else None,
        "channels_last_weights": [p.is_contiguous(memory_format=torch.channels_last) for p in session.unwrap(net).parameters() if p.dim() == 4],
        "lr": scheduler.get_last_lr()[0],
        "saved": str(session.save()) if save_to else None,
    }
    session.close(sync=error is None)
    return result


def run(args: tuple, kwargs: dict) -> dict:
    """``train(*args, **kwargs)``, for phalanx.spawn (which passes positional arguments only)."""
    return train(*args, **kwargs)
