"""Two launches started at once in one directory race to create its run directory: the one that
loses the race (the directory appears, or the other removes its own, between its check and its
write) checks again instead of calling the path unwritable."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.errors import PhalanxError
from phalanx.launch import preflight


def test_a_parent_another_launch_created_meanwhile_is_taken_as_there(tmp_path, monkeypatch):
    real_mkdir, raced = Path.mkdir, []

    def mkdir(self, *args, **kwargs):
        if not raced:  # the other launch creates it first
            raced.append(self)
            real_mkdir(self)
            raise FileExistsError(17, "File exists")
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert preflight.check_writable("launch.run_dir", str(tmp_path / "runs"), "fix") == tmp_path / "runs"
    assert raced


def test_a_race_lost_every_time_is_still_one_line(tmp_path, monkeypatch):
    def mkdir(self, *args, **kwargs):
        raise FileExistsError(17, "File exists")

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(PhalanxError) as refused:
        preflight.check_writable("launch.run_dir", str(tmp_path / "runs"), "pass --run-dir DIR")
    assert "\n" not in str(refused.value) and "launch.run_dir" in str(refused.value)
