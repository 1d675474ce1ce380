"""Launch settings in the Config: `config show` lists them with their sources, and a launch writes
them into the run directory's config.yaml, which reproduces the run."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import run_phalanx
from tests.helpers.scripts import tiny_training

LAUNCH_KEYS = (
    "nproc",
    "gpus",
    "cpu",
    "ranks",
    "run_dir",
    "max_restarts",
    "nnodes",
    "node_rank",
    "master",
    "rdzv_endpoint",
    "rdzv_id",
    "verbose",
)


def test_config_show_lists_the_launch_settings_with_sources(tmp_path):
    result = run_phalanx("config", "show", "--json", "--set", "launch.nproc=4", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.output
    data = json.loads(result.stdout)
    assert data["launch.nproc"] == {"value": 4, "source": "--set"}
    assert {key: data[f"launch.{key}"]["source"] for key in LAUNCH_KEYS if key != "nproc"} == dict.fromkeys(
        LAUNCH_KEYS[1:], "default"
    )
    table = run_phalanx("config", "show", "--set", "launch.nproc=4", cwd=tmp_path, timeout=60).stdout
    line = next(line for line in table.splitlines() if "launch.nproc" in line)
    assert "4" in line and "--set" in line


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_run_config_holds_the_flags_and_reproduces_the_run(tmp_path):
    (tmp_path / "train.py").write_text(tiny_training(32))
    result = run_phalanx("launch", "--nproc", "2", "--cpu", "train.py", cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    saved = (run_dir / "config.yaml").read_text()
    lines = {line.split(":")[0].strip(): line for line in saved.split("launch:")[1].splitlines() if ":" in line}
    assert lines["nproc"].split("#")[0].split(":")[1].strip() == "2" and lines["nproc"].endswith("# --set")
    assert lines["cpu"].split("#")[0].split(":")[1].strip() == "true" and lines["cpu"].endswith("# --set")

    # device: launch.cpu from the run's config.yaml
    again = run_phalanx("launch", "--config", str(run_dir / "config.yaml"), "train.py", cwd=tmp_path, timeout=180)
    assert again.returncode == 0, again.output
    assert "2 CPU processes (gloo)" in again.stdout
