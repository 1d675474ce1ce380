"""Time-to-target tasks: learnable problems with a held-out set and an accuracy to reach.

Each task carries its learning-rate recipe as a user would write it for one process: an optimizer
tuned at ``reference_batch`` samples per step. With more processes (or a bigger batch chosen by
phalanx) the rate is scaled by phalanx's rule, the same rule for both contenders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from peers.workloads import MODEL_SEED, mlp, teacher_mlp_data


@dataclass(frozen=True)
class Task:
    name: str
    title: str
    micro_batch: int  # the naive per-process batch
    reference_batch: int  # the batch the learning rate below was tuned for
    build_model: Callable[[], nn.Module]
    data: Callable[[], tuple[TensorDataset, TensorDataset]]  # (train, held out)
    make_optimizer: Callable[[list], torch.optim.Optimizer]
    target: float  # held-out accuracy
    eval_every: int  # training samples between evaluations
    max_samples: int  # give up here
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy

    def model(self) -> nn.Module:
        torch.manual_seed(MODEL_SEED)
        return self.build_model()


def _digits_model() -> nn.Module:
    from phalanx.demo.digits import DigitsCNN  # a plain nn.Module, the demo's

    return DigitsCNN()


def _digits_data() -> tuple[TensorDataset, TensorDataset]:
    from phalanx.demo.digits import train_test_split  # the shipped UCI digits, fixed split

    return train_test_split()


def _teacher_data() -> tuple[TensorDataset, TensorDataset]:
    return teacher_mlp_data(131072, 11), teacher_mlp_data(4096, 12)


TASKS = {
    "digits": Task(
        "digits",
        "digits demo CNN (UCI digits, 1,437 train / 359 test images)",
        64,
        64,
        _digits_model,
        _digits_data,
        lambda p: torch.optim.AdamW(p, lr=2e-3, weight_decay=1e-4),
        target=0.985,
        eval_every=512,
        max_samples=200_000,
    ),
    "teacher": Task(
        "teacher",
        "MLP 4x1024 (3.4M parameters) on labels of a random teacher network",
        64,
        64,
        mlp,
        _teacher_data,
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        target=0.80,
        eval_every=4096,
        max_samples=2_000_000,
    ),
}
