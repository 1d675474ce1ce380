"""batch.adaptive's model of how long an optimizer step takes at multiple k of the starting batch.

A prior, fitted to the steps before the first choice (or given, ``batch.adaptive_step_times``): k a0
micro-steps of t_micro each plus a fixed t_step (a0 the starting accumulation steps). Then, as Pollux
does, what the run measured: the median step time of the first window of ``batch.adapt_every`` steps
trained at each multiple (a forward that joins micro-batches, a larger all-reduce: whatever a larger
batch really costs on this machine). A multiple not yet trained at is read off the line through the
nearest measured ones, or the prior's slope through the one measured.

Each multiple is measured once and kept (it is in the checkpoint): the choices depend on one
timing per multiple, not on every window's. With the times given nothing is measured, so the
choices depend on the data alone.
"""

from __future__ import annotations

import statistics
from typing import Any

# A backward costs one to two forwards (two by FLOPs, 4N against 2N per sample; less where its
# all-reduce overlaps it). The prior takes the low end: it errs toward trying a larger batch, and
# the first window at that batch measures what it really costs.
BACKWARD_PER_FORWARD = 1.0


def fit(times: list[tuple[float, float, bool]], accumulation: int) -> tuple[float, float] | None:
    """(t_micro, t_step) from steps' (step time, synchronising time, estimated) at ``accumulation``
    micro-steps. The synchronising part starts with the last micro-step's backward: the micro-steps
    before it are accumulation - 1 whole ones; with one micro-step, the part before is its forward
    alone, and the backward's share of the synchronising part is BACKWARD_PER_FORWARD forwards."""
    steps = [t for t in times if not t[2]] or times
    if len(steps) < 2:
        return None
    step_time = statistics.median(t[0] for t in steps)
    sync = min(statistics.median(t[1] for t in steps), step_time)
    if accumulation > 1:
        t_micro = (step_time - sync) / (accumulation - 1)
    else:
        forward = step_time - sync
        t_micro = forward + min(BACKWARD_PER_FORWARD * forward, sync)
    t_micro = max(t_micro, 1e-9)
    return t_micro, max(step_time - accumulation * t_micro, 0.0)


class StepTimes:
    """Seconds per optimizer step at each multiple: measured where the run trained, else predicted."""

    def __init__(self, given: list[float] | None):
        self.given = given is not None
        self.prior: tuple[float, float] | None = (float(given[0]), float(given[1])) if given else None
        self.measured: dict[int, float] = {}

    def record(self, k: int, times: list[tuple[float, float, bool]], accumulation: int) -> None:
        """The window of steps just ended, all at multiple ``k`` and ``accumulation`` micro-steps: the
        prior at the first, and k's step time if it is the first window there."""
        if self.given:
            return
        if self.prior is None:
            self.prior = fit(times, accumulation)
        # The steps that estimated the noise scale did more; all of them where every step estimates.
        steps = [t[0] for t in times if not t[2]] or [t[0] for t in times]
        if len(steps) >= 2 and k not in self.measured:
            self.measured[k] = statistics.median(steps)

    def seconds(self, k: int, accumulation: int) -> float | None:
        """One optimizer step at multiple ``k`` of a start of ``accumulation`` micro-steps; None with
        neither a prior nor a measurement."""
        if k in self.measured:
            return self.measured[k]
        slope = accumulation * self.prior[0] if self.prior else None
        known = sorted(self.measured)
        if not known:
            return None if self.prior is None else k * slope + self.prior[1]
        if len(known) == 1 and slope is None:
            return None
        if len(known) > 1:
            below = [m for m in known if m < k]
            above = [m for m in known if m > k]
            a, b = (below[-1], above[0]) if below and above else (known[-2], known[-1]) if below else known[:2]
            slope = max((self.measured[b] - self.measured[a]) / (b - a), 0.0)
            anchor = a
        else:
            anchor = known[0]
        return max(self.measured[anchor] + (k - anchor) * slope, 1e-9)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.prior, "measured": [[k, s] for k, s in sorted(self.measured.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Also a checkpoint from before the measured times: its fitted model alone."""
        if not self.given:
            self.prior = tuple(state["model"]) if state.get("model") is not None else None
        self.measured = {int(k): float(s) for k, s in state.get("measured", [])}
