"""Which samples of a global batch each rank and micro-step gets.

One rule serves every training order: shuffled and ordered training loaders (runtime/data.py deals
them out by it), iterable datasets, streams with a carried state and tensors already in memory
(docs/data.md#the-layout-of-a-global-batch). Global batch ``b`` holds samples ``[b*G, (b+1)*G)`` of
the order, ``G = mb*A*N``; micro-step ``m`` (``m = 0 .. A-1``) of the N ranks takes its block
``[b*G + m*N*mb, b*G + (m+1)*N*mb)``, and rank ``r`` the r-th share of ``mb`` of that block:
``[b*G + (m*N + r)*mb, b*G + (m*N + r + 1)*mb)``. So

- sample slot ``(r, m)`` always sees the same columns of a stream;
- one micro-step of N processes holds what one process's micro-step of ``N*mb`` holds (with the
  same A): synced BatchNorm sees the same samples together;
- each rank's micro-batch is one process's micro-batch of ``mb`` (with ``A*N`` micro-steps, the
  ``(m*N + r)``-th): BatchNorm that is not synced sees the same samples too.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from phalanx.config.batch import BatchPlan
from phalanx.errors import PhalanxError


def micro_start(rank: int, micro_step: int, world_size: int, micro_batch_size: int) -> int:
    """Offset, inside its global batch, of the first sample of ``rank``'s micro-step ``micro_step``."""
    return (micro_step * world_size + rank) * micro_batch_size


# -- tensors already in memory -------------------------------------------------------------------------
def shard_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    dim: int,
    rank: int,
    world_size: int,
    plan: BatchPlan | None,
    micro_steps: bool,
) -> Any:
    """``session.shard``: this rank's share of each tensor along ``dim`` (see docs/data.md).

    Without ``micro_steps``, the tensor is read as consecutive global batches of ``G`` entries and
    this rank keeps its slots of each, micro-step after micro-step (the whole tensor is one block,
    of which each rank keeps a contiguous share, when no batch is planned). With ``micro_steps``, the
    tensor must be one global batch wide (a stream's columns) and the result is a list with one
    piece per micro-step, in the order the micro-steps run.
    """
    if not tensors:
        raise PhalanxError("session.shard() needs at least one tensor: session.shard(x, y, dim=0)")
    out = [_shard_one(t, i, dim, rank, world_size, plan, micro_steps) for i, t in enumerate(tensors)]
    if micro_steps:
        pieces = list(zip(*out))
        return [p[0] if len(tensors) == 1 else p for p in pieces]
    return out[0] if len(tensors) == 1 else tuple(out)


def _shard_one(
    tensor: Any, index: int, dim: int, rank: int, world: int, plan: BatchPlan | None, micro_steps: bool
) -> Any:
    what = "session.shard(..., micro_steps=True)" if micro_steps else "session.shard()"
    if not isinstance(tensor, torch.Tensor):
        raise PhalanxError(f"{what} takes tensors; argument {index + 1} is a {type(tensor).__name__}")
    if tensor.dim() == 0 or not -tensor.dim() <= dim < tensor.dim():
        raise PhalanxError(f"{what}: dim {dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
    dim %= tensor.dim()
    n = tensor.shape[dim]
    block = plan.global_batch_size if plan is not None else n
    accumulation = plan.accumulation_steps if plan is not None else 1
    if micro_steps and n != block:
        raise PhalanxError(
            f"{what}: dim {dim} has {n} entries but the global batch is {block}; a stream needs one column per "
            "sample of the global batch: build it with session.batch.global_batch_size columns, and set "
            "batch.fixed_layout: true so that no setting can change the global batch under it"
        )
    if n == 0:
        raise PhalanxError(f"{what}: dim {dim} of argument {index + 1} has no entries")
    if n % block:
        raise PhalanxError(
            f"{what}: dim {dim} of argument {index + 1} has {n} entries, not a whole number of global batches "
            f"of {block}; drop the last {n % block} (keep the first {n - n % block}) or pad them"
        )
    if block % world:
        raise PhalanxError(
            f"{what}: dim {dim} of argument {index + 1} has {n} entries, which {world} processes cannot share "
            f"equally; drop {n % world} of them, or plan a batch (batch.global_batch_size)"
        )
    micro = block // (world * accumulation)
    # (..., global batches, micro-steps, ranks, samples of one micro-batch, ...): each rank selects
    # its index of the third.
    mine = tensor.unflatten(dim, (n // block, accumulation, world, micro)).select(dim + 2, rank)
    # Contiguous, because scripts reshape what they get (nanoGPT's get_batch calls .view(-1)): a
    # share along dim 1 or later is a strided view from 2 processes on, while at 1 process it is the
    # whole tensor, so a view would break only once the script is scaled out. contiguous() copies
    # only what is not already contiguous.
    if not micro_steps:
        return mine.flatten(dim, dim + 2).contiguous()
    return [mine.select(dim + 1, m).flatten(dim, dim + 1).contiguous() for m in range(accumulation)]


# -- iterable datasets ---------------------------------------------------------------------------------
class StreamShare:
    """A training loader over an iterable dataset: its batches, whatever their size, are re-cut into
    global batches of ``G`` samples, and this rank keeps its share of each in micro-batches (the rule
    above). Every rank reads the whole stream, so the stream must be the same on every rank.

    A last incomplete global batch is dropped on every rank alike: handing out only some of its
    micro-steps would give the ranks different numbers of forwards (a collective under FSDP), and a
    stream has no known start to wrap around to. ``say`` (rank 0's print) tells the user, unless the
    loader asked for it (``drop_last``).
    """

    def __init__(self, rank: int, world_size: int, global_batch_size: int, micro_batch_size: int, *, drop_last: bool):
        self.rank = rank
        self.world_size = world_size
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.share = global_batch_size // world_size
        self.accumulation_steps = self.share // micro_batch_size
        self.drop_last = drop_last
        self.say: Callable[[str], None] | None = None

    def length(self, samples: int) -> int:
        """Micro-batches this rank runs in one pass over a stream of ``samples``."""
        return samples // self.global_batch_size * self.accumulation_steps

    def micro_batches(self, batches: Iterable[Any]) -> Iterator[Any]:
        g = self.global_batch_size
        pending: list[Any] = []
        count = 0
        for batch in batches:
            rows = batch_rows(batch)
            if not rows:
                continue
            pending.append(batch)
            count += rows
            while count >= g:
                merged = pending[0] if len(pending) == 1 else cat_rows(pending)
                block = merged if count == g else cut_rows(merged, 0, g)
                pending = [cut_rows(merged, g, count)] if count > g else []
                count -= g
                yield from self._mine(block)
        if count and not self.drop_last and self.say is not None:
            self.say(
                f"phalanx: dropping {-(-count // self.micro_batch_size)} micro-step(s) that did not complete a "
                f"global batch at the end of the epoch (the last {count} samples of the stream)"
            )

    def _mine(self, block: Any) -> Iterator[Any]:
        for m in range(self.accumulation_steps):
            start = micro_start(self.rank, m, self.world_size, self.micro_batch_size)
            yield cut_rows(block, start, start + self.micro_batch_size)


# -- samples of a collated batch ------------------------------------------------------------------------
# A batch is tensors (one row per sample) in nested dicts, lists, tuples and named tuples, and lists of
# per-sample values (strings, numbers: what default_collate makes of them). Anything else is kept whole.
def _per_sample(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and not hasattr(value, "_fields")
        and not any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value)
    )


def batch_rows(batch: Any) -> int:
    """Samples in a collated batch: the first dimension of its first tensor, else the length of its
    first list of per-sample values."""
    rows = _rows(batch)
    if rows is None:
        raise PhalanxError(
            f"cannot tell the samples of a {type(batch).__name__} batch from an iterable dataset; "
            "batches should hold tensors or lists with one entry per sample"
        )
    return rows


def _rows(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if _per_sample(batch):
        return len(batch)
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((rows for rows in map(_rows, values) if rows is not None), None)


def cut_rows(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() else batch
    if _per_sample(batch):
        return batch[start:stop]
    if isinstance(batch, dict):
        return type(batch)((k, cut_rows(v, start, stop)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(cut_rows(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(cut_rows(v, start, stop) for v in batch)
    return batch


def cat_rows(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else first
    if _per_sample(first):
        return type(first)(v for part in parts for v in part)
    if isinstance(first, dict):
        return type(first)((k, cat_rows([p[k] for p in parts])) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(cat_rows([p[i] for p in parts]) for i in range(len(first))))
    if isinstance(first, (list, tuple)):
        return type(first)(cat_rows([p[i] for p in parts]) for i in range(len(first)))
    return first
