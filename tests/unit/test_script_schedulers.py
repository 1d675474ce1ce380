"""A scheduler the script steps itself stays the script's (session/schedulers.py): a per-epoch
StepLR keeps its meaning, a per-iteration call under accumulation counts once per optimizer step,
and one phalanx missed in the source is handed back at run time, with a line that says whether
the schedule stayed exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from phalanx import Config, Session
from phalanx.session.schedulers import script_steps
from tests.helpers.models import make_data, make_model

BATCHES = 4  # optimizer steps per epoch
EPOCHS = 3


def _session(tmp_path, **batch):
    return Session(
        Config(),
        train={"progress": False, "epochs": EPOCHS},
        batch={"global_batch_size": 8, **batch},
        checkpoint={"dir": str(tmp_path / "ck"), "resume": "never"},
    )


def _reference(per_epoch: bool):
    """One process, no phalanx: the script's own loop."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1 if per_epoch else 3, gamma=0.5)
    lrs = []
    for _ in range(EPOCHS):
        for x, y in DataLoader(make_data(8 * BATCHES), batch_size=8):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            if not per_epoch:
                scheduler.step()
        if per_epoch:
            scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    return model.state_dict(), lrs


def _per_epoch(tmp_path, short_form: bool, **batch):
    session = _session(tmp_path, **batch)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(make_data(8 * BATCHES), batch_size=8)
    model, optimizer, loader, scheduler = session.setup(model, optimizer, loader, scheduler)
    lrs = []
    for _ in session.epochs():
        for x, y in loader:
            if short_form:
                session.backward(F.mse_loss(model(x), y))
                session.step()
            else:
                with session.accumulate(model):
                    session.backward(F.mse_loss(model(x), y))
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    state = session.model_state_dict()
    session.close()
    return state, lrs


def _close(a, b):
    return all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in b)


@pytest.mark.parametrize("short_form", [False, True])
@pytest.mark.parametrize("micro", [None, 4])
def test_a_per_epoch_steplr_stepped_by_the_script_keeps_its_epochs(tmp_path, capsys, short_form, micro):
    state, lrs = _per_epoch(tmp_path, short_form, micro_batch_size=micro)
    want_state, want_lrs = _reference(per_epoch=True)
    assert lrs == pytest.approx(want_lrs) == [0.05, 0.025, 0.0125]
    assert _close(state, want_state)
    assert "the script steps StepLR itself (test_script_schedulers.py:" in capsys.readouterr().out


@pytest.mark.parametrize("short_form", [False, True])
def test_a_per_iteration_call_under_accumulation_counts_once_per_optimizer_step(tmp_path, capsys, short_form):
    session = _session(tmp_path, micro_batch_size=4)  # 2 micro-steps per optimizer step
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = DataLoader(make_data(8 * BATCHES), batch_size=8)
    model, optimizer, loader, sched = session.setup(model, optimizer, loader, sched)
    for _ in session.epochs():
        for x, y in loader:
            if short_form:
                optimizer.zero_grad()  # a one-GPU loop's: skipped between micro-steps, not an error
                session.backward(F.mse_loss(model(x), y))
                session.step()
            else:
                with session.accumulate(model):
                    session.backward(F.mse_loss(model(x), y))
            sched.step()
    state = session.model_state_dict()
    assert sched.last_epoch == session.step_count == EPOCHS * BATCHES
    session.close()
    want_state, _ = _reference(per_epoch=False)
    assert _close(state, want_state)
    assert "only the call after each optimizer step counts" in capsys.readouterr().out


def _hidden_step(holder):
    holder["scheduler"].step()  # through a dict: not a name or attribute setup()'s frame binds


@pytest.mark.parametrize("step_size, exact", [(100, True), (2, False)])
def test_a_call_the_source_check_misses_is_handed_back_at_run_time(tmp_path, capsys, step_size, exact):
    session = _session(tmp_path)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    holder = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=0.5)}
    loader = DataLoader(make_data(8 * BATCHES), batch_size=8)
    model, optimizer, loader, _ = session.setup(model, optimizer, loader, holder["scheduler"])
    for _ in session.epochs():
        for x, y in loader:
            with session.accumulate(model):
                session.backward(F.mse_loss(model(x), y))
        _hidden_step(holder)
    scheduler = holder["scheduler"]
    assert scheduler.last_epoch == EPOCHS  # the script's calls alone, from the first epoch's end
    assert scheduler.get_last_lr()[0] == pytest.approx(0.1 * 0.5 ** (EPOCHS // step_size))
    out = capsys.readouterr().out
    assert "the script called StepLR.step() itself" in out
    assert ("the schedule is exact" in out) == exact
    assert ("differs from the script's own schedule" in out) == (not exact)
    session.close()


def test_reduce_lr_on_plateau_is_the_scripts_and_is_checkpointed(tmp_path, capsys):
    session = _session(tmp_path)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
    loader = DataLoader(make_data(8 * BATCHES), batch_size=8)
    model, optimizer, loader, plateau = session.setup(model, optimizer, loader, plateau)
    for _ in session.epochs():
        for x, y in loader:
            with session.accumulate(model):
                session.backward(F.mse_loss(model(x), y))
        plateau.step(1.0)  # the same metric every epoch: no improvement after the first
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1 ** (EPOCHS - 1))
    saved = session.save()
    session.close()
    assert "ReduceLROnPlateau itself (it needs a metric)" in capsys.readouterr().out
    again = Session(
        Config(),
        train={"progress": False, "epochs": EPOCHS},
        batch={"global_batch_size": 8},
        checkpoint={"dir": str(saved.parent)},
    )
    model2 = make_model()
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    plateau2 = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer2, patience=0)
    loader2 = DataLoader(make_data(8 * BATCHES), batch_size=8)
    again.setup(model2, optimizer2, loader2, plateau2)  # resumes the checkpoint
    assert plateau2.num_bad_epochs == plateau.num_bad_epochs and plateau2.best == plateau.best
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])
    again.close()


def _setup_here(scheduler):
    import inspect

    return inspect.currentframe()


def _reference_loop(scheduler):
    scheduler.step()  # another function's scheduler of the same name: not the caller's


def _caller_that_hands_it_on(scheduler):
    import inspect

    frame = inspect.currentframe()
    _train(scheduler=scheduler)
    return frame


def _train(scheduler):
    scheduler.step()


def test_the_source_check_reads_the_callers_function_and_one_call_deeper():
    optimizer = torch.optim.SGD(make_model().parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    assert script_steps(scheduler, _setup_here(scheduler)) is None  # _reference_loop's call is not counted
    assert script_steps(scheduler, _caller_that_hands_it_on(scheduler)) == (
        f"test_script_schedulers.py:{_train.__code__.co_firstlineno + 1}"
    )
    assert script_steps(scheduler, None) is None
