"""Config loading, precedence, provenance and error messages: no processes."""

from __future__ import annotations

import pytest

from phalanx.config.loader import load_config, override_config
from phalanx.config.schema import Config
from phalanx.config.template import render
from phalanx.errors import ConfigError
from phalanx.topology import LaunchContext

NO_LAUNCH = LaunchContext()


def load(path=None, **kw):
    return load_config(path, context=kw.pop("context", NO_LAUNCH), **kw)


def test_defaults_without_file(tmp_path):
    config = load(cwd=tmp_path)
    assert config.strategy.name == "auto"
    assert config.precision.mode == "fp32"
    assert set(config.sources.values()) == {"default"}


def test_yaml_file_then_code_then_set(tmp_path):
    path = tmp_path / "phalanx.yaml"
    path.write_text("precision:\n  mode: bf16\nbatch:\n  global_batch_size: 64\n  micro_batch_size: 8\n")
    config = load(
        path, sections={"batch": {"micro_batch_size": 16}, "strategy": "ddp"}, overrides=["batch.global_batch_size=128"]
    )
    assert config.precision.mode == "bf16"
    assert config.batch.micro_batch_size == 16
    assert config.batch.global_batch_size == 128
    assert config.strategy.name == "ddp"
    assert config.sources["precision.mode"] == f"file {path}"
    assert config.sources["batch.micro_batch_size"] == "code"
    assert config.sources["batch.global_batch_size"] == "--set"
    assert config.sources["strategy.name"] == "code"
    assert config.sources["train.epochs"] == "default"


def test_toml_file(tmp_path):
    path = tmp_path / "phalanx.toml"
    path.write_text('[strategy]\nname = "ddp"\n[strategy.ddp]\nbucket_cap_mb = 50\n')
    config = load(path)
    assert config.strategy.ddp.bucket_cap_mb == 50
    assert config.strategy.ddp.static_graph is False


def test_phalanx_yaml_in_cwd_is_picked_up(tmp_path):
    (tmp_path / "phalanx.yaml").write_text("train:\n  epochs: 3\n")
    assert load(cwd=tmp_path).train.epochs == 3


def test_launcher_context_beats_code_path_and_set_wins(tmp_path):
    code_file = tmp_path / "code.yaml"
    code_file.write_text("train:\n  epochs: 2\n")
    cli_file = tmp_path / "cli.yaml"
    cli_file.write_text("train:\n  epochs: 5\n  seed: 7\n")
    context = LaunchContext(config_file=str(cli_file), overrides=("train.seed=9",))
    config = load(code_file, sections={"train": {"seed": 1}}, context=context)
    assert config.train.epochs == 5
    assert config.train.seed == 9


def test_set_values_are_yaml_scalars():
    config = load(
        overrides=[
            "data.pin_memory=false",
            "optim.max_grad_norm=1.5",
            "launch.ranks=all",
            "batch.micro_batch_size=null",
        ]
    )
    assert config.data.pin_memory is False
    assert config.optim.max_grad_norm == 1.5
    assert config.launch.ranks == "all"


def test_override_config_keeps_sources(tmp_path):
    base = load(overrides=["train.epochs=4"])
    merged = override_config(base, {"precision": "fp16"})
    assert merged.precision.mode == "fp16" and merged.train.epochs == 4
    assert merged.sources["precision.mode"] == "code" and merged.sources["train.epochs"] == "--set"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["precision.mode=fp8"],
            "invalid value 'fp8' for 'precision.mode' (from --set): Input should be 'fp32', 'bf16', 'fp16' or 'fp64'",
        ),
        (
            ["precision.colour=red"],
            "unknown setting 'precision.colour' (from --set); known settings in 'precision': mode, tf32, "
            "cudnn_benchmark",
        ),
        (["batch.global_batch_size=-4"], "'batch.global_batch_size'"),
        (["train.epochs=many"], "'train.epochs'"),
        (["nodots=1"], "--set expects section.key=value"),
        (["launch.ranks=3"], "'launch.ranks'"),
    ],
)
def test_invalid_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load(overrides=overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_section_lists_sections():
    with pytest.raises(
        ConfigError, match="unknown setting 'bogus'.*known settings at the top level: preset, strategy, batch"
    ):
        load(sections={"bogus": {"a": 1}})


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="'.*missing.yaml' not found"):
        load(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("strategy:\n  name: [ddp\n")
    with pytest.raises(ConfigError, match="broken.yaml' line .* is not valid YAML"):
        load(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load(listing)
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[strategy\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load(bad_toml)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(binary)


def test_rendered_template_loads_back_to_the_same_config(tmp_path):
    config = load(sections={"precision": "bf16", "batch": {"global_batch_size": 32}})
    path = tmp_path / "phalanx.yaml"
    path.write_text(render(config))
    again = load(path)
    assert again.model_dump() == config.model_dump()
    assert "# fp32 | bf16 | fp16" in path.read_text()


def test_config_load_classmethod_reads_kwargs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PHALANX_CONTEXT", raising=False)
    assert Config.load(strategy="dp").strategy.name == "dp"


def test_gpus_and_ranks_written_as_numbers_are_accepted():
    config = load(overrides=["launch.gpus=1", "launch.ranks=0"])
    assert config.launch.gpus == "1" and config.launch.ranks == "0"


def test_unknown_section_from_set_names_its_origin():
    with pytest.raises(ConfigError, match=r"unknown setting 'foo' \(from --set\)"):
        load(overrides=["foo.bar=1"])


def test_code_overrides_lose_to_the_launchers_set_lines():
    context = LaunchContext(overrides=("train.epochs=9",))
    assert load(overrides=["train.epochs=2"], context=context).train.epochs == 9
