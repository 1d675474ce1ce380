"""The launcher checks the batch the way the Session plans it (max_micro_batch_size included)."""

from __future__ import annotations

import pytest

from phalanx.errors import PhalanxError
from phalanx.launch.launcher import LaunchRequest, prepare


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("print('ran')\n")
    return "x.py"


def test_a_micro_batch_above_the_limit_is_refused_before_any_worker(script, tmp_path):
    sizes = ["batch.global_batch_size=20", "batch.micro_batch_size=10", "batch.max_micro_batch_size=8"]
    with pytest.raises(PhalanxError, match="micro_batch_size 10 is above max_micro_batch_size 8"):
        prepare(LaunchRequest(script, overrides=sizes, cpu=True, nproc=2))
    assert not (tmp_path / "runs").exists()


def test_a_limit_below_the_pipeline_micro_batches_is_refused_not_exceeded():
    from phalanx.config.batch import plan_batch
    from phalanx.errors import ConfigError

    with pytest.raises(ConfigError, match="max_micro_batch_size 2 is below 4"):
        plan_batch(1, None, None, 2, multiple_of=4)
    assert plan_batch(1, None, None, 9, multiple_of=4).micro_batch_size == 8
