"""Issue 14, friction 3 (the config side): `batch.max_micro_batch_size`, the per-device limit phalanx
tune writes, plans the same global batch at any process count that divides it, with the largest
micro batch that fits and divides; an exact `micro_batch_size` fits one count only."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx import Config
from phalanx.config.batch import plan_batch
from phalanx.errors import ConfigError


@given(
    per_process=st.integers(1, 512),
    processes=st.integers(1, 64),
    limit=st.integers(1, 600),
    multiple_of=st.sampled_from([1, 1, 2, 4]),
)
def test_the_limit_plans_every_process_count_with_the_largest_micro_batch_that_fits(
    per_process, processes, limit, multiple_of
):
    global_batch = per_process * processes
    divisors = [d for d in range(1, per_process + 1) if per_process % d == 0 and d % multiple_of == 0]
    fitting = [d for d in divisors if d <= limit]
    if not fitting:
        with pytest.raises(ConfigError, match="max_micro_batch_size"):
            plan_batch(processes, global_batch, None, limit, multiple_of=multiple_of)
        return
    plan = plan_batch(processes, global_batch, None, limit, multiple_of=multiple_of)
    assert plan.global_batch_size == global_batch  # the same global batch, whatever the count
    assert plan.micro_batch_size * plan.accumulation_steps * processes == global_batch
    assert plan.micro_batch_size == max(fitting)  # the largest that fits and divides
    assert plan.micro_batch_size <= limit and plan.micro_batch_size % multiple_of == 0


@given(global_batch=st.sampled_from([20, 48, 64, 96, 120]), limit=st.integers(1, 128))
def test_a_limit_tuned_at_two_processes_runs_at_one_two_and_four(global_batch, limit):
    for processes in (1, 2, 4):
        plan = plan_batch(processes, global_batch, None, limit)
        assert plan.global_batch_size == global_batch and plan.micro_batch_size <= limit


def test_the_issues_example():
    # tune at 2 processes wrote micro-batch 10 for global 20: as a limit, it fits 1, 2 and 4.
    assert [plan_batch(n, 20, None, 10).micro_batch_size for n in (1, 2, 4)] == [10, 10, 5]
    assert [plan_batch(n, 20, None, 10).accumulation_steps for n in (1, 2, 4)] == [2, 1, 1]
    with pytest.raises(ConfigError, match="not a multiple of micro_batch_size 10 x 4 processes"):
        plan_batch(4, 20, 10)  # the exact size it used to write


def test_an_exact_micro_batch_wins_but_may_not_exceed_the_limit():
    assert plan_batch(2, 48, 4, 8).micro_batch_size == 4
    with pytest.raises(ConfigError, match="micro_batch_size 12 is above max_micro_batch_size 8"):
        plan_batch(2, 48, 12, 8)


def test_the_limit_alone_and_in_the_config():
    assert plan_batch(2, None, None, 6).global_batch_size == 12  # as micro_batch_size alone
    assert Config.load(overrides=["batch.max_micro_batch_size=8"]).batch.max_micro_batch_size == 8
    with pytest.raises(ConfigError, match="batch.max_micro_batch_size"):
        Config.load(overrides=["batch.max_micro_batch_size=0"])
