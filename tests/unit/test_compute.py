"""Compute knobs (compute.compile, channels_last, optimizer_impl) in one process: each keeps training
equal to the plain PyTorch reference within a stated tolerance, and impossible combinations stop
with one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from phalanx import Config, ConfigError, Session
from phalanx.checkpoint.export import export
from phalanx.config.loader import load_config
from phalanx.config.schema import ComputeConfig
from phalanx.runtime.compute import Compute
from phalanx.strategies import check_combination
from phalanx.topology import LaunchContext
from tests.helpers.compute import COMPILE_TOLERANCE, KERNEL_TOLERANCE, LAYOUT_TOLERANCE, needs_inductor
from tests.helpers.models import mlp
from tests.helpers.training import reference, rel_diff, train


# -- torch.compile ----------------------------------------------------------------------------------
@needs_inductor
def test_compile_in_one_process_matches_eager_and_keeps_checkpoints_clean(tmp_path):
    out = train("single", 16, None, 4, model="mlp", save_to=str(tmp_path / "ckpt"), compute={"compile": True})
    assert out["compiled"] and out["type"] == "Sequential"  # compiled in place: the user's own module
    assert rel_diff(out["state"], reference(16, 4, model="mlp")) < COMPILE_TOLERANCE
    assert list(out["state"]) == list(reference(16, 4, model="mlp")) == out["user_state_keys"]  # no _orig_mod.
    _, exported = export(out["saved"], tmp_path / "w.pt")
    assert list(exported) == list(out["state"])


@needs_inductor
def test_a_model_compiled_by_the_user_is_compiled_after_wrapping_without_orig_mod(capsys):
    out = train("single", 16, None, 3, model="mlp", compiled_by_user=True)
    assert out["compiled"] and out["type"] == "Sequential"
    assert not any("_orig_mod" in k for k in out["user_state_keys"] + list(out["state"]))
    assert rel_diff(out["state"], reference(16, 3, model="mlp")) < COMPILE_TOLERANCE
    assert "the model passed to setup() was already compiled" in capsys.readouterr().out


# -- channels_last ----------------------------------------------------------------------------------
def test_channels_last_in_one_process():
    out = train("single", 16, None, 4, model="convnet", compute={"channels_last": True})
    assert out["channels_last_weights"] == [True, True] and out["channels_last_inputs"] is True
    assert rel_diff(out["state"], reference(16, 4, model="convnet")) < LAYOUT_TOLERANCE


def test_channels_last_on_a_model_without_convolutions_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"^compute.channels_last: Sequential has no 4-D \(convolution\) weights, so the channels-last memory "
        r"format changes nothing; set compute.channels_last: false$",
    ):
        train("single", 16, None, 1, model="mlp", compute={"channels_last": True})


# -- optimizer implementation ----------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_kernels_match_the_for_loop(optimizer, impl):
    out = train("single", 16, None, 5, model="mlp", optimizer=optimizer, compute={"optimizer_impl": impl})
    assert out["optimizer"] == {"foreach": impl == "foreach", "fused": impl == "fused"}
    assert all(g == out["optimizer"] for g in out["group_flags"])
    assert out["lr"] == pytest.approx(
        0.25 * (1e-2 if optimizer == "adam" else 0.05)
    )  # the user's scheduler still steers it
    loop = reference(16, 5, model="mlp", optimizer=optimizer, foreach=False)
    assert rel_diff(out["state"], loop) < KERNEL_TOLERANCE


def test_auto_picks_fused_then_foreach_and_keeps_an_explicit_choice(monkeypatch):
    compute = Compute(ComputeConfig(optimizer_impl="auto"))
    params = [torch.nn.Parameter(torch.randn(3))]
    assert compute.implementation_flags(torch.optim.AdamW(params)) == {"foreach": False, "fused": True}
    # No fused kernels: foreach where the device has native foreach kernels (CUDA), else as built.
    assert compute.implementation_flags(torch.optim.RMSprop(params)) == {}
    monkeypatch.setattr(sys.modules["torch.optim.optimizer"], "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    assert compute.implementation_flags(torch.optim.RMSprop(params)) == {"foreach": True}
    assert compute.implementation_flags(torch.optim.Adam(params, foreach=False)) == {}
    assert compute.implementation_flags(torch.optim.LBFGS(params)) == {}
    assert Compute(ComputeConfig()).implementation_flags(torch.optim.Adam(params)) == {}


def test_fused_on_an_optimizer_without_fused_kernels_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"^compute.optimizer_impl=fused: RMSprop has no fused implementation \(in torch: Adam, AdamW, SGD, "
        r"Adagrad\); use auto",
    ):
        train("single", 16, None, 1, model="mlp", optimizer="rmsprop", compute={"optimizer_impl": "fused"})


def test_resume_keeps_this_runs_implementation(tmp_path):
    fused = {"optimizer_impl": "fused"}
    saved = train("single", 16, None, 2, model="mlp", optimizer="adam", save_to=str(tmp_path / "ckpt"), compute=fused)
    session = Session(
        Config(), compute={"optimizer_impl": "loop"}, train={"progress": False}, checkpoint={"resume": "never"}
    )
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, _ = session.setup(
        model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    )
    session.load(saved["saved"])
    assert [(g["foreach"], g["fused"]) for g in optimizer.param_groups] == [(False, False)]
    assert len(optimizer.state) == 4  # the saved Adam state did load
    session.close()


# -- combinations the config refuses ---------------------------------------------------------------
@pytest.mark.parametrize(
    "sections, message",
    [
        (
            {"strategy": "pipeline", "compute": {"compile": True}},
            "compute.compile is not supported with strategy pipeline",
        ),
        ({"strategy": "dp", "compute": {"compile": True}}, "compute.compile is not supported with strategy dp"),
        (
            {"compute": {"compile_mode": "max-autotune"}},
            "compute.compile_mode=max-autotune has no effect while compute.compile is false",
        ),
        (
            {"strategy": "fsdp", "compute": {"channels_last": True}},
            "compute.channels_last is not supported with strategy fsdp",
        ),
    ],
)
def test_refused_combinations(sections, message):
    # compile_mode is the config's own rule; the others are the strategies' (launcher and Session).
    with pytest.raises(ConfigError, match=message):
        check_combination(
            load_config(sections=sections, context=LaunchContext(), cwd=Path("/nonexistent"))
        )  # no phalanx.yaml
