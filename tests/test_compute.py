"""Compute knobs (compute.compile, channels_last, optimizer_impl): each keeps training equal to the
plain PyTorch reference within a stated tolerance, and impossible combinations stop with one line."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

import phalanx
from _perf_workers import mlp, reference, run, train
from phalanx import Config, ConfigError, Session
from phalanx.checkpoint.export import export
from phalanx.runtime.compute import Compute
from phalanx.config.loader import load_config
from phalanx.config.schema import ComputeConfig
from phalanx.topology import LaunchContext
from test_session_single import rel_diff

TIMEOUT = 300
# Inductor reorders and fuses float operations: the same maths, not the same rounding.
COMPILE_TOLERANCE = 1e-4
# Fused and foreach kernels compute the same update in another order of operations.
KERNEL_TOLERANCE = 1e-5
# Convolutions in channels-last pick other algorithms (other summation orders).
LAYOUT_TOLERANCE = 1e-4

needs_inductor = pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")),
    reason="torch.compile's inductor backend needs a C++ compiler on CPU",
)


# -- torch.compile ----------------------------------------------------------------------------------
@needs_inductor
def test_compile_in_one_process_matches_eager_and_keeps_checkpoints_clean(tmp_path):
    out = train("mlp", "single", 16, None, 4, save_to=str(tmp_path / "ckpt"), compute={"compile": True})
    assert out["compiled"] and out["type"] == "Sequential"  # compiled in place: the user's own module
    assert rel_diff(out["state"], reference("mlp", 16, 4)) < COMPILE_TOLERANCE
    assert list(out["state"]) == list(reference("mlp", 16, 4)) == out["user_state_keys"]  # no _orig_mod.
    _, exported = export(out["saved"], tmp_path / "w.pt")
    assert list(exported) == list(out["state"])


@needs_inductor
def test_a_model_compiled_by_the_user_is_compiled_after_wrapping_without_orig_mod(capsys):
    out = train("mlp", "single", 16, None, 3, compiled_by_user=True)
    assert out["compiled"] and out["type"] == "Sequential"
    assert not any("_orig_mod" in k for k in out["user_state_keys"] + list(out["state"]))
    assert rel_diff(out["state"], reference("mlp", 16, 3)) < COMPILE_TOLERANCE
    assert "the model passed to setup() was already compiled" in capsys.readouterr().out


@needs_inductor
@pytest.mark.multiprocess
def test_compile_under_ddp_compiles_the_wrapped_module():
    outs = phalanx.spawn(run, nprocs=2, args=(("mlp", "ddp", 16, None, 4), {"compute": {"compile": True}}), timeout=TIMEOUT)
    for out in outs:
        # DDP itself is compiled (TorchDynamo's DDPOptimizer then cuts the graph at bucket boundaries).
        assert out["compiled"] and out["type"] == "DistributedDataParallel"
        assert out["searching"] == [False]  # auto unused-parameter detection works under compile too
        assert rel_diff(out["state"], reference("mlp", 16, 4)) < COMPILE_TOLERANCE
        assert not any("_orig_mod" in k for k in out["state"])


# -- channels_last ----------------------------------------------------------------------------------
def test_channels_last_in_one_process():
    out = train("convnet", "single", 16, None, 4, compute={"channels_last": True})
    assert out["channels_last_weights"] == [True, True] and out["channels_last_inputs"] is True
    assert rel_diff(out["state"], reference("convnet", 16, 4)) < LAYOUT_TOLERANCE


@pytest.mark.multiprocess
def test_channels_last_under_ddp():
    outs = phalanx.spawn(run, nprocs=2, args=(("convnet", "ddp", 16, None, 4), {"compute": {"channels_last": True}}), timeout=TIMEOUT)
    assert outs[0]["channels_last_weights"] == [True, True] and outs[0]["channels_last_inputs"] is True
    # BatchNorm sees each process's half batch: compare with DDP in the default layout, not one process.
    plain = phalanx.spawn(run, nprocs=2, args=(("convnet", "ddp", 16, None, 4), {}), timeout=TIMEOUT)
    assert rel_diff(outs[0]["state"], plain[0]["state"]) < LAYOUT_TOLERANCE


def test_channels_last_on_a_model_without_convolutions_is_refused():
    with pytest.raises(ConfigError, match=r"^compute.channels_last: Sequential has no 4-D \(convolution\) weights, so the channels-last memory format changes nothing; set compute.channels_last: false$"):
        train("mlp", "single", 16, None, 1, compute={"channels_last": True})


# -- optimizer implementation ----------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_kernels_match_the_for_loop(optimizer, impl):
    out = train("mlp", "single", 16, None, 5, optimizer=optimizer, compute={"optimizer_impl": impl})
    assert out["optimizer"] == {"foreach": impl == "foreach", "fused": impl == "fused"}
    assert all(g == out["optimizer"] for g in out["group_flags"])
    assert out["lr"] == pytest.approx(0.25 * (1e-2 if optimizer == "adam" else 0.05))  # the user's scheduler still steers it
    loop = reference("mlp", 16, 5, optimizer, foreach=False)
    assert rel_diff(out["state"], loop) < KERNEL_TOLERANCE


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_fused_under_data_parallel_strategies(strategy):
    outs = phalanx.spawn(run, nprocs=2, args=(("mlp", strategy, 16, None, 5), {"optimizer": "adam", "compute": {"optimizer_impl": "fused"}}), timeout=TIMEOUT)
    assert outs[0]["optimizer"]["fused"] is True
    assert rel_diff(outs[0]["state"], reference("mlp", 16, 5, "adam", foreach=False)) < KERNEL_TOLERANCE


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
    with pytest.raises(ConfigError, match=r"^compute.optimizer_impl=fused: RMSprop has no fused implementation \(in torch: Adam, AdamW, SGD, Adagrad\); use auto"):
        train("mlp", "single", 16, None, 1, optimizer="rmsprop", compute={"optimizer_impl": "fused"})


def test_resume_keeps_this_runs_implementation(tmp_path):
    saved = train("mlp", "single", 16, None, 2, optimizer="adam", save_to=str(tmp_path / "ckpt"), compute={"optimizer_impl": "fused"})
    session = Session(Config(), compute={"optimizer_impl": "loop"}, train={"progress": False}, checkpoint={"resume": "never"})
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, _ = session.setup(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5))
    session.load(saved["saved"])
    assert [(g["foreach"], g["fused"]) for g in optimizer.param_groups] == [(False, False)]
    assert len(optimizer.state) == 4  # the saved Adam state did load
    session.close()


# -- combinations the config refuses ---------------------------------------------------------------
@pytest.mark.parametrize(
    "sections, message",
    [
        ({"strategy": "pipeline", "compute": {"compile": True}}, "compute.compile is not supported with strategy pipeline"),
        ({"strategy": "dp", "compute": {"compile": True}}, "compute.compile is not supported with strategy dp"),
        ({"compute": {"compile_mode": "max-autotune"}}, "compute.compile_mode=max-autotune has no effect while compute.compile is false"),
        ({"strategy": "fsdp", "compute": {"channels_last": True}}, "compute.channels_last is not supported with strategy fsdp"),
    ],
)
def test_refused_combinations(sections, message):
    with pytest.raises(ConfigError, match=message):
        load_config(sections=sections, context=LaunchContext(), cwd=Path("/nonexistent"))  # no phalanx.yaml
