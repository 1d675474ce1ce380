"""phalanx reads no tensor back to the host in the middle of a step, with several processes
(issue 26): the collectives' results stay on the device too (tests/helpers/tensor_reads.py)."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers.tensor_reads import train_and_count

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180

CASES = {
    "ddp": {"strategy": "ddp"},
    "ddp, noise scale in the comm hook, clipping": {
        "strategy": "ddp",
        "train": {"noise_scale": "hook", "noise_scale_every": 2},
        "optim": {"max_grad_norm": 1.0},
    },
    "ddp, accumulation, batch.adaptive": {
        "strategy": "ddp",
        "batch": {"global_batch_size": 32, "micro_batch_size": 8, "adaptive": "goodput", "adapt_every": 10},
    },
    "fsdp, accumulation": {"strategy": "fsdp", "batch": {"global_batch_size": 32, "micro_batch_size": 8}},
    "zero1": {"strategy": "zero1"},
    # Two replicas of a one-process tensor group: their gradients go through tp's own average.
    "tp replicas": {"strategy": {"name": "tp", "tp": {"size": 1, "plan": {"0": "colwise", "2": "rowwise"}}}},
}


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_no_read_of_the_device_outside_a_read_point_on_two_processes(case):
    ranks = phalanx.spawn(train_and_count, nprocs=2, args=(case, 60), cpu=True, timeout=TIMEOUT)
    for rank, out in enumerate(ranks):
        assert out["stepped"] >= 30  # batch.adaptive may have grown the batch
        assert out["stray"] == "", f"rank {rank}: {out['stray']}"


@pytest.mark.timeout(TIMEOUT)
def test_token_weighted_ddp_reads_nothing_per_step():
    sections = {"strategy": "ddp", "batch": {"global_batch_size": 32, "micro_batch_size": 8}}
    ranks = phalanx.spawn(train_and_count, nprocs=2, args=(sections, 40, True), cpu=True, timeout=TIMEOUT)
    assert [out["stray"] for out in ranks] == ["", ""]
