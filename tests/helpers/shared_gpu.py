"""Training on two processes that share one GPU over gloo, run inside phalanx.spawn: the training
harness's run, plus what the side-stream prefetcher did."""

from __future__ import annotations

import torch.distributed as dist

from phalanx.runtime.transfer import StreamTransfer
from tests.helpers.training import train


def train_watching_the_prefetcher(strategy, global_bs: int, micro_bs: int | None, steps: int) -> dict:
    """``training.train``, with each batch the side stream copies recorded as (device, backend of the
    process group at that moment)."""
    copies: list[tuple[str, str]] = []
    real_start = StreamTransfer.start

    def start(self, batch):
        copies.append((str(self.device), dist.get_backend()))
        return real_start(self, batch)

    StreamTransfer.start = start  # in this spawned process only, which ends with the run
    try:
        out = train(strategy, global_bs, micro_bs, steps)
    finally:
        StreamTransfer.start = real_start
    return {**out, "copies": copies}
