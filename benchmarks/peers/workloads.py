"""The workloads every contender trains: models, deterministic synthetic data, optimizers, losses.

Everything is built from a seed, in every process, before any timing starts, so all contenders see
the same initial weights, the same samples and (through ``seeded_order``) the same sample order.
Labels come from fixed random *teacher* networks, so the tasks are learnable and the final loss
says whether a speed-up harmed training.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Sampler, TensorDataset

DATA_SEED, EVAL_SEED, TEACHER_SEED, MODEL_SEED = 1, 2, 3, 0


@dataclass(frozen=True)
class Workload:
    name: str
    title: str  # for the report
    micro_batch: int  # samples per process per step (the same for every contender)
    warmup: int  # untimed steps
    steps: int  # timed steps
    build_model: Callable[[], nn.Module]
    make_data: Callable[[int, int], TensorDataset]  # (samples, seed) -> dataset of (input, target)
    eval_samples: int
    make_optimizer: Callable[[list], torch.optim.Optimizer]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (model output, target) -> mean loss

    def model(self) -> nn.Module:
        torch.manual_seed(MODEL_SEED)  # every contender, every rank: the same initial weights
        return self.build_model()


# --- the communication-bound MLP: 3.4M parameters, labels from a random teacher network ---------

MLP_IN, MLP_HIDDEN, MLP_CLASSES = 256, 1024, 10


def mlp(hidden: int = MLP_HIDDEN, layers: int = 4) -> nn.Module:
    parts, width = [], MLP_IN
    for _ in range(layers):
        parts += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*parts, nn.Linear(width, MLP_CLASSES))


def teacher_classes(x: torch.Tensor) -> torch.Tensor:
    """Labels of a fixed random network with 8 tanh units: non-linear, and learnable by the MLP
    to a held-out accuracy that keeps rising for a minute or so of training here."""
    g = torch.Generator().manual_seed(TEACHER_SEED)
    w1 = torch.randn(x.shape[1], 8, generator=g) / x.shape[1] ** 0.5
    w2 = torch.randn(8, MLP_CLASSES, generator=g) / 8**0.5
    return (torch.tanh(x @ w1) @ w2).argmax(dim=1)


def teacher_mlp_data(n: int, seed: int) -> TensorDataset:
    x = torch.randn(n, MLP_IN, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, teacher_classes(x))


# --- a small conv net on synthetic 3x32x32 images, labels from a random teacher on their coarse content


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def image_data(n: int, seed: int) -> TensorDataset:
    """Smooth images (a 4x4 random latent, upsampled) plus pixel noise; the label is a fixed random
    linear teacher's choice on the latent, so a conv net can learn it from the pixels."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, 3, 4, 4, generator=g)
    x = F.interpolate(latent, size=32, mode="bilinear", align_corners=False) + 0.5 * torch.randn(
        n, 3, 32, 32, generator=g
    )
    readout = torch.randn(3 * 4 * 4, 10, generator=torch.Generator().manual_seed(TEACHER_SEED))
    return TensorDataset(x, (latent.flatten(1) @ readout).argmax(dim=1))


# --- a small GPT-style transformer on tokens from a fixed random Markov chain ---------------------

VOCAB, CONTEXT = 64, 64


def tiny_gpt() -> nn.Module:
    from phalanx.demo.gpt import TinyGPT  # a plain nn.Module; nothing of phalanx runs in it

    return TinyGPT(vocab=VOCAB, dim=128, layers=2, heads=4, seq=CONTEXT)


def markov_table() -> torch.Tensor:
    """(VOCAB, 4): the 4 successors of each token, drawn with replacement (a repeat is likelier)."""
    return torch.randint(0, VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(TEACHER_SEED))


def markov_tokens(n: int, seed: int) -> TensorDataset:
    """Sequences where each token is followed by one of 4 tokens fixed per token (a random table):
    a model that learns the table reaches a loss near ln 4 from ln 64."""
    table = markov_table()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(n, CONTEXT + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    choice = torch.randint(0, 4, (n, CONTEXT), generator=g)
    for t in range(CONTEXT):
        tokens[:, t + 1] = table[tokens[:, t], choice[:, t]]
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adamw(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)


WORKLOADS = {
    "mlp": Workload(
        "mlp",
        "MLP 4x1024 (3.4M parameters), fp32, teacher labels",
        64,
        5,
        40,
        mlp,
        teacher_mlp_data,
        2048,
        _sgd,
        F.cross_entropy,
    ),
    "conv": Workload(
        "conv",
        "conv net on 3x32x32 images (0.27M parameters), teacher labels",
        64,
        3,
        20,
        convnet,
        image_data,
        512,
        _sgd,
        F.cross_entropy,
    ),
    "gpt": Workload(
        "gpt",
        "GPT 2 layers, d=128, context 64 (0.41M parameters), Markov tokens",
        16,
        3,
        15,
        tiny_gpt,
        markov_tokens,
        256,
        _adamw,
        token_loss,
    ),
}


# --- per-step overhead (benchmarks/overhead.py): the same MLP, sized for a step of about N ms -----
# (hidden width, micro-batch, timed steps) per target step time of one process with 2 threads on
# the 2-core reference machine; the benchmark prints the step time each actually took.
STEP_SIZES = {
    1: (320, 32, 1500),
    3: (768, 32, 600),
    10: (1024, 64, 200),
    30: (1024, 192, 80),
    100: (1536, 160, 25),
}


def step_workload(ms: int) -> Workload:
    hidden, micro, steps = STEP_SIZES[ms]
    return Workload(
        f"step-{ms}ms",
        f"MLP 4x{hidden}, micro-batch {micro}, SGD (a step of about {ms} ms)",
        micro,
        max(3, steps // 10),
        steps,
        functools.partial(mlp, hidden),
        teacher_mlp_data,
        256,
        _sgd,
        F.cross_entropy,
    )


WORKLOADS.update({f"step-{ms}ms": step_workload(ms) for ms in STEP_SIZES})


def tiny(workload: Workload) -> Workload:
    """The test suite's size: a few steps, so the harness runs end to end in seconds."""
    from dataclasses import replace

    return replace(workload, warmup=1, steps=3, eval_samples=64)


class SeededOrder(Sampler[int]):
    """One global sample order per epoch: ``randperm(n)`` seeded with ``seed + epoch``.

    It is the order ``DistributedSampler(shuffle=True, seed=seed)`` and phalanx's sampler shard
    (rank r takes positions r, r+W, ...), so with it every contender trains on the same samples in
    each optimizer step."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n
