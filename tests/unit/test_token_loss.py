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


def test_a_global_batch_without_items_is_refused_within_the_check_interval(capsys):
    from phalanx.session.items import ITEMS_CHECK_EVERY

    session, model = _session()
    with session.accumulate(model):  # no item: the step gets no gradient, and is not read back here
        session.backward(model(torch.ones(4, 3)).mean(), items=torch.tensor(0))
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(PhalanxError, match="added up to 0 over a global batch"):
        for _ in range(ITEMS_CHECK_EVERY):  # read at the same step on every rank, not at every step
            with session.accumulate(model):
                session.backward(model(torch.ones(4, 3)).mean(), items=4)
    assert session.step_count == ITEMS_CHECK_EVERY
    with session.accumulate(model):  # the run's last window: said when the Session closes
        session.backward(model(torch.ones(4, 3)).mean(), items=torch.tensor(-1))
    session.close()
    assert "negative count on 1 micro-step(s)" in capsys.readouterr().out


def test_a_second_weighted_backward_after_the_synchronising_one_is_refused():
    session, model = _session()
    with pytest.raises(PhalanxError, match="came again after the backward that synchronised"):
        with session.accumulate(model):
            session.backward(model(torch.ones(4, 3)).mean(), items=3)
            session.backward(model(torch.ones(4, 3)).mean(), items=5)
    session.close()


def test_gradients_keep_the_size_they_have_under_the_plain_contract():
    # A rank's gradient before the step's rescaling: what fp16 scaling and compressed all-reduces see.
    sizes = {}
    for weighted in (True, False):
        session, model = _session(micro_batch_size=2)
        seen = []
        for p in model.parameters():
            p.register_hook(lambda g, seen=seen: seen.append(g.norm().item()))
        for _ in range(3):
            for _ in range(2):
                with session.accumulate(model):
                    session.backward(model(torch.ones(2, 3)).pow(2).mean(), items=2 if weighted else None)
        sizes[weighted] = seen
        session.close()
    for weighted, plain in zip(sizes[True], sizes[False]):
        assert 0.5 <= weighted / plain <= 2  # a power of two near the plain size, at every step


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
    # The resumed run scales its first backwards by a unit of its own (from its first micro-batch's
    # tokens, where the whole run's comes from step 0's count): a power of two, so the weights still
    # agree bit for bit.
    assert resumed["units"][0] != whole["units"][1]
    for key, value in whole["state"].items():
        assert torch.equal(value, resumed["state"][key]), key


def test_a_micro_batch_without_items_counts_for_nothing_in_the_reported_loss():
    # F.cross_entropy over only padding: a NaN mean, with zero gradients.
    session, model = _session(micro_batch_size=2)
    with session.accumulate(model):
        empty = model(torch.ones(2, 3)).mean() * 0 + float("nan")
        session.backward(empty, items=0)
    with session.accumulate(model):
        loss = model(torch.ones(2, 3)).mean()
        session.backward(loss, items=2)
    assert session.step_count == 1
    assert session._loss_value() == pytest.approx(loss.item())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    session.close()
