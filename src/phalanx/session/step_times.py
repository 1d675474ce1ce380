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
    steps = _plain(times)
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


def _plain(times: list[tuple[float, float, bool]]) -> list[tuple[float, float, bool]]:
    """The steps that did not estimate the noise scale (those did more work); all of them where every
    step estimates."""
    return [t for t in times if not t[2]] or times


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
        steps = _plain(times)
        if len(steps) >= 2 and k not in self.measured:
            self.measured[k] = statistics.median(t[0] for t in steps)

    def seconds(self, k: int, accumulation: int) -> float | None:
        """One optimizer step at multiple ``k`` of a start of ``accumulation`` micro-steps; None with
        neither a prior nor a measurement."""
        if k in self.measured:
            return self.measured[k]
        known = sorted(self.measured)
        if len(known) >= 2:  # the line through the two measured nearest k, never falling
            below, above = [m for m in known if m < k], [m for m in known if m > k]
            if below and above:
                a, b = below[-1], above[0]
            elif below:
                a, b = known[-2], known[-1]
            else:
                a, b = known[0], known[1]
            slope = max((self.measured[b] - self.measured[a]) / (b - a), 0.0)
        elif self.prior is None:
            return None
        else:  # the prior's slope, through the one measured multiple if there is one
            slope = accumulation * self.prior[0]
            if not known:
                return k * slope + self.prior[1]
            a = known[0]
        return max(self.measured[a] + (k - a) * slope, 1e-9)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.prior, "measured": [[k, s] for k, s in sorted(self.measured.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Also a checkpoint from before the measured times: its fitted model alone."""
        if not self.given:
            self.prior = tuple(state["model"]) if state.get("model") is not None else None
        self.measured = {int(k): float(s) for k, s in state.get("measured", [])}
