"""strategy.pipeline.microbatches: null is one pipeline micro-batch per stage and at least 4, so
torch's 1F1B schedule (which needs one per stage) never raises on 5 or more stages; a user value
below the stage count, and a micro-batch the count cannot cut, are refused before launch."""

from __future__ import annotations

import pytest

from phalanx.config.schema import Config
from phalanx.errors import ConfigError
from phalanx.launch.launcher import LaunchRequest, prepare
from phalanx.strategies.checks import check_combination
from phalanx.strategies.pipeline import Pipeline, PipelineConfig, cannot_cut, pipeline_microbatches


@pytest.mark.parametrize("stages, expected", [(1, 4), (2, 4), (4, 4), (5, 5), (8, 8)])
def test_null_is_one_per_stage_and_at_least_four(stages, expected):
    assert PipelineConfig().microbatches is None
    assert pipeline_microbatches(PipelineConfig(), stages) == expected
    assert pipeline_microbatches(PipelineConfig(microbatches=2), stages) == 2  # the user's value stays


def _config(**pipeline) -> Config:
    return Config(strategy={"name": "pipeline", "pipeline": pipeline})


def test_null_on_many_stages_passes_the_checks_and_sets_the_micro_batch_multiple():
    for stages in (2, 5, 8):
        check_combination(_config(), stages, "cpu")  # before: schedule 1f1b raised inside setup()
        assert Pipeline.micro_batch_multiple(_config(), stages) == max(4, stages)
    assert Pipeline.micro_batch_multiple(_config(microbatches=6), 8) == 6


def test_a_micro_batch_that_null_cannot_cut_is_refused_with_the_fix():
    config = Config(strategy={"name": "pipeline"}, batch={"micro_batch_size": 4})
    with pytest.raises(ConfigError) as refused:
        check_combination(config, 5, "cpu")
    assert str(refused.value) == (
        "the micro-batch of 4 samples cannot be cut into 5 pipeline micro-batches "
        "(strategy.pipeline.microbatches is null: one per stage, at least 4); make batch.micro_batch_size a "
        "multiple of 5, or set strategy.pipeline.microbatches to a divisor of 4 with strategy.pipeline.schedule=gpipe"
    )
    check_combination(Config(strategy={"name": "pipeline"}, batch={"micro_batch_size": 10}), 5, "cpu")
    explicit = cannot_cut(6, PipelineConfig(microbatches=4), 2)
    assert (
        explicit
        == "the micro-batch of 6 samples cannot be cut into strategy.pipeline.microbatches=4; choose a divisor of 6"
    )
    assert "gpipe" not in cannot_cut(6, PipelineConfig(), 5)  # 6 itself is a divisor with one per stage


def test_the_launcher_refuses_an_uncuttable_micro_batch_and_still_a_value_below_the_stages(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    common = {"nproc": 5, "cpu": True}
    with pytest.raises(ConfigError, match="cannot be cut into 5 pipeline micro-batches"):
        prepare(LaunchRequest(str(script), overrides=["strategy.name=pipeline", "batch.micro_batch_size=4"], **common))
    with pytest.raises(ConfigError, match="strategy.pipeline.microbatches=4 is fewer than the 5 pipeline stages"):
        prepare(
            LaunchRequest(
                str(script), overrides=["strategy.name=pipeline", "strategy.pipeline.microbatches=4"], **common
            )
        )
