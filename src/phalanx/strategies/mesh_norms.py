"""The norm of gradients spread over a device mesh: sharded along some axes, replicated along the
others, or plain tensors every rank holds whole (tensor parallelism leaves the modules its plan
does not split as they are).

A rank's squares of a gradient count once per distinct piece: each is weighted by one over the
ranks that hold the same piece, and one all-reduce of the world sums them. torch's own
``clip_grad_norm_`` cannot take plain tensors and DTensors together (one foreach norm over both).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.runtime.noise_scale import squared_norm
from phalanx.strategies.dtensor_state import local


def holders(tensor: torch.Tensor, world_size: int) -> int:
    """How many ranks hold the same piece of ``tensor``: the world for a plain tensor, the world
    over the shard count for a DTensor."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return world_size
    mesh = tensor.device_mesh
    shards = 1
    for dim, placement in enumerate(placements):
        # Every kind of shard: FSDP over a tensor-parallel split shards with a strided placement,
        # which is not a Shard. Gradients are never partial here (they are reduced by then).
        if not placement.is_replicate() and not placement.is_partial():
            shards *= mesh.size(dim)
    return world_size // shards


def squared_norm_over_mesh(grads: list[torch.Tensor], world_size: int, comm_device: torch.device) -> torch.Tensor:
    """The squared norm of the whole gradients (float64), the same on every rank."""
    by_holders: dict[int, list[torch.Tensor]] = {}
    for grad in grads:
        piece = local(grad)
        by_holders.setdefault(holders(grad, world_size), []).append(piece)
    total = torch.zeros((), dtype=torch.float64, device=comm_device)
    for count, tensors in by_holders.items():
        total = total + squared_norm(tensors).to(comm_device) / count
    if world_size > 1:
        dist.all_reduce(total)
    return total


def clip_over_mesh(
    parameters: list[torch.nn.Parameter], max_norm: float, world_size: int, comm_device: torch.device
) -> torch.Tensor:
    """``clip_grad_norm_`` for gradients over a mesh; returns the total norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = squared_norm_over_mesh(grads, world_size, comm_device).sqrt()
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        piece = local(grad)
        piece.mul_(coefficient.to(piece.device, piece.dtype))
    return norm.to(torch.float32)
