"""torch.nn.DataParallel: one process driving every visible GPU. Kept because users know it;
DDP is faster (no GIL contention, no per-step model replication, no scatter/gather through GPU 0)."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from phalanx.strategies.base import Strategy
from phalanx.strategies.dp_replicas import DataParallel as ReplicaDataParallel


class DataParallel(Strategy):
    name = "dp"
    processes_per_node = 1
    drives_every_gpu = True  # DataParallel replicates onto every visible GPU
    supports_compile = False
    advice: ClassVar[dict[str, str]] = {"launch.nproc": "or use strategy ddp"}

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if self.topology.is_main:
            print(
                "phalanx: strategy 'dp' replicates the model every step in one process; "
                "strategy 'ddp' is faster on every GPU count."
            )
        on_cuda = self.topology.device.type == "cuda"
        # Without CUDA, DataParallel simply calls the module, which keeps this path testable on CPU.
        return ReplicaDataParallel(model, device_ids=[d.index for d in self.devices] if on_cuda else None)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.DataParallel) else model

    def describe(self) -> str:
        n = len(self.devices) if self.topology.device.type == "cuda" else 0
        return f"dp over {n} GPU{'s' if n != 1 else ''}" if n else "dp (no GPU: runs as one CPU device)"
