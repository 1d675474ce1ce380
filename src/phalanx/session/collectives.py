"""The Session's collectives over the data-parallel processes: reduce a number or tensor, and
gather evaluation outputs back into dataset order without the samples the sampler padded in."""

from __future__ import annotations

import numbers
from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import PhalanxError

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reduce(value: Any, op: str, *, data_parallel_size: int, group: Any, comm_device: torch.device) -> Any:
    """``group``: the data-parallel ranks' process group (None: every process)."""
    if op not in REDUCE_OPS:
        raise PhalanxError(f"reduce op '{op}' is not one of {', '.join(REDUCE_OPS)}")
    as_number = not isinstance(value, torch.Tensor)
    if data_parallel_size == 1:
        # One data-parallel process (pipeline stages and tensor peers all hold the same values).
        return float(value) if as_number else value
    tensor = torch.as_tensor(value, dtype=torch.float64 if as_number else None).to(comm_device).clone()
    dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group)
    if op == "mean":
        tensor = tensor / data_parallel_size
    return tensor.item() if as_number else tensor.to(value.device)


def gather_in_order(tensor: Any, *, data_parallel_size: int, group: Any, comm_device: torch.device, loader: Any) -> Any:
    """``loader``: the evaluation loader the tensor came from (its sampler state says where the
    padding starts), or None / a training loader (then every gathered row is kept). A Python number
    or 0-d tensor is one value per process, not rows: see :func:`gather_values`. A tuple or list
    (Accelerate's ``(predictions, labels)``) gathers each of its entries: a tuple of the results."""
    if isinstance(tensor, (tuple, list)):
        args = {"data_parallel_size": data_parallel_size, "group": group, "comm_device": comm_device}
        return tuple(gather_in_order(t, loader=loader, **args) for t in tensor)
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        return gather_values(tensor, data_parallel_size=data_parallel_size, group=group, comm_device=comm_device)
    if data_parallel_size == 1:
        return tensor  # every process saw the same samples (one process, pipeline stages, tensor peers)
    local = tensor.to(comm_device).contiguous()
    parts = [torch.empty_like(local) for _ in range(data_parallel_size)]
    dist.all_gather(parts, local, group=group)
    if loader is None or loader.train or loader.state is None:
        return torch.cat(parts).to(tensor.device)
    # Data-parallel rank r's i-th sample sits at global position D*(start+i) + r: interleave, then
    # cut the padding.
    state = loader.state
    ordered = torch.stack(parts, dim=1).flatten(0, 1)
    keep = max(0, min(ordered.shape[0], state.dataset_len - data_parallel_size * state.batch_start))
    return ordered[:keep].to(tensor.device)


def gather_values(value: Any, *, data_parallel_size: int, group: Any, comm_device: torch.device) -> torch.Tensor:
    """A Python number or 0-d tensor from every data-parallel process -> a 1-d tensor of their values in
    data-parallel rank order (one value with one data-parallel process). Numbers become float64 (int64 for whole
    numbers and bools) on the CPU; a tensor keeps its dtype and device. A per-batch value cannot
    tell padded samples from real ones, so none is removed."""
    if isinstance(value, torch.Tensor):
        local = value.detach().reshape(1)  # a metric: a loss's graph need not come along
    elif isinstance(value, numbers.Real):
        whole = isinstance(value, (bool, numbers.Integral))
        local = torch.tensor([value], dtype=torch.int64 if whole else torch.float64)
    else:
        raise PhalanxError(
            f"gather_for_metrics takes a tensor, a number, or a tuple of them, not {type(value).__name__}; "
            "gather a tensor (one row per sample) or one number per batch"
        )
    if data_parallel_size == 1:
        return local
    on_comm = local.to(comm_device)
    parts = [torch.empty_like(on_comm) for _ in range(data_parallel_size)]
    dist.all_gather(parts, on_comm, group=group)
    return torch.cat(parts).to(local.device)
