"""Moving batches to the device: in line on the compute stream, or on a side CUDA stream.

On the compute stream a batch's host-to-device copy queues behind the previous step's kernels,
so the GPU computes, then copies, then computes. On a side stream the copy runs while the
compute stream is still busy; the compute stream waits for it (an event, not a host sync) just
before the batch is handed out. See docs/data.md#input-pipeline.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch

from phalanx.util.tree import map_tensors


def to_device(value: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor inside a batch (nested dicts, lists, tuples) to ``device``."""
    return map_tensors(value, lambda t: t.to(device, non_blocking=non_blocking))


class Transfer(Protocol):
    def start(self, batch: Any) -> Any:
        """Begin moving a host batch; returns a handle for :meth:`ready`."""

    def ready(self, handle: Any) -> Any:
        """The device batch, safe to use on the current stream."""


class PlainTransfer:
    """The copy on the current stream (CPU runs, or ``data.prefetch_to_device: false``)."""

    def __init__(self, device: torch.device, non_blocking: bool):
        self.device = device
        self.non_blocking = non_blocking
        # A CPU run's batches are on the CPU already (a loader's tensors are host tensors), and
        # walking each batch to call a no-op .to() costs microseconds per step.
        self.moves = device.type != "cpu"

    def start(self, batch: Any) -> Any:
        return to_device(batch, self.device, self.non_blocking) if self.moves else batch

    def ready(self, handle: Any) -> Any:
        return handle


class StreamTransfer:
    """The copy on a side CUDA stream, from pinned memory when the loader pins."""

    def __init__(self, device: torch.device, non_blocking: bool):
        self.device = device
        self.non_blocking = non_blocking
        self.stream = torch.cuda.Stream(device)

    def start(self, batch: Any) -> tuple[Any, torch.cuda.Event]:
        with torch.cuda.stream(self.stream):
            moved = to_device(batch, self.device, self.non_blocking)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        # The pinned source needs no guard: torch's pinned-memory cache does not reuse a block
        # until the non-blocking copies out of it have finished. A batch already on the device (a
        # dataset of CUDA tensors, not pinned, see pinning.py) passes through: .to() returns the
        # same tensors, built on the compute stream, so the wait and record_stream in ready() are no-ops.
        return moved, copied

    def ready(self, handle: tuple[Any, torch.cuda.Event]) -> Any:
        moved, copied = handle
        compute = torch.cuda.current_stream(self.device)
        # An event and not wait_stream: by now the next batch's copy may be queued on the side
        # stream too, and the compute stream must not wait for that one.
        compute.wait_event(copied)
        # The memory was allocated on the side stream; without this the caching allocator could
        # hand it out again once the batch is freed, while kernels reading it still run.
        return map_tensors(moved, lambda t: _used_on(t, compute))


def _used_on(tensor: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    if tensor.is_cuda:
        tensor.record_stream(stream)
    return tensor


def staged(batches: Iterator[Any], transfer: Transfer, *, ahead: bool) -> Iterator[Any]:
    """The transfer handles of ``batches``, in the loader's order.

    With ``ahead``, batch k+1 is fetched and its copy started before batch k is handed out, so the
    copy overlaps batch k's compute; the loader is then always one batch further than the user.
    Without, each batch is fetched and copied only when it is asked for: no generator of its own
    (it would cost each step a resumption), and none at all where the copy is a no-op.
    """
    if not ahead:
        if isinstance(transfer, PlainTransfer) and not transfer.moves:
            return batches
        return map(transfer.start, batches)
    return _ahead(batches, transfer)


def _ahead(batches: Iterator[Any], transfer: Transfer) -> Iterator[Any]:
    waiting = None
    for batch in batches:
        fetched = transfer.start(batch)
        if waiting is not None:
            yield waiting
        waiting = fetched
    if waiting is not None:
        yield waiting
