"""benchmarks/compare.py, the side-by-side harness: it runs end to end in a tiny configuration and
its figures are the measured ones (format and arithmetic, never speed)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from peers import summary  # noqa: E402
from peers.driver import Outcome  # noqa: E402
from peers.report import render  # noqa: E402

PEERS = [name for name, module in (("accelerate", "accelerate"), ("fabric", "lightning_fabric")) if importlib.util.find_spec(module)]


def _compare(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "compare.py"), *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"compare.py {' '.join(args)} did not finish in {timeout}s\n{out}\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.multiprocess
def test_harness_end_to_end_tiny(tmp_path):
    contenders = ["raw", "phalanx", *PEERS]
    runs = tmp_path / "runs"
    result = _compare(
        "--tiny", "--workloads", "mlp", "--contenders", ",".join(contenders), "--nproc-list", "1",
        "--repeats", "1", "--out", str(tmp_path / "out"), "--keep-runs", str(runs), "--timeout", "120",
    )
    assert result.returncode == 0, result.stdout + result.stderr

    data = json.loads((tmp_path / "out" / "benchmarks.json").read_text())
    section = data["throughput"]
    assert section["workloads"] == ["mlp"]
    assert section["failures"] == []
    assert {"date", "machine", "command", "settings", "rows", "readings", "launches"} <= set(section)
    rows = {r["contender"]: r for r in section["rows"]}
    assert set(rows) == set(contenders)

    # Every figure comes from the launches' own result files.
    measured = {}
    for result_file in runs.glob("*/result.json"):
        figures = json.loads(result_file.read_text())
        measured.setdefault(figures["contender"], []).append(figures["workloads"]["mlp"])
    assert set(measured) == set(contenders)
    for name, row in rows.items():
        rates = [m["samples_per_s"] for m in measured[name]]
        assert row["samples_per_s_runs"] == rates
        assert row["samples_per_s"] == statistics.median(rates) > 0
        assert row["final_loss"] == statistics.median(m["final_loss"] for m in measured[name])
        assert row["ratio_to_raw"] == pytest.approx(row["samples_per_s"] / rows["raw"]["samples_per_s"])
        assert row["scaling_efficiency"] == pytest.approx(1.0)  # one process against itself
        assert row["global_batch"] == 64 and row["threads_per_process"] >= 1
        assert measured[name][0]["timed_steps"] == 3
    # Same seeds, data and sample order: every contender ends at the same held-out loss.
    losses = [row["final_loss"] for row in rows.values()]
    assert max(losses) - min(losses) < 1e-4, losses

    markdown = (tmp_path / "out" / "benchmarks.md").read_text()
    assert "## Throughput" in markdown and "### mlp:" in markdown
    assert "| contender | processes | threads each | global batch | samples/s (median) |" in markdown
    assert f"`{section['command']}`" in markdown and "--tiny" in section["command"]
    assert f"| raw DDP | 1 | {rows['raw']['threads_per_process']} | 64 | {rows['raw']['samples_per_s']:,.1f} |" in markdown
    assert "Reading, 1 process: phalanx defaults run at" in markdown
    if importlib.util.find_spec("matplotlib"):
        chart = tmp_path / "out" / section["chart"]
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({section['chart']})" in markdown


def _outcome(contender: str, nproc: int, rate: float | None, loss: float = 1.0, error: str | None = None) -> Outcome:
    result = None
    if rate is not None:
        figures = {"title": "t", "global_batch": 64 * nproc, "samples_per_s": rate, "step_time_median_s": 0.01, "final_loss": loss, "choices": {"micro_batch": 64, "accumulation": 1, "precision": "fp32"}}
        result = {"threads_per_process": 1, "workloads": {"mlp": figures}}
    return Outcome(contender, nproc, 0, 1.0, result, error, 0 if error is None else 2, "log")


def test_ratios_scaling_and_failures_from_the_figures():
    outcomes = [
        _outcome("raw", 1, 100.0), _outcome("raw", 1, 300.0), _outcome("raw", 1, 200.0),
        _outcome("phalanx", 1, 190.0), _outcome("phalanx", 1, 210.0),
        _outcome("raw", 2, 300.0), _outcome("phalanx", 2, 297.0), _outcome("fabric", 2, 310.0),
        _outcome("phalanx-preset", 1, None, error="preset: unknown key"),
    ]
    rows = summary.throughput_rows(outcomes, ["mlp"], ["raw", "phalanx", "phalanx-preset", "fabric"], [1, 2])
    by = {(r["contender"], r["nproc"]): r for r in rows}
    assert by[("raw", 1)]["samples_per_s"] == 200.0 and by[("raw", 1)]["spread"] == pytest.approx(1.0)
    assert by[("phalanx", 1)]["ratio_to_raw"] == pytest.approx(1.0)
    assert by[("phalanx", 2)]["ratio_to_raw"] == pytest.approx(0.99)
    assert by[("phalanx", 2)]["scaling_efficiency"] == pytest.approx(297 / (2 * 200))
    assert by[("fabric", 2)]["scaling_efficiency"] is None  # no 1-process figure to scale from
    assert by[("phalanx-preset", 1)]["errors"] == ["preset: unknown key"] and "samples_per_s" not in by[("phalanx-preset", 1)]

    lines = summary.readings(rows)["mlp"]
    assert lines[1].startswith("2 processes: phalanx defaults run at 0.990x raw DDP's samples/s (target: at most 2% slower, met; one run each")
    assert "0.958x Lightning Fabric (target: not slower, 2% allowed for noise, missed)" in lines[1]
    assert "spread over 2 runs: raw 100%, phalanx 10%" in lines[0]

    markdown = render({"throughput": {"date": "d", "machine": {"cpu": "c", "cores": 2, "os": "o", "gpu": "none", "versions": {}}, "command": "cmd", "settings": "s", "workloads": ["mlp"], "rows": rows, "readings": summary.readings(rows), "failures": ["phalanx-preset x1: preset: unknown key"], "launches": []}})
    assert "| phalanx preset=throughput | 1 | | | failed | | | | | | preset: unknown key |" in markdown
    assert "- phalanx-preset x1: preset: unknown key" in markdown


def test_raw_loop_applies_phalanxs_lr_rule(monkeypatch):
    """The raw loop's hand-written LambdaLR follows phalanx's scaling and warm-up step for step."""
    from compare import raw_lr_args

    from phalanx.config.schema import OptimConfig
    from phalanx.runtime.lr import LRScaling
    from peers.common import lr_rule, parse_args

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
    task = {"task": "digits", "title": "t", "target_accuracy": 0.98, "reached": reached, "seconds": seconds, "eval_seconds": 0.5,
            "samples": 1000, "final_accuracy": 0.98 if reached else 0.9, "curve": [], "choices": {}}
    return Outcome(contender, 2, 0, seconds + 5, {"threads_per_process": 1, "task": task}, None, 0, "log", unit="digits")


def test_time_to_target_ratio_only_when_every_run_reached():
    outcomes = [_target("raw", 10.0), _target("raw", 12.0), _target("raw", 14.0), _target("phalanx-preset", 6.0), _target("phalanx-preset", 9.0)]
    rows = summary.target_rows(outcomes, ["digits"], ["raw", "phalanx-preset"], [2])
    by = {r["contender"]: r for r in rows}
    assert by["raw"]["seconds"] == 12.0 and by["phalanx-preset"]["seconds"] == 7.5
    assert by["phalanx-preset"]["ratio_to_raw"] == pytest.approx(7.5 / 12.0)
    assert summary.target_readings(rows) == [
        "digits, 2 processes: phalanx preset=throughput reaches accuracy 0.98 in 0.62x the raw DDP loop's time (7.5 s against 12.0 s); it meets the 0.75x target."
    ]
    missed = summary.target_rows([*outcomes, _target("phalanx-preset", 30.0, reached=False)], ["digits"], ["raw", "phalanx-preset"], [2])
    assert {r["contender"]: r["ratio_to_raw"] for r in missed}["phalanx-preset"] is None
