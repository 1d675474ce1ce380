"""A later config layer wins (docs/config.md): a section merges key by key, but a setting, a map
included (``strategy.tp.plan``), takes the later layer's value whole: ``--set strategy.tp.plan={}``
empties the file's plan. No processes."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.config.loader import load_config, override_config
from phalanx.config.schema import Config
from phalanx.topology import LaunchContext

FEW = settings(derandomize=True, database=None, max_examples=40, deadline=None)
STYLES = ["colwise", "rowwise", "sequence_parallel", "replicate"]
plans = st.dictionaries(st.text(alphabet="ab.*0", min_size=1, max_size=6), st.sampled_from(STYLES), max_size=4)


def _file(tmp_path: Path, plan: dict) -> Path:
    path = tmp_path / "phalanx.yaml"
    path.write_text(yaml.safe_dump({"strategy": {"name": "tp", "tp": {"size": 2, "plan": plan}}}))
    return path


def test_set_an_empty_plan_empties_the_files(tmp_path):
    path = _file(tmp_path, {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"})
    config = load_config(path, overrides=["strategy.tp.plan={}"], context=LaunchContext())
    assert config.strategy.tp.plan == {}
    # The section around it still merges: the file's size and strategy stay.
    assert (config.strategy.name, config.strategy.tp.size) == ("tp", 2)
    assert not any(key.startswith("strategy.tp.plan") for key in config.sources)


@FEW
@given(first=plans, later=plans, how=st.sampled_from(["--set", "code", "launcher --set", "Session(config, ...)"]))
def test_a_later_layers_plan_replaces_the_earlier_one_whole(tmp_path_factory, first, later, how):
    path = _file(tmp_path_factory.mktemp("layers"), first)
    line = f"strategy.tp.plan={json.dumps(later)}"
    if how == "--set":
        config = load_config(path, overrides=[line], context=LaunchContext())
    elif how == "launcher --set":
        config = load_config(path, context=LaunchContext(overrides=(line,)))
    elif how == "code":
        config = load_config(path, sections={"strategy": {"tp": {"plan": later}}}, context=LaunchContext())
    else:
        config = override_config(load_config(path, context=LaunchContext()), {"strategy": {"tp": {"plan": later}}})
    assert config.strategy.tp.plan == later
    assert (config.strategy.name, config.strategy.tp.size) == ("tp", 2)
    source = "code" if how.startswith(("code", "Session")) else "--set"
    plan_sources = {k: v for k, v in config.sources.items() if k.startswith("strategy.tp.plan.")}
    assert plan_sources == {f"strategy.tp.plan.{k}": source for k in later}
    assert isinstance(config, Config)
