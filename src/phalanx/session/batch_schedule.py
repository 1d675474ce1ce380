"""``batch.schedule``: a scheduled batch warm-up, the robust way to a larger batch, which needs no
gradient noise scale (so no plateau can mislead it).

The global batch grows at the points the config names (``"x2@30%,x4@60%"``: twice the starting
global batch G0 from the end of the step at 30% of ``train.max_steps``, four times from 60%; or step
numbers, ``"x2@3000"``), by the machinery batch.adaptive uses (adaptive.py): k times the starting
accumulation steps, forwards that join micro-batches up to ``batch.max_micro_batch_size``, the user's
schedulers stepping k times per optimizer step. Grow where a step-decay schedule would decay the
learning rate: a larger batch lowers the noise of the updates as a smaller learning rate does, in
fewer, larger steps (Smith et al. 2018, "Don't decay the learning rate, increase the batch size";
Seesaw, 2025; the batch warm-up of "Critical Batch Size Revisited", 2025).

The learning rate at k G0, as Seesaw's rule for replacing a decay: SGD-family optimizers keep it
(multiplied by 1: the batch growth is the decay); Adam-family ones (``betas``) multiply it by
1 / sqrt(k) (each doubling in place of halving the learning rate comes with a 1 / sqrt(2) step).
On top of ``optim.lr_scaling``, which stays that of the starting batch. The multiple at a step is a
function of the step alone, the same on every rank; it is in the checkpoint all the same, with its
history, as batch.adaptive's is.
"""

from __future__ import annotations

import math

from phalanx.config.batch import BatchPlan, parse_schedule, schedule_steps
from phalanx.config.schema import Config
from phalanx.errors import ConfigError
from phalanx.session.adaptive import AdaptiveBatch
from phalanx.topology import Topology


def seesaw_gain(k: int, adam: bool) -> float:
    """What the learning rate is multiplied by at ``k`` times the starting batch."""
    return 1 / math.sqrt(k) if adam else 1.0


class ScheduledBatch(AdaptiveBatch):
    """batch.adaptive's multiple, taken from the schedule instead of chosen."""

    def __init__(self, config: Config, topology: Topology):
        super().__init__(config, topology)
        self.points = schedule_steps(parse_schedule(config.batch.schedule), config.train.max_steps)

    def multiple_at(self, step: int) -> int:
        """The multiple in effect after optimizer step ``step``."""
        return max((k for at, k in self.points if at <= step), default=1)

    def plan(self, batch: BatchPlan) -> BatchPlan:
        most = self.settings.adaptive_max_global_batch
        largest = self.points[-1][1] * batch.global_batch_size
        if most is not None and largest > most:
            raise ConfigError(
                f"batch.schedule grows the global batch to {largest} (x{self.points[-1][1]} of "
                f"{batch.global_batch_size}), above batch.adaptive_max_global_batch {most}; lower the schedule's "
                "multiples or raise the limit"
            )
        return super().plan(batch)

    def candidates(self) -> list[int]:
        return [1, *(k for _, k in self.points)]

    def observe_loss(self, loss) -> None:
        """The schedule does not ask the loss."""

    def decide(self, step: int, noise_scale: float | None, adam: bool) -> bool:
        """At the end of every optimizer step: the schedule's multiple (the noise scale is not asked)."""
        k = self.multiple_at(step)
        changed = k != self.k
        self.k, self.gain = k, seesaw_gain(k, adam)
        if changed:
            self.history.append((step, k))
        return changed


def check(config: Config) -> None:
    """Refuse schedule settings that cannot work, before training."""
    b = config.batch
    if b.schedule is None:
        return
    if b.fixed_layout:
        raise ConfigError(
            "batch.schedule changes the global batch during training, which batch.fixed_layout forbids; "
            "set one of them off"
        )
    schedule_steps(parse_schedule(b.schedule), config.train.max_steps)  # points within train.max_steps
