"""Loops without an optimizer on 2 gloo processes: a hand-written SGD update with accumulation ends
with the weights of one process, and of the plain one-process loop, at the same global batch."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers.manual import manual_sgd, reference_manual
from tests.helpers.training import rel_diff

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180

STRATEGIES = {  # id: (strategy, micro-batch on 2 processes: 2 accumulation steps of a global 16)
    "ddp": ("ddp", 4),
    "fsdp": ("fsdp", 4),
    "pipeline": ({"name": "pipeline", "pipeline": {"microbatches": 2}}, 8),  # every stage sees the whole batch
}


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("strategy, micro", STRATEGIES.values(), ids=STRATEGIES.keys())
def test_hand_written_sgd_on_two_processes_matches_one(strategy, micro):
    ranks = phalanx.spawn(manual_sgd, nprocs=2, args=(strategy, 16, micro, 6), cpu=True, timeout=TIMEOUT)
    one = manual_sgd("single", 16, 4, 6)  # 1 process, 4 accumulation steps
    ref = reference_manual(16, 6)
    for out in (*ranks, one):
        assert out["error"] is None
        assert out["steps"] == out["updates"] == 6  # one update and one counted step per global batch
        assert not any(out["grads_left"])  # phalanx zeroed them after the last step
    assert ranks[0]["accumulation"] == 2 and one["accumulation"] == 4
    assert list(ranks[0]["state"]) == list(ref)
    assert rel_diff(ranks[0]["state"], one["state"]) < 1e-5
    assert rel_diff(ranks[0]["state"], ref) < 1e-5
