"""Token-weighted losses: ``session.backward(loss, items=n)``.

A language model's loss is a mean over the micro-batch's valid tokens. Averaging those means over
micro-steps and ranks (phalanx's plain contract) weights a token of a short micro-batch more than
one of a long micro-batch, so the step is not the mean over the global batch's tokens that one
process with the whole global batch computes. With ``items`` phalanx makes it that mean:

- each micro-step back-propagates ``loss * n / unit``: its sum over items, divided by ``unit``, a
  power of two near one rank's items per window (agreed at the first window and kept: following
  each window's count would read it from the device every step), only so that gradients keep
  about the size they have under the plain contract, which fp16 loss scaling and compressed
  all-reduces expect;
- on the synchronising micro-step, the item count and the loss sum of the window are all-reduced
  over the data-parallel ranks in one collective, started before that backward and awaited after
  it, so it overlaps the gradients' own reduction (nothing is read back to the host in the step:
  the counts are checked every ``ITEMS_CHECK_EVERY`` optimizer steps, at the same step on every
  rank, and when the Session closes);
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
from phalanx.strategies.dtensor_state import local

ITEMS_CHECK_EVERY = 50  # optimizer steps between two reads of the windows' counts (one stacked read)


def check_items(items: Any) -> None:
    """Refuse what cannot be an item count, in one line (a tensor's value is checked a window later)."""
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

    def __init__(self, data_parallel_size: int, group: Any, comm_device: torch.device):
        self.dp = data_parallel_size
        self.group = group  # the data-parallel ranks' process group (None: every process)
        self.comm_device = comm_device
        self.collective = data_parallel_size > 1  # several ranks to all-reduce over
        self.unit: float | None = None
        self.weighted: bool | None = None  # this window's backwards give items (None: none yet)
        self._local: list[tuple[Any, torch.Tensor]] = []  # (items, detached loss) per micro-step
        self._pending: Any = None  # the in-flight all-reduce of (items, loss sum, negative counts)
        self._totals: torch.Tensor | None = None
        self._finished = False  # this window's gradients are rescaled already
        # Past windows' global totals, on their way to the host: checked every ITEMS_CHECK_EVERY steps.
        self._waiting: list[tuple[torch.Tensor, Any]] = []

    def begin(self, weighted: bool) -> None:
        """Before each backward of a window: all of its backwards give items, or none, and none
        comes after the one that rescaled the window's gradients."""
        if self.weighted is not None and self.weighted != weighted:
            raise PhalanxError(
                "session.backward() got items= on some micro-steps of an accumulation window and not on others; "
                "pass items on every backward (a count of what each loss averages over) or on none"
            )
        if self._finished:
            raise PhalanxError(
                "session.backward(loss, items=n) came again after the backward that synchronised this global "
                "batch (its gradients are already averaged over its items); call it once per micro-step, with the "
                "losses combined first: (loss_a * n_a + loss_b * n_b) / (n_a + n_b) and items=n_a + n_b"
            )
        self.weighted = weighted

    def scaled_loss(self, loss: torch.Tensor, items: Any, accumulation_steps: int) -> torch.Tensor:
        """What this micro-step back-propagates: its loss summed over its items, over ``unit``."""
        check_items(items)
        if self.unit is None:
            self.unit = self._first_unit(float(items), accumulation_steps)
        count = items.detach().to(loss.device, torch.float32) if isinstance(items, torch.Tensor) else float(items)
        self._local.append((count, loss.detach()))
        return loss * (count / self.unit)

    def _first_unit(self, items: float, accumulation_steps: int) -> float:
        # The same on every rank (the ranks' gradients are averaged as they are): the largest first
        # count times the window's backwards, about a rank's items per window, so that a rank's
        # gradient is about the mean it is under the plain contract. A power of two, so dividing by
        # it is exact and a run that picks another one (a resumed run) trains bit for bit alike.
        largest = torch.tensor([max(items, 1.0)], dtype=torch.float64, device=self.comm_device)
        if self.collective:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
        return _power_of_two(float(largest) * accumulation_steps)

    def start_reduce(self) -> None:
        """On the synchronising micro-step, before its backward: the window's items, loss sum and
        negative counts, all-reduced over the data-parallel ranks without waiting."""
        counts = torch.stack([_on(c, self.comm_device) for c, _ in self._local])
        # A micro-batch without items has a loss of NaN (a mean over nothing) that counts for nothing.
        sums = torch.stack(
            [
                torch.where(torch.as_tensor(c) > 0, loss.double() * c, 0.0).to(self.comm_device)
                for c, loss in self._local
            ]
        )
        totals = torch.stack([counts.sum(), sums.sum(), (counts < 0).sum().double()])
        self._totals = totals
        self._pending = dist.all_reduce(totals, async_op=True, group=self.group) if self.collective else None

    def finish(self, models: list[nn.Module]) -> torch.Tensor:
        """After the synchronising backward: rescale the models' gradients to the mean over every
        item of the global batch; returns that mean of the loss (the one the progress bar and the
        metrics show). Nothing is read back to the host here: a window whose items add up to 0 gets
        a factor of 0 and is refused at the next backward (or when the Session closes)."""
        if self._pending is not None:
            self._pending.wait()
        totals, self._pending = self._totals, None
        self._finished = True
        count = totals[0]
        factor = torch.where(count > 0, self.dp * self.unit / count, 0.0).to(torch.float32)
        grads = [p.grad for model in models for p in model.parameters() if p.grad is not None]
        by_device: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            piece = local(g)  # an fsdp shard is multiplied in place
            by_device.setdefault((piece.device, piece.dtype), []).append(piece)
        for (device, _), group in by_device.items():
            scale_tensors(group, factor.to(device))
        self._stash(totals)
        return (totals[1] / count).float()

    def _stash(self, totals: torch.Tensor) -> None:
        # Read at the next check, when the copy has long arrived: no wait for the device in the step.
        if totals.device.type == "cuda":
            host = torch.empty(totals.shape, dtype=totals.dtype, pin_memory=True)
            host.copy_(totals, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._waiting.append((host, done))
        else:
            self._waiting.append((totals.clone(), None))

    def check(self) -> None:
        """The windows' totals since the last check (the Session checks every ITEMS_CHECK_EVERY
        optimizer steps, the same step on every rank, so every rank refuses alike): refuse what made a
        step wrong."""
        problem = self._problem()
        if problem:
            raise PhalanxError(problem)

    def _problem(self) -> str | None:
        waiting, self._waiting = self._waiting, []
        if not waiting:
            return None
        if waiting[-1][1] is not None:
            waiting[-1][1].synchronize()  # the newest copy: the others were recorded before it
        rows = torch.stack([host for host, _ in waiting]).tolist()
        for count, _, negative in rows:
            if negative:
                return (
                    f"session.backward(loss, items=n) got a negative count on {negative:.0f} micro-step(s) of a "
                    "global batch; n counts the items the loss averages over, e.g. (labels != -100).sum()"
                )
            if not math.isfinite(count) or count <= 0:
                return (
                    f"the items given to session.backward(loss, items=n) added up to {count:g} over a global "
                    "batch, so its step had no gradient; a token-weighted step needs at least one item (check that "
                    "not every label is padding, e.g. -100), and n must be finite"
                )
        return None

    def mean_factor(self, whole_window: bool) -> torch.Tensor:
        """What turns the gradients now held into a mean over their items, for the gradient noise
        scale: after the window's first backward alone, or (``whole_window``) this rank's whole
        window before the ranks' gradients are averaged; 0 where they hold no item. A tensor, so
        that nothing is read from the device."""
        counts = self._local if whole_window else self._local[:1]
        total = sum(_on(c, self.comm_device) for c, _ in counts)
        return torch.where(total > 0, self.unit / total, 0.0)

    def reset(self) -> None:
        """At the end of each window (a step, or a window dropped at the epoch's end)."""
        self.weighted = None
        self._local = []
        self._pending = None
        self._totals = None
        self._finished = False

    def close(self) -> str | None:
        """What was wrong with the windows since the last check, if anything (none is left to refuse)."""
        return self._problem()


def _on(count: Any, device: torch.device) -> torch.Tensor:
    """A count as a float64 scalar on ``device``. A number is filled there (a kernel) rather than
    copied from the host, a copy to a GPU that waits for the device."""
    if isinstance(count, torch.Tensor):
        return count.to(device, torch.float64)
    return torch.full((), float(count), dtype=torch.float64, device=device)


def _weighted(loss: torch.Tensor, count: Any) -> torch.Tensor:
    """``loss * count`` in float64, 0 without items: their loss is a mean over nothing (NaN)."""
    if isinstance(count, torch.Tensor):
        return torch.where(count > 0, loss.double() * count, 0.0)
    return loss.double() * count if count > 0 else torch.zeros((), dtype=torch.float64, device=loss.device)


def _power_of_two(value: float) -> float:
    return 2.0 ** max(0, round(math.log2(max(value, 1.0))))


def weighted_mean(value: Any, items: Any, *, data_parallel_size: int, group: Any, comm_device: torch.device) -> Any:
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
    pair = torch.stack([_weighted(mean.reshape(()), count), count])
    if data_parallel_size > 1:
        dist.all_reduce(pair, group=group)
    if float(pair[1]) <= 0:
        raise PhalanxError(
            "session.reduce(value, items=n): the items add up to 0 over the processes, so there is nothing to "
            "average; give the count the value is a mean over"
        )
    result = pair[0] / pair[1]
    if as_number:
        return result.item()
    return result.to(value.device, value.dtype if value.is_floating_point() else torch.float64).reshape(value.shape)
