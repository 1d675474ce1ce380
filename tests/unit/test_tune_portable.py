"""Issue 14, friction 3 (the tune side): tune writes the micro-batch it chose as
`batch.max_micro_batch_size`, in place of an exact `batch.micro_batch_size` that would fit one
process count only; its trials still set exact sizes."""

from __future__ import annotations

import yaml

from phalanx import Config
from phalanx.tune.config_file import write_values
from phalanx.tune.trials import Settings

LIMIT, EXACT = "batch.max_micro_batch_size", "batch.micro_batch_size"


def test_the_exact_size_line_becomes_the_limit_with_its_comment(tmp_path):
    path = tmp_path / "phalanx.yaml"
    path.write_text(
        "# mine\nbatch:\n  global_batch_size: 20\n  micro_batch_size: 12   # what I had\ntrain:\n  seed: 7\n"
    )
    written = write_values(path, {LIMIT: 10, "data.num_workers": 1}, replaces={LIMIT: EXACT})
    text = path.read_text()
    assert "  max_micro_batch_size: 10   # what I had\n" in text and "\n  micro_batch_size" not in text
    assert yaml.safe_load(text)["batch"] == {"global_batch_size": 20, "max_micro_batch_size": 10}
    assert written.removed == (EXACT,) and written.comments_kept
    config = Config.load(path)  # what launch then plans from, at any process count
    assert config.batch.micro_batch_size is None and config.batch.max_micro_batch_size == 10


def test_an_existing_limit_is_updated_and_the_exact_size_removed(tmp_path):
    path = tmp_path / "phalanx.yaml"
    path.write_text("batch:\n  micro_batch_size: 4\n  max_micro_batch_size: 6  # tuned\n")
    write_values(path, {LIMIT: 8}, replaces={LIMIT: EXACT})
    assert path.read_text() == "batch:\n  max_micro_batch_size: 8  # tuned\n"


def test_without_an_exact_size_nothing_is_removed(tmp_path):
    path = tmp_path / "phalanx.yaml"
    path.write_text("train:\n  seed: 7\n")
    written = write_values(path, {LIMIT: 8}, replaces={LIMIT: EXACT})
    assert yaml.safe_load(path.read_text()) == {"train": {"seed": 7}, "batch": {"max_micro_batch_size": 8}}
    assert written.removed == ()


def test_toml_and_flow_style_files(tmp_path):
    toml = tmp_path / "phalanx.toml"
    toml.write_text("[batch]\nmicro_batch_size = 12 # mine\nglobal_batch_size = 48\n")
    write_values(toml, {LIMIT: 8}, replaces={LIMIT: EXACT})
    assert toml.read_text() == "[batch]\nmax_micro_batch_size = 8  # mine\nglobal_batch_size = 48\n"
    flow = tmp_path / "flow.yaml"
    flow.write_text("batch: {micro_batch_size: 12, global_batch_size: 48}\n")
    written = write_values(flow, {LIMIT: 8}, replaces={LIMIT: EXACT})
    assert not written.comments_kept and written.removed == (EXACT,)
    assert yaml.safe_load(flow.read_text()) == {"batch": {"global_batch_size": 48, "max_micro_batch_size": 8}}


def test_trials_set_exact_sizes_over_a_limit_of_the_users():
    overrides = Settings(16, 48).overrides()
    assert "batch.micro_batch_size=16" in overrides and "batch.max_micro_batch_size=null" in overrides
    config = Config.load(overrides=["batch.max_micro_batch_size=8", *overrides])
    assert (config.batch.micro_batch_size, config.batch.max_micro_batch_size) == (16, None)
