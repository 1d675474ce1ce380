"""The gradient noise scale B_noise = tr(Σ)/|G|² (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training"): the batch size beyond which a larger batch mostly buys speed at the cost of
samples. Steps to a given loss go as S_min (1 + B_noise/B), samples as E_min (1 + B/B_noise).

It is measured from two gradients each estimating step already has (their appendix A.1): a small
one, over ``small`` samples (one micro-batch of one rank: the first micro-step's gradient under
accumulation, or a rank's gradient before DDP averages it), and the big one the optimizer uses,
over the global batch. With E|G_B|² = |G|² + tr(Σ)/B at any batch size B,

    |G|²  ≈ (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)
    tr(Σ) ≈ (|G_small|² - |G_big|²) / (1/B_small - 1/B_big)

are unbiased, but each is very noisy on one step; both are averaged over estimates with an
exponential moving average (``smoothing`` per estimate, bias-corrected as Adam's moments are)
before their ratio is taken, which is what makes the ratio consistent.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class NoiseScale:
    def __init__(self, small: int, big: int, smoothing: float):
        if not 0 < small < big:
            raise ValueError(f"the noise scale needs two batch sizes, small < big (got {small} and {big})")
        self.small, self.big, self.smoothing = small, big, smoothing
        self.count = 0  # estimates observed
        self._g2 = 0.0  # moving averages of the |G|² and tr(Σ) estimates, before bias correction
        self._trace = 0.0

    def observe(self, small_sq: float, big_sq: float) -> None:
        """One estimate: the squared norms of a small-batch and of the big-batch gradient."""
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return  # a step with inf/nan gradients (fp16 overflow) says nothing about the noise
        b_small, b_big = self.small, self.big
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
        beta = self.smoothing
        self._g2 = beta * self._g2 + (1 - beta) * g2
        self._trace = beta * self._trace + (1 - beta) * trace
        self.count += 1

    @property
    def gradient_sq(self) -> float | None:
        """The smoothed |G|² (the true gradient's squared norm)."""
        return self._g2 / (1 - self.smoothing**self.count) if self.count else None

    @property
    def trace(self) -> float | None:
        """The smoothed tr(Σ) (per-sample gradient variance, summed over parameters)."""
        return self._trace / (1 - self.smoothing**self.count) if self.count else None

    @property
    def value(self) -> float | None:
        """B_noise; None before the first estimate or while |G|² is not yet positive (the
        estimate of a nearly zero gradient can come out negative)."""
        g2, trace = self.gradient_sq, self.trace
        if g2 is None or g2 <= 0 or trace <= 0:
            return None
        return trace / g2

    def state_dict(self) -> dict[str, Any]:
        return {"small": self.small, "big": self.big, "count": self.count, "g2": self._g2, "trace": self._trace}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Estimates of other batch sizes are still estimates of the same two quantities.
        self.count, self._g2, self._trace = int(state["count"]), float(state["g2"]), float(state["trace"])


class LocalNorms:
    """The squared norm of a rank's gradient, added up bucket by bucket in DDP's comm hook while
    ``armed`` (the Session arms it on the synchronising backward of a measuring step)."""

    def __init__(self):
        self.armed = False
        self._sum: torch.Tensor | None = None

    def add(self, tensor: torch.Tensor) -> None:
        part = _norm_sq(tensor.detach().reshape(-1))
        self._sum = part if self._sum is None else self._sum + part

    def take(self) -> torch.Tensor | None:
        """The sum since the last take (None when nothing was added), and disarm."""
        out, self._sum, self.armed = self._sum, None, False
        return out


def squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of ``tensors``, on their device, as a float64 scalar (one sync when read).
    Each is a dot product in the tensor's own float precision (a relative error near 1e-6 against
    float64, far below the estimate's own noise); a float64 copy first made an estimating step cost
    40 ms more than a plain one of 50 ms (benchmarks/noise_overhead.py)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    device = tensors[0].device  # model_parallel: gradients on several GPUs, their sum on the first
    return torch.stack([_norm_sq(t.detach()).to(device) for t in tensors]).sum()


def _norm_sq(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()  # bf16/fp16 gradients: their squares would lose the digits the estimate needs
    return torch.dot(flat, flat).to(torch.float64)  # BLAS's blocked sum: 1e-6 of float64's, at a seventh of its time


def efficiency(batch: int, noise_scale: float) -> float:
    """Samples a step at batch 1 would need, per sample at ``batch``: 1 / (1 + batch/B_noise)."""
    return 1.0 / (1.0 + batch / noise_scale)


def describe(batch: int, noise_scale: float) -> str:
    """What the noise scale means for a run at global batch ``batch``: the summary's line."""
    ratio = batch / noise_scale
    near = f"{noise_scale:,.0f}" if noise_scale >= 10 else f"{noise_scale:.2g}"
    if ratio >= 2:
        return (
            f"global batch {batch:,} is {ratio:.1f}x the gradient noise scale (≈{near}): beyond it more devices buy "
            f"speed at the cost of samples (a sample does {efficiency(batch, noise_scale):.0%} of the work it does "
            "at a small batch)"
        )
    if ratio <= 0.5:
        return (
            f"global batch {batch:,} is {ratio:.2f}x the gradient noise scale (≈{near}): a larger batch (more devices, "
            "or accumulation) would cost few extra samples per step of progress"
        )
    return f"global batch {batch:,} is about the gradient noise scale (≈{near}): a balance of steps and samples"
