"""The gradient noise scale's arithmetic, where each run reads it from, what the metrics and the
summary say about it, and that a resumed run continues its averages exactly."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session
from phalanx.metrics.summary_display import noise_line
from phalanx.runtime.noise_scale import NoiseScale, describe, efficiency


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    g2=st.floats(1e-6, 1e6),
    trace=st.floats(1e-6, 1e8),
    small=st.integers(1, 512),
    factor=st.integers(2, 64),
)
def test_exact_expectations_give_back_the_noise_scale(g2, trace, small, factor):
    # E|G_B|^2 = |G|^2 + tr(S)/B at both sizes: the estimate is exact after one observation (up to
    # float64 rounding, which the difference of two norms amplifies by about B_noise / B_small).
    assume(trace / g2 / small < 1e7)
    big = small * factor
    noise = NoiseScale(small, big, smoothing=0.9)
    noise.observe(g2 + trace / small, g2 + trace / big)
    assert noise.gradient_sq == pytest.approx(g2, rel=1e-6, abs=1e-9 * trace)
    assert noise.value == pytest.approx(trace / g2, rel=1e-4)


def test_no_value_before_an_estimate_or_from_non_finite_norms():
    noise = NoiseScale(8, 64, 0.95)
    assert noise.value is None
    noise.observe(float("inf"), 1.0)
    noise.observe(1.0, float("nan"))
    assert noise.count == 0 and noise.value is None
    with pytest.raises(ValueError):
        NoiseScale(64, 64, 0.95)


def test_the_state_round_trips():
    a, b = NoiseScale(8, 64, 0.95), NoiseScale(16, 128, 0.95)
    for small_sq, big_sq in [(5.0, 2.0), (6.0, 2.5), (4.0, 1.5)]:
        a.observe(small_sq, big_sq)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value and b.count == 3


def test_the_summary_line_says_what_the_batch_means():
    assert "6.0x the gradient noise scale (≈170)" in describe(1020, 170)
    assert "at the cost of samples" in describe(1020, 170)
    assert "0.10x" in describe(17, 170) and "few extra samples" in describe(17, 170)
    assert "about the gradient noise scale" in describe(170, 170)
    assert efficiency(170, 170) == pytest.approx(0.5)
    assert noise_line({"noise_scale": None, "global_batch": 64}) is None
    assert noise_line({"noise_scale": 20.0, "global_batch": 64}).startswith("phalanx: global batch 64 is 3.2x")


def _run(tmp_path, *, steps: int, micro: int | None = 4, resume: bool = False, **train) -> Session:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 6, generator=g)
    y = x.sum(1, keepdim=True) + 0.3 * torch.randn(256, 1, generator=g)
    session = Session(
        Config(),
        batch={"micro_batch_size": micro},
        train={"progress": False, "metrics": False, "noise_scale_every": 1, "max_steps": steps} | train,
        checkpoint={"dir": str(tmp_path / "ckpt"), "resume": "auto" if resume else "never"},
    )
    model = nn.Linear(6, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = session.setup(model, optimizer, DataLoader(TensorDataset(x, y), 16, shuffle=True))
    for _ in session.epochs(100):
        for xb, yb in loader:
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(xb), yb))
    return session


def test_one_process_reads_accumulation_and_names_why_it_cannot_without(tmp_path):
    session = _run(tmp_path, steps=20)
    assert session.noise.estimate.small == 4 and session.noise.estimate.big == 16
    assert session.noise.value is not None and session.noise.value > 0
    session.close()
    single = _run(tmp_path, steps=3, micro=None)
    assert single.noise.value is None and "single batch size" in single.noise.why_not
    single.close()
    off = _run(tmp_path, steps=3, noise_scale=False)
    assert off.noise.estimate is None and off.noise.why_not is None
    off.close()


def test_a_resumed_run_continues_the_averages_exactly(tmp_path):
    whole = _run(tmp_path / "a", steps=30)
    expected = whole.noise.estimate.state_dict()
    whole.close()
    first = _run(tmp_path / "b", steps=12)
    first.save()
    first.close()
    resumed = _run(tmp_path / "b", steps=30, resume=True)
    assert resumed.noise.estimate.state_dict() == expected
    resumed.close()


def test_the_metrics_record_the_estimate(tmp_path):
    session = _run(tmp_path, steps=12, noise_scale_every=3, metrics=True)
    session.metrics.flush()
    records = list(session.metrics.records)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all(r["noise_scale"] is None for r in records[:2])  # the first estimate is at step 3
    assert records[-1]["noise_scale"] == session.noise.value and session.noise.estimate.count == 4
    json.dumps(records)  # plain numbers
    session.close()


def test_ddp_without_accumulation_says_how_to_measure():
    from types import SimpleNamespace

    from phalanx.config.batch import BatchPlan
    from phalanx.session.noise import NoiseProbe

    strategy = SimpleNamespace(
        name="ddp", data_parallel_size=2, local_micro_step_gradients=True, local_norms=None, ddp_buckets=True
    )
    probe = NoiseProbe(Config(), strategy, None, [])
    probe.plan(BatchPlan(global_batch_size=64, micro_batch_size=32, accumulation_steps=1, data_parallel_size=2))
    assert probe.estimate is None and "train.noise_scale: hook" in probe.why_not
    probe.plan(BatchPlan(global_batch_size=64, micro_batch_size=8, accumulation_steps=4, data_parallel_size=2))
    assert probe.estimate is not None and probe.estimate.small == 8  # accumulation's micro-steps
