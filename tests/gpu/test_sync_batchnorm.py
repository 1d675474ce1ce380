"""The CUDA path of SyncBatchNorm (docs/strategies.md#batchnorm): on a GPU with several data-parallel
processes, setup() keeps torch's own SyncBatchNorm kernels, over the data-parallel group. Two
processes share cuda:0 over gloo (NCCL refuses two ranks on one GPU), so one GPU runs it; they end
with the weights and running statistics of one process on cuda:0 whose micro batch is theirs
together. Prepared, not run yet (docs/gpu-status.md)."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers.batchnorm import plain_keys, run, train
from tests.helpers.training import rel_diff

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]
STEPS = 6


@pytest.mark.timeout(240)
def test_synced_batchnorm_on_two_processes_sharing_a_gpu_matches_one_process():
    one = train("single", 16, 8, STEPS, sync=True)  # cuda:0, one data-parallel process: nothing to reduce
    two = phalanx.spawn(
        run, nprocs=2, args=(("ddp", 16, 4, STEPS), {"sync": True}), cpu=False, backend="gloo", timeout=180
    )
    for out in two:
        assert out["classes"] == ["_DataGroupSyncBatchNorm"]  # torch's SyncBatchNorm, over the data group
        assert list(out["state"]) == plain_keys()
        # CUDA's kernels sum in another order than one process's BatchNorm.
        assert rel_diff(out["state"], one["state"]) < 1e-4
    assert rel_diff(two[0]["state"], two[1]["state"]) == 0
