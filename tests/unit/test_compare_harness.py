"""benchmarks/compare.py, the side-by-side harness: its figures are the measured ones (format and
arithmetic, never speed), computed from hand-made outcomes."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.cli import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from peers import summary  # noqa: E402
from peers.driver import Outcome  # noqa: E402
from peers.report import render  # noqa: E402


def _outcome(contender: str, nproc: int, rate: float | None, loss: float = 1.0, error: str | None = None) -> Outcome:
    result = None
    if rate is not None:
        figures = {
            "title": "t",
            "global_batch": 64 * nproc,
            "samples_per_s": rate,
            "step_time_median_s": 0.01,
            "final_loss": loss,
            "choices": {"micro_batch": 64, "accumulation": 1, "precision": "fp32"},
        }
        result = {"threads_per_process": 1, "workloads": {"mlp": figures}}
    return Outcome(contender, nproc, 0, 1.0, result, error, 0 if error is None else 2, "log")


def test_ratios_scaling_and_failures_from_the_figures():
    outcomes = [
        _outcome("raw", 1, 100.0),
        _outcome("raw", 1, 300.0),
        _outcome("raw", 1, 200.0),
        _outcome("phalanx", 1, 190.0),
        _outcome("phalanx", 1, 210.0),
        _outcome("raw", 2, 300.0),
        _outcome("phalanx", 2, 297.0),
        _outcome("fabric", 2, 310.0),
        _outcome("phalanx-preset", 1, None, error="preset: unknown key"),
    ]
    rows = summary.throughput_rows(outcomes, ["mlp"], ["raw", "phalanx", "phalanx-preset", "fabric"], [1, 2])
    by = {(r["contender"], r["nproc"]): r for r in rows}
    assert by[("raw", 1)]["samples_per_s"] == 200.0 and by[("raw", 1)]["spread"] == pytest.approx(1.0)
    assert by[("phalanx", 1)]["ratio_to_raw"] == pytest.approx(1.0)
    assert by[("phalanx", 2)]["ratio_to_raw"] == pytest.approx(0.99)
    assert by[("phalanx", 2)]["scaling_efficiency"] == pytest.approx(297 / (2 * 200))
    assert by[("fabric", 2)]["scaling_efficiency"] is None  # no 1-process figure to scale from
    assert (
        by[("phalanx-preset", 1)]["errors"] == ["preset: unknown key"]
        and "samples_per_s" not in by[("phalanx-preset", 1)]
    )

    lines = summary.readings(rows)["mlp"]
    assert lines[1].startswith(
        "2 processes: phalanx defaults run at 0.990x raw DDP's samples/s (target: at most 2% slower, met; one run each"
    )
    assert "0.958x Lightning Fabric (target: not slower, 2% allowed for noise, missed)" in lines[1]
    assert "spread over 2 runs: raw 100%, phalanx 10%" in lines[0]

    markdown = render(
        {
            "throughput": {
                "date": "d",
                "machine": {"cpu": "c", "cores": 2, "os": "o", "gpu": "none", "versions": {}},
                "command": "cmd",
                "settings": "s",
                "workloads": ["mlp"],
                "rows": rows,
                "readings": summary.readings(rows),
                "failures": ["phalanx-preset x1: preset: unknown key"],
                "launches": [],
            }
        }
    )
    assert "| phalanx preset=throughput | 1 | | | failed | | | | | | preset: unknown key |" in markdown
    assert "- phalanx-preset x1: preset: unknown key" in markdown


def test_raw_loop_applies_phalanxs_lr_rule(monkeypatch):
    """The raw loop's hand-written LambdaLR follows phalanx's scaling and warm-up step for step."""
    from compare import raw_lr_args
    from peers.common import lr_rule, parse_args

    from phalanx.config.schema import OptimConfig
    from phalanx.runtime.lr import LRScaling

    for rule, warmup, start in (("linear", 5, None), ("sqrt", 3, 0.25), ("none", 0, None), ("linear", 0, None)):
        optim = OptimConfig(lr_scaling=rule, warmup_steps=warmup, warmup_start_factor=start)
        args = raw_lr_args(optim, 256, 64)
        monkeypatch.setattr(sys, "argv", ["w", "--contender", "raw", "--result", "r", *args])
        by_hand = lr_rule(parse_args())
        expected = LRScaling(rule, 256, 64, warmup, start)
        for step in range(8):
            assert (by_hand(step) if by_hand else 1.0) == pytest.approx(expected.multiplier(step))


def test_contenders_take_turns():
    from compare import rotated

    order = [rotated(["a", "b", "c"], k) for k in range(4)]
    assert order == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def _target(contender: str, seconds: float, reached: bool = True) -> Outcome:
    task = {
        "task": "digits",
        "title": "t",
        "target_accuracy": 0.98,
        "reached": reached,
        "seconds": seconds,
        "eval_seconds": 0.5,
        "samples": 1000,
        "final_accuracy": 0.98 if reached else 0.9,
        "curve": [],
        "choices": {},
    }
    return Outcome(
        contender, 2, 0, seconds + 5, {"threads_per_process": 1, "task": task}, None, 0, "log", unit="digits"
    )


def test_time_to_target_ratio_only_when_every_run_reached():
    outcomes = [
        _target("raw", 10.0),
        _target("raw", 12.0),
        _target("raw", 14.0),
        _target("phalanx-preset", 6.0),
        _target("phalanx-preset", 9.0),
    ]
    rows = summary.target_rows(outcomes, ["digits"], ["raw", "phalanx-preset"], [2])
    by = {r["contender"]: r for r in rows}
    assert by["raw"]["seconds"] == 12.0 and by["phalanx-preset"]["seconds"] == 7.5
    assert by["phalanx-preset"]["ratio_to_raw"] == pytest.approx(7.5 / 12.0)
    assert summary.target_readings(rows) == [
        "digits, 2 processes: phalanx preset=throughput reaches accuracy 0.98 in 0.62x the raw DDP loop's time (7.5 s "
        "against 12.0 s); it meets the 0.75x target."
    ]
    missed = summary.target_rows(
        [*outcomes, _target("phalanx-preset", 30.0, reached=False)], ["digits"], ["raw", "phalanx-preset"], [2]
    )
    assert {r["contender"]: r["ratio_to_raw"] for r in missed}["phalanx-preset"] is None
