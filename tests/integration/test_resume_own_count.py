"""The nanoGPT-shaped loop of tests/helpers/own_count.py on 2 gloo processes, stopped after a save
and run again: exactly the steps asked for in all, and the weights of an uninterrupted run bit for
bit, without and with accumulation (batch.micro_batch_size)."""

from __future__ import annotations

import pytest
import torch

import phalanx
from tests.helpers import own_count as oc

pytestmark = pytest.mark.multiprocess
TIMEOUT = 120


def _spawn(*args, **kwargs) -> list[dict]:
    return phalanx.spawn(oc.run, nprocs=2, args=(args, kwargs), cpu=True, timeout=TIMEOUT)


@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("batch", [{}, {"micro_batch_size": 2}], ids=["no accumulation", "accumulation"])
def test_a_self_counting_loop_resumes_to_the_uninterrupted_weights(batch, tmp_path):
    whole = _spawn(str(tmp_path / "whole"), resume="never", **batch)
    _spawn(str(tmp_path / "stopped"), stop_at=7, **batch)
    again = _spawn(str(tmp_path / "stopped"), **batch)
    for rank in again:
        assert (rank["at_setup"], rank["steps"], rank["step_count"]) == (7, oc.MAX_ITERS - 7, oc.MAX_ITERS)
    for key, value in whole[0]["weights"].items():
        assert torch.equal(value, again[0]["weights"][key]), key
