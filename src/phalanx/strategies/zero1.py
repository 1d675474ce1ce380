"""ZeRO stage 1: DDP for gradients, optimizer state sharded over processes with
torch.distributed.optim.ZeroRedundancyOptimizer (each rank updates and broadcasts its shard)."""

from __future__ import annotations

import torch

from phalanx.errors import PhalanxError
from phalanx.strategies.base import Sharding
from phalanx.strategies.ddp import DDP
from phalanx.strategies.plan_rows import PlanRow
from phalanx.util.optim import rebuild_arguments
from phalanx.util.words import plural


class Zero1(DDP):
    name = "zero1"
    shards = Sharding(optimizer=("dp_replicate",))
    # DDP's all-reduce (2), then ZeroRedundancyOptimizer broadcasts the updated parameters (1).
    plan_rows = (PlanRow("zero1", traffic=3),)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        # Imported here: torch.distributed.optim costs most of a second at `import phalanx`.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # The user's param-group dicts are handed over as they are, so a scheduler built on the
        # user's optimizer keeps steering the learning rate of the sharded one.
        return ZeroRedundancyOptimizer(
            optimizer.param_groups, optimizer_class=type(optimizer), **rebuild_arguments(optimizer)
        )

    def optimizer_state_dict(self, model, optimizer) -> dict:
        # A collective: every rank sends its shard to rank 0, the one that writes plain checkpoints.
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if self.topology.rank == 0 else {}

    def named_optimizer_state_dict(self, model, optimizer) -> dict:
        raise PhalanxError(
            "a sharded checkpoint (of fsdp or tp) cannot resume under zero1: its optimizer shards are not "
            "keyed by parameter names; resume it under ddp, fsdp or tp, or load only its weights with "
            "session.load(path, weights_only=True)"
        )

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        local = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer's optimizer of this rank's shard
        return local.state if local is not None else optimizer.state

    def describe(self) -> str:
        return f"zero1 over {plural(self.topology.world_size, 'process')} (optimizer state sharded)"
