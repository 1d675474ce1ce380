"""Which rank, if any, holds the others back.

Step times cannot tell: in synchronous data-parallel training every rank leaves the gradient
all-reduce together, so all ranks take the same time per step however slow one of them is; the
fast ones spend the difference waiting inside the synchronisation. What differs is each rank's
own work, its step time minus the synchronising part of the step (``step_time - sync_time``).

The rule: after leaving out the first WARMUP_STEPS steps that every rank recorded, a rank is slow
at a step when its work exceeds the median work of the other ranks at that step by more than
SLOW_FACTOR (and by at least MIN_EXCESS_S, below which the difference is timer noise). It is a
straggler when it is slow in at least SLOW_SHARE of at least MIN_STEPS compared steps. When
several ranks qualify, the one slow most often is named.

On CUDA host times cannot tell: a collective returns as soon as it is queued, and a fast rank waits
for the slow one wherever its host next waits for its device, which may fall inside its own work.
There the work is the device's (``device_work``, from two CUDA events a step): from the end of the
previous step's queued work to the start of the synchronising part, which a wait for a peer's
gradient all-reduce precedes in stream order. summary.py compares it where every rank has it, host
times otherwise; a collective inside a step's own work (fsdp's all-gathers, DDP's buffer broadcast)
still counts as work (docs/metrics.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

WARMUP_STEPS = 3
SLOW_FACTOR = 1.10
SLOW_SHARE = 0.60
MIN_STEPS = 5
MIN_EXCESS_S = 1e-3


@dataclass(frozen=True)
class Straggler:
    rank: int
    slow_share: float  # of the compared steps, those in which this rank was slow
    excess_s: float  # median over the compared steps of its work minus the others' median
    steps: int  # steps compared


def find_straggler(work: dict[int, dict[int, float]]) -> Straggler | None:
    """``work[rank][step]``: seconds of the rank's own work in each step."""
    if len(work) < 2:
        return None
    common = sorted(set.intersection(*(set(steps) for steps in work.values())))[WARMUP_STEPS:]
    if len(common) < MIN_STEPS:
        return None
    found: Straggler | None = None
    for rank, mine in work.items():
        excess, slow = [], 0
        for step in common:
            others = median(w[step] for r, w in work.items() if r != rank)
            excess.append(mine[step] - others)
            slow += mine[step] > SLOW_FACTOR * others and mine[step] - others >= MIN_EXCESS_S
        candidate = Straggler(rank, slow / len(common), median(excess), len(common))
        if candidate.slow_share >= SLOW_SHARE and (
            found is None or (candidate.slow_share, candidate.excess_s) > (found.slow_share, found.excess_s)
        ):
            found = candidate
    return found
