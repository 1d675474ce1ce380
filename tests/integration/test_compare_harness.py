"""benchmarks/compare.py, the side-by-side harness, run end to end in a tiny configuration."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from tests.helpers import processes
from tests.helpers.cli import REPO

sys.path.insert(0, str(REPO / "benchmarks"))


PEERS = [
    name
    for name, module in (("accelerate", "accelerate"), ("fabric", "lightning_fabric"))
    if importlib.util.find_spec(module)
]


def _compare(*args: str, timeout: float = 240, script: str = "compare.py") -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script} {' '.join(args)} did not finish in {timeout}s\n{out}\n{err}")
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
        "--tiny",
        "--workloads",
        "mlp",
        "--contenders",
        ",".join(contenders),
        "--nproc-list",
        "1",
        "--repeats",
        "1",
        "--out",
        str(tmp_path / "out"),
        "--keep-runs",
        str(runs),
        "--timeout",
        "120",
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
        # Taking turns, 3 steps make blocks of 2 and 1, whose first steps (right after a wait) are not timed.
        assert measured[name][0]["timed_steps"] == 1
        assert len(measured[name][0]["block_medians_s"]) == 1
    # Same seeds, data and sample order: every contender ends at the same held-out loss.
    losses = [row["final_loss"] for row in rows.values()]
    assert max(losses) - min(losses) < 1e-4, losses

    markdown = (tmp_path / "out" / "benchmarks.md").read_text()
    assert "## Throughput" in markdown and "### mlp:" in markdown
    assert "| contender | processes | threads each | global batch | samples/s (median) |" in markdown
    assert f"`{section['command']}`" in markdown and "--tiny" in section["command"]
    assert (
        f"| raw DDP | 1 | {rows['raw']['threads_per_process']} | 64 | {rows['raw']['samples_per_s']:,.1f} |" in markdown
    )
    assert "Reading, 1 process: phalanx defaults run at" in markdown
    if importlib.util.find_spec("matplotlib"):
        chart = tmp_path / "out" / section["chart"]
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({section['chart']})" in markdown


@pytest.mark.multiprocess
def test_overhead_takes_turns_end_to_end(tmp_path):
    """benchmarks/overhead.py's default: both contenders launched at once, 2 processes each, taking
    turns; every step size gives paired rounds, and every launch exits."""
    out = tmp_path / "out"
    args = ["--quick", "--sizes", "1", "--nproc-list", "2", "--contenders", "raw,phalanx", "--out", str(out)]
    proc = _compare(*args, "--timeout", "150", script="overhead.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads((out / "benchmarks.json").read_text())["step_overhead"]["figures"]
    phalanx = figures["2"]["1"]["phalanx"]
    assert phalanx["ratios"] and all(r > 0 for r in phalanx["ratios"])
    assert "taking turns" in (out / "benchmarks.md").read_text()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_sigterm_to_the_driver_ends_every_launch_taking_turns(tmp_path):
    """The driver's clean-up runs on SIGTERM too: no worker of the launches it started (each in a
    session of its own under torch elastic) is left waiting for a turn."""
    tag = processes.new_tag()
    # Full-length steps (tens of seconds of training), so the launches are still there at the signal.
    args = ["--sizes", "10", "--repeats", "1", "--nproc-list", "2", "--contenders", "raw,phalanx", "--timeout", "100"]
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "overhead.py"), *args],
        cwd=REPO,
        env={**os.environ, **tag},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(processes.tagged(tag)) < 5 and time.monotonic() < deadline:  # driver, 2 launchers, workers
            time.sleep(0.2)
        seen = processes.tagged(tag)
        assert len(seen) >= 5, "the launches did not start"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        _, alive = processes.wait_gone(tag, within=20, known=seen)
        assert alive == []
    finally:
        processes.kill_tagged(tag)
        proc.kill()
