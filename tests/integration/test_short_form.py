"""The short form of the loop (``optimizer.zero_grad()``, ``session.backward(loss)``,
``session.step()``, no ``accumulate()`` block) trains as the block does when the plan accumulates:
2 gloo processes x 2 micro-steps against one process on the whole global batch."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers.training import reference, rel_diff, run

pytestmark = pytest.mark.multiprocess
TIMEOUT = 150


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_short_form_under_accumulation_matches_the_block(strategy):
    args = (strategy, 16, 4, 6)  # 2 processes x micro-batch 4 x 2 micro-steps = 16
    short = phalanx.spawn(run, nprocs=2, args=(args, {"short_form": True}), cpu=True, timeout=TIMEOUT)[0]
    assert short["accumulation"] == 2 and short["micro_steps"] == 12
    assert short["steps"] == short["scheduler_steps"] == 6
    assert rel_diff(short["state"], reference(16, 6)) < 1e-5
