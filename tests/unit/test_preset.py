"""preset: throughput: a layer below the user's values, device-aware, and never touching the batch
or the learning rate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx import Config, ConfigError, Session
from phalanx.config.loader import load_config, override_config
from phalanx.config.preset import PRESETS, fit_to_device, preset_values
from phalanx.config.schema import flatten
from phalanx.topology import LaunchContext

NO_LAUNCH = LaunchContext()
SOURCE = "preset throughput"


def load(path=None, **kw):
    return load_config(path, context=NO_LAUNCH, cwd=Path("/nonexistent"), **kw)


def test_preset_values_sit_below_file_code_and_set(tmp_path):
    path = tmp_path / "phalanx.yaml"
    path.write_text("preset: throughput\ncompute:\n  optimizer_impl: loop\n")
    config = load(path)
    assert config.compute.optimizer_impl == "loop" and config.sources["compute.optimizer_impl"] == f"file {path}"
    config = load(path, sections={"compute": {"optimizer_impl": "foreach"}})
    assert config.compute.optimizer_impl == "foreach" and config.sources["compute.optimizer_impl"] == "code"
    config = load(path, overrides=["compute.optimizer_impl=fused"])
    assert config.compute.optimizer_impl == "fused" and config.sources["compute.optimizer_impl"] == "--set"
    path.write_text("preset: throughput\n")
    config = load(path)
    assert config.compute.optimizer_impl == "auto" and config.sources["compute.optimizer_impl"] == SOURCE


def test_preset_from_set_and_none_changes_nothing():
    config = load(overrides=["preset=throughput"])
    assert config.preset == "throughput" and config.sources["preset"] == "--set"
    assert config.compute.optimizer_impl == "auto" and config.sources["compute.optimizer_impl"] == SOURCE
    assert load().model_dump() == Config().model_dump()
    with pytest.raises(ConfigError, match="invalid value 'fastest' for 'preset' \\(from --set\\)"):
        load(overrides=["preset=fastest"])
    with pytest.raises(ConfigError, match="--set expects section.key=value"):
        load(overrides=["bogus=1"])


def test_resolving_again_follows_the_current_preset():
    config = load(overrides=["preset=throughput"])
    off = override_config(config, {"preset": "none"}, NO_LAUNCH)
    assert off.model_dump() == {**Config().model_dump(), "preset": "none"}
    assert SOURCE not in off.sources.values()


def test_a_config_built_in_code_keeps_what_it_sets():
    session = Session(Config(preset="throughput", compute={"optimizer_impl": "loop"}), train={"progress": False})
    try:
        assert session.config.compute.optimizer_impl == "loop"
        assert session.config.sources["compute.optimizer_impl"] == "code"
        assert session.config.sources["preset"] == "code"
    finally:
        session.close()
    session = Session(Config(preset="throughput"), train={"progress": False})
    try:
        assert session.config.compute.optimizer_impl == "auto"
        assert session.config.sources["compute.optimizer_impl"] == SOURCE
    finally:
        session.close()


def test_the_preset_never_touches_batch_or_learning_rate():
    for table in PRESETS.values():
        for kind, values in table.items():
            assert not [key for key in values if key.split(".")[0] in ("batch", "optim")], kind
            assert set(values) <= set(flatten(Config().model_dump())), kind  # every key is a real setting


def test_device_aware_values():
    cuda, cpu = preset_values("throughput", "cuda"), preset_values("throughput", "cpu")
    assert cuda["precision.mode"] == "bf16" and cuda["precision.tf32"] and cuda["precision.cudnn_benchmark"]
    assert "precision.mode" not in cpu  # bf16 autocast on CPU is slower than fp32 here
    assert cuda["compute.optimizer_impl"] == cpu["compute.optimizer_impl"] == "auto"


def test_preset_bf16_falls_back_to_fp32_without_native_bf16():
    config = override_config(Config(), {}, NO_LAUNCH)
    tree = config.model_dump()
    tree["precision"]["mode"] = "bf16"
    preset = Config.model_validate(tree)
    preset.record_sources({**config.sources, "precision.mode": SOURCE})
    fitted = fit_to_device(preset, torch.device("cpu"))
    assert fitted.precision.mode == "fp32" and fitted.sources["precision.mode"].startswith(SOURCE)
    assert preset.precision.mode == "bf16"  # a copy: the caller's config is left alone
    chosen = Config(precision={"mode": "bf16"})
    assert fit_to_device(chosen, torch.device("cpu")) is chosen  # the user's own bf16 stays
