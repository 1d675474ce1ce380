"""`phalanx tune --objective time`: the choice by goodput (throughput x statistical efficiency)
rather than by throughput, from the gradient noise scale the trials measured."""

from __future__ import annotations

import pytest

from phalanx.cli.main import main
from phalanx.harness.figures import run_figures
from phalanx.tune import search
from phalanx.tune.runner import TuneOptions


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
