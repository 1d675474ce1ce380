"""`phalanx plan`: agreement with bytes measured on 2 gloo processes, and the CLI."""

from __future__ import annotations

import json

import pytest

import phalanx
from phalanx.plan import model_state
from phalanx.strategies import tp_plan
from tests.helpers import tensor_parallel, tp_memory
from tests.helpers.cli import call_phalanx, run_phalanx
from tests.helpers.probes import held_bytes


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy, planned", [("ddp", "ddp"), ("zero1", "zero1"), ("fsdp", "fsdp-zero3"), ("pipeline", "pipeline")]
)
def test_plan_matches_bytes_measured_in_a_training_step(strategy, planned):
    n_params = 8 * (64 * 64 + 64)  # the model held_bytes trains: 8 x Linear(64, 64), Adam
    measured = phalanx.spawn(held_bytes, nprocs=2, args=(strategy,), cpu=True, timeout=180)
    state = model_state(planned, n_params, 2, optimizer="adam")
    for held in measured:
        assert held["parameters"] == pytest.approx(state.parameters, rel=0.1)
        assert held["gradients"] == pytest.approx(state.gradients, rel=0.1)
        assert held["optimizer"] == pytest.approx(state.optimizer, rel=0.1)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy, planned", [("fsdp", "fsdp-zero3 x tp2"), ("tp", "tp2")])
def test_a_2_x_2_layout_matches_bytes_measured_in_a_training_step(strategy, planned):
    # 4 CPU processes: 2 data-parallel x 2 tensor peers. The planned row divides only the MLP pairs
    # by tp; the rest of the model (attention, embeddings, norms) is whole on both peers.
    model = tensor_parallel.build()
    n_params = sum(p.numel() for p in model.parameters())
    split = tp_plan.split_parameters(model, tp_plan.resolve(model, 2, {}))
    assert 0 < split < n_params
    measured = phalanx.spawn(tp_memory.held_bytes, nprocs=4, args=(strategy, 2), cpu=True, timeout=200)
    state = model_state(planned, n_params, 4, optimizer="adam", split=split)
    for held in measured:
        assert held["parameters"] == pytest.approx(state.parameters, rel=0.1)
        assert held["gradients"] == pytest.approx(state.gradients, rel=0.1)
        assert held["optimizer"] == pytest.approx(state.optimizer, rel=0.1)


def test_cli_json_for_the_gpt_example(tmp_path):
    result = call_phalanx(
        "plan", "--example", "gpt", "--micro-batch", "4", "--device-memory", "0.02", "--json", cwd=tmp_path
    )
    assert result.returncode == 0, result.output
    data = json.loads(result.stdout)
    labels = [r["label"] for r in data["rows"]]
    assert labels[:4] == ["ddp", "fsdp-zero2", "zero1", "fsdp-zero3"]
    assert "pipeline" not in labels  # TinyGPT is not an nn.Sequential and "ddp + checkpointing" in labels
    assert data["checkpoint_classes"] == ["Block"] and data["n_params"] == 867072
    assert data["recommendation"] is not None


def test_cli_table_without_device_memory(tmp_path):
    result = run_phalanx("plan", "--params", "1e9", "--devices", "8", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    assert "fsdp-zero3" in result.stdout and "pass --device-memory" in result.stdout


BAD = [
    (["--model", "nosuchpkg.models:build", "--input-shape", "3"], "cannot import 'nosuchpkg.models'"),
    (["--model", "phalanx.demo.digits:Nope", "--input-shape", "3"], "has no callable 'Nope'"),
    (["--model", "phalanx.demo.digits", "--input-shape", "3"], "--model expects package.module:factory"),
    (
        ["--model", "phalanx.demo.digits:DigitsCNN", "--model-arg", "colour=3", "--input-shape", "1,8,8"],
        "the model factory failed: TypeError",
    ),
    (["--model", "phalanx.demo.digits:DigitsCNN", "--input-shape", "3,5"], "does not run through the model"),
    (["--model", "phalanx.demo.digits:DigitsCNN"], "--input-shape is needed with --model"),
    (["--example", "digits", "--input-shape", "a,b"], "--input-shape expects positive comma-separated sizes"),
    (["--example", "digits", "--micro-batch", "0"], "--micro-batch must be at least 1"),
    (["--params", "1e9", "--devices", "0"], "--devices must be at least 1"),
    (["--params", "1e9", "--device-memory", "0"], "--device-memory must be a positive number"),
    (["--example", "gpt", "--checkpoint", "Nope"], "--checkpoint names Nope"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[a[1] for a, _ in BAD])
def test_bad_input_is_one_line(tmp_path, args, message):
    result = (
        run_phalanx("plan", *args, cwd=tmp_path, timeout=120)
        if args == BAD[0][0]
        else call_phalanx("plan", *args, cwd=tmp_path)
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
