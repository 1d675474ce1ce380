"""The communication-bound MLP the CPU benchmarks train (knobs.py, noise_overhead.py,
unused_switch.py): 256 -> 4 hidden layers of 1024 -> 10, 3.4M fp32 parameters, so that at small
micro-batches the gradient all-reduce, not the compute, sets the step time. Seeded, so every
contender starts from the same weights and sees the same data.

(It was overhead.py's workload; overhead.py itself, phalanx against a hand-written loop, is
superseded by `compare.py --contenders raw,phalanx --workloads mlp`.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

IN, HIDDEN, OUT = 256, 1024, 10


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers, width = [], IN
    for _ in range(4):
        layers += [nn.Linear(width, HIDDEN), nn.ReLU()]
        width = HIDDEN
    return nn.Sequential(*layers, nn.Linear(width, OUT))


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))
