"""Two processes sharing cuda:0 over gloo (which takes CUDA tensors; NCCL refuses two ranks on one
GPU), so a machine with a single GPU still runs the multi-process CUDA path: ddp and zero1 place the
model on the GPU, the process group is gloo's, the Session's own collectives use CPU tensors, and
the side-stream prefetcher copies every batch. The weights end as one process's on the same data."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers.shared_gpu import train_watching_the_prefetcher
from tests.helpers.training import reference, rel_diff

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_two_processes_on_one_gpu_over_gloo_train_like_one(strategy):
    ranks = phalanx.spawn(
        train_watching_the_prefetcher, nprocs=2, args=(strategy, 16, None, 6), cpu=False, backend="gloo", timeout=180
    )
    one = reference(16, 6)  # the plain one-process loop, on the CPU
    for out in ranks:
        assert out["world"] == 2 and out["steps"] == 6 and out["micro_steps"] == 6
        # Every batch went to cuda:0 on the side stream while the process group was gloo's; the
        # model took them, so it was on cuda:0 too.
        assert out["copies"] == [("cuda:0", "gloo")] * 6
        # fp32 on both sides (TF32 is off by default); CUDA's kernels sum in another order than the CPU's.
        assert rel_diff(out["state"], one) < 1e-4
    assert rel_diff(ranks[0]["state"], ranks[1]["state"]) == 0  # the replicas stay identical
