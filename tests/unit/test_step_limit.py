"""Issue 14, friction 8 (the Session side): `train.max_steps`, the limit bench and tune end their
runs with, ends `session.epochs()` and every training loader's pass cleanly, in any way of writing
the loop, so the script's own end-of-training code runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session

LIMIT = 3


def _set_up(micro=8, **train):
    session = Session(
        Config(),
        batch={"micro_batch_size": micro},
        train={"progress": False, "epochs": 5, "max_steps": LIMIT, **train},
        checkpoint={"resume": "never"},
    )
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))  # 8 steps per epoch at global 8
    model, optimizer, loader = session.setup(model, optimizer, DataLoader(data, batch_size=8, shuffle=True))
    test_loader = session.setup(DataLoader(data, batch_size=16))
    return session, model, loader, test_loader


def _step(session, model, x, y):
    with session.accumulate(model):
        session.backward(F.mse_loss(model(x), y))


@pytest.mark.parametrize("micro", [8, 4], ids=["no accumulation", "2 micro-steps"])
def test_epochs_and_the_loader_end_at_the_limit(micro, capsys):
    session, model, loader, test_loader = _set_up(micro)
    batches = 0
    for _ in session.epochs():
        for x, y in loader:
            batches += 1
            _step(session, model, x, y)
    ended = True  # the code after the loop runs: that is the point
    assert ended and session.step_count == LIMIT and batches == LIMIT * (8 // micro)
    assert session.epoch == 0  # stopped inside the first epoch; it stays the epoch
    assert len([b for b in test_loader]) == 4  # evaluation after the limit is not cut
    assert list(session.epochs()) == []  # a second training loop yields nothing
    assert capsys.readouterr().out.count(f"train.max_steps={LIMIT} reached") == 1
    session.close()


def test_progress_and_a_loop_without_epochs_end_there_too():
    session, model, loader, _ = _set_up()
    for _ in range(5):  # the script's own epoch loop
        for x, y in session.progress(loader):
            _step(session, model, x, y)
    assert session.step_count == LIMIT
    assert list(loader) == []  # a pass begun after the limit yields nothing
    session.close()


def test_a_limit_beyond_the_epochs_changes_nothing():
    session, model, loader, _ = _set_up(max_steps=1000, epochs=2)
    for _ in session.epochs():
        for x, y in loader:
            _step(session, model, x, y)
    assert session.step_count == 16 and session.epoch == 2
    session.close()


def test_no_limit_by_default():
    assert Config().train.max_steps is None


def test_a_limit_inside_the_last_epoch_keeps_it_the_epoch(tmp_path):
    # A one-epoch run stopped at the limit and saved after its loop: the checkpoint is inside
    # epoch 1, so a resume with a higher limit trains the rest of it (it did nothing before).
    def run(limit):
        session = Session(
            Config(),
            batch={"global_batch_size": 8},
            train={"progress": False, "epochs": 1, "max_steps": limit},
            checkpoint={"dir": str(tmp_path), "resume": "auto"},
        )
        model = torch.nn.Linear(4, 1)
        model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))  # 8 steps in the epoch
        loader = session.setup(DataLoader(data, batch_size=8, shuffle=True))
        for _ in session.epochs():
            for x, y in loader:
                _step(session, model, x, y)
        epoch, steps = session.epoch, session.step_count
        session.save()
        session.close()
        return epoch, steps

    assert run(LIMIT) == (0, LIMIT)
    assert run(100) == (1, 8)  # the rest of the epoch, then it is done
