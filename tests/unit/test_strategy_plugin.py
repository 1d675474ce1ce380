"""Issue 21, point 3: a strategy owns what is about itself. A strategy declared only here, with its
own options section, plan row and advice, and added with registry.register(), is a value of
strategy.name, a section of the config (`phalanx config show`, dump and load), a row of
`phalanx plan`, and refused in its own words; unregister() undoes all of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field

from phalanx.cli.main import main
from phalanx.config.loader import load_config
from phalanx.config.schema import Config
from phalanx.config.sections import Section, StrategyConfig
from phalanx.config.template import render
from phalanx.errors import ConfigError
from phalanx.strategies import STRATEGIES, Sharding, Strategy, check_combination
from phalanx.strategies.plan_rows import PlanRow
from phalanx.strategies.registry import register, unregister
from phalanx.topology import LaunchContext


class ToyConfig(Section):
    rounds: int = Field(3, gt=0, le=10, description="toy: rounds of nothing per step")


class Toy(Strategy):
    name = "toy"
    options_key = "toy"
    options = ToyConfig
    precisions = frozenset({"fp32"})
    supports_compile = False
    shards = Sharding(gradients=("dp_replicate",), optimizer=("dp_replicate",))
    # Between fsdp-zero2 (2) and zero1 (3) in the plan.
    plan_rows = (PlanRow("toy-sharded", traffic=2.5, options={"rounds": 5}),)
    advice = {
        "precision.mode": "(its toy arithmetic is fp32); set precision.mode fp32",
        "compute.compile": "(there is nothing to compile in a toy); set compute.compile: false",
    }

    @classmethod
    def check_settings(cls, config, world_size, device) -> None:
        if world_size is not None and config.strategy.toy.rounds > world_size:
            raise ConfigError(f"strategy.toy.rounds={config.strategy.toy.rounds} is more than the {world_size} ranks")


@pytest.fixture
def toy():
    register(Toy)
    yield Toy
    unregister(Toy.name)


def _load(*overrides: str) -> Config:
    return load_config(None, overrides=overrides, context=LaunchContext(), cwd=Path("/nonexistent"))


def _cli(capsys, monkeypatch, tmp_path, *argv: str) -> tuple[int, str, str]:
    monkeypatch.chdir(tmp_path)  # no phalanx.yaml of the repository's
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_its_section_is_in_the_config_and_config_show(toy, capsys, monkeypatch, tmp_path):
    code, out, _ = _cli(
        capsys, monkeypatch, tmp_path, "config", "show", "--set", "strategy.name=toy", "--set", "strategy.toy.rounds=7"
    )
    shown = json.loads(_cli(capsys, monkeypatch, tmp_path, "config", "show", "--json")[1])
    assert code == 0 and "strategy.toy.rounds" in out and "--set" in out
    assert shown["strategy.toy.rounds"] == {"value": 3, "source": "default"}
    assert list(shown).index("strategy.toy.rounds") > list(shown).index("strategy.pipeline.split_points")
    # Its own validation, in the one-line form every section's errors take.
    with pytest.raises(ConfigError, match=r"invalid value 11 for 'strategy.toy.rounds' \(from --set\)"):
        _load("strategy.toy.rounds=11")
    # Round trip, and config init's comment for it.
    config = Config(strategy={"name": "toy", "toy": {"rounds": 2}})
    assert Config.model_validate(config.model_dump()) == config
    assert "rounds: 2" in render(config) and "toy: rounds of nothing per step" in render(Config())
    assert "| toy (auto:" in StrategyConfig.model_fields["name"].description


def test_it_is_a_row_of_the_plan(toy, capsys, monkeypatch, tmp_path):
    # 1e9 parameters on 4 devices, Adam: ddp holds 16 B/parameter, fsdp-zero2 8 (its gathered copy),
    # toy 4 + 4/4 + 8/4 = 7; 90% of 7.9 GiB fits toy only.
    argv = ("plan", "--params", "1e9", "--devices", "4", "--device-memory", "7.9")
    plan = json.loads(_cli(capsys, monkeypatch, tmp_path, *argv, "--json")[1])
    labels = [row["label"] for row in plan["rows"]]
    assert labels == ["ddp", "fsdp-zero2", "toy-sharded", "zero1", "fsdp-zero3", "pipeline"]
    row = plan["rows"][2]
    assert (row["parameters"], row["gradients"], row["optimizer"]) == (4e9, 1e9, 2e9)
    assert plan["recommendation"] == "toy-sharded"
    assert plan["config_lines"] == "strategy:\n  name: toy\n  toy:\n    rounds: 5"
    code, out, _ = _cli(capsys, monkeypatch, tmp_path, *argv)
    assert code == 0 and "recommended: toy-sharded" in out
    # A precision it does not support leaves it out, with why.
    code, out, _ = _cli(capsys, monkeypatch, tmp_path, *argv, "--precision", "bf16")
    assert "toy is left out: it supports fp32 only for now" in out and "toy-sharded" not in out.split("left out")[0]


def test_it_is_refused_in_its_own_words(toy, capsys, monkeypatch, tmp_path):
    with pytest.raises(ConfigError) as precision:
        check_combination(Config(strategy={"name": "toy"}, precision={"mode": "bf16"}))
    assert str(precision.value) == (
        "strategy toy does not support precision.mode bf16 (its toy arithmetic is fp32); set precision.mode fp32"
    )
    with pytest.raises(ConfigError, match=r"^compute.compile is not supported with strategy toy \(there is nothing"):
        check_combination(Config(strategy={"name": "toy"}, compute={"compile": True}))
    # Another strategy's section, set where it does nothing, is refused by its owner's rule.
    with pytest.raises(ConfigError, match=r"strategy.ddp.comm_hook=fp16 .* which strategy toy does not use; use"):
        check_combination(Config(strategy={"name": "toy", "ddp": {"comm_hook": "fp16"}}))
    with pytest.raises(ConfigError, match=r"strategy.toy.rounds=3 is more than the 2 ranks"):
        check_combination(Config(strategy={"name": "toy"}), world_size=2)
    # The CLI's one line: config show runs the same checks.
    code, _, err = _cli(
        capsys, monkeypatch, tmp_path, "config", "show", "--set", "strategy.name=toy", "--set", "precision.mode=fp16"
    )
    assert code == 2 and "strategy toy does not support precision.mode fp16 (its toy arithmetic" in err


def test_unregister_undoes_it(capsys, monkeypatch, tmp_path):
    register(Toy)
    unregister(Toy.name)
    assert Toy.name not in STRATEGIES and "toy" not in StrategyConfig.model_fields
    assert "toy" not in Config().model_dump()["strategy"]
    assert "| toy" not in StrategyConfig.model_fields["name"].description
    with pytest.raises(ConfigError, match="unknown setting 'strategy.toy' "):
        _load("strategy.toy.rounds=2")
    with pytest.raises(ConfigError, match="unknown strategy 'toy' in strategy.name"):
        check_combination(Config(strategy={"name": "toy"}))
    plan = json.loads(_cli(capsys, monkeypatch, tmp_path, "plan", "--params", "1e9", "--json")[1])
    assert "toy-sharded" not in [row["label"] for row in plan["rows"]]


def test_a_name_or_a_plan_row_is_registered_once(toy):
    with pytest.raises(ValueError, match="a strategy named 'toy' is already registered"):
        register(Toy)
    twin = type("Twin", (Toy,), {"name": "twin"})  # inherits toy's plan row and its section
    with pytest.raises(ValueError, match="declares plan rows that others have: toy-sharded"):
        register(twin)
    other = type("Other", (Section,), {"__annotations__": {"x": int}, "x": 1})
    clash = type("Clash", (Strategy,), {"name": "clash", "options_key": "toy", "options": other})
    with pytest.raises(ValueError, match="strategy.toy is already ToyConfig, not Other"):
        register(clash)
    assert "clash" not in STRATEGIES


def test_a_strategy_of_the_surface_before_the_layout_is_refused_at_register():
    counted = type("Counted", (Strategy,), {"name": "counted", "data_parallel_size_for": classmethod(lambda c, w: w)})
    with pytest.raises(ValueError, match="declare its layout axes"):
        register(counted)
    flagged = type("Flagged", (Strategy,), {"name": "flagged", "shards": Sharding(optimizer=True)})
    with pytest.raises(ValueError, match="Sharding with booleans"):
        register(flagged)
    assert "counted" not in STRATEGIES and "flagged" not in STRATEGIES


def test_phalanx_config_brings_the_strategies_sections():
    # A fresh interpreter: the config layer alone has no strategy sections, and says why; phalanx.Config
    # imports the strategies, which register theirs.
    code = (
        "from phalanx.config import Config\n"
        "try:\n"
        "    Config(strategy={'ddp': {'bucket_cap_mb': 5}})\n"
        "except ValueError as err:\n"
        "    assert 'import phalanx.strategies' in str(err), err\n"
        "else:\n"
        "    raise SystemExit('accepted strategy.ddp without the strategies')\n"
        "try:\n"
        "    Config()\n"  # a tree without strategy.ddp would fail far from here, in the Session
        "except ValueError as err:\n"
        "    assert 'import phalanx.strategies' in str(err), err\n"
        "else:\n"
        "    raise SystemExit('built a Config without the strategies sections')\n"
        "import phalanx\n"
        "assert phalanx.Config(strategy={'ddp': {'bucket_cap_mb': 5}}).strategy.ddp.bucket_cap_mb == 5\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
