"""Loops without an optimizer in one process: the update reads complete, clipped gradients inside
the accumulate block, phalanx zeroes them and counts the step after it, and what cannot work is
refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from phalanx import Config, PhalanxError, Session
from tests.helpers.manual import manual_sgd, reference_manual
from tests.helpers.models import make_data, make_model
from tests.helpers.training import rel_diff


@pytest.mark.parametrize("micro", [None, 4])
def test_hand_written_sgd_matches_the_plain_loop(micro):
    out = manual_sgd("single", 16, micro, 6)
    assert out["error"] is None and out["steps"] == out["updates"] == 6
    assert not any(out["grads_left"])
    assert rel_diff(out["state"], reference_manual(16, 6)) < 1e-5


def test_a_one_gpu_zero_grad_before_each_batch_is_harmless_without_accumulation():
    out = manual_sgd("single", 16, None, 4, zero_grad_each_batch=True)
    assert out["error"] is None and rel_diff(out["state"], reference_manual(16, 4)) < 1e-5


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_gradients_cleared_in_the_middle_of_a_window_are_refused(with_optimizer):
    if not with_optimizer:
        out = manual_sgd("single", 16, 4, 4, zero_grad_each_batch=True)
        error = out["error"]
    else:
        session = Session(Config(), batch={"global_batch_size": 8, "micro_batch_size": 4}, train={"progress": False})
        model = make_model()
        model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = make_data(4).tensors
        with pytest.raises(PhalanxError) as caught:
            for _ in range(2):
                model.zero_grad()  # the optimizer's own zero_grad is guarded elsewhere; this is the model's
                with session.accumulate(model):
                    session.backward(F.mse_loss(model(x), y))
        session.close()
        error = str(caught.value)
    assert error.startswith("the model's gradients were cleared in the middle of an accumulation window")
    assert "remove it" in error


def _manual_session(**sections):
    session = Session(Config(), train={"progress": False}, checkpoint={"resume": "never"}, **sections)
    return session, session.setup(make_model())


def test_fp16_without_an_optimizer_is_refused_at_the_first_backward():
    session, model = _manual_session(precision="fp16")
    x, y = make_data(4).tensors
    try:
        with pytest.raises(PhalanxError, match="precision.mode fp16 scales the loss.*set precision.mode bf16 or fp32"):
            session.backward(F.mse_loss(model(x), y))
    finally:
        session.close()


def test_max_grad_norm_clips_before_the_update_reads_the_gradients():
    session, model = _manual_session(optim={"max_grad_norm": 0.01})
    x, y = make_data(8).tensors
    with session.accumulate(model):
        session.backward(F.mse_loss(model(x), y))
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert norm.item() == pytest.approx(0.01, rel=1e-3)
    assert session.step_count == 1 and all(p.grad is None for p in model.parameters())
    session.close()


def test_session_step_ends_a_hand_written_step_without_accumulate():
    session, model = _manual_session()
    x, y = make_data(8).tensors
    for expected in (1, 2):
        session.backward(F.mse_loss(model(x), y))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.1)
        session.step()
        assert session.step_count == expected and all(p.grad is None for p in model.parameters())
    session.close()


def test_lr_scaling_without_an_optimizer_says_to_use_lr_multiplier(capsys):
    session = Session(
        Config(),
        train={"progress": False},
        checkpoint={"resume": "never"},
        optim={"lr_scaling": "linear", "reference_batch_size": 4, "warmup_steps": 2},
    )
    model = session.setup(make_model())
    loader = session.setup_loader(DataLoader(make_data(24), batch_size=8), train=True)
    multipliers = []
    for _ in session.epochs(1):
        for x, y in loader:
            with session.accumulate(model):
                session.backward(F.mse_loss(model(x), y))
                multipliers.append(session.lr_multiplier)
    assert multipliers[0] < multipliers[1] == multipliers[2] == 2.0  # warmed up to x2 (global 8 / reference 4)
    assert capsys.readouterr().out.count("multiply your learning rate by it") == 1
    session.close()
