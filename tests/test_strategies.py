"""Sharding strategies on 2 gloo processes: same weights as one process, about 1/N of the state."""

from __future__ import annotations

import pytest
import torch

import phalanx
from _workers import clipped_norm, compute_dtypes, held_bytes, make_model, pipeline_eval_and_clip, reference, train
from test_session_single import rel_diff

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180

SHARDED = {
    "zero1": "zero1",
    "fsdp-zero3": {"name": "fsdp", "fsdp": {"reshard_after_forward": True}},
    "fsdp-zero2-wrapped": {"name": "fsdp", "fsdp": {"reshard_after_forward": False, "wrap": ["Linear"]}},
    "fsdp-checkpointed": {"name": "fsdp", "activation_checkpointing": ["Linear"]},
    "ddp-checkpointed": {"name": "ddp", "activation_checkpointing": ["Tanh"]},
}


@pytest.mark.parametrize("strategy", SHARDED.values(), ids=SHARDED.keys())
def test_matches_one_process_with_accumulation(strategy):
    # 2 processes x 2 micro-steps of 4 against 1 process x 1 step of 16.
    out = phalanx.spawn(train, nprocs=2, args=(strategy, 16, 4, 6), timeout=TIMEOUT)[0]  # full weights on rank 0
    assert out["accumulation"] == 2 and out["steps"] == out["scheduler_steps"] == 6
    ref = reference(16, 6)
    assert list(out["state"]) == list(ref)  # plain names: loads into the bare model
    assert rel_diff(out["state"], ref) < 1e-5
    make_model().load_state_dict(out["state"])


@pytest.mark.parametrize(
    "name, sharded", [("ddp", ()), ("zero1", ("optimizer",)), ("fsdp", ("parameters", "gradients", "optimizer"))]
)
def test_each_rank_holds_about_one_nth(name, sharded):
    single = held_bytes("single")
    per_rank = phalanx.spawn(held_bytes, nprocs=2, args=(name,), timeout=TIMEOUT)
    for kind in ("parameters", "gradients", "optimizer"):
        for held in per_rank:
            ratio = held[kind] / single[kind]
            if kind in sharded:
                assert 0.4 <= ratio <= 0.6, (kind, ratio)
            else:
                assert ratio == 1.0, (kind, ratio)


@pytest.mark.parametrize("name", ["zero1", "fsdp"])
def test_clipping_sees_the_global_norm(name):
    single = clipped_norm("single")
    norms = phalanx.spawn(clipped_norm, nprocs=2, args=(name,), timeout=TIMEOUT)
    assert norms[0] == pytest.approx(single, rel=1e-5) and norms[1] == pytest.approx(single, rel=1e-5)


def test_fsdp_refuses_fp16():
    with pytest.raises(phalanx.ConfigError, match="fsdp does not support precision.mode fp16"):
        phalanx.Session(phalanx.Config(), strategy="fsdp", precision="fp16")


@pytest.mark.parametrize("name", ["fsdp", "zero1"])
def test_bf16_computes_in_bf16_and_returns_fp32(name):
    out = phalanx.spawn(compute_dtypes, nprocs=2, args=(name, "bf16"), timeout=TIMEOUT)[0]
    assert out == {"inside": "torch.bfloat16", "output": "torch.float32"}


def test_model_parallel_in_one_process_matches_plain_loop():
    out = train("model_parallel", 16, 4, 6)
    assert rel_diff(out["state"], reference(16, 6)) < 1e-5
    assert list(out["state"]) == list(reference(16, 6))


def test_model_parallel_places_blocks_in_order_balanced_by_parameters():
    from phalanx.demo.gpt import TinyGPT
    from phalanx.strategies.placement import assign, placement_units

    units = placement_units(TinyGPT(layers=6))
    names = [n for n, _ in units]
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4", "blocks.5", "norm", "head"]
    devices = assign(units, 3)
    assert devices == sorted(devices) and set(devices) == {0, 1, 2}  # contiguous, every device used
    per_device = [sum(p.numel() for (_, u), d in zip(units, devices) if d == k for p in u.parameters()) for k in range(3)]
    assert max(per_device) < 1.6 * min(per_device)
    assert assign(units, 1) == [0] * len(units)


def test_model_parallel_refuses_several_processes():
    with pytest.raises(phalanx.ConfigError, match="strategy 'model_parallel' runs in 1 process, not 2"):
        from phalanx.strategies import strategy_class

        strategy_class("model_parallel").check_world(2)


def test_model_parallel_refuses_weights_tied_across_devices():
    from phalanx.strategies.placement import refuse_shared_across

    embed = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    units = [("embed", embed), ("mid", torch.nn.Linear(4, 4)), ("head", head)]
    refuse_shared_across(units, [0, 0, 0])  # one device: fine
    with pytest.raises(phalanx.ConfigError, match="embed and head share a parameter"):
        refuse_shared_across(units, [0, 1, 1])


PIPELINES = {  # id: (strategy, micro_batch_size)
    "1f1b": ({"name": "pipeline", "pipeline": {"schedule": "1f1b", "microbatches": 4}}, None),
    "gpipe-accumulation": ({"name": "pipeline", "pipeline": {"schedule": "gpipe", "microbatches": 2}}, 8),
    "1f1b-accumulation-split": ({"name": "pipeline", "pipeline": {"split_points": ["4"], "microbatches": 2}}, 8),
}


@pytest.mark.parametrize("strategy, micro", PIPELINES.values(), ids=PIPELINES.keys())
def test_pipeline_matches_one_process(strategy, micro):
    out = phalanx.spawn(train, nprocs=2, args=(strategy, 16, micro, 6), timeout=TIMEOUT)[0]
    assert out["steps"] == out["scheduler_steps"] == 6
    assert out["accumulation"] == (2 if micro else 1)
    ref = reference(16, 6)
    assert list(out["state"]) == list(ref)
    assert rel_diff(out["state"], ref) < 1e-5


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_loss_norm_and_evaluation_match_one_process(schedule):
    results = phalanx.spawn(pipeline_eval_and_clip, nprocs=2, args=(schedule,), timeout=TIMEOUT)
    model = make_model()
    x, y = _data16()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    for out in results:  # every rank reports the same figures
        assert out["loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert out["norm"] == pytest.approx(norm.item(), rel=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(results[1]["out"], model(x))  # before any step: the same weights


def _data16():
    from _workers import make_data

    return make_data(16).tensors


def test_pipeline_needs_a_sequential_model():
    from phalanx.strategies.pipeline import _split
    from phalanx.strategies.placement import placement_units

    units = placement_units(make_model())
    assert _split(units, 2, ["2"]) == [0, 0, 1, 1, 1]
    with pytest.raises(phalanx.ConfigError, match="split_points must name 1 of the model's children"):
        _split(units, 2, ["9"])
    with pytest.raises(phalanx.ConfigError, match="fewer than the 8 stages"):
        _split(units, 8, [])


@pytest.mark.parametrize("name", ["ddp", "fsdp", "pipeline"])
def test_sharded_state_dict_round_trips_through_torch_distributed_checkpoint(name, tmp_path):
    from _workers import dcp_roundtrip

    out = phalanx.spawn(dcp_roundtrip, nprocs=2, args=(name, str(tmp_path / "ckpt")), timeout=TIMEOUT)[0]
    assert out["before"] and list(out["after"]) == list(out["before"])
    assert rel_diff(out["after"], out["before"]) == 0
    assert any(v.abs().sum() > 0 for v in out["after"].values())


def test_deferred_output_refuses_reads_and_finds_the_target():
    from phalanx.strategies.deferred import DeferredOutput

    out = DeferredOutput((torch.zeros(4, 3),))
    with pytest.raises(phalanx.PhalanxError, match="exists only on the last stage"):
        out.argmax(1)
    with pytest.raises(phalanx.PhalanxError, match="exists only on the last stage"):
        out.size()
    y, weight = torch.zeros(4, dtype=torch.long), torch.ones(8)
    loss = torch.nn.functional.cross_entropy(out.view(-1, 3), y, weight=weight)
    assert loss.target(4) is y  # exactly one row per sample beats a multiple
    ambiguous = torch.nn.functional.mse_loss(out, torch.zeros(4, 3)).add(torch.ones(4))
    with pytest.raises(phalanx.PhalanxError, match="several tensors with one row per sample"):
        ambiguous.target(4)


def test_pipeline_split_points_must_leave_no_stage_empty():
    from phalanx.strategies.placement import placement_units
    from phalanx.strategies.pipeline import _split

    units = placement_units(make_model())
    with pytest.raises(phalanx.ConfigError, match="distinct children after the first"):
        _split(units, 3, ["2", "2"])
    with pytest.raises(phalanx.ConfigError, match="distinct children after the first"):
        _split(units, 2, ["0"])


def test_pipeline_evaluation_takes_any_batch_size():
    from _workers import make_data, pipeline_eval_sizes

    results = phalanx.spawn(pipeline_eval_sizes, nprocs=2, timeout=TIMEOUT)
    x = make_data(16).tensors[0]
    with torch.no_grad():
        expected = [make_model()(x[:n]) for n in (16, 6, 1)]
    for out in results:
        for got, want in zip(out[:3], expected):
            torch.testing.assert_close(got, want)
        assert out[3] == 3.0  # every stage saw the same samples: nothing to add up
