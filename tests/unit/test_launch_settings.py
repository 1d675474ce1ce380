"""Launch flags are shorthands for `--set launch.*`: they enter the Config with their source, and a
run's resolved config.yaml, given back with --config, plans the same launch. No process starts."""

from __future__ import annotations

import pytest

from phalanx.config.template import write_resolved
from phalanx.errors import ConfigError, PhalanxError
from phalanx.launch.launcher import LaunchRequest, prepare


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no phalanx.yaml of the repository's
    (tmp_path / "x.py").write_text("print('not run')\n")
    return "x.py"


def test_flags_are_launch_settings_with_their_source(script):
    plan = prepare(LaunchRequest(script, nproc=3, cpu=True, ranks="all", max_restarts=2, rdzv_id="12", verbose=True))
    launch, sources = plan.config.launch, plan.config.sources
    assert (launch.nproc, launch.cpu, launch.ranks, launch.max_restarts, launch.rdzv_id, launch.verbose) == (
        3,
        True,
        "all",
        2,
        "12",
        True,
    )
    assert {sources[f"launch.{k}"] for k in ("nproc", "cpu", "ranks", "max_restarts", "rdzv_id", "verbose")} == {
        "--set"
    }
    assert sources["launch.gpus"] == "default" and launch.gpus is None
    assert (plan.devices.kind, plan.devices.nproc, plan.context.show_ranks) == ("cpu", 3, "all")
    assert "launch.nproc=3" in plan.context.overrides  # the workers resolve the same launch settings


def test_a_flag_wins_over_set_and_the_file(script, tmp_path):
    (tmp_path / "c.yaml").write_text("launch:\n  nproc: 5\n  run_dir: elsewhere\n  max_restarts: 3\n")
    request = LaunchRequest(
        script, config_file="c.yaml", overrides=["launch.nproc=4"], nproc=2, cpu=True, max_restarts=0
    )
    plan = prepare(request)
    assert plan.devices.nproc == 2 and plan.config.launch.run_dir == "elsewhere"
    assert plan.config.launch.max_restarts == 0  # a flag of 0 is a value, not "not given"
    assert plan.run_dir.parent == (tmp_path / "elsewhere").resolve()


def test_the_run_config_reproduces_the_launch(script, tmp_path):
    first = prepare(LaunchRequest(script, nproc=3, cpu=True, max_restarts=1, ranks="all", run_dir="mine"))
    write_resolved(first.config, tmp_path / "config.yaml")
    again = prepare(LaunchRequest(script, config_file="config.yaml"))
    assert (again.devices.kind, again.devices.nproc, again.context.show_ranks) == ("cpu", 3, "all")
    assert again.config.launch.max_restarts == 1 and again.run_dir.parent == first.run_dir.parent
    assert again.config.sources["launch.nproc"] == "file config.yaml"


@pytest.mark.parametrize(
    "request_kwargs, message",
    [
        ({"max_restarts": -1}, "--max-restarts must be 0 or more, got -1"),
        ({"nproc": 0}, "--nproc must be at least 1, got 0"),
        ({"overrides": ["launch.nproc=0"]}, "invalid value 0 for 'launch.nproc' (from --set)"),
        ({"overrides": ["launch.verbose=maybe"]}, "invalid value 'maybe' for 'launch.verbose' (from --set)"),
    ],
)
def test_bad_launch_values_are_one_line(script, request_kwargs, message):
    with pytest.raises(PhalanxError) as err:
        prepare(LaunchRequest(script, cpu=True, **request_kwargs))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_refused_combination_fails_in_prepare(script):
    with pytest.raises(ConfigError, match="strategy.pipeline.microbatches=2 is fewer than the 4 pipeline stages"):
        prepare(
            LaunchRequest(
                script, nproc=4, cpu=True, overrides=["strategy.name=pipeline", "strategy.pipeline.microbatches=2"]
            )
        )
