"""Where the Session's gradients feed the gradient noise scale (runtime/noise_scale.py).

Every ``train.noise_scale_every``-th optimizer step is an estimating step. Its big-batch gradient is
the one the optimizer gets (the global batch), read right after the synchronising backward, before
any clipping. Its small-batch gradient is one rank's gradient over one micro-batch, taken where it
already exists: under accumulation, the first micro-step's gradient (it is alone in ``.grad``
until the second backward adds to it); without accumulation and with several processes, each
rank's gradient before DDP averages it, measured in DDP's comm hook. The small squared norm is
averaged over the ranks (one all-reduce of one number per estimating step).

An estimating step reads nothing back to the host (under fp16, torch's GradScaler.get_scale reads
the loss scale once): its two squared norms stay on the device until
``settle()``, which the Session calls where the estimate is used or written (the metrics flush,
about once a second; a batch.adaptive decision; a checkpoint). Reading them at the step would make
the host wait for the device there (a stall of the kernel queue on a GPU).
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

_REMEMBERED = 1000  # values kept for the records not yet written (a flush writes at most 500)


class NoiseProbe:
    def __init__(self, config: Config, strategy: Strategy, topology: Topology, models: list[nn.Module]):
        self.settings = config.train
        self.strategy = strategy
        self.topology = topology
        self._models = models  # the Session's list
        self._estimate: NoiseScale | None = None  # the moving averages, without the unread estimates
        self.why_not: str | None = None  # why this run has no estimate, once the batch is planned
        self._source: str | None = None  # where the small batch's gradient is read (see plan)
        self._small: torch.Tensor | None = None
        self._waiting: list[torch.Tensor] = []  # (small, ranks that had one, big) per estimate, unread
        self.taken = 0  # estimating steps so far, read or not: a metrics record notes it
        self._after: dict[int, float | None] = {0: None}  # the value once the first n were read
        self._pending: dict[str, Any] | None = None  # a checkpoint's state, until the batch is planned
        # Whether this run estimates at all: the Session skips the probe's per-step calls where not.
        self.estimates = False

    def plan(self, batch: BatchPlan) -> None:
        """The batch sizes are known (or changed): choose where the small batch comes from."""
        self._estimate, self.why_not, self._source = None, None, None
        self.estimates = False
        self._restart()
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
        self._estimate = NoiseScale(small, batch.global_batch_size, self.settings.noise_scale_smoothing)
        self.estimates = True
        if self._pending is not None:
            self._estimate.load_state_dict(self._pending)
            self._pending = None
            self._restart()

    def resize(self, batch: BatchPlan) -> None:
        """The global batch changed (batch.adaptive): the same estimate goes on at the new sizes."""
        if self._estimate is None:
            return
        self.settle()  # the estimates taken so far were of the old sizes
        self._estimate.big = batch.global_batch_size
        if self._source == "comm hook":
            self._estimate.small = batch.global_batch_size // self.strategy.data_parallel_size

    def wants_one_micro_batch_first(self, step: int) -> bool:
        """Whether the step after ``step`` reads its small batch from its first forward, which
        should then be one micro-batch: the widest ratio of the two batches, as without joining."""
        return self._source == "micro-step" and self.measuring(step)

    def measuring(self, step: int) -> bool:
        """Whether the optimizer step after ``step`` steps estimates."""
        return self._estimate is not None and (step + 1) % self.settings.noise_scale_every == 0

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
        mean_factor: Callable[[bool], torch.Tensor] | None = None,
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
            self._small = self._scaled(self.strategy.gradient_sq(self._models), factor, scale)
        if not sync:
            return
        if self._source == "comm hook":
            norms = self.strategy.local_norms  # None where fsdp found no reduce-scatter to wrap after all
            local = norms.take() if norms is not None else None
            # DDP's buckets hold the micro-steps' sum (each loss divided by the steps): the mean.
            factor = mean_factor(True) if mean_factor is not None and local is not None else 1.0
            self._small = self._scaled(local, factor, scale) if local is not None else None
        small, self._small = self._small, None
        big = self.strategy.gradient_sq(self._models) / scale**2
        # (small, ranks that had one): a rank whose hook saw no bucket sends zeros.
        zero = torch.zeros((), dtype=torch.float64, device=self.topology.comm_device)
        value, had = small if small is not None else (zero, zero)
        if not isinstance(had, torch.Tensor):  # filled on the device: a copy from the host would wait
            had = torch.full((), float(had), dtype=torch.float64, device=zero.device)
        pair = torch.stack([value.to(zero.device, torch.float64), had.to(zero.device, torch.float64)])
        if self.topology.world_size > 1:
            # Each rank's small gradient is its own: their sum and how many ranks had one, in one
            # all-reduce that every rank joins.
            dist.all_reduce(pair)
        row = torch.cat([pair, big.to(pair.device, torch.float64).reshape(1)])
        self._waiting.append(row)
        self.taken += 1

    @staticmethod
    def _scaled(norm_sq: torch.Tensor, factor: Any, scale: float) -> tuple[torch.Tensor, Any]:
        """(the small batch's squared mean gradient, whether it had one): a token-weighted window's
        ``factor`` is a tensor, 0 without items (no estimate from it), and stays on the device."""
        if isinstance(factor, torch.Tensor):
            return norm_sq * (factor.to(norm_sq.device) / scale) ** 2, factor > 0
        return norm_sq * (factor / scale) ** 2, 1.0

    def settle(self) -> None:
        """Feed the estimates taken since the last call to the moving averages: one read of the
        device for all of them. Every rank has the same rows (they come out of an all-reduce), so
        settling at the same step gives every rank the same value."""
        if not self._waiting or self._estimate is None:
            self._waiting.clear()
            return
        rows = torch.stack([row.to(self._waiting[0].device) for row in self._waiting]).tolist()
        self._waiting.clear()
        first = self.taken - len(rows) + 1
        for n, (small_sum, had, big) in enumerate(rows, start=first):
            if had > 0:
                self._estimate.observe(small_sum / had, big)
            self._after[n] = self._estimate.value
        for old in [n for n in self._after if n < self.taken - _REMEMBERED]:
            del self._after[old]

    def value_after(self, taken: int) -> float | None:
        """The value once the first ``taken`` estimates were in (what a metrics record of that step
        shows, written at the flush)."""
        self.settle()
        if taken in self._after:
            return self._after[taken]
        return self._after[min(self._after)] if taken < min(self._after) else self.value

    def _restart(self) -> None:
        """A new estimate (planned, or restored): what records show from here."""
        self._waiting.clear()
        self._after = {self.taken: self._estimate.value if self._estimate is not None else None}

    @property
    def estimate(self) -> NoiseScale | None:
        """The moving averages with every estimating step so far (None where this run has none)."""
        self.settle()
        return self._estimate

    @property
    def value(self) -> float | None:
        """The estimate, with every estimating step so far in it (reading it reads the device: the
        Session asks only at a metrics flush and at a batch.adaptive decision)."""
        self.settle()
        return self._estimate.value if self._estimate is not None else None

    def state_dict(self) -> dict[str, Any] | None:
        self.settle()
        return self._estimate.state_dict() if self._estimate is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        if self._estimate is None:
            self._waiting.clear()
            self._pending = state  # restored once the batch is planned
        else:
            self._estimate.load_state_dict(state)
            self._restart()
