"""BatchNorm over the data-parallel processes, on every device (docs/strategies.md#batchnorm).

A BatchNorm layer normalises over the samples of its own forward: with N processes, each process's
micro-batch, not what one process would see, so N processes do not train like one. The fix is the
script's, as in plain PyTorch: ``torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)`` before
``setup()``. torch's SyncBatchNorm runs only on CUDA (DistributedDataParallel refuses to wrap it on
the CPU, and its forward refuses CPU input), and syncs over the group it was built with, every
process by default, which would count tensor-parallel peers that hold the same batch more than once.
So before the wrap, :meth:`BatchNorms.prepare` swaps the class of each such layer in place (the same
parameters, buffers and state-dict keys; checkpoints and ``model_state_dict()`` are unchanged):

- on CUDA with several data-parallel processes: torch's own kernels, over the data-parallel group;
- elsewhere (CPU processes; one data-parallel process under tensor or pipeline parallelism):
  :class:`SyncBatchNorm`, an autograd Function that all-reduces the per-channel sum, sum of squares
  and count over the data-parallel group in forward, and the two gradient sums in backward.

It also counts the BatchNorm layers left to normalise per process, for one line at the end of
``setup()`` (:meth:`BatchNorms.say`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from phalanx._torch_compat import BATCH_NORM_BASE
from phalanx.config.batch import BatchPlan
from phalanx.util.words import plural


@dataclass(frozen=True)
class _Sync:
    """What a synced layer reduces over: the data-parallel group (None: every process), its size,
    and the device phalanx's collectives use (gloo takes CPU tensors)."""

    group: Any
    size: int
    comm_device: torch.device

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.to(self.comm_device)
        dist.all_reduce(moved, group=self.group)
        return moved.to(tensor.device)


class _SyncRef:
    """A synced layer's hold on its :class:`_Sync`, one per strategy, shared by its layers. A process
    group can be neither pickled nor deep-copied, and the model must stay copyable: a copy shares the
    reference (the same processes), and a pickled model (torch.save of the bare model) keeps none, so
    a layer loaded in another process normalises over its own forward. Emptied at teardown."""

    __slots__ = ("sync",)

    def __init__(self, sync: _Sync | None):
        self.sync = sync

    def __deepcopy__(self, memo: dict) -> "_SyncRef":
        return self

    def __reduce__(self) -> tuple:
        return (_SyncRef, (None,))


def _sync_of(layer: nn.Module) -> _Sync | None:
    ref = getattr(layer, "sync_ref", None)
    sync = ref.sync if ref is not None else None
    if sync is None or sync.size < 2 or not dist.is_initialized():
        return None
    return sync


class SyncBatchNorm(BATCH_NORM_BASE):
    """torch.nn.SyncBatchNorm's arithmetic on any device, over the data-parallel processes.

    Layers of this class are torch.nn.SyncBatchNorm layers whose class :meth:`BatchNorms.prepare`
    swapped, in place; what their forward does is torch's, with phalanx's reduction in place of
    torch's CUDA kernels. In eval mode, and with one data-parallel process, it is a plain BatchNorm.
    """

    sync_ref: _SyncRef | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        # What torch's SyncBatchNorm.forward does (torch 2.13), up to the reduction.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        sync = _sync_of(self) if self.training else None
        if sync is None:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, batch_stats, factor, self.eps)
        return _SyncedBatchNorm.apply(input, self.weight, self.bias, running_mean, running_var, self.eps, factor, sync)


class _DataGroupSyncBatchNorm(nn.SyncBatchNorm):
    """torch's SyncBatchNorm (its CUDA kernels), over the data-parallel group it holds."""

    sync_ref: _SyncRef | None = None

    @property
    def process_group(self) -> Any:  # read by torch's forward
        sync = self.sync_ref.sync if self.sync_ref is not None else None
        return sync.group if sync is not None else None


class _SyncedBatchNorm(torch.autograd.Function):
    """Batch normalisation with the statistics of every data-parallel process's input together."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, sync):
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, channels] + [1] * (x.dim() - 2)
        compute = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        # Sums in float64 (where the device has it): the variance is E[x^2] - E[x]^2, whose
        # cancellation float32 sums would make visible against one process's BatchNorm.
        acc = torch.float32 if x.device.type == "mps" else torch.float64
        xc = x.to(compute)
        count = torch.full((1,), x.numel() // channels, dtype=acc, device=x.device)
        local = torch.cat([xc.sum(dims, dtype=acc), (xc * xc).sum(dims, dtype=acc), count])
        total = sync.all_reduce(local)
        n = int(total[-1].item())
        if n < 2:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {n}")
        mean = total[:channels] / n
        var = (total[channels : 2 * channels] / n - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((var * n / (n - 1)).to(running_var.dtype), alpha=momentum)
        mean, invstd = mean.to(compute), invstd.to(compute)
        scale = invstd if weight is None else invstd * weight.to(compute)
        shift = -mean * scale if bias is None else bias.to(compute) - mean * scale
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.sync, ctx.acc = n, sync, acc
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return (xc * scale.view(shape) + shift.view(shape)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, invstd = ctx.saved_tensors
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, channels] + [1] * (x.dim() - 2)
        compute = mean.dtype
        dy = grad_output.to(compute)
        xmu = x.to(compute) - mean.view(shape)
        sum_dy = dy.sum(dims, dtype=ctx.acc)
        sum_dy_xmu = (dy * xmu).sum(dims, dtype=ctx.acc)
        grad_input = grad_weight = grad_bias = None
        # This process's own parameter gradients: the strategy averages them over the processes,
        # as it does every other gradient.
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            both = ctx.sync.all_reduce(torch.cat([sum_dy, sum_dy_xmu]))
            mean_dy = (both[:channels] / ctx.count).to(compute).view(shape)
            mean_dy_xmu = (both[channels:] / ctx.count).to(compute).view(shape)
            scale = invstd if weight is None else invstd * weight.to(compute)
            inner = dy - mean_dy - xmu * (invstd * invstd).view(shape) * mean_dy_xmu
            grad_input = (inner * scale.view(shape)).to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _per_process(layer: nn.Module) -> bool:
    """A BatchNorm layer that normalises over its own forward's samples in training."""
    synced = isinstance(layer, (nn.SyncBatchNorm, SyncBatchNorm))
    return isinstance(layer, BATCH_NORM_BASE) and not synced and (layer.training or layer.running_mean is None)


class BatchNorms:
    """A strategy's BatchNorm layers: synced ones made to work here (:meth:`prepare`, before each
    model's wrap), and one line about those that are not (:meth:`say`, at the end of ``setup()``).

    ``data_group`` is called only where there are several data-parallel processes (it may build
    the strategy's device mesh)."""

    def __init__(
        self,
        device: torch.device,
        data_parallel_size: int,
        data_group: Callable[[], Any],
        comm_device: torch.device,
    ):
        self.device = device
        self.data_parallel_size = data_parallel_size
        self._data_group = data_group
        self._comm_device = comm_device
        self._ref: _SyncRef | None = None
        self._unsynced = 0  # layers of the models set up since the last say()

    def prepare(self, model: nn.Module) -> None:
        for layer in model.modules():
            if isinstance(layer, (nn.SyncBatchNorm, SyncBatchNorm)):
                self._swap(layer)
            elif self.data_parallel_size > 1 and _per_process(layer):
                self._unsynced += 1

    def _swap(self, layer: nn.Module) -> None:
        """A synced layer (torch's, or one a Session set up before) syncs over this run's group."""
        vars(layer).pop("process_group", None)  # phalanx's data-parallel group, whatever was given
        on_cuda = self.device.type == "cuda" and self.data_parallel_size > 1
        layer.__class__ = _DataGroupSyncBatchNorm if on_cuda else SyncBatchNorm
        layer.sync_ref = self._reference()

    def _reference(self) -> _SyncRef:
        if self._ref is None:
            group = self._data_group() if self.data_parallel_size > 1 else None
            self._ref = _SyncRef(_Sync(group, self.data_parallel_size, self._comm_device))
        return self._ref

    def close(self) -> None:
        """The process group is going away: the layers normalise over their own forward from here on."""
        if self._ref is not None:
            self._ref.sync = None
            self._ref = None

    def say(self, plan: BatchPlan | None, say: Callable[[str], None]) -> None:
        """One line for the BatchNorm layers of the models set up since the last call that normalise
        per process under data parallelism: the effect, and the fix."""
        count, self._unsynced = self._unsynced, 0
        if count:
            say(unsynced_line(count, plan, self.data_parallel_size))


def unsynced_line(count: int, plan: BatchPlan | None, processes: int) -> str:
    """The setup() line for ``count`` BatchNorm layers that normalise per process, with ``plan``'s sizes."""
    layers = plural(count, "BatchNorm layer") + (" normalises" if count == 1 else " normalise")
    if plan is None:
        over = f"each process's micro-batch, not the samples of all {processes} processes together"
    else:
        mine = plural(plan.micro_batch_size, "sample")
        together = plan.micro_batch_size * processes
        if plan.accumulation_steps == 1:
            whole = f"the global batch of {together}"
        else:
            whole = f"the {together} of a micro-step over all {processes} processes"
        over = f"each process's {mine}, not {whole}"
    return (
        f"phalanx: {layers} over {over}: {processes} processes will not train like one; convert them "
        "with torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before setup()"
    )
