"""Batch arithmetic and learning-rate scaling: pure logic."""

from __future__ import annotations

import math

import pytest

from phalanx.config.batch import plan_batch
from phalanx.errors import ConfigError
from phalanx.runtime.lr import LRScaling


@pytest.mark.parametrize(
    "world, global_bs, micro, expected",
    [
        (2, 64, None, (64, 32, 1)),
        (2, 64, 16, (64, 16, 2)),
        (4, 64, 8, (64, 8, 2)),
        (1, 64, 16, (64, 16, 4)),
        (3, None, 5, (15, 5, 1)),
        (8, 512, 64, (512, 64, 1)),
    ],
)
def test_plan_batch(world, global_bs, micro, expected):
    plan = plan_batch(world, global_bs, micro)
    assert (plan.global_batch_size, plan.micro_batch_size, plan.accumulation_steps) == expected
    assert plan.global_batch_size == plan.micro_batch_size * plan.accumulation_steps * world


@pytest.mark.parametrize(
    "world, global_bs, micro, message",
    [
        (
            3,
            64,
            None,
            "global_batch_size 64 cannot be split evenly over 3 processes; use a multiple of 3 (e.g. 63 or 66)",
        ),
        (2, 64, 24, "global_batch_size 64 is not a multiple of micro_batch_size 24 x 2 processes = 48"),
        (2, None, None, "set batch.global_batch_size"),
    ],
)
def test_plan_batch_refuses_impossible(world, global_bs, micro, message):
    with pytest.raises(ConfigError) as err:
        plan_batch(world, global_bs, micro)
    assert message in str(err.value)


def test_describe_plan():
    assert plan_batch(2, 64, 16).describe() == "global batch 64 = micro batch 16 x 2 accumulation steps x 2 processes"


def test_scaling_rules():
    assert LRScaling("none", 512, 64).scale == 1.0
    assert LRScaling("linear", 512, 64).scale == 8.0
    assert math.isclose(LRScaling("sqrt", 512, 64).scale, math.sqrt(8))


def test_goyal_warmup_goes_from_unscaled_to_scaled():
    s = LRScaling("linear", 256, 64, warmup_steps=4)
    factors = [s.multiplier(step) for step in range(6)]
    # Starts near the unscaled lr (1/scale of the target), reaches the scaled lr at the end of warm-up.
    assert factors[0] == pytest.approx(1 + 3 * 0.25)
    assert factors[3] == pytest.approx(4.0)
    assert factors[5] == pytest.approx(4.0)
    assert factors == sorted(factors)


def test_plain_warmup_from_zero_without_scaling():
    s = LRScaling("none", 64, 64, warmup_steps=10)
    assert s.multiplier(0) == pytest.approx(0.1)
    assert s.multiplier(9) == pytest.approx(1.0)
    assert LRScaling("none", 64, 64, warmup_steps=10, warmup_start_factor=0.5).multiplier(0) == pytest.approx(0.55)
