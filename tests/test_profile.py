"""`--profile steps=A:B`: the window, bad specs before anything starts, and a traced launch."""

from __future__ import annotations

import json

import pytest
import torch

from _scripts import tiny_training
from conftest import run_phalanx
from phalanx import ConfigError
from phalanx.metrics.profile import ProfileWindow, StepProfiler, parse_ranks, profile_overrides


def test_window_is_half_open_and_counted_from_one():
    window = ProfileWindow.parse("steps=5:8")
    assert (window.start, window.stop) == (5, 8) and window.describe() == "steps 5-7"
    assert ProfileWindow.parse(" steps = 1 : 2 ").describe() == "step 1"


@pytest.mark.parametrize("spec", ["steps=8:5", "steps=5:5", "steps=0:3", "foo", "steps=5", "5:8"])
def test_bad_window(spec):
    with pytest.raises(ConfigError, match="profile '"):
        ProfileWindow.parse(spec)


def test_flags_become_set_lines():
    assert profile_overrides("steps=5:8", "1, 0") == ["train.profile=steps=5:8", "train.profile_ranks=[0,1]"]
    assert profile_overrides(None, None) == []
    with pytest.raises(ConfigError, match="--profile-ranks expects comma-separated ranks"):
        parse_ranks("0,x")


def test_profiler_starts_and_stops_at_step_boundaries(tmp_path, capsys):
    profiler = StepProfiler(ProfileWindow.parse("steps=2:4"), 0, torch.device("cpu"), tmp_path)
    saved = []
    for step in range(0, 6):  # 0: the first batch is requested
        saved.append(profiler.step_end(step))
        torch.randn(16, 16) @ torch.randn(16, 16)
    profiler.close(5)
    assert saved == [False, False, False, True, False, False]
    assert "traceEvents" in json.loads((tmp_path / "rank0.json").read_text())
    out = capsys.readouterr().out
    assert f"phalanx: profile of steps 2-3 on rank 0: {tmp_path / 'rank0.json'}" in out
    assert "phalanx: top" in out and "aten::mm" in out


def test_a_window_the_run_never_reaches_is_reported(tmp_path, capsys):
    profiler = StepProfiler(ProfileWindow.parse("steps=50:60"), 1, torch.device("cpu"), tmp_path)
    for step in range(0, 4):
        profiler.step_end(step)
    profiler.close(3)
    assert "phalanx: no profile on rank 1: the run ended after step 3, before steps 50-59" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


BAD = [
    (["--profile", "steps=8:5"], "phalanx: error: profile 'steps=8:5' traces no step: steps=A:B needs 1 <= A < B"),
    (["--profile", "foo"], "phalanx: error: profile 'foo' is not of the form steps=A:B"),
    (["--set", "train.profile=steps=3"], "phalanx: error: profile 'steps=3' is not of the form steps=A:B"),
    (["--profile", "steps=1:2", "--profile-ranks", "a,b"], "phalanx: error: --profile-ranks expects comma-separated ranks such as 0,1; got 'a,b'"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_profile_input_is_one_line_before_any_process(tmp_path, args, message):
    (tmp_path / "ok.py").write_text("print('should not run')\n")
    result = run_phalanx("launch", *args, "ok.py", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message) and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "should not run" not in result.stdout and not (tmp_path / "runs").exists()


TRAIN = tiny_training(96)


@pytest.mark.multiprocess
def test_launch_profiles_the_chosen_ranks(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    result = run_phalanx("launch", "--cpu", "--nproc", "2", "--profile", "steps=2:4", "--profile-ranks", "0,1", "train.py", cwd=tmp_path, timeout=150)
    assert result.returncode == 0, result.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    for rank in (0, 1):
        assert "traceEvents" in json.loads((run_dir / "profile" / f"rank{rank}.json").read_text())
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"phalanx: profile of steps 2-3 on rank {rank}: {run_dir / 'profile' / f'rank{rank}.json'}" in log
    assert "phalanx: top 10 operators by self CPU time" in result.stdout and "aten::addmm" in result.stdout
    assert f"phalanx: profile traces: {run_dir / 'profile' / 'rank0.json'}, {run_dir / 'profile' / 'rank1.json'}" in result.stdout
    saved = (run_dir / "config.yaml").read_text()
    assert "profile: steps=2:4" in saved and "profile_ranks: [0, 1]" in saved


@pytest.mark.multiprocess
def test_a_profile_rank_that_does_not_exist_is_one_line(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    result = run_phalanx("launch", "--cpu", "--nproc", "2", "--set", "train.profile=steps=1:2", "--set", "train.profile_ranks=[3]", "train.py", cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "phalanx: error: train.profile_ranks names rank 3, but this run has ranks 0-1"
