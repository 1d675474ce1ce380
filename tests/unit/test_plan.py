"""`phalanx plan`: the ZeRO paper's accounting and activations, as functions."""

from __future__ import annotations

import pytest
import torch

from phalanx.demo.digits import DigitsCNN
from phalanx.plan import make_plan, measure_activations, model_state
from phalanx.plan.measure import _example_input, _saved_bytes, build

GB = 1e9


def test_zero_paper_accounting_for_7_5b_parameters_on_64_devices():
    # Rajbhandari et al. 2019, Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
    totals = {
        s: model_state(s, 7_500_000_000, 64, accounting="zero-paper").total / GB
        for s in ("ddp", "zero1", "fsdp-zero2", "fsdp-zero3")
    }
    assert totals["ddp"] == pytest.approx(120, rel=1e-3)
    assert totals["zero1"] == pytest.approx(31.4, rel=1e-2)
    assert totals["fsdp-zero2"] == pytest.approx(16.6, rel=1e-2)
    assert totals["fsdp-zero3"] == pytest.approx(1.9, rel=2e-2)


def test_recommendation_is_the_least_communication_that_fits():
    plan = make_plan(
        7_500_000_000,
        64,
        optimizer="adam",
        accounting="zero-paper",
        micro_batch=1,
        activations=None,
        checkpointed=None,
        checkpoint_classes=[],
        device_memory=32 * 1024**3,
    )
    assert plan.recommendation.label == "fsdp-zero2"
    assert "reshard_after_forward: false" in plan.config_lines


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activations_on_meta_match_a_real_cpu_batch(precision):
    acts = measure_activations(DigitsCNN, {}, (1, 8, 8), torch.float32, precision)
    assert acts.measured_on == "meta"
    real = _saved_bytes(
        build(DigitsCNN, {}, "cpu"), _example_input((1, 8, 8), torch.float32, 8, "cpu"), precision, "cpu"
    )
    assert acts.at(8) == pytest.approx(real, rel=0.1)


def test_checkpointing_shrinks_activations():
    from phalanx.demo.gpt import TinyGPT

    full = measure_activations(TinyGPT, {}, (64,), torch.long, "fp32")
    ckpt = measure_activations(TinyGPT, {}, (64,), torch.long, "fp32", ["Block"])
    assert ckpt.per_sample < 0.25 * full.per_sample


def test_fp16_leaves_fsdp_out_and_zero2_counts_its_gathered_copy():
    plan = make_plan(
        1000,
        4,
        optimizer="adam",
        accounting="phalanx",
        micro_batch=1,
        activations=None,
        checkpointed=None,
        checkpoint_classes=[],
        device_memory=None,
        precision="fp16",
    )
    assert [r.strategy for r in plan.rows] == ["ddp", "zero1"]  # fsdp refuses fp16, pipeline is fp32-only
    zero2 = model_state("fsdp-zero2", 1000, 4, compute_bytes=2)
    assert zero2.parameters == 4 * 1000 / 4 + 2 * 1000  # fp32 shards + the bf16 copy held forward to backward
    assert model_state("fsdp-zero3", 1000, 4).parameters == 1000


def test_frozen_parameters_have_no_gradients_or_optimizer_state():
    state = model_state("ddp", 1000, 2, optimizer="adam", trainable=600)
    assert (state.parameters, state.gradients, state.optimizer) == (4000, 2400, 4800)


def test_fsdp_rows_do_not_count_autocast_weight_copies():
    from phalanx.demo.gpt import TinyGPT

    acts = measure_activations(TinyGPT, {}, (64,), torch.long, "bf16")
    assert acts.weight_copies == 2 * 867072
    plan = make_plan(
        867072,
        2,
        optimizer="adam",
        accounting="phalanx",
        micro_batch=4,
        activations=acts,
        checkpointed=None,
        checkpoint_classes=[],
        device_memory=None,
        precision="bf16",
    )
    by = {r.strategy: r.activations for r in plan.rows}
    assert by["ddp"] - by["fsdp-zero3"] == pytest.approx(2 * 867072)
