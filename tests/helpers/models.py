"""The small models, data sets and optimizers every training test builds from (seeded, so each
process and each run starts from the same weights and sees the same samples)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))


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


def small_convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 2),
    )  # fmt: skip


# By name, so a test can pick one across phalanx.spawn (which pickles arguments, not classes).
MODELS = {"default": make_model, "mlp": mlp, "two_heads": TwoHeads, "convnet": small_convnet}


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = torch.stack([x[:, :4].sum(1), x[:, 4:].prod(1)], dim=1) + 0.1 * torch.randn(n, 2, generator=g)
    return TensorDataset(x, y)


def image_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, 8, 8, generator=g)
    return TensorDataset(x, torch.stack([x.mean((1, 2, 3)), x[:, 0].std((1, 2))], dim=1))


def data_for(model: str, n: int) -> TensorDataset:
    return image_data(n) if model == "convnet" else make_data(n)


def make_optimizer(name: str, params, **flags) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2, **flags)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-2, **flags)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, **flags)


def step_schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def make_optim(model: nn.Module):
    """The SGD optimizer and StepLR schedule that train() and reference() use by default."""
    optimizer = make_optimizer("sgd", model.parameters())
    return optimizer, step_schedule(optimizer)


class Scale(nn.Module):
    """Parameters and no reset_parameters(): nothing can initialise them after init_module()."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.gain


class TiedLM(nn.Module):
    """An embedding tied to the output layer, as language models are."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.body(self.embed(x)))
