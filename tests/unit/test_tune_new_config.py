"""`phalanx tune --config FILE` creates FILE when it is absent, as docs/tune.md says: the trials run
on what FILE will hold (the defaults, not a ./phalanx.yaml beside it), and the winners go into it."""

from __future__ import annotations

import pytest
import yaml

from phalanx.cli.main import main
from phalanx.harness.figures import RunFigures
from phalanx.tune import runner as tune_runner
from phalanx.tune.trials import OK, Announced, Trial


@pytest.fixture
def fake_trials(tmp_path, monkeypatch):
    """Trials that run nothing: larger micro-batches are faster; each records the config it would read."""
    (tmp_path / "train.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)
    seen: list[tuple[str, str]] = []

    def trial(self, stage, settings, label, *, again=False):
        settings = settings or tune_runner.Settings(0, 0)
        path = self.launching.config_file
        seen.append((path, open(path, encoding="utf-8").read()))
        rate = 1000.0 * settings.micro / (settings.micro + 16)
        figures = RunFigures(2, settings.global_batch, 4, rate, 0.1, 0.0, None, None)
        made = Trial(len(self.trials) + 1, stage, settings, label, outcome=OK, figures=figures)
        self.trials.append(made)
        return made

    monkeypatch.setattr(tune_runner._Tuner, "trial", trial)
    monkeypatch.setattr(tune_runner, "announced", lambda run_dir: Announced(128, 64, 2, 0.01, False))
    return tmp_path, seen


ARGS = ["tune", "--cpu", "--nproc", "2", "--steps", "4", "--warmup", "1", "--search", "micro-batch"]


@pytest.mark.parametrize("name", ["tuned.yaml", "tuned.toml"])
def test_an_absent_config_file_is_created_with_the_winners(fake_trials, capsys, name):
    tmp_path, seen = fake_trials
    (tmp_path / "phalanx.yaml").write_text("precision:\n  mode: bf16\n")  # another file: the trials must not read it
    target = tmp_path / name
    assert main([*ARGS, "--config", str(target), "--max-micro-batch", "128", "train.py"]) == 0
    out = capsys.readouterr().out
    assert target.is_file() and f"into {target} (new file)" in out, out
    assert seen and all(text == "" for _, text in seen), seen  # the trials ran on an empty file in its place
    assert all(path != str(target) and path.endswith(target.suffix) for path, _ in seen)
    if name.endswith(".yaml"):
        written = yaml.safe_load(target.read_text())
        assert "batch" in written and "precision" not in written
    assert not (tmp_path / f"{name}.bak").exists()


def test_a_dry_run_creates_nothing(fake_trials, capsys):
    tmp_path, _ = fake_trials
    assert main([*ARGS, "--config", "tuned.yaml", "--max-micro-batch", "128", "--dry-run", "train.py"]) == 0
    assert "would write" in capsys.readouterr().out and not (tmp_path / "tuned.yaml").exists()


def test_a_file_in_a_directory_that_does_not_exist_is_one_line_before_any_trial(fake_trials, capsys):
    tmp_path, seen = fake_trials
    assert main([*ARGS, "--config", "nodir/tuned.yaml", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "the directory nodir does not exist" in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not seen
