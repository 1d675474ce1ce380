"""batch.schedule: the scheduled batch warm-up. Its format (property-based), the one-line refusals,
the multiples a run trains with, the learning rate at each growth, the line it prints, and its
state across a resume."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session
from phalanx.config.batch import BatchPlan, parse_schedule, schedule_steps
from phalanx.errors import ConfigError
from phalanx.session.batch_schedule import ScheduledBatch, seesaw_gain
from phalanx.topology import Topology


@st.composite
def schedules(draw):
    """A valid schedule: increasing powers of two, increasing points of one kind."""
    n = draw(st.integers(1, 4))
    powers = sorted(draw(st.sets(st.integers(1, 10), min_size=n, max_size=n)))
    if draw(st.booleans()):
        points = sorted(draw(st.sets(st.integers(1, 99), min_size=n, max_size=n)))
        written = [f"{p}%" for p in points]
    else:
        points = sorted(draw(st.sets(st.integers(1, 10**6), min_size=n, max_size=n)))
        written = [str(p) for p in points]
    return [f"x{2**e}@{w}" for e, w in zip(powers, written)]


@given(schedules())
def test_a_valid_schedule_reads_the_same_as_a_string_or_a_list(entries):
    as_list = parse_schedule(entries)
    assert parse_schedule(",".join(entries)) == as_list
    assert parse_schedule(" , ".join(entries)) == as_list
    assert [g.multiple for g in as_list] == [int(e[1 : e.index("@")]) for e in entries]
    assert Config.load(batch={"schedule": entries}).batch.schedule == entries


@given(st.text(max_size=30))
def test_any_text_is_a_schedule_or_one_line_why_not(text):
    try:
        parse_schedule(text)
    except ValueError as err:
        assert "\n" not in str(err)


@pytest.mark.parametrize(
    "value, words",
    [
        ("x3@30%", "power of two"),
        ("x1@30%", "power of two"),
        ("x2@0", "whole number from 1"),
        ("x2@100%", "between 0 and 100"),
        ("x4@30%,x2@60%", "larger multiple"),
        ("x2@60%,x4@30%", "must come after"),
        ("x2@10,x4@50%", "mixes step numbers and percentages"),
        ("2x@10", "is not x<multiple>@<point>"),
        ("", "is not x<multiple>@<point>"),
    ],
)
def test_a_bad_schedule_is_one_config_error_line(value, words):
    with pytest.raises(ConfigError, match="batch.schedule") as err:
        Config.load(batch={"schedule": value})
    assert words in str(err.value) and "\n" not in str(err.value)


def test_it_and_batch_adaptive_exclude_each_other():
    with pytest.raises(ConfigError, match="set one of them to null"):
        Config.load(batch={"schedule": "x2@10", "adaptive": "goodput"})


def test_percentages_are_of_train_max_steps():
    growths = parse_schedule("x2@30%,x4@62.5%")
    assert schedule_steps(growths, 1000) == [(300, 2), (625, 4)]
    with pytest.raises(ConfigError, match="set train.max_steps"):
        schedule_steps(growths, None)
    with pytest.raises(ConfigError, match="as the growth before it"):
        schedule_steps(parse_schedule("x2@30%,x4@31%"), 10)
    with pytest.raises(ConfigError, match="before the first step"):
        schedule_steps(parse_schedule("x2@1%"), 10)
    with pytest.raises(ConfigError, match="at or after train.max_steps"):
        schedule_steps(parse_schedule("x2@20"), 20)
    assert schedule_steps(parse_schedule("x2@20"), None) == [(20, 2)]


def test_the_session_refuses_what_cannot_work():
    with pytest.raises(ConfigError, match="set train.max_steps"):
        Session(Config(), batch={"schedule": "x2@50%"}, train={"progress": False})
    with pytest.raises(ConfigError, match="batch.fixed_layout"):
        Session(Config(), batch={"schedule": "x2@5", "fixed_layout": True}, train={"progress": False})
    with pytest.raises(ConfigError, match="above batch.adaptive_max_global_batch 32"):
        _run(batch={"schedule": "x2@5,x8@10", "adaptive_max_global_batch": 32})


def test_the_learning_rate_at_a_growth():
    assert seesaw_gain(1, adam=False) == seesaw_gain(8, adam=False) == 1.0  # SGD: the growth is the decay
    assert seesaw_gain(4, adam=True) == pytest.approx(0.5)  # Adam: 1/sqrt(2) per doubling (Seesaw)


def _run(batch, optimizer=torch.optim.SGD, steps=30):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 4, generator=g)
    y = x.sum(1, keepdim=True)
    # One process without accumulation: no noise scale can be measured, and none is needed.
    session = Session(Config(), batch=batch, train={"progress": False, "metrics": False, "max_steps": steps})
    model = nn.Linear(4, 1)
    opt = optimizer(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1000)
    model, opt, loader, scheduler = session.setup(
        model, opt, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True), scheduler
    )
    for _ in session.epochs(1000):
        for xb, yb in loader:
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(xb), yb))
    return session, scheduler


def test_a_run_grows_at_its_points_and_keeps_the_schedule_in_samples(capsys):
    session, scheduler = _run({"schedule": "x2@10,x4@20"})
    a = session.adaptive
    assert isinstance(a, ScheduledBatch)
    assert a.history == [(10, 2), (20, 4)] and a.k == 4 and a.gain == 1.0
    assert session.batch.global_batch_size == 32 and session.batch.accumulation_steps == 4
    assert scheduler.last_epoch == 10 * 1 + 10 * 2 + 10 * 4  # k scheduler steps per optimizer step
    out = capsys.readouterr().out
    assert "phalanx: batch.schedule: global batch 16 = micro batch 8 x 2 accumulation steps" in out
    assert "from step 10" in out and "from step 20" in out
    session.close()


def test_forwards_join_micro_batches_up_to_the_limit():
    session, _ = _run({"schedule": "x2@5,x4@10", "max_micro_batch_size": 32}, steps=15)
    assert session.adaptive.merge == 4  # four of the loader's 8 in one forward of 32
    session.close()


def test_adam_takes_the_seesaw_step_at_each_growth():
    session, _ = _run({"schedule": "x4@10"}, optimizer=torch.optim.Adam, steps=12)
    assert session.adaptive.gain == pytest.approx(0.5)
    session.close()


def test_its_state_resumes_exactly():
    config = Config.load(batch={"schedule": "x2@10,x4@20"}, train={"max_steps": 40})
    plan = BatchPlan(global_batch_size=8, micro_batch_size=8, accumulation_steps=1, data_parallel_size=1)
    whole = ScheduledBatch(config, Topology())
    whole.plan(plan)
    for step in range(1, 16):
        whole.decide(step, None, adam=True)
    resumed = ScheduledBatch(config, Topology())
    resumed.plan(plan)
    resumed.load_state_dict(whole.state_dict())
    assert (resumed.k, resumed.gain, resumed.history) == (2, pytest.approx(1 / math.sqrt(2)), [(10, 2)])
    for step in range(16, 30):
        whole.decide(step, None, adam=True)
        resumed.decide(step, None, adam=True)
    assert resumed.state_dict() == whole.state_dict()
    assert [resumed.multiple_at(s) for s in (9, 10, 19, 20, 39)] == [1, 2, 2, 4, 4]
