"""`phalanx tune --objective time`: the choice by goodput (throughput x statistical efficiency)
rather than by throughput, from the gradient noise scale the trials measured."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.cli.main import main
from phalanx.harness.figures import RunFigures, run_figures
from phalanx.tune import runner, search
from phalanx.tune.runner import TuneOptions
from phalanx.tune.trials import OK, Announced


def _m(micro: int, rate: float | None, global_batch: int) -> search.Measured:
    return search.Measured(micro, rate, global_batch=global_batch)


def test_a_larger_batch_that_is_faster_per_sample_can_be_slower_to_a_target():
    # 3.4x the samples/s at 8x the batch: by throughput the larger one wins...
    results = [_m(64, 2000.0, 128), _m(512, 6800.0, 1024)]
    assert search.fastest(results, 64).value == 512
    # ...but with B_noise 100 its samples do 1/(1+10.24) of the work, against 1/(1+1.28): slower.
    assert search.fastest_to_target(results, 64, noise_scale=100.0).value == 64
    assert search.predicted_time_ratio(results[1], results[0], 100.0) == pytest.approx(
        (1 + 1024 / 100) / 6800 / ((1 + 128 / 100) / 2000)
    )
    # With a large noise scale both batches are efficient, and the faster one wins.
    assert search.fastest_to_target(results, 64, noise_scale=1e6).value == 512


def test_the_current_value_stays_within_the_minimum_gain():
    results = [_m(64, 1000.0, 64), _m(128, 1010.0, 128)]
    assert search.fastest_to_target(results, 64, noise_scale=1e9).value == 64
    assert search.fastest_to_target([_m(64, None, 64)], 64, noise_scale=10.0) is None
    assert search.efficiency(100, 100.0) == pytest.approx(0.5)


def test_the_figures_carry_the_runs_last_noise_scale():
    records = {
        0: [
            {"step": s, "step_time": 0.1, "data_wait": 0.0, "samples": 8, "noise_scale": n}
            for s, n in [(1, None), (2, 30.0), (3, 40.0)]
        ]
    }
    assert run_figures(1, records, warmup=1, name="trial").noise_scale == 40.0


def test_the_objective_is_a_documented_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "--objective", "speed", "--demo"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'speed'" in capsys.readouterr().err
    assert "--objective time" in TuneOptions(objective="time", demo=True).command()


@given(st.integers(1, 2000))
def test_the_noise_trial_is_longer_and_weighs_out_its_first_half(steps):
    total, overrides = search.noise_trial(steps)
    assert total == max(search.NOISE_TRIAL_LENGTH * steps, search.NOISE_TRIAL_MIN_STEPS)
    smoothing = float(next(o for o in overrides if o.startswith("train.noise_scale_smoothing=")).split("=")[1])
    assert "train.noise_scale_every=2" in overrides and 0 < smoothing < 1
    # The estimates of the warm-up (the first half) in the bias-corrected moving average at the end.
    estimates = total // search.NOISE_EVERY
    early = math.floor(total * search.NOISE_WARMUP) // search.NOISE_EVERY
    weights = [smoothing ** (estimates - i) for i in range(1, estimates + 1)]
    assert sum(weights[:early]) / sum(weights) <= search.NOISE_WARMUP_WEIGHT + 1e-3


def test_the_choice_takes_the_noise_scale_of_the_noise_trial_alone(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)
    launched = []

    def launch(self, script, script_args, *, nproc, parent, extra=(), cap, env=None):
        launched.append((tuple(extra), cap))
        return object()

    def conclude(trial, run, *, nproc, warmup, steps, min_steps=None):
        noise = 1e6 if trial.stage == runner.NOISE else 2.0  # the early steps' low estimate
        trial.outcome = OK
        rate = 1000.0 * trial.settings.micro / (trial.settings.micro + 16) if trial.settings.micro else 500.0
        trial.figures = RunFigures(2, trial.settings.global_batch or 128, steps, rate, 0.1, 0.0, None, noise)
        return trial

    monkeypatch.setattr(TuneOptions, "launch", launch)
    monkeypatch.setattr(runner, "conclude", conclude)
    monkeypatch.setattr(runner, "stop_note", lambda run, what, cap: None)
    monkeypatch.setattr(runner, "announced", lambda run_dir: Announced(128, 16, 2, 0.01, False))
    opts = TuneOptions(
        script="train.py",
        cpu=True,
        nproc=2,
        steps=10,
        warmup=2,
        dry_run=True,
        search=("micro-batch",),
        objective="time",
        allow_global_batch=True,
        max_micro_batch=128,
    )
    result = runner._Tuner(opts, lambda line: None).run()
    noise_trials = [t for t in result.trials if t.stage == runner.NOISE]
    assert len(noise_trials) == 1 and "100 steps" in noise_trials[0].label
    caps = [cap for extra, cap in launched if any("noise_scale_smoothing" in o for o in extra)]
    assert caps == [100]  # the one trial that estimates runs 100 steps; the others 10, without estimates
    assert all(cap == 10 for extra, cap in launched if not any("noise_scale" in o for o in extra))
    # With the late noise scale (1e6) no smaller global batch wins; the early one (2) would have chosen one.
    assert "gradient noise scale ≈1,000,000" in result.stages[0].summary
    assert result.values.get("batch.global_batch_size", 128) >= 128


@pytest.mark.parametrize("steps", [1, 3, 12, 40, 100])
def test_a_noise_trial_may_end_after_its_warm_up_and_five_estimates(steps):
    from phalanx.tune import search

    total, _ = search.noise_trial(steps)
    least = search.noise_trial_minimum(total)
    assert total // 2 < least <= total  # past the weighted-out half, never more than the trial
    assert least - int(total * search.NOISE_WARMUP) == 5 * search.NOISE_EVERY or least == total
