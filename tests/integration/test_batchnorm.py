"""BatchNorm trains like one process (docs/strategies.md#batchnorm): a model converted with
torch.nn.SyncBatchNorm.convert_sync_batchnorm before setup() on 2 CPU processes (ddp, fsdp) ends
with the weights and running statistics of one process, with and without accumulation; a model
left unsynced on 2 processes equals one process whose micro-steps are the processes' micro-batches
(the layout of docs/data.md), and setup() says once what it costs."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers.batchnorm import parameters, plain_keys, run, train
from tests.helpers.training import rel_diff

pytestmark = pytest.mark.multiprocess
TIMEOUT = 120
STEPS = 6


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "micro_two, micro_one",
    [(None, None), (4, 8)],  # 2 x 8 against 1 x 16; 2 x 4 x 2 steps against 1 x 8 x 2 steps
)
def test_synced_batchnorm_on_two_processes_matches_one_process(micro_two, micro_one):
    one = train("ddp", 16, micro_one, STEPS, sync=True)  # one process: DDP would refuse torch's layer on the CPU
    two = phalanx.spawn(run, nprocs=2, args=(("ddp", 16, micro_two, STEPS), {"sync": True}), cpu=True, timeout=TIMEOUT)
    assert one["accumulation"] == two[0]["accumulation"] == (1 if micro_two is None else 2)
    for out in two:
        assert out["world"] == 2 and out["steps"] == STEPS
        assert out["classes"] == ["SyncBatchNorm"] and out["notes"] == []
        assert list(out["state"]) == plain_keys()  # the state dict a plain BatchNorm model has
        assert rel_diff(out["state"], one["state"]) < 1e-5  # parameters and running statistics
    assert rel_diff(two[0]["state"], two[1]["state"]) == 0


@pytest.mark.timeout(300)
def test_synced_batchnorm_under_fsdp_matches_one_process():
    one = train("single", 16, 8, STEPS, sync=True)
    two = phalanx.spawn(run, nprocs=2, args=(("fsdp", 16, 4, STEPS), {"sync": True}), cpu=True, timeout=TIMEOUT)
    assert two[0]["accumulation"] == one["accumulation"] == 2
    assert two[0]["classes"] == ["SyncBatchNorm"]
    assert list(two[0]["state"]) == plain_keys()  # the full state dict is rank 0's
    assert rel_diff(two[0]["state"], one["state"]) < 1e-5


@pytest.mark.timeout(300)
def test_unsynced_batchnorm_on_two_processes_matches_one_process_of_their_micro_batches():
    # 2 processes x micro batch 4 x 2 accumulation steps against 1 process x 4 x 4: each process's
    # micro-batch is one of that process's micro-steps, so BatchNorm normalises the same groups (a
    # shuffled loader; an ordered one is laid out alike: tests/unit/test_data_layout.py).
    one = train("ddp", 16, 4, STEPS, sync=False)
    two = phalanx.spawn(run, nprocs=2, args=(("ddp", 16, 4, STEPS), {"sync": False}), cpu=True, timeout=TIMEOUT)
    assert one["accumulation"] == 4 and two[0]["accumulation"] == 2
    for out in two:
        assert out["classes"] == ["BatchNorm1d", "BatchNorm2d"]
        # Running statistics differ: DDP copies rank 0's before each forward, one process updates them at each.
        assert rel_diff(parameters(out["state"]), parameters(one["state"])) < 1e-5
    # One line, on rank 0 only; none at one process.
    assert two[0]["notes"] == [
        "phalanx: 2 BatchNorm layers normalise over each process's 4 samples, not the 8 of a micro-step over all "
        "2 processes: 2 processes will not train like one; convert them with "
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before setup()"
    ]
    assert two[1]["notes"] == [] and one["notes"] == []
