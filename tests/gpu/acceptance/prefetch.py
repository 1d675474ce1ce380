"""The side-stream prefetcher (data.prefetch_to_device): the same batches and the same weights as the
plain copy, with and without loader workers, and its time against the plain copy on two copy-heavy toys."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests.gpu.acceptance.report import Check
from tests.gpu.acceptance.workloads import max_relative, on_cuda, quiet, session, sync, train_mlp

WEIGHT_TOLERANCE = 1e-6  # the same batches in the same order through the same kernels: identical in practice
SPEED_TOLERANCE = 0.97  # prefetch at most 3% slower than the plain copy (medians)
SPEED_STEPS = 60


def batches(prefetch: bool, workers: int) -> tuple[list, tuple[str, bool]]:
    """Every batch of two shuffled epochs as the training loop receives it."""
    with quiet():
        run = session(data={"num_workers": workers, "prefetch_to_device": prefetch})
        g = torch.Generator().manual_seed(2)
        data = TensorDataset(
            torch.randint(0, 256, (640, 3, 64, 64), dtype=torch.uint8, generator=g),
            torch.randint(0, 10, (640,), generator=g),
        )
        loader = run.setup(DataLoader(data, batch_size=64, shuffle=True))
        kind = (type(loader.transfer).__name__, loader.fetch_ahead)
        seen = []
        for _ in run.epochs(2):
            for x, y in loader:
                seen.append((x.float().mul(2).sum().item(), x.clone(), y.clone()))  # read on the compute stream first
        run.close()
    return seen, kind


def identity_checks() -> list[Check]:
    checks = []
    for workers in (0, 2):
        plain, plain_kind = batches(False, workers)
        fast, fast_kind = batches(True, workers)
        same = len(plain) == len(fast) == 20 and all(
            a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(plain, fast)
        )
        paths_ok = plain_kind == ("PlainTransfer", False) and fast_kind == ("StreamTransfer", workers > 0)
        figure = f"{len(fast)} batches identical to the plain copy" if same else "batches DIFFER from the plain copy"
        figure += f" ({fast_kind[0]}, {'next batch fetched ahead' if fast_kind[1] else 'copied when asked for'})"
        checks.append(
            Check(
                f"batches, {workers} workers",
                same and paths_ok,
                figure,
                "every batch equal; StreamTransfer, fetching ahead with workers",
                {"batches": len(fast), "plain_path": plain_kind, "prefetch_path": fast_kind},
            )
        )
    return checks


def weight_checks(steps: int = 20, micro: int = 256) -> list[Check]:
    checks = []
    for workers in (0, 2):
        data = {"num_workers": workers}
        plain = train_mlp(steps, micro, data=data | {"prefetch_to_device": False})
        fast = train_mlp(steps, micro, data=data | {"prefetch_to_device": True})
        diff = max_relative(fast.weights, plain.weights)
        losses = "identical" if fast.losses == plain.losses else "DIFFER"
        checks.append(
            Check(
                f"weights after {steps} steps, {workers} workers",
                diff <= WEIGHT_TOLERANCE and fast.losses == plain.losses,
                f"weights differ by {diff:.1e} at most, losses {losses}",
                f"losses equal, weights within {WEIGHT_TOLERANCE:g} (relative)",
                {"max_relative_weight_diff": diff},
            )
        )
    return checks


class Cycled(Dataset):
    """``length`` samples read round-robin from a smaller dataset (a long epoch without the memory)."""

    def __init__(self, data: Dataset, length: int):
        self.data, self.length = data, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return self.data[i % len(self.data)]


def copy_heavy_model() -> nn.Module:
    # Little compute per byte of input, so the host-to-device copy is a large part of each step.
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory() if on_cuda() else tensor  # (a CPU smoke run has nothing to pin for)


def step_time(prefetch: bool, toy: str, steps: int, warmup: int = 10) -> float:
    """Seconds per step of one of two copy-heavy toys, with or without the side-stream copy.

    pinned: 128 float images of 3x128x128 per batch (25 MB), already in pinned memory (as a
    loader that decodes into pinned buffers hands them over), loaded in the training process;
    the loop never waits for the GPU, as phalanx's loops do not.
    workers: 64 such images per batch from 4 worker processes, pinned by the DataLoader; the loop
    reads its loss every step (loss.item()), so only a batch fetched ahead can overlap.
    """
    with quiet():
        run = session(data={"prefetch_to_device": prefetch})
        g = torch.Generator().manual_seed(3)
        if toy == "pinned":
            micro, workers = 128, 0
            pool = [
                (
                    pinned(torch.randn(micro, 3, 128, 128, generator=g)),
                    pinned(torch.randint(0, 10, (micro,), generator=g)),
                )
                for _ in range(8)
            ]
            data = TensorDataset(torch.arange(micro * (warmup + steps)))

            def collate(items):
                return pool[int(items[0][0]) % len(pool)]

            raw = DataLoader(data, batch_size=micro, shuffle=True, collate_fn=collate)
        else:
            micro, workers = 64, 4
            data = Cycled(
                TensorDataset(torch.randn(512, 3, 128, 128, generator=g), torch.randint(0, 10, (512,), generator=g)),
                micro * (warmup + steps),
            )
            raw = DataLoader(data, batch_size=micro, shuffle=True, num_workers=workers)
        model = copy_heavy_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer, loader = run.setup(model, optimizer, raw)
        start = None
        for i, (x, y) in enumerate(loader):
            if i == warmup:
                sync()
                start = time.perf_counter()
            if i == warmup + steps:
                break
            with run.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                run.backward(loss)
            if toy == "workers":
                loss.item()
        sync()
        seconds = (time.perf_counter() - start) / steps
        run.close()
    return seconds


def speed_checks(steps: int, repeats: int) -> list[Check]:
    checks = []
    for toy in ("pinned", "workers"):
        plain, fast = [], []
        for _ in range(repeats):  # alternate the contenders
            plain.append(step_time(False, toy, steps))
            fast.append(step_time(True, toy, steps))
        p, f = statistics.median(plain), statistics.median(fast)
        checks.append(
            Check(
                f"speed, {toy} toy",
                p / f >= SPEED_TOLERANCE,
                f"{f * 1e3:.2f} ms/step with prefetch, {p * 1e3:.2f} without ({p / f:.2f}x), median of {repeats}",
                f"at least {SPEED_TOLERANCE:.2f}x the plain copy's speed",
                {"prefetch_s": fast, "plain_s": plain, "speedup": p / f},
            )
        )
    return checks


def run(repeats: int) -> list[Check]:
    return identity_checks() + weight_checks() + speed_checks(SPEED_STEPS, repeats)
