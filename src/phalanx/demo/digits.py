"""The digits data set and the demo's model."""

from __future__ import annotations

import gzip
from importlib import resources

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

N_CLASSES = 10


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 images as float tensors (N, 1, 8, 8) scaled to [0, 1], and int64 labels."""
    with resources.files("phalanx.demo").joinpath("data/digits.csv.gz").open("rb") as raw:
        table = np.loadtxt(gzip.open(raw, "rt"), delimiter=",", dtype=np.float32)
    images = torch.from_numpy(table[:, :64] / 16.0).reshape(-1, 1, 8, 8)
    labels = torch.from_numpy(table[:, 64].astype(np.int64))
    return images, labels


def train_test_split(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """A fixed split (same on every rank and every run)."""
    images, labels = load_digits()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


class DigitsCNN(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, N_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
