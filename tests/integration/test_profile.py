"""`--profile steps=A:B` through `phalanx launch`: bad specs before anything starts, and a traced
launch."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import call_phalanx, run_phalanx
from tests.helpers.scripts import tiny_training

BAD = [
    (["--profile", "steps=8:5"], "phalanx: error: profile 'steps=8:5' traces no step: steps=A:B needs 1 <= A < B"),
    (["--profile", "foo"], "phalanx: error: profile 'foo' is not of the form steps=A:B"),
    (["--set", "train.profile=steps=3"], "phalanx: error: profile 'steps=3' is not of the form steps=A:B"),
    (
        ["--profile", "steps=1:2", "--profile-ranks", "a,b"],
        "phalanx: error: --profile-ranks expects comma-separated ranks such as 0,1; got 'a,b'",
    ),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_profile_input_is_one_line_before_any_process(tmp_path, args, message):
    (tmp_path / "ok.py").write_text("print('should not run')\n")
    result = call_phalanx("launch", "--cpu", *args, "ok.py", cwd=tmp_path)  # refused before any process starts
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message) and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "should not run" not in result.stdout and not (tmp_path / "runs").exists()


TRAIN = tiny_training(96)


@pytest.mark.multiprocess
def test_launch_profiles_the_chosen_ranks(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    result = run_phalanx(
        "launch",
        "--cpu",
        "--nproc",
        "2",
        "--profile",
        "steps=2:4",
        "--profile-ranks",
        "0,1",
        "train.py",
        cwd=tmp_path,
        timeout=150,
    )
    assert result.returncode == 0, result.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    for rank in (0, 1):
        assert "traceEvents" in json.loads((run_dir / "profile" / f"rank{rank}.json").read_text())
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"phalanx: profile of steps 2-3 on rank {rank}: {run_dir / 'profile' / f'rank{rank}.json'}" in log
    # The model's matrix products, forward or backward: aten::addmm alone ranks about 10th of the
    # table, where any other thread's operator (the metrics thread's read) can push it out.
    assert "phalanx: top 10 operators by self CPU time" in result.stdout and "addmm" in result.stdout.lower()
    assert (
        f"phalanx: profile traces: {run_dir / 'profile' / 'rank0.json'}, {run_dir / 'profile' / 'rank1.json'}"
        in result.stdout
    )
    saved = (run_dir / "config.yaml").read_text()
    assert "profile: steps=2:4" in saved and "profile_ranks: [0, 1]" in saved


@pytest.mark.multiprocess
def test_a_profile_rank_that_does_not_exist_is_one_line(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    result = run_phalanx(
        "launch",
        "--cpu",
        "--nproc",
        "2",
        "--set",
        "train.profile=steps=1:2",
        "--set",
        "train.profile_ranks=[3]",
        "train.py",
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "phalanx: error: train.profile_ranks names rank 3, but this run has ranks 0-1"
