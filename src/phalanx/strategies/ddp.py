"""DistributedDataParallel: one process per device, gradients all-reduced in buckets during backward."""

from __future__ import annotations

import contextlib
import inspect

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.strategies.base import Strategy
from phalanx.words import plural

_DDP_ARGS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)


class DDP(Strategy):
    name = "ddp"
    needs_process_group = True

    def wrap_model(self, model: nn.Module) -> nn.Module:
        opts = self.config.strategy.ddp
        device = self.topology.device
        # torch 2.13 renamed the per-forward buffer sync; the old name still works but warns.
        buffers = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
        return DistributedDataParallel(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            bucket_cap_mb=opts.bucket_cap_mb,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
            static_graph=opts.static_graph,
            find_unused_parameters=opts.find_unused_parameters,
            **{buffers: opts.broadcast_buffers},
        )

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def describe(self) -> str:
        opts = self.config.strategy.ddp
        return f"ddp over {plural(self.topology.world_size, 'process')} (bucket {opts.bucket_cap_mb:g} MiB)"

