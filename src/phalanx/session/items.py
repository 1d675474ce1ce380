"""Token-weighted losses: ``session.backward(loss, items=n)``.

A language model's loss is a mean over the micro-batch's valid tokens. Averaging those means over
micro-steps and ranks (phalanx's plain contract) weights a token of a short micro-batch more than
one of a long micro-batch, so the step is not the mean over the global batch's tokens that one
process with the whole global batch computes. With ``items`` phalanx makes it that mean:

- each micro-step back-propagates ``loss * n / unit``: its sum over items, divided by a constant
  ``unit`` (a power of two near the items of a whole global batch, agreed once per run) only so
  that gradients keep the size they have under the plain contract, which fp16 loss scaling expects;
- on the synchronising micro-step, the item count and the loss sum of the window are all-reduced
  over the data-parallel ranks in one collective, started before that backward and awaited after
  it, so it overlaps the gradients' own reduction;
- the averaged gradients (each rank's sum / dp) are then multiplied by ``dp * unit / N``, N the
  global batch's items: the mean over every item. That is before clipping, before the gradient
  noise scale reads them, and before a script without an optimizer updates with them.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx._torch_compat import scale_tensors
from phalanx.errors import PhalanxError


def check_items(items: Any) -> None:
    """Refuse what cannot be an item count, in one line (a tensor's value is checked at the step)."""
    if isinstance(items, torch.Tensor):
        if items.numel() != 1 or items.is_complex() or items.dtype == torch.bool:
            raise PhalanxError(
                f"session.backward(loss, items=n) takes a count: a number or a one-element tensor, not a "
                f"{items.dtype} tensor of shape {tuple(items.shape)}; pass e.g. (labels != -100).sum()"
            )
        return
    if isinstance(items, bool) or not isinstance(items, numbers.Real):
        raise PhalanxError(
            f"session.backward(loss, items=n) takes a count (a number or a one-element tensor), not "
            f"{type(items).__name__}; pass e.g. (labels != -100).sum()"
        )
    if not math.isfinite(items) or items < 0:
        raise PhalanxError(
            f"session.backward(loss, items={items!r}): the count of items the loss averages over must be a "
            "finite number >= 0"
        )


class ItemWeighting:
    """One per Session: the items and loss of the current accumulation window, and the step's
    rescaling of the synchronised gradients."""

    def __init__(self, data_parallel_size: int, comm_device: torch.device, collective: bool):
        self.dp = data_parallel_size
        self.comm_device = comm_device
        self.collective = collective  # a process group to all-reduce over (dp > 1)
        self.unit: float | None = None
        self.weighted: bool | None = None  # this window's backwards give items (None: none yet)
        self._local: list[tuple[Any, torch.Tensor]] = []  # (items, detached loss) per micro-step
        self._pending: Any = None  # the in-flight all-reduce of (items, loss sum)
        self._totals: torch.Tensor | None = None

    def begin(self, weighted: bool) -> None:
        """Before each backward of a window: all of its backwards give items, or none."""
        if self.weighted is not None and self.weighted != weighted:
            raise PhalanxError(
                "session.backward() got items= on some micro-steps of an accumulation window and not on others; "
                "pass items on every backward (a count of what each loss averages over) or on none"
            )
        self.weighted = weighted

    def scaled_loss(self, loss: torch.Tensor, items: Any, accumulation_steps: int) -> torch.Tensor:
        """What this micro-step back-propagates: its loss summed over its items, over ``unit``."""
        check_items(items)
        if self.unit is None:
            self.unit = self._choose_unit(float(items), accumulation_steps)
        count = items.detach().to(loss.device, torch.float32) if isinstance(items, torch.Tensor) else float(items)
        self._local.append((count, loss.detach()))
        return loss * (count / self.unit)

    def _choose_unit(self, items: float, accumulation_steps: int) -> float:
        # The same on every rank (the ranks' gradients are averaged as they are), once per run: the
        # largest first count, times the window's backwards, rounded to a power of two, so that
        # dividing by it is exact and a resumed run that picks another one trains bit for bit alike.
        largest = torch.tensor([max(items, 1.0)], dtype=torch.float64, device=self.comm_device)
        if self.collective:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return 2.0 ** round(math.log2(float(largest) * accumulation_steps * self.dp))

    def start_reduce(self) -> None:
        """On the synchronising micro-step, before its backward: the window's items and loss sum,
        all-reduced over the data-parallel ranks without waiting."""
        counts = [torch.as_tensor(c, dtype=torch.float64, device=self.comm_device) for c, _ in self._local]
        sums = [(loss.double() * c).to(self.comm_device) for c, loss in self._local]
        totals = torch.stack([torch.stack(counts).sum(), torch.stack(sums).sum()])
        self._totals = totals
        self._pending = dist.all_reduce(totals, async_op=True) if self.collective else None

    def finish(self, models: list[nn.Module]) -> torch.Tensor:
        """After the synchronising backward: rescale the models' gradients to the mean over every
        item of the global batch; returns that mean of the loss (the one the progress bar and the
        metrics show). Refuses a global batch without items."""
        if self._pending is not None:
            self._pending.wait()
        totals, self._pending = self._totals, None
        count = totals[0]
        if not bool(torch.isfinite(count)) or float(count) <= 0:
            raise PhalanxError(
                f"the items given to session.backward(loss, items=n) add up to {float(count):g} over the global "
                "batch; a token-weighted step needs at least one item (check that not every label is padding, "
                "e.g. -100), and n must be finite"
            )
        factor = (self.dp * self.unit / count).to(torch.float32)
        grads = [p.grad for model in models for p in model.parameters() if p.grad is not None]
        locals_ = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        by_device: dict[tuple, list[torch.Tensor]] = {}
        for g in locals_:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_device.items():
            scale_tensors(group, factor.to(device))
        return (totals[1] / count).float()

    def mean_factor(self, whole_window: bool) -> float:
        """What turns the gradients now held into a mean over their items, for the gradient noise
        scale: after the window's first backward alone, or (``whole_window``) this rank's whole
        window before the ranks' gradients are averaged. Reads counts from the device: only on the
        steps that estimate."""
        counts = self._local if whole_window else self._local[:1]
        total = sum(float(c) for c, _ in counts)
        return self.unit / total if total > 0 else math.nan

    def reset(self) -> None:
        """At the end of each window (a step, or a window dropped at the epoch's end)."""
        self.weighted = None
        self._local = []
        self._pending = None
        self._totals = None


def weighted_mean(value: Any, items: Any, *, data_parallel_size: int, comm_device: torch.device) -> Any:
    """``session.reduce(value, items=n)``: ``value`` (a number or one-element tensor, a mean over
    ``n`` items on this rank) averaged over every item of the data-parallel ranks, sum(value * n) /
    sum(n), in one all-reduce."""
    check_items(items)
    as_number = not isinstance(value, torch.Tensor)
    if not as_number and value.numel() != 1:
        raise PhalanxError(
            f"session.reduce(value, items=n) averages one value per process, not a tensor of shape "
            f"{tuple(value.shape)}; reduce each element separately, or drop items="
        )
    mean = torch.as_tensor(value.detach() if not as_number else value, dtype=torch.float64).to(comm_device)
    count = torch.as_tensor(items.detach() if isinstance(items, torch.Tensor) else items, dtype=torch.float64)
    count = count.to(comm_device).reshape(())
    pair = torch.stack([mean.reshape(()) * count, count])
    if data_parallel_size > 1:
        dist.all_reduce(pair)
    if float(pair[1]) <= 0:
        raise PhalanxError(
            "session.reduce(value, items=n): the items add up to 0 over the processes, so there is nothing to "
            "average; give the count the value is a mean over"
        )
    result = pair[0] / pair[1]
    if as_number:
        return result.item()
    return result.to(value.device, value.dtype if value.is_floating_point() else torch.float64).reshape(value.shape)
