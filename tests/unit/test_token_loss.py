"""``session.backward(loss, items=n)`` in one process: accumulation over micro-batches of unequal
token counts gives the whole global batch's token mean; what cannot be a count, a window that mixes
weighted and plain backwards, a global batch without tokens and strategies that cannot weight are
refused in one line."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from phalanx import Config, PhalanxError, Session
from phalanx.session.items import check_items
from tests.helpers import token_loss as tl
from tests.helpers.training import rel_diff


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero1", "fsdp"])
def test_accumulated_micro_batches_give_the_global_batchs_token_mean(strategy):
    reference = tl.reference(steps=6)
    weighted = tl.train(strategy, 2, True, steps=6)
    plain = tl.train(strategy, 2, False, steps=6)
    assert weighted["accumulation"] == 4
    assert rel_diff(weighted["state"], reference["state"]) < 1e-5
    assert weighted["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert rel_diff(plain["state"], reference["state"]) > 1e-3  # the mean of means this replaces


@given(st.integers(min_value=0, max_value=2**40) | st.floats(min_value=0, max_value=1e12))
def test_counts_are_accepted(n):
    check_items(n)
    check_items(torch.tensor(n))


@given(st.floats(max_value=-1e-9) | st.integers(max_value=-1) | st.sampled_from([math.nan, math.inf, -math.inf]))
def test_negative_or_non_finite_counts_are_refused(n):
    with pytest.raises(PhalanxError, match="finite number >= 0"):
        check_items(n)


@given(
    st.one_of(
        st.booleans(),
        st.text(max_size=4),
        st.lists(st.integers(), max_size=3),
        st.none().map(lambda _: object()),
        st.integers(min_value=2, max_value=5).map(lambda k: torch.ones(k)),
        st.just(torch.tensor([True])),
        st.just(torch.zeros(0)),
    )
)
def test_what_is_not_a_count_is_refused(value):
    with pytest.raises(PhalanxError, match=r"items=n\) takes a count") as err:
        check_items(value)
    assert "\n" not in str(err.value)


def _session(**batch) -> tuple[Session, nn.Module]:
    session = Session(
        Config(),
        strategy="single",
        batch={"global_batch_size": 4, **batch},
        train={"progress": False, "metrics": False},
        checkpoint={"resume": "never"},
    )
    model = nn.Linear(3, 1)
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return session, model


def test_a_window_that_mixes_weighted_and_plain_backwards_is_refused():
    session, model = _session(micro_batch_size=2)
    with session.accumulate(model):
        session.backward(model(torch.ones(2, 3)).mean(), items=2)
    with pytest.raises(PhalanxError, match="items= on some micro-steps"):
        with session.accumulate(model):
            session.backward(model(torch.ones(2, 3)).mean())
    session.close()


def test_a_global_batch_without_items_is_refused():
    session, model = _session()
    with pytest.raises(PhalanxError, match="add up to 0 over the global batch"):
        with session.accumulate(model):
            session.backward(model(torch.ones(4, 3)).mean(), items=torch.tensor(0))
    session.close()


def test_reduce_weights_by_items_only_a_mean():
    session, _ = _session()
    assert session.reduce(torch.tensor(2.5), items=3) == pytest.approx(2.5)
    assert session.reduce(1.5, items=torch.tensor(2)) == pytest.approx(1.5)
    with pytest.raises(PhalanxError, match="use op='mean'"):
        session.reduce(1.0, "sum", items=2)
    with pytest.raises(PhalanxError, match="add up to 0"):
        session.reduce(1.0, items=0)
    with pytest.raises(PhalanxError, match="one value per process"):
        session.reduce(torch.ones(3), items=2)
    session.close()


def test_pipeline_refuses_items_in_one_line():
    session = Session(
        Config(),
        strategy="pipeline",
        batch={"global_batch_size": 4},
        train={"progress": False, "metrics": False},
        checkpoint={"resume": "never"},
    )
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(PhalanxError, match="strategy pipeline cannot weight the loss by items: .*use fsdp or ddp"):
        with session.accumulate(model):
            session.backward(model(torch.ones(4, 3)).mean(), items=4)
    session.close()


def test_a_resumed_weighted_run_equals_an_uninterrupted_one(tmp_path):
    whole = tl.train("single", 2, True, steps=8, ckpt=str(tmp_path / "a"), save_at=1)
    resumed = tl.train("single", 2, True, steps=8, ckpt=str(tmp_path / "b"), resume=whole["saved"])
    # The resumed run scales its backwards by a unit of its own (its first micro-batch's tokens):
    # a power of two, so the weights still agree bit for bit.
    assert resumed["unit"] != whole["unit"]
    for key, value in whole["state"].items():
        assert torch.equal(value, resumed["state"][key]), key
