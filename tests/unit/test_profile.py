"""`--profile steps=A:B`: the window, its flags, and the profiler in one process."""

from __future__ import annotations

import json

import pytest
import torch

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
