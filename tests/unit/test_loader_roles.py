"""Which DataLoaders train: the rule (runtime/data.loader_roles) over every combination of a setup()
call, and the Session's side of it in one process: an ordered loader given with an optimizer trains
with the plan the header announces, and a backward on an evaluation loader's batches is refused,
while evaluating in the middle of training (a pass finished or left) is not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, PhalanxError, Session
from phalanx.runtime.data import loader_roles


@given(st.lists(st.booleans(), max_size=6), st.booleans(), st.booleans())
def test_the_rule_over_every_call(shuffling, with_optimizer, training_set_up):
    roles = loader_roles(shuffling, with_optimizer=with_optimizer, training_set_up=training_set_up)
    assert len(roles) == len(shuffling)
    assert all(role for role, shuffles in zip(roles, shuffling) if shuffles)  # a shuffling loader always trains
    ordered_training = [i for i, (role, shuffles) in enumerate(zip(roles, shuffling)) if role and not shuffles]
    if ordered_training:
        # Only the first loader, only where nothing else could train.
        assert ordered_training == [0]
        assert with_optimizer and not training_set_up and not any(shuffling)
    elif shuffling and with_optimizer and not training_set_up and not any(shuffling):
        pytest.fail("an ordered loader given with an optimizer, and nothing else to train on, must train")


def _data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def _session(**batch) -> Session:
    return Session(
        Config(),
        strategy="single",
        batch=batch,
        train={"progress": False, "metrics": False},
        checkpoint={"resume": "never"},
    )


def test_an_ordered_loader_given_with_an_optimizer_trains_with_the_announced_plan(capsys):
    session = _session(micro_batch_size=4)
    model = torch.nn.Linear(4, 1)
    model, _, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_data(), 16))
    out = capsys.readouterr().out
    assert "does not shuffle; it is taken as the training loader" in out
    assert "global batch 16 = micro batch 4 x 4 accumulation steps" in out
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        with session.accumulate(model):
            session.backward(F.mse_loss(model(x), y))
    assert sizes == [4] * 8 and session.step_count == 2
    session.close()


def test_a_backward_on_an_evaluation_loaders_batch_is_refused():
    session = _session(global_batch_size=8)
    model = torch.nn.Linear(4, 1)
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    evaluation = session.setup(DataLoader(_data(), 16))
    with pytest.raises(PhalanxError, match=r"evaluation loader's batch .*setup_loader\(loader, train=True\)") as err:
        for x, y in evaluation:
            session.backward(F.mse_loss(model(x), y))
    assert "\n" not in str(err.value)
    session.close()


def _training_and_evaluation(evaluation_batch: int) -> tuple:
    """A Session with a shuffling training loader (8 micro-batches of 4) and an ordered one."""
    session = _session(micro_batch_size=4)
    model = torch.nn.Linear(4, 1)
    model, _, train, evaluation = session.setup(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(_data(), 8, shuffle=True),
        DataLoader(_data(), evaluation_batch),
    )
    assert train.train and not evaluation.train
    return session, model, train, evaluation


def test_evaluating_in_the_middle_of_training_is_not_refused():
    session, model, train, evaluation = _training_and_evaluation(8)
    for i, (x, y) in enumerate(train):
        loss = F.mse_loss(model(x), y)
        with torch.no_grad():
            if i % 2:
                for ex, _ in evaluation:  # a whole pass, between the forward and its backward
                    model(ex)
            else:
                for ex, _ in evaluation:  # a pass left early
                    model(ex)
                    break
        with session.accumulate(model):
            session.backward(loss)
    assert session.step_count == 4
    session.close()


def test_a_validation_batch_drawn_from_a_kept_iterator_before_the_backward_is_not_refused():
    session, model, train, evaluation = _training_and_evaluation(2)
    kept = iter(evaluation)
    for x, y in train:
        loss = F.mse_loss(model(x), y)
        with torch.no_grad():
            model(next(kept)[0])  # its pass stays open, and it handed out the last batch
        with session.accumulate(model):
            session.backward(loss)
    assert session.step_count == 4
    session.close()


def test_an_explicit_evaluation_loader_is_named_as_such_in_the_refusal():
    session = _session(global_batch_size=8)
    model = torch.nn.Linear(4, 1)
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    evaluation = session.setup_loader(DataLoader(_data(), 16, shuffle=True), train=False)
    with pytest.raises(PhalanxError, match=r"set up with session.setup_loader\(loader, train=False\)\)"):
        for x, y in evaluation:
            session.backward(F.mse_loss(model(x), y))
    session.close()


def test_a_training_loader_after_the_ordered_rule_chose_one_is_refused():
    session = _session(micro_batch_size=4)
    model = torch.nn.Linear(4, 1)
    session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_data(), 8))
    with pytest.raises(PhalanxError, match=r"a training loader is set up after setup\(\) took an ordered"):
        session.setup(DataLoader(_data(), 8, shuffle=True))
    session.close()


def test_training_on_other_data_than_the_loader_the_ordered_rule_chose_is_refused():
    # A nanoGPT-style loop: batches of its own, and the ordered loader given with the optimizer evaluates.
    session = _session(global_batch_size=8)
    model = torch.nn.Linear(4, 1)
    model, _, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_data(), 8))
    x, y = _data(8).tensors
    with pytest.raises(PhalanxError, match=r"came without a batch of the loader setup\(\) took as the training"):
        session.backward(F.mse_loss(model(x), y))
    session.close()
