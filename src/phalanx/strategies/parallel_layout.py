"""The parallel layout: how a job's processes split into named axes, and where each rank sits.

Four axes, outermost first: ``pp`` (pipeline stages), ``dp_replicate`` (data-parallel ranks that
each hold the whole model: ddp, zero1), ``dp_shard`` (data-parallel ranks that shard it: fsdp) and
``tp`` (tensor-parallel peers that split layers). Their sizes multiply to the world size. ``tp``
is innermost so that a rank's tensor peers are its neighbours in rank order, on one node (the
launcher numbers ranks node by node), where their per-layer collectives belong.

Everything that asks "how many data-parallel ranks, and which one am I" reads this: the batch
plan, the samplers, ``reduce`` and ``gather_for_metrics``, seeding, the planner. It is pure
arithmetic (no process group), so the launcher and ``phalanx plan`` use it before any worker exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Iterable

from phalanx.errors import ConfigError
from phalanx.util.words import plural

AXES = ("pp", "dp_replicate", "dp_shard", "tp")
TENSOR = "tp"  # the axis tensor parallelism splits layers over
DATA_AXES = ("dp_replicate", "dp_shard")
_WORDS = {
    "pp": "pipeline",
    "dp_replicate": "data-parallel",
    "dp_shard": "data-parallel (sharded)",
    "tp": "tensor-parallel",
}


@dataclass(frozen=True)
class ParallelLayout:
    """Axis sizes in :data:`AXES` order; build one with :meth:`of`."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @classmethod
    def of(
        cls, world_size: int, *, data_axis: str = "dp_replicate", tp: int = 1, pp: int = 1, per_node: int | None = None
    ) -> "ParallelLayout":
        """The layout of ``world_size`` processes with ``tp`` tensor peers and ``pp`` stages; the
        data axis ``data_axis`` takes what is left. ``per_node``: processes per node, where known
        (tensor peers must share a node). Refusals are one-line ConfigErrors."""
        if data_axis not in DATA_AXES:
            raise ValueError(f"data_axis must be one of {DATA_AXES}, not {data_axis!r}")
        if world_size < 1 or tp < 1 or pp < 1:
            raise ConfigError(f"a layout needs positive sizes, not world {world_size}, tp {tp}, pp {pp}")
        if world_size % (tp * pp):
            what = " x ".join(
                part for part, n in ((f"strategy.tp.size {tp}", tp), (f"{pp} pipeline stages", pp)) if n > 1
            )
            raise ConfigError(
                f"{what} does not divide the {plural(world_size, 'process')}; "
                f"launch a multiple of {tp * pp} processes, or set strategy.tp.size to a divisor of {world_size}"
            )
        if tp > 1 and per_node is not None and per_node % tp:
            raise ConfigError(
                f"strategy.tp.size {tp} does not divide the {per_node} processes per node: tensor-parallel peers "
                "exchange activations in every layer, which only a node's own links are fast enough for; "
                f"set strategy.tp.size to a divisor of {per_node}"
            )
        sizes = {"pp": pp, "tp": tp, data_axis: world_size // (tp * pp)}
        return cls(**sizes)

    # -- sizes --------------------------------------------------------------------------------
    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def divisor(self, axes: Iterable[str]) -> int:
        """How many ways state divided over ``axes`` is cut: the product of their sizes."""
        return prod(self.size(a) for a in axes)

    @property
    def world_size(self) -> int:
        return self.divisor(AXES)

    @property
    def dp_size(self) -> int:
        """Processes that each take a different share of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def used(self) -> tuple[str, ...]:
        """The axes with more than one rank, outermost first."""
        return tuple(a for a in AXES if self.size(a) > 1)

    # -- where a rank sits --------------------------------------------------------------------
    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along every axis (row-major over :data:`AXES`)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size}")
        coords = {}
        for axis in reversed(AXES):
            rank, coords[axis] = divmod(rank, self.size(axis))
        return {a: coords[a] for a in AXES}

    def rank_at(self, coordinates: dict[str, int]) -> int:
        rank = 0
        for axis in AXES:
            rank = rank * self.size(axis) + coordinates.get(axis, 0)
        return rank

    def group(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from ``rank`` along ``axis`` alone, in order (``rank`` among them)."""
        here = self.coordinates(rank)
        return [self.rank_at({**here, axis: i}) for i in range(self.size(axis))]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: a partition of the ranks."""
        seen: dict[int, list[int]] = {}
        for rank in range(self.world_size):
            members = self.group(axis, rank)
            seen.setdefault(members[0], members)
        return list(seen.values())

    def dp_rank(self, rank: int) -> int:
        """``rank``'s share of the global batch, 0 to ``dp_size - 1``."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def seed_rank(self, rank: int) -> int:
        """``rank``'s index with its tensor coordinate dropped: tensor peers draw the same random
        stream (their replicated activations must agree), every other rank its own."""
        return rank // self.tp

    def describe(self) -> str:
        used = self.used
        if not used:
            return "1 process"
        return " x ".join(f"{self.size(a)} {_WORDS[a]}" for a in used)
