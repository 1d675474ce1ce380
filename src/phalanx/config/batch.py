"""Batch arithmetic: global batch = micro batch x accumulation steps x data-parallel processes; and
the entries of ``batch.schedule``, the multiples of the starting global batch at given steps."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from phalanx.errors import ConfigError
from phalanx.util.words import plural


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int  # samples per optimizer step, all devices
    micro_batch_size: int  # samples per data-parallel process per forward
    accumulation_steps: int
    data_parallel_size: int

    def describe(self) -> str:
        return (
            f"global batch {self.global_batch_size} = micro batch {self.micro_batch_size}"
            f" x {plural(self.accumulation_steps, 'accumulation step')} x {plural(self.data_parallel_size, 'process')}"
        )


def plan_batch(
    data_parallel_size: int,
    global_batch_size: int | None,
    micro_batch_size: int | None,
    max_micro_batch_size: int | None = None,
    *,
    multiple_of: int = 1,
) -> BatchPlan:
    """Derive the missing sizes and refuse combinations that cannot be met exactly.

    With only the global batch given, each process takes an equal share (no accumulation). With only
    the micro batch, the global batch is one micro batch per process. ``max_micro_batch_size`` is a
    per-device memory limit rather than a size: the micro batch is then the largest divisor of the
    per-process share that is at most the limit (and a multiple of ``multiple_of``, the pipeline's
    micro-batch count), so the same limit plans any process count. An exact ``micro_batch_size`` wins
    over the limit, but may not exceed it.
    """
    n = data_parallel_size
    if max_micro_batch_size is not None:
        if micro_batch_size is not None:
            if micro_batch_size > max_micro_batch_size:
                raise ConfigError(
                    f"micro_batch_size {micro_batch_size} is above max_micro_batch_size {max_micro_batch_size} "
                    "(the largest that fits one device); lower it, or set batch.max_micro_batch_size=null"
                )
        elif global_batch_size is None:  # as with micro_batch_size alone: one micro batch per process
            if max_micro_batch_size < multiple_of:
                raise ConfigError(
                    f"max_micro_batch_size {max_micro_batch_size} is below {multiple_of}, the smallest micro batch "
                    f"this strategy can split (a multiple of its {multiple_of} pipeline micro-batches); raise it"
                )
            micro_batch_size = max_micro_batch_size // multiple_of * multiple_of
        else:
            micro_batch_size = _micro_within(global_batch_size, n, max_micro_batch_size, multiple_of)
    if global_batch_size is None and micro_batch_size is None:
        raise ConfigError(
            "set batch.global_batch_size (or pass a DataLoader with a batch_size) "
            "so phalanx can split it over processes"
        )
    if global_batch_size is None:
        return BatchPlan(micro_batch_size * n, micro_batch_size, 1, n)
    if micro_batch_size is None:
        if global_batch_size % n:
            raise ConfigError(
                f"global_batch_size {global_batch_size} cannot be split evenly over {plural(n, 'process')}; "
                f"use a multiple of {n} (e.g. {_multiples_near(global_batch_size, n)}) or set batch.micro_batch_size"
            )
        return BatchPlan(global_batch_size, global_batch_size // n, 1, n)
    per_step = micro_batch_size * n
    if global_batch_size % per_step:
        raise ConfigError(
            f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size {micro_batch_size} "
            f"x {plural(n, 'process')} = {per_step}; "
            f"use global_batch_size {_multiples_near(global_batch_size, per_step)}, "
            "or a micro_batch_size that divides "
            f"{global_batch_size // n if global_batch_size % n == 0 else 'global_batch_size / processes'}"
        )
    return BatchPlan(global_batch_size, micro_batch_size, global_batch_size // per_step, n)


def largest_micro_batch(per_process: int, limit: int, multiple_of: int = 1) -> int | None:
    """The largest divisor of ``per_process`` that is at most ``limit`` and a multiple of
    ``multiple_of``; None when there is none."""
    return next(
        (d for d in range(min(limit, per_process), 0, -1) if per_process % d == 0 and d % multiple_of == 0), None
    )


def _micro_within(global_batch_size: int, n: int, limit: int, multiple_of: int) -> int:
    if global_batch_size % n:
        raise ConfigError(
            f"global_batch_size {global_batch_size} cannot be split evenly over {plural(n, 'process')}; "
            f"use a multiple of {n} (e.g. {_multiples_near(global_batch_size, n)})"
        )
    per_process = global_batch_size // n
    micro = largest_micro_batch(per_process, limit, multiple_of)
    if micro is None:  # only with multiple_of > 1: 1 divides everything
        raise ConfigError(
            f"no micro batch of at most max_micro_batch_size {limit} that is a multiple of {multiple_of} "
            f"divides the {per_process} samples per process of global_batch_size {global_batch_size}; "
            f"raise batch.max_micro_batch_size, or use a global batch whose share per process is a multiple of "
            f"{multiple_of}"
        )
    return micro


def _multiples_near(value: int, base: int) -> str:
    """The multiples of ``base`` on either side of ``value``: "4 or 6"."""
    below, above = (value // base) * base, -(-value // base) * base
    return f"{below} or {above}" if below > 0 else str(above)


# -- batch.schedule: a scheduled batch warm-up -----------------------------------------------------
SCHEDULE_FORMAT = (
    "x<multiple>@<point>, comma-separated or a list: the multiple a power of two from 2 up, the point a step "
    "number (x2@3000) or a percentage of train.max_steps (x2@30%), both increasing, e.g. 'x2@30%,x4@60%'"
)
_ENTRY = re.compile(r"x(?P<k>\d+)@(?P<at>\d+(?:\.\d+)?)(?P<percent>%?)")


@dataclass(frozen=True)
class Growth:
    """One entry of ``batch.schedule``: from the end of optimizer step ``at`` (or of the step at
    ``at`` per cent of train.max_steps) on, the global batch is ``multiple`` times the starting one."""

    multiple: int
    at: Fraction  # a step number, or a percentage when ``percent``
    percent: bool

    def step(self, max_steps: int | None) -> int:
        if not self.percent:
            return int(self.at)
        if max_steps is None:
            raise ConfigError(
                f"batch.schedule x{self.multiple}@{_point(self)} is a share of train.max_steps, which is null; "
                f"set train.max_steps, or give the step (x{self.multiple}@<step>)"
            )
        return math.floor(self.at * max_steps / 100)


def parse_schedule(value: str | list[str]) -> tuple[Growth, ...]:
    """``batch.schedule`` as written (``"x2@30%,x4@60%"``, or a list of such entries) -> its entries;
    ValueError in one line for anything else."""
    entries = value.split(",") if isinstance(value, str) else list(value)
    out: list[Growth] = []
    for entry in entries:
        text = entry.strip().replace(" ", "") if isinstance(entry, str) else None
        match = _ENTRY.fullmatch(text) if text else None
        if match is None:
            raise ValueError(f"entry {entry!r} is not {SCHEDULE_FORMAT}")
        k, at, percent = int(match["k"]), Fraction(match["at"]), bool(match["percent"])
        if k < 2 or k & (k - 1):
            raise ValueError(f"entry {text!r}: the multiple must be a power of two from 2 up")
        if percent and not 0 < at < 100:
            raise ValueError(f"entry {text!r}: a percentage of train.max_steps lies between 0 and 100")
        if not percent and (at.denominator != 1 or at < 1):
            raise ValueError(f"entry {text!r}: the step must be a whole number from 1 up")
        out.append(Growth(k, at, percent))
    if not out:
        raise ValueError(f"it is empty; write {SCHEDULE_FORMAT}, or null for none")
    if len({g.percent for g in out}) > 1:
        raise ValueError("it mixes step numbers and percentages; give all its points one way")
    for before, after in zip(out, out[1:]):
        if after.multiple <= before.multiple or after.at <= before.at:
            raise ValueError(
                f"x{after.multiple}@{_point(after)} must come after x{before.multiple}@{_point(before)} "
                "with a larger multiple; both increase along the schedule"
            )
    return tuple(out)


def schedule_steps(growths: tuple[Growth, ...], max_steps: int | None) -> list[tuple[int, int]]:
    """(optimizer step, multiple) of each growth for a run of ``max_steps`` (None: no limit);
    ConfigError when a point falls on step 0, on the same step as the one before, or at the end."""
    out: list[tuple[int, int]] = []
    for growth in growths:
        step = growth.step(max_steps)
        where = f"batch.schedule x{growth.multiple}@{_point(growth)}"
        if step < 1 or (out and step <= out[-1][0]):
            raise ConfigError(
                f"{where} falls on step {step} of train.max_steps {max_steps}, "
                + ("before the first step" if step < 1 else f"as the growth before it (step {out[-1][0]})")
                + "; space the percentages further apart, or give step numbers"
            )
        if max_steps is not None and step >= max_steps:
            raise ConfigError(f"{where} is at or after train.max_steps {max_steps}: it would never train")
        out.append((step, growth.multiple))
    return out


def _point(growth: Growth) -> str:
    return f"{float(growth.at):g}%" if growth.percent else str(growth.at)
