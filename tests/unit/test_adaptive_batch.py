"""batch.adaptive: goodput in one process: the choice, the AdaScale gain, the schedule kept in
samples, the plan the Session trains with, and the settings it refuses."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session
from phalanx.config.batch import BatchPlan
from phalanx.errors import ConfigError
from phalanx.session import adaptive
from phalanx.session.step_times import StepTimes

BASE = BatchPlan(global_batch_size=64, micro_batch_size=16, accumulation_steps=4, data_parallel_size=1)


def test_the_choice_follows_the_noise_scale():
    # 1 ms per micro-step, 20 ms fixed per step: larger batches amortise the fixed part.
    candidates = [1, 2, 4, 8]
    times = StepTimes([1e-3, 20e-3])
    assert adaptive.choose(1, candidates, BASE, noise_scale=10_000.0, times=times) == 8
    # A noise scale far below the batch: larger batches' samples do little work.
    assert adaptive.choose(1, candidates, BASE, noise_scale=8.0, times=times) == 1
    # Within the minimum gain the current multiple stays.
    assert adaptive.choose(2, [1, 2], BASE, noise_scale=1e9, times=StepTimes([1.0, 0.0])) == 2


def test_the_learning_rate_gain():
    assert adaptive.lr_gain(1, BASE, 100.0, adam=False) == 1.0
    # AdaScale: (1 + Bn/G0) / (1 + Bn/G); it approaches k when the noise dominates.
    assert adaptive.lr_gain(4, BASE, 100.0, adam=False) == pytest.approx((1 + 100 / 64) / (1 + 100 / 256))
    assert adaptive.lr_gain(4, BASE, 1e9, adam=False) == pytest.approx(4.0, rel=1e-3)
    assert adaptive.lr_gain(4, BASE, 1e9, adam=True) == pytest.approx(2.0, rel=1e-3)


class _SlowSGD(torch.optim.SGD):
    """A fixed cost per optimizer step (as an all-reduce or a large optimizer has), which larger
    batches amortise: with a large noise scale, goodput grows with the batch."""

    def step(self, closure=None):
        time.sleep(0.004)
        return super().step(closure)


def _run(**batch) -> tuple[Session, torch.optim.lr_scheduler.LRScheduler]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 4, generator=g)
    y = x.sum(1, keepdim=True) + 30.0 * torch.randn(2048, 1, generator=g)  # very noisy: B_noise near 900
    session = Session(
        Config(),
        # The loss of this noise is too noisy to show progress: the noise scale alone decides here
        # (the loss's check has tests of its own, tests/unit/test_adaptive_stall.py).
        batch={"micro_batch_size": 4, "adaptive": "goodput", "adapt_every": 5, "adaptive_loss_check": False, **batch},
        train={"progress": False, "metrics": False, "noise_scale_every": 1, "max_steps": 40},
    )
    model = nn.Linear(4, 1)
    optimizer = _SlowSGD(model.parameters(), lr=0.001)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1000)
    model, optimizer, loader, scheduler = session.setup(
        model, optimizer, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True), scheduler
    )
    for _ in session.epochs(1000):
        for xb, yb in loader:
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(xb), yb))
    return session, scheduler


def test_a_run_grows_its_batch_and_keeps_the_schedule_in_samples():
    session, scheduler = _run()
    history = session.adaptive.history
    assert history and session.adaptive.k > 1, history
    assert session.batch.global_batch_size == 8 * session.adaptive.k
    assert session.batch.accumulation_steps == 2 * session.adaptive.k
    # Every optimizer step stepped the schedule k times: the count is the samples seen / 8.
    steps_at = [1] * session.step_count
    for step, k in history:
        for i in range(step, session.step_count):
            steps_at[i] = k
    assert scheduler.last_epoch == sum(steps_at)
    assert session.adaptive.gain > 1.0
    session.close()


def test_the_settings_it_refuses():
    with pytest.raises(ConfigError, match="batch.fixed_layout"):
        Session(Config(), batch={"adaptive": "goodput", "fixed_layout": True}, train={"progress": False})
    with pytest.raises(ConfigError, match="train.noise_scale: true"):
        Session(Config(), batch={"adaptive": "goodput"}, train={"progress": False, "noise_scale": False})
    with pytest.raises(ConfigError):
        Config.load(overrides=["batch.adaptive=throughput"])
