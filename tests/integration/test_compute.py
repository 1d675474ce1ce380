"""Compute knobs (compute.compile, channels_last, optimizer_impl) under ddp and zero1 on 2 gloo
processes: training stays equal to the plain PyTorch reference within a stated tolerance."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers.compute import COMPILE_TOLERANCE, KERNEL_TOLERANCE, LAYOUT_TOLERANCE, needs_inductor
from tests.helpers.training import reference, rel_diff, run

TIMEOUT = 300


@needs_inductor
@pytest.mark.multiprocess
def test_compile_under_ddp_compiles_the_wrapped_module():
    args = (("ddp", 16, None, 4), {"model": "mlp", "compute": {"compile": True}})
    outs = phalanx.spawn(run, nprocs=2, args=args, cpu=True, timeout=TIMEOUT)
    for out in outs:
        # DDP itself is compiled (TorchDynamo's DDPOptimizer then cuts the graph at bucket boundaries).
        assert out["compiled"] and out["type"] == "DistributedDataParallel"
        assert out["searching"] == [False]  # auto unused-parameter detection works under compile too
        assert rel_diff(out["state"], reference(16, 4, model="mlp")) < COMPILE_TOLERANCE
        assert not any("_orig_mod" in k for k in out["state"])


@pytest.mark.multiprocess
def test_channels_last_under_ddp():
    args = (("ddp", 16, None, 4), {"model": "convnet", "compute": {"channels_last": True}})
    outs = phalanx.spawn(run, nprocs=2, args=args, cpu=True, timeout=TIMEOUT)
    assert outs[0]["channels_last_weights"] == [True, True] and outs[0]["channels_last_inputs"] is True
    # BatchNorm sees each process's half batch: compare with DDP in the default layout, not one process.
    plain = phalanx.spawn(run, nprocs=2, args=(("ddp", 16, None, 4), {"model": "convnet"}), cpu=True, timeout=TIMEOUT)
    assert rel_diff(outs[0]["state"], plain[0]["state"]) < LAYOUT_TOLERANCE


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_fused_under_data_parallel_strategies(strategy):
    args = ((strategy, 16, None, 5), {"model": "mlp", "optimizer": "adam", "compute": {"optimizer_impl": "fused"}})
    outs = phalanx.spawn(run, nprocs=2, args=args, cpu=True, timeout=TIMEOUT)
    assert outs[0]["optimizer"]["fused"] is True
    assert rel_diff(outs[0]["state"], reference(16, 5, model="mlp", optimizer="adam", foreach=False)) < KERNEL_TOLERANCE
