"""Batch arithmetic: global batch = micro batch x accumulation steps x data-parallel processes."""

from __future__ import annotations

from dataclasses import dataclass

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
