"""N processes train like one: ddp on 2 gloo processes against one process on the same global batch."""

from __future__ import annotations

import pytest
import torch

import phalanx
from tests.helpers.probes import evaluate
from tests.helpers.training import reference, rel_diff, train

pytestmark = pytest.mark.multiprocess
TIMEOUT = 120


def test_ddp_two_processes_match_one_process():
    results = phalanx.spawn(train, nprocs=2, args=("ddp", 16, None, 6), cpu=True, timeout=TIMEOUT)
    for out in results:
        assert out["world"] == 2 and out["accumulation"] == 1 and out["micro_steps"] == 6
        assert rel_diff(out["state"], reference(16, 6)) < 1e-5
    assert rel_diff(results[0]["state"], results[1]["state"]) == 0  # replicas stay identical


def test_ddp_with_accumulation_matches_whole_batch():
    # 2 processes x 2 micro-steps of 4 against 1 process x 1 step of 16.
    results = phalanx.spawn(train, nprocs=2, args=("ddp", 16, 4, 6), cpu=True, timeout=TIMEOUT)
    out = results[0]
    assert out["accumulation"] == 2 and out["micro_steps"] == 12
    assert out["steps"] == out["scheduler_steps"] == 6
    assert rel_diff(out["state"], reference(16, 6)) < 1e-5


def test_shuffled_training_is_independent_of_world_size():
    one = train("single", 16, None, 6, shuffle=True, epochs=2)
    two = phalanx.spawn(train, nprocs=2, args=("auto", 16, 4, 6, True, 2), cpu=True, timeout=TIMEOUT)[0]
    assert two["steps"] == one["steps"] == two["scheduler_steps"] == 12
    assert two["lrs"] == pytest.approx(one["lrs"])
    assert rel_diff(two["state"], one["state"]) < 1e-5


@pytest.mark.parametrize("nprocs, n, batch", [(2, 11, 4), (3, 10, 2)])
def test_evaluation_is_exact_when_world_size_does_not_divide_the_dataset(nprocs, n, batch):
    single = evaluate(n, batch)
    results = phalanx.spawn(evaluate, nprocs=nprocs, args=(n, batch), cpu=True, timeout=TIMEOUT)
    for out in results:
        assert out["count"] == n
        assert out["accuracy"] == single["accuracy"]
        torch.testing.assert_close(out["preds"], single["preds"])  # same samples, dataset order
        assert out["reduced_sum"] == n * nprocs


def _boom(rank_to_fail: int) -> None:
    import os

    if int(os.environ["RANK"]) == rank_to_fail:
        raise ValueError("rank failed on purpose")


def test_spawn_reports_a_failing_rank():
    with pytest.raises(Exception, match="rank failed on purpose"):
        phalanx.spawn(_boom, nprocs=2, args=(1,), cpu=True, timeout=TIMEOUT)


def _sleep_forever() -> None:
    import time

    time.sleep(600)


def test_spawn_timeout_kills_every_process():
    with pytest.raises(TimeoutError, match="did not finish within 3s"):
        phalanx.spawn(_sleep_forever, nprocs=2, cpu=True, timeout=3)
