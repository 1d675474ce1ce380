"""Where the Session's gradients feed the gradient noise scale (runtime/noise_scale.py).

Every ``train.noise_scale_every``-th optimizer step is an estimating step. Its big-batch gradient is
the one the optimizer gets (the global batch), read right after the synchronising backward, before
any clipping. Its small-batch gradient is one rank's gradient over one micro-batch, taken where it
already exists: under accumulation, the first micro-step's gradient (it is alone in ``.grad``
until the second backward adds to it); without accumulation and with several processes, each
rank's gradient before DDP averages it, measured in DDP's comm hook. The small squared norm is
averaged over the ranks (one all-reduce of one number per estimating step).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from phalanx.config.batch import BatchPlan
from phalanx.config.schema import Config
from phalanx.runtime.noise_scale import NoiseScale
from phalanx.strategies import Strategy
from phalanx.topology import Topology


class NoiseProbe:
    def __init__(self, config: Config, strategy: Strategy, topology: Topology, models: list[nn.Module]):
        self.settings = config.train
        self.strategy = strategy
        self.topology = topology
        self._models = models  # the Session's list
        self.estimate: NoiseScale | None = None
        self.why_not: str | None = None  # why this run has no estimate, once the batch is planned
        self._source: str | None = None  # where the small batch's gradient is read (see plan)
        self._small: torch.Tensor | None = None
        self._pending: dict[str, Any] | None = None  # a checkpoint's state, until the batch is planned

    def plan(self, batch: BatchPlan) -> None:
        """The batch sizes are known (or changed): choose where the small batch comes from."""
        self.estimate, self.why_not, self._source = None, None, None
        if not self.settings.noise_scale:
            return
        dp = self.strategy.data_parallel_size
        if batch.accumulation_steps > 1 and self.strategy.local_micro_step_gradients:
            # The widest ratio of the two batches: one micro-batch against the global batch.
            self._source, small = "micro-step", batch.micro_batch_size
        elif dp > 1 and self.strategy.local_norms is not None:
            self._source, small = "comm hook", batch.global_batch_size // dp  # a rank's share, all micro-steps
        else:
            if dp == 1 and self.strategy.local_micro_step_gradients:
                self.why_not = (
                    "one process without accumulation has a single batch size; set batch.micro_batch_size below "
                    "the global batch to measure it"
                )
            elif self.strategy.ddp_buckets and dp > 1:
                self.why_not = (
                    f"strategy {self.strategy.name} without accumulation keeps DDP's built-in all-reduce; "
                    "train.noise_scale: hook measures there (a Python comm hook, which costs step time), "
                    "or accumulate (batch.micro_batch_size below the global batch / processes)"
                )
            else:
                name = self.strategy.name
                self.why_not = f"strategy {name} exposes no gradient over fewer samples than the global batch"
            return
        self.estimate = NoiseScale(small, batch.global_batch_size, self.settings.noise_scale_smoothing)
        if self._pending is not None:
            self.estimate.load_state_dict(self._pending)
            self._pending = None

    def resize(self, batch: BatchPlan) -> None:
        """The global batch changed (batch.adaptive): the same estimate goes on at the new sizes."""
        if self.estimate is None:
            return
        self.estimate.big = batch.global_batch_size
        if self._source == "comm hook":
            self.estimate.small = batch.global_batch_size // self.strategy.data_parallel_size

    def wants_one_micro_batch_first(self, step: int) -> bool:
        """Whether the step after ``step`` reads its small batch from its first forward, which
        should then be one micro-batch: the widest ratio of the two batches, as without joining."""
        return self._source == "micro-step" and self.measuring(step)

    def measuring(self, step: int) -> bool:
        """Whether the optimizer step after ``step`` steps estimates."""
        return self.estimate is not None and (step + 1) % self.settings.noise_scale_every == 0

    def before_backward(self, step: int, first: bool, joined: int, accumulation: int, sync: bool) -> None:
        if sync and self._source == "comm hook" and self.measuring(step) and self.strategy.local_norms is not None:
            self.strategy.local_norms.armed = True

    def after_backward(
        self,
        step: int,
        first: bool,
        joined: int,
        accumulation: int,
        sync: bool,
        scaler: Any,
        mean_factor: Callable[[bool], float | None] | None = None,
    ) -> None:
        """``first``: the step's first forward, over ``joined`` micro-batches (batch.adaptive joins
        them) of the step's ``accumulation``; ``scaler``: fp16's GradScaler (gradients are scaled
        until the step) or None. The Session keeps an estimating step's first forward to one
        micro-batch (wants_one_micro_batch_first), so the small batch is the plan's micro-batch.
        ``mean_factor``: with token-weighted losses (session/items.py), what turns the gradients
        held after the first backward (False) or a rank's whole window (True) into a mean (None:
        they hold no item, so that rank gives no small-batch estimate this step)."""
        if not self.measuring(step):
            return
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        if self._source == "micro-step" and first and joined == 1:
            # The loss was divided by the accumulation steps (or weighted by its items): the
            # micro-batch's own mean gradient is the accumulated one times that.
            factor = mean_factor(False) if mean_factor is not None else accumulation
            # No estimate from a micro-batch without items (factor None).
            self._small = self.strategy.gradient_sq(self._models) * (factor / scale) ** 2 if factor else None
        if not sync:
            return
        if self._source == "comm hook":
            norms = self.strategy.local_norms  # None where fsdp found no reduce-scatter to wrap after all
            local = norms.take() if norms is not None else None
            # DDP's buckets hold the micro-steps' sum (each loss divided by the steps): the mean.
            factor = mean_factor(True) if mean_factor is not None and local is not None else 1.0
            self._small = local * (factor / scale) ** 2 if local is not None and factor else None
        small, self._small = self._small, None
        big = self.strategy.gradient_sq(self._models) / scale**2
        if self.topology.world_size > 1:
            # Each rank's small gradient is its own: their mean, and how many ranks had one, in one
            # all-reduce that every rank joins (a rank whose hook saw no bucket sends zeros).
            both = torch.zeros(2, dtype=torch.float64, device=self.topology.comm_device)
            if small is not None:
                both[0], both[1] = small.to(both.device), 1.0
            dist.all_reduce(both)
            small = both[0] / both[1] if both[1] > 0 else None
        if small is not None:
            self.estimate.observe(float(small), float(big))

    @property
    def value(self) -> float | None:
        return self.estimate.value if self.estimate is not None else None

    def state_dict(self) -> dict[str, Any] | None:
        return self.estimate.state_dict() if self.estimate is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        if self.estimate is None:
            self._pending = state  # restored once the batch is planned
        else:
            self.estimate.load_state_dict(state)
