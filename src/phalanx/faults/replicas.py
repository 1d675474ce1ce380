"""Data-parallel replicas whose weights drift apart, stopped at run time (``faults.replica_check_every``).

Under ddp every replica applies the same averaged gradient, so the replicas' weights stay equal bit
for bit. A script that changes a weight on one rank, a random draw per rank in the update or a
non-deterministic kernel breaks that without a sign: each rank trains on its own copy, and the
checkpoint holds rank 0's (TrainCheck, OSDI 2025, found this in BLOOM-176B's training).

Every ``faults.replica_check_every`` optimizer steps, at the same step on every rank, each rank
takes a fingerprint of every tensor it holds as a copy of its replicas' (its parameters, and the
optimizer state where that is not sharded over them), all-gathers it over the strategy's replica
group in one collective, and compares the gathered rows. The rows are the same on every rank, so
every rank reaches the same verdict and raises the same one-line error.

A fingerprint is two numbers per tensor, each one reduction that reads the tensor in place, in its
own dtype (a reduction that casts as it goes, to float64 or int64, is 25 times slower on a CPU):

- the sum of its elements' bits read as integers of their width, wrapping. Integer sums are exact,
  so the order a kernel adds in cannot change it, and a change to any one element changes it;
- the sum of its values. A shift of every element can cancel in the first (the bits of a positive
  value grow where a negative one's shrink); not here. Every replica runs the same kernel on the
  same kind of device with the same threads, so this sum comes out the same on each.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import PhalanxError
from phalanx.util.words import plural

ANCHOR = "docs/faults.md#replicas-that-drift-apart"
# An element's bits as an integer of its own width: a view, never a copy.
_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaCheck:
    """One per Session where ranks hold copies of each other's weights: every ``every`` optimizer
    steps, compares them over ``group`` (whose global ranks are ``ranks``)."""

    def __init__(
        self,
        every: int,
        group: Any,
        ranks: list[int],
        comm_device: torch.device,
        models: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        unwrap: Callable[[nn.Module], nn.Module],
    ):
        self.every = every
        self.group = group
        self.ranks = ranks
        self.comm_device = comm_device
        self._models = models  # the Session's lists: what setup() adds later is compared too
        self._optimizers = optimizers  # empty where the optimizer state is sharded over the replicas
        self._unwrap = unwrap  # to the user's model, whose parameter names the error gives
        self._equal_at: int | None = None  # the step of the last check that found the copies equal

    @classmethod
    def create(
        cls,
        every: int,
        group: Any,
        comm_device: torch.device,
        models: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        unwrap: Callable[[nn.Module], nn.Module],
    ) -> "ReplicaCheck | None":
        """None where there is nothing to compare (turned off, or no rank holds a copy of this
        rank's weights: ``group`` None), so that the step does not call it at all."""
        if not every or group is None:
            return None
        ranks = dist.get_process_group_ranks(group)
        return cls(every, group, ranks, comm_device, models, optimizers, unwrap) if len(ranks) > 1 else None

    def after_step(self, step: int) -> None:
        """After each optimizer step (``step``: the steps taken); compares every ``every`` steps."""
        if step % self.every == 0:
            self.check(step)

    def check(self, step: int) -> None:
        names, tensors = self.tensors()
        if not tensors:
            return
        kind = torch.tensor([device_kind(tensors[0].device)], dtype=torch.int64, device=tensors[0].device)
        mine = torch.cat([fingerprint(tensors), kind]).to(self.comm_device)
        rows = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(rows, mine, group=self.group)
        gathered = torch.stack(rows).cpu()
        # GPUs of another model may lay a float sum out otherwise and round its last bit so: between
        # them, the exact integer sums alone are compared.
        same_kind = bool((gathered[:, -1] == gathered[0, -1]).all())
        problem = drift(gathered[:, :-1], names, self.ranks, step, self._equal_at, compare_values=same_kind)
        if problem:
            raise PhalanxError(problem)
        self._equal_at = step

    def tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        """What this rank holds as its replicas' copy, in the same order on each, by name."""
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        by_id: dict[int, str] = {}
        for m, model in enumerate(self._models):
            prefix = f"model {m}: " if len(self._models) > 1 else ""
            for name, param in self._unwrap(model).named_parameters():
                by_id[id(param)] = prefix + name
                names.append(prefix + name)
                tensors.append(_local(param))
        for optimizer in self._optimizers:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for i, param in enumerate(params):
                for key, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        names.append(f"the optimizer's {key} of {by_id.get(id(param), f'parameter {i}')}")
                        tensors.append(_local(value))
        return names, tensors


def fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor, the sum of its bits as integers, then (a second half as long) the sum of its
    values, its float64 bits read as an int64: one int64 vector, compared bit for bit."""
    bits, values = [], []
    with torch.no_grad():
        for t in tensors:
            t = torch.view_as_real(t) if t.is_complex() else t
            as_integers = _AS_INTEGERS[t.element_size()]
            bits.append(t.view(as_integers).sum(dtype=as_integers))
            values.append(t.sum() if t.is_floating_point() else torch.zeros((), device=t.device))
        # stack widens each kind to the widest dtype among them (a wrapped sum stays what it is).
        device = tensors[0].device
        bits_column = torch.stack([b.to(device) for b in bits]).to(torch.int64)
        values_column = torch.stack([v.to(device) for v in values]).to(torch.float64).view(torch.int64)
        return torch.cat([bits_column, values_column])


def device_kind(device: torch.device) -> int:
    """A number for the device's model (the same on every rank with the same kind of device)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return zlib.crc32(name.encode())


def drift(
    rows: torch.Tensor,
    names: list[str],
    ranks: list[int],
    step: int,
    equal_at: int | None,
    compare_values: bool = True,
) -> str | None:
    """The one line that says where the gathered fingerprints (one row per rank of ``ranks``)
    disagree, or None where they are equal; the first tensor named is the first that differs.
    ``compare_values``: False leaves the float sums out (ranks on devices of different models)."""
    n = len(names)
    differs = (rows != rows[0]).any(dim=0)
    per_tensor = differs[:n] | (differs[n:] if compare_values else torch.zeros_like(differs[:n]))
    if not bool(per_tensor.any()):
        return None
    first = int(per_tensor.nonzero()[0])
    copies: dict[tuple[int, int], list[int]] = {}
    for row, rank in zip(rows.tolist(), ranks):
        copies.setdefault((row[first], row[n + first]), []).append(rank)
    sums = rows[:, n + first].view(torch.float64).tolist()
    holders = list(copies.values())
    values = ", ".join(f"{sums[ranks.index(h[0])]:.12g} on rank {h[0]}" for h in holders)
    count = int(per_tensor.sum())
    others = f"; {count} of {plural(n, 'tensor')} differ" if count > 1 else ""
    since = f" (they were equal at step {equal_at})" if equal_at is not None else ""
    return (
        f"replicas drifted apart at step {step}{since}: {names[first]} differs between {_who(holders)} "
        f"(sum of its values: {values}{others}); the update depends on the rank: a weight the script changes on "
        "some ranks only (under `if rank == ...`, or a load of its own), a random draw per rank in the update, or "
        f"a non-deterministic kernel; phalanx verify on the script finds the first step where they part ({ANCHOR})"
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor's piece on this rank: what its replicas hold too (reading it whole is a collective).
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _who(holders: list[list[int]]) -> str:
    """``ranks 0 and 1``, or ``ranks 0, 2 and rank 1`` where some copies have several holders."""
    if all(len(h) == 1 for h in holders):
        firsts = [str(h[0]) for h in holders]
        return f"ranks {', '.join(firsts[:-1])} and {firsts[-1]}"
    parts = [f"rank {h[0]}" if len(h) == 1 else f"ranks {', '.join(map(str, h))}" for h in holders]
    return ", ".join(parts[:-1]) + " and " + parts[-1]
