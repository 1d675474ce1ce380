"""DistributedDataParallel: one process per device, gradients all-reduced in buckets during backward."""

from __future__ import annotations

import contextlib
import inspect

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.errors import ConfigError
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
        wrapped = DistributedDataParallel(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            bucket_cap_mb=opts.bucket_cap_mb,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
            static_graph=opts.static_graph,
            find_unused_parameters=opts.find_unused_parameters,
            **{buffers: opts.broadcast_buffers},
        )
        if opts.comm_hook != "none":
            self._register_hook(wrapped)
        return wrapped

    def _register_hook(self, model: DistributedDataParallel) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        opts = self.config.strategy.ddp
        if opts.comm_hook == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif opts.comm_hook == "bf16":
            if self.topology.backend != "nccl":
                raise ConfigError("strategy.ddp.comm_hook=bf16 needs NCCL (CUDA devices); on gloo use fp16 or none")
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        else:
            # Error feedback carries what the low-rank step dropped into the next step, so
            # training converges; its state is not in checkpoints (a resume restarts it).
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=opts.powersgd_rank,
                start_powerSGD_iter=opts.powersgd_start_step,
                warm_start=opts.powersgd_warm_start,
                use_error_feedback=True,
            )
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def describe(self) -> str:
        opts = self.config.strategy.ddp
        hook = f", {opts.comm_hook} compression" if opts.comm_hook != "none" else ""
        return f"ddp over {plural(self.topology.world_size, 'process')} (bucket {opts.bucket_cap_mb:g} MiB{hook})"

