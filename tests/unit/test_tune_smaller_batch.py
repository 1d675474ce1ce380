"""`phalanx tune --objective time --allow-global-batch` also tries a half and a quarter of the
script's global batch: below the noise scale a smaller batch needs fewer samples for the same
progress, and the choice weighs that against its lower samples/s."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.harness.figures import RunFigures
from phalanx.tune import runner as tune_runner
from phalanx.tune import search
from phalanx.tune.trials import OK, Announced, Trial


def _tuner(tmp_path, monkeypatch, noise: float, rate, **options):
    """A tuner whose trials run nothing: samples/s from ``rate(settings)``, the noise scale given."""
    (tmp_path / "train.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)
    trials: list[Trial] = []

    def trial(self, stage, settings, label, *, again=False):
        settings = settings or tune_runner.Settings(0, 0)
        figures = RunFigures(2, settings.global_batch, 4, rate(settings), 0.1, 0.0, None, noise)
        made = Trial(len(trials) + 1, stage, settings, label, outcome=OK, figures=figures)
        trials.append(made)
        return made

    monkeypatch.setattr(tune_runner._Tuner, "trial", trial)
    monkeypatch.setattr(tune_runner, "announced", lambda run_dir: Announced(128, 64, 2, 0.01, False))
    opts = tune_runner.TuneOptions(
        script="train.py", cpu=True, nproc=2, steps=4, warmup=1, dry_run=True, search=("micro-batch",), **options
    )
    return tune_runner._Tuner(opts, lambda line: None), trials


def _per_sample_cost(settings) -> float:
    return 1000.0 * settings.micro / (settings.micro + 16)  # smaller micro-batches run slower per sample


def test_a_small_noise_scale_chooses_a_smaller_global_batch(tmp_path, monkeypatch):
    tuner, trials = _tuner(
        tmp_path, monkeypatch, 20.0, _per_sample_cost, objective="time", allow_global_batch=True, max_micro_batch=128
    )
    result = tuner.run()
    globals_tried = {t.settings.global_batch for t in trials}
    assert {32, 64} <= globals_tried  # a quarter and a half of 128
    assert result.values["batch.global_batch_size"] < 128, result.stages[0].summary
    assert result.values["optim.lr_scaling"] == "sqrt" and "optim.warmup_steps" not in result.values
    summary = result.stages[0].summary
    assert "(global 32)" in summary and "(global 64)" in summary and "scaled by 0." in summary


def test_a_large_noise_scale_keeps_the_batch_or_grows_it(tmp_path, monkeypatch):
    tuner, _ = _tuner(
        tmp_path, monkeypatch, 1e6, _per_sample_cost, objective="time", allow_global_batch=True, max_micro_batch=128
    )
    result = tuner.run()
    assert result.values.get("batch.global_batch_size", 128) >= 128


@pytest.mark.parametrize("objective, allow", [("throughput", True), ("time", False)])
def test_only_the_time_objective_with_a_free_global_batch_tries_smaller_ones(tmp_path, monkeypatch, objective, allow):
    tuner, trials = _tuner(
        tmp_path,
        monkeypatch,
        20.0,
        _per_sample_cost,
        objective=objective,
        allow_global_batch=allow,
        max_micro_batch=128,
    )
    tuner.run()
    assert min(t.settings.global_batch for t in trials) == 128


def test_without_a_noise_scale_no_smaller_batch_is_tried(tmp_path, monkeypatch):
    tuner, trials = _tuner(
        tmp_path, monkeypatch, None, _per_sample_cost, objective="time", allow_global_batch=True, max_micro_batch=128
    )
    result = tuner.run()
    assert min(t.settings.global_batch for t in trials) == 128  # by throughput, a smaller batch never wins
    assert "no trial measured the gradient noise scale" in result.stages[0].summary


@given(
    st.integers(1, 4096),
    st.integers(1, 4096),
    st.sampled_from(["none", "linear", "sqrt"]),
    st.one_of(st.none(), st.integers(1, 4096)),
    st.integers(0, 1000),
)
def test_warm_up_comes_with_a_larger_learning_rate_only(original, new, rule, reference, warmup):
    values = search.lr_settings(original, new, rule=rule, reference=reference, warmup_steps=warmup)
    if new == original:
        assert values == {}
        return
    ratio = new / (reference or original)
    expected = ratio if values["optim.lr_scaling"] == "linear" else math.sqrt(ratio)
    assert search.lr_multiplier(values) == pytest.approx(expected)
    # A user's warm-up is kept; one is added where the lr jumps up at step 0, never where it falls.
    assert ("optim.warmup_steps" in values) == (warmup > 0 or new > (reference or original))
