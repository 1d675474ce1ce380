"""What ``phalanx tune`` tries next and what it keeps: pure functions of trial results, so tests feed
them fake outcomes.

A trial's result is reduced here to what the choice needs: whether it fit (ran its steps), and its
samples/s and data-wait share when it did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from phalanx.runtime.noise_scale import efficiency

# A change must measure at least this much faster than the value it replaces: on a shared machine,
# trial-to-trial noise of a few per cent would otherwise decide.
MIN_GAIN = 0.03
# Data wait under this share of the step time counts as "not waiting for data".
DATA_WAIT_TARGET = 0.03
BUCKETS_MB = (10.0, 25.0, 50.0, 100.0)

# --objective time: the noise scale comes from one longer trial of the script's own settings, whose
# first steps do not count. Early in training B_noise is well below what it is later (the gradient is
# large against its noise), so the first steps of a short trial made larger batches look costly.
NOISE_TRIAL_LENGTH = 5  # the noise trial runs this many times --steps ...
NOISE_TRIAL_MIN_STEPS = 100  # ... and at least this many optimizer steps
NOISE_WARMUP = 0.5  # the share of its steps whose estimates are weighted out
NOISE_WARMUP_WEIGHT = 0.05  # ... down to at most this share of the final estimate
NOISE_EVERY = 2  # an estimate every other step


def noise_trial(steps: int) -> tuple[int, tuple[str, ...]]:
    """(optimizer steps, config overrides) of the noise trial for trials of ``steps`` steps.

    The Session's estimate is a moving average of its two parts (docs/goodput.md), factor beta per
    estimate; the estimates before the warm-up then weigh at most beta^(estimates after it) of the
    average at the end, and beta is chosen so that this is NOISE_WARMUP_WEIGHT: the value at the
    trial's end is (to within that weight) the average over the estimates after its warm-up.
    """
    total = max(NOISE_TRIAL_LENGTH * steps, NOISE_TRIAL_MIN_STEPS)
    late = (total - math.floor(total * NOISE_WARMUP)) // NOISE_EVERY
    smoothing = NOISE_WARMUP_WEIGHT ** (1 / late)
    return total, (
        "train.noise_scale=hook",  # under ddp without accumulation too
        f"train.noise_scale_every={NOISE_EVERY}",
        f"train.noise_scale_smoothing={smoothing:.6f}",
    )


def noise_trial_minimum(total: int) -> int:
    """The fewest steps a noise trial of ``total`` steps may end after and still count: its
    weighted-out first part and five estimates after it (a script may end before ``total``)."""
    return min(total, math.floor(total * NOISE_WARMUP) + 5 * NOISE_EVERY)


@dataclass(frozen=True)
class Measured:
    """One trial as the choice sees it; ``samples_per_s`` is None when it did not run its steps."""

    value: float | int
    samples_per_s: float | None
    data_wait_share: float | None = None
    global_batch: int | None = None

    @property
    def ok(self) -> bool:
        return self.samples_per_s is not None

    def goodput(self, noise_scale: float) -> float | None:
        """Samples/s times the statistical efficiency of its global batch (see :func:`efficiency`):
        the progress per second, in samples of a tiny batch."""
        if not self.ok or self.global_batch is None:
            return None
        return self.samples_per_s * efficiency(self.global_batch, noise_scale)


# -- micro-batch ----------------------------------------------------------------------------------
def micro_candidates(per_process: int, start: int, *, keep_global: bool, most: int, multiple_of: int = 1) -> list[int]:
    """Micro-batch sizes a trial may use, ascending, ``start`` among them.

    ``per_process`` is the global batch over the data-parallel processes (micro-batch x accumulation
    steps). Keeping the global batch, a micro-batch must divide it: only the accumulation steps
    change, so training is the same computation. Otherwise any size above it is allowed too (one
    accumulation step, a larger global batch). ``multiple_of``: the pipeline's micro-batch count.
    """
    sizes = {d for d in range(1, per_process + 1) if per_process % d == 0}
    if not keep_global:
        sizes |= set(range(per_process + 1, most + 1))
    sizes = {s for s in sizes if s <= most and s % multiple_of == 0} | {start}
    return sorted(sizes)


def largest_fitting(candidates: list[int], start: int, fits: Callable[[int], bool]) -> int | None:
    """The largest candidate that fits, assuming memory grows with the micro-batch: from ``start``,
    double while it fits (halve while it does not), then bisect between the last fit and the first
    failure. ``fits`` runs a trial; each size is asked at most once. None: not even the smallest fits."""
    seen: dict[int, bool] = {}

    def ask(i: int) -> bool:
        size = candidates[i]
        if size not in seen:
            seen[size] = fits(size)
        return seen[size]

    i = candidates.index(start)
    if ask(i):
        lo, hi = i, len(candidates)  # hi: first known failure (len: none found)
        while lo < len(candidates) - 1:
            j = max(k for k in range(lo + 1, len(candidates)) if k == lo + 1 or candidates[k] <= 2 * candidates[lo])
            if ask(j):
                lo = j
            else:
                hi = j
                break
    else:
        hi = i
        while True:
            if hi == 0:
                return None
            j = max((k for k in range(hi) if candidates[k] * 2 <= candidates[hi]), default=0)
            if ask(j):
                lo = j
                break
            hi = j
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ask(mid):
            lo = mid
        else:
            hi = mid
    return candidates[lo]


def global_batch_for(micro: int, global_batch: int, data_parallel: int) -> int:
    """The global batch a trial at ``micro`` runs with: the script's own while ``micro`` divides its
    per-process share; beyond it, one micro-batch per process (no accumulation)."""
    per_process = global_batch // data_parallel
    return global_batch if micro <= per_process and per_process % micro == 0 else micro * data_parallel


# -- time to a target -----------------------------------------------------------------------------
def predicted_time_ratio(candidate: Measured, reference: Measured, noise_scale: float) -> float:
    """Time to the same quality at ``candidate``'s settings over that at ``reference``'s: the
    inverse ratio of their goodputs."""
    good = candidate.goodput(noise_scale)
    return reference.goodput(noise_scale) / good if good else float("inf")


def fastest_to_target(
    results: list[Measured], current: float | int | None, noise_scale: float, min_gain: float = MIN_GAIN
) -> Measured | None:
    """The result of the highest goodput (throughput x statistical efficiency), unless the current
    value's is within ``min_gain`` of it. The largest batch that fits is no longer the answer when
    its samples do less work than its speed buys."""
    ok = [r for r in results if r.ok and r.global_batch is not None]
    if not ok:
        return None
    best = max(ok, key=lambda r: r.goodput(noise_scale))
    now = next((r for r in ok if r.value == current), None)
    if now is not None and best.goodput(noise_scale) < now.goodput(noise_scale) * (1 + min_gain):
        return now
    return best


# -- choices --------------------------------------------------------------------------------------
def fastest(results: list[Measured], current: float | int | None, min_gain: float = MIN_GAIN) -> Measured | None:
    """The fastest result, unless the current value (when measured and fit) is within ``min_gain``
    of it: then the current one stays. Ties go to the value tried first."""
    ok = [r for r in results if r.ok]
    if not ok:
        return None
    best = max(ok, key=lambda r: r.samples_per_s)
    now = next((r for r in ok if r.value == current), None)
    if now is not None and best.samples_per_s < now.samples_per_s * (1 + min_gain):
        return now
    return best


def confirmed(current: float | None, winner: float | None, min_gain: float = MIN_GAIN) -> bool:
    """The second comparison of a change: the winner again at least ``min_gain`` faster."""
    return current is not None and winner is not None and winner >= current * (1 + min_gain)


def stop_adding_workers(result: Measured, target: float = DATA_WAIT_TARGET) -> bool:
    """More loader workers cannot help once the step no longer waits for data (or a trial failed)."""
    return not result.ok or result.data_wait_share is None or result.data_wait_share < target


def choose_workers(results: list[Measured], target: float = DATA_WAIT_TARGET, slack: float = 0.01) -> Measured | None:
    """The fewest workers that stop the data wait (under ``target`` of the step); when no count
    does, the fewest within ``slack`` (a share of the step) of the lowest wait measured. Decided on
    the data wait, which each trial measures inside its own steps, rather than on samples/s, which
    moves with the machine's load between trials; and fewest, because every worker is a process
    holding a copy of the dataset object and competing for the cores."""
    ok = [r for r in results if r.ok and r.data_wait_share is not None]
    if not ok:
        return None
    under = [r for r in ok if r.data_wait_share < target]
    if under:
        return min(under, key=lambda r: r.value)
    lowest = min(r.data_wait_share for r in ok)
    return min((r for r in ok if r.data_wait_share <= lowest + slack), key=lambda r: r.value)


def worker_counts(cpus_per_rank: int) -> list[int]:
    """0 (loading in the training process), 1, 2, ... up to the cores each rank has."""
    return list(range(0, max(1, cpus_per_rank) + 1))


def bucket_sizes(current: float, gradient_mib: float | None = None) -> list[float]:
    """The sizes to try: 10, 25, 50, 100 MiB and the current one. Sizes that hold all the
    gradients in one bucket all behave alike, so of those only the current one (or the smallest)
    is kept; gradients that fit in one bucket of every size leave just one: nothing to tune."""
    sizes = sorted(set(BUCKETS_MB) | {float(current)})
    if gradient_mib is None:
        return sizes
    below = [s for s in sizes if s < gradient_mib]
    whole = [s for s in sizes if s >= gradient_mib]
    return below + ([float(current)] if float(current) in whole else whole[:1])


# -- learning rate --------------------------------------------------------------------------------
def lr_settings(
    original_global: int, new_global: int, *, rule: str, reference: int | None, warmup_steps: int
) -> dict[str, object]:
    """Config values that keep the learning rate right for a global batch tune enlarged.

    The user's rule is kept when they chose one; otherwise ``sqrt`` (the conservative one, and the
    usual rule for Adam-type optimizers; SGD users often prefer ``linear``). The reference is the
    batch the lr was tuned for: the user's, or the script's original global batch. A warm-up of 100
    optimizer steps is added when there was none and the lr grows: a jump to a larger lr at step 0
    is what warm-up exists to avoid (Goyal et al., 2017)."""
    if new_global == original_global:
        return {}
    reference = reference or original_global
    values: dict[str, object] = {
        "batch.global_batch_size": new_global,
        "optim.lr_scaling": rule if rule != "none" else "sqrt",
        "optim.reference_batch_size": reference,
    }
    if new_global > reference or warmup_steps > 0:
        values["optim.warmup_steps"] = warmup_steps if warmup_steps > 0 else 100
    return values


def lr_multiplier(values: dict[str, object]) -> float:
    """The scale :func:`lr_settings` implies, for the summary line."""
    ratio = values["batch.global_batch_size"] / values["optim.reference_batch_size"]  # type: ignore[operator]
    return ratio if values["optim.lr_scaling"] == "linear" else math.sqrt(ratio)
