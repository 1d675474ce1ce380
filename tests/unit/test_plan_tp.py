"""Issue 24, point 5: `phalanx plan` divides by the layout, not by every device, and has rows for
tensor parallelism (tp) and the 2-D layout (fsdp x tp): tp divides only what its plan splits (the
MLP pairs' weights and the activations between them), and moves activations, not parameters."""

from __future__ import annotations

import json

import pytest
import torch

from phalanx.cli.main import main
from phalanx.demo.gpt import TinyGPT
from phalanx.plan import make_plan, measure_activations, model_state, setup_peak
from phalanx.plan.tensor_split import find_split
from phalanx.plan.traffic import step_traffic
from phalanx.strategies.parallel_layout import ParallelLayout

N, SPLIT = 867_072, 526_336  # TinyGPT's parameters, and those of its 4 MLP pairs that tp divides
SEQ, DIM, HIDDEN, BLOCKS = 64, 128, 512, 4
GIB = 1024**3


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_gpt_example_on_8_devices_has_tp_and_fsdp_x_tp_rows(capsys):
    plan = _plan_json(capsys, "--example", "gpt", "--devices", "8")
    labels = [r["label"] for r in plan["rows"]]
    # Every row without tensor parallelism first, checkpointing ones too; then tp over 2 (tp alone, and
    # fsdp x tp, the 2-D layout) and over the whole node, the smaller degree first (fsdp x tp8 would
    # shard over one rank: the tp8 row is that).
    assert labels[:4] == ["ddp", "fsdp-zero2", "zero1", "fsdp-zero3"]
    assert [(r["strategy"], r["checkpointing"]) for r in plan["rows"][4:8]] == [(label, True) for label in labels[:4]]
    assert labels[8:] == [
        *("fsdp-zero2 x tp2", "tp2", "fsdp-zero3 x tp2"),  # least traffic first
        *("fsdp-zero2 x tp2 + checkpointing", "tp2 + checkpointing", "fsdp-zero3 x tp2 + checkpointing"),
        *("tp8", "tp8 + checkpointing"),
    ]
    assert plan["tensor"]["parameters"] == SPLIT and plan["tensor"]["degrees"] == [2, 8]
    rows = {r["label"]: r for r in plan["rows"]}
    # tp8: 8 peers, no replicas; the whole part of the model on every peer, 1/8 of the split part.
    tp8, zero3_2d = rows["tp8"], rows["fsdp-zero3 x tp2"]
    assert tp8["parameters"] == pytest.approx(4 * (N - SPLIT + SPLIT / 8))
    assert tp8["optimizer"] == pytest.approx(8 * (N - SPLIT + SPLIT / 8))
    # 2 x 4: sharded over the 4 data-parallel ranks, and the split part over the 2 peers as well.
    assert zero3_2d["parameters"] == pytest.approx(4 * ((N - SPLIT) / 4 + SPLIT / 8))
    # Only the hidden activations of the MLP pairs are divided: 2 tensors of (seq, 4 x dim) per block.
    hidden = BLOCKS * 2 * SEQ * HIDDEN * 4 * 8  # fp32, micro-batch 8
    assert rows["ddp"]["activations"] - tp8["activations"] == pytest.approx(hidden * 7 / 8)
    assert rows["ddp"]["activations"] - rows["tp2"]["activations"] == pytest.approx(hidden / 2)
    # Traffic: tp8 all-reduces each pair's output in forward and its input's gradient in backward.
    exchanged = 2 * BLOCKS * SEQ * DIM * 4 * 8
    assert tp8["traffic"] == pytest.approx(2 * 7 / 8 * exchanged)
    assert rows["ddp"]["traffic"] == pytest.approx(2 * 7 / 8 * 4 * N)


def test_the_table_names_the_rows_and_what_tp_splits(capsys):
    assert main(["plan", "--example", "gpt", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "fsdp-zero3 x tp2" in out and "tp8 + checkpointing" in out
    assert "tp rows (automatic: MLP blocks): 8 layers split, 526,336 of 867,072 parameters" in out


def test_2_d_is_recommended_where_no_row_without_it_fits(capsys):
    # One block: no repeated class, so no checkpointing rows; tp divides the MLP's activations.
    gpt = ("--example", "gpt", "--model-arg", "layers=1", "--devices", "8")
    plan = _plan_json(capsys, *gpt)
    peak = {r["label"]: max(r["total"], r["setup"]) for r in plan["rows"]}
    labels = list(peak)
    before = labels[: labels.index("fsdp-zero3 x tp2")]
    assert "fsdp-zero3" in before and peak["fsdp-zero3 x tp2"] < min(peak[label] for label in before)
    memory = (peak["fsdp-zero3 x tp2"] + min(peak[label] for label in before)) / 2 / 0.9 / GIB
    argv = (*gpt, "--device-memory", f"{memory:.6f}")
    assert _plan_json(capsys, *argv)["recommendation"] == "fsdp-zero3 x tp2"
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    assert "recommended: fsdp-zero3 x tp2 with whole construction" in out
    assert "no row above fits without tensor parallelism: fsdp-zero3 x tp2 divides the split layers' activations" in out
    assert "phalanx.yaml:\nstrategy:\n  name: fsdp\n  tp:\n    size: 2\n  fsdp:\n    reshard_after_forward: true" in out
    # Four blocks, checkpointed: a row without tp fits first, though fsdp-zero3 x tp2 (18.84 MiB) fits too.
    plan = _plan_json(capsys, "--example", "gpt", "--devices", "8", "--device-memory", "0.0205")
    rows = {r["label"]: r for r in plan["rows"]}
    assert rows["fsdp-zero3 x tp2"]["fits"] and plan["recommendation"] == "ddp + checkpointing"


def test_divisors_come_from_the_layout():
    # 1000 parameters, 600 of them split, on 8 devices.
    zero3 = model_state("fsdp-zero3 x tp2", 1000, 8, split=600)
    assert (zero3.parameters, zero3.gradients, zero3.optimizer) == (4 * (400 / 4 + 600 / 8), 700, 1400)
    zero2 = model_state("fsdp-zero2 x tp2", 1000, 8, split=600, compute_bytes=2)
    assert zero2.parameters == 4 * (400 / 4 + 600 / 8) + 2 * (400 + 600 / 2)  # shards + the gathered copy
    tp2 = model_state("tp2", 1000, 8, split=600)  # 4 replicas of 2 peers
    assert (tp2.parameters, tp2.optimizer) == (4 * 700, 8 * 700)
    paper = model_state("tp8", 1000, 8, split=600, accounting="zero-paper")
    assert paper.total == 16 * (400 + 600 / 8)
    # Without a split, tp divides nothing: the layers it would split are what it divides.
    assert model_state("fsdp-zero3 x tp2", 1000, 8).parameters == 4 * 1000 / 4
    # Set-up: the whole model, its slices of the split layers and, under fsdp, its shards.
    assert setup_peak("tp2", 1000, 8, split=600).whole == 4 * 1000 + 4 * 300
    assert setup_peak("fsdp-zero3 x tp2", 1000, 8, split=600).deferred == 4 * 1000 + 4 * 300 + 4 * 175


def test_traffic_counts_activations_for_tp_and_parameters_over_the_data_axis():
    from phalanx.plan.tensor_split import SplitActivations

    acts = SplitActivations(forward=100.0, backward=100.0)
    two_d = ParallelLayout.of(8, data_axis="dp_shard", tp=2)
    assert step_traffic(3, two_d, 1000, 600, acts, micro_batch=4) == pytest.approx(
        3 * 3 / 4 * 4 * 700 + 2 * 1 / 2 * 200 * 4
    )
    # Checkpointing recomputes the forward, and its all-reduces.
    assert step_traffic(0, two_d, 1000, 600, acts, 4, checkpointing=True) == pytest.approx(300 * 4)
    assert step_traffic(2, ParallelLayout.of(1), 1000) == 0  # one rank sends nothing
    assert step_traffic(float("inf"), ParallelLayout.of(8), 1000) == float("inf")


def test_the_measured_split_activations_are_the_hidden_ones():
    model = TinyGPT()
    acts = measure_activations(TinyGPT, {}, (SEQ,), torch.long, "fp32", tensor=find_split(model, 8))
    assert acts.split.per_sample == BLOCKS * 2 * SEQ * HIDDEN * 4
    assert acts.split.forward == acts.split.backward == BLOCKS * SEQ * DIM * 4
    assert acts.at(8, tp=1) == measure_activations(TinyGPT, {}, (SEQ,), torch.long, "fp32").at(8)


def test_without_a_split_there_are_no_tp_rows_and_the_output_says_why(capsys):
    assert main(["plan", "--example", "digits", "--devices", "4"]) == 0
    out = capsys.readouterr().out
    assert "tp is left out: DigitsCNN has nothing the automatic plan splits" in out and "tp2" not in out
    assert main(["plan", "--params", "1e9", "--devices", "4"]) == 0
    assert "tp is left out: with --params there is no model" in capsys.readouterr().out
    assert main(["plan", "--example", "gpt", "--devices", "6"]) == 0
    out = capsys.readouterr().out
    assert "tp6 is left out: module 'blocks.0.mlp.0' (Linear) has 512 output features" in out
    assert "fsdp-zero3 x tp2" in out
    assert main(["plan", "--example", "gpt", "--devices", "4", "--precision", "fp16"]) == 0
    assert "tp is left out: it does not support fp16 (use bf16)" in capsys.readouterr().out


def test_make_plan_without_a_split_is_as_before():
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
    )
    assert [r.strategy for r in plan.rows] == ["ddp", "fsdp-zero2", "zero1", "fsdp-zero3", "pipeline"]
