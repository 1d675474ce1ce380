"""Learning-rate scaling for a larger global batch, with gradual warm-up (Goyal et al., 2017).

The multiplier is applied on top of whatever the user's scheduler set, only for the duration of the
optimizer step, so any torch scheduler (chainable or closed-form) keeps seeing its own values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRScaling:
    rule: str  # none | linear | sqrt
    global_batch_size: int
    reference_batch_size: int
    warmup_steps: int = 0
    warmup_start_factor: float | None = None

    @functools.cached_property  # read at every optimizer step; the fields are frozen
    def scale(self) -> float:
        ratio = self.global_batch_size / self.reference_batch_size
        if self.rule == "linear":
            return ratio
        if self.rule == "sqrt":
            return math.sqrt(ratio)
        return 1.0

    def multiplier(self, step: int) -> float:
        """Factor applied to the scheduler's lr at optimizer step ``step`` (0-based)."""
        scale = self.scale
        if self.warmup_steps <= 0 or step >= self.warmup_steps:
            return scale
        start = self.warmup_start_factor
        if start is None:
            # Goyal et al. warm up from the unscaled lr (1/scale of the target); with nothing to
            # scale, a warm-up can only mean starting from zero.
            start = 1.0 / scale if scale > 1 else 0.0
        progress = (step + 1) / self.warmup_steps
        return scale * (start + (1.0 - start) * progress)

    def describe(self) -> str:
        if self.rule == "none" and self.warmup_steps == 0:
            return "lr as given (no scaling)"
        text = (
            f"lr x {self.scale:.4g} ({self.rule} rule, global batch {self.global_batch_size} "
            f"vs reference {self.reference_batch_size})"
        )
        if self.warmup_steps:
            text += f", linear warm-up over {self.warmup_steps} steps"
        return text
