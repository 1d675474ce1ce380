"""Sharding strategies on 2 gloo processes: same weights as one process, about 1/N of the state."""

from __future__ import annotations

import pytest
import torch

import phalanx
from tests.helpers.models import make_model
from tests.helpers.probes import clipped_norm, compute_dtypes, held_bytes, pipeline_eval_and_clip
from tests.helpers.training import reference, rel_diff, train

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
    # full weights on rank 0
    out = phalanx.spawn(train, nprocs=2, args=(strategy, 16, 4, 6), cpu=True, timeout=TIMEOUT)[0]
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
    per_rank = phalanx.spawn(held_bytes, nprocs=2, args=(name,), cpu=True, timeout=TIMEOUT)
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
    norms = phalanx.spawn(clipped_norm, nprocs=2, args=(name,), cpu=True, timeout=TIMEOUT)
    assert norms[0] == pytest.approx(single, rel=1e-5) and norms[1] == pytest.approx(single, rel=1e-5)


@pytest.mark.parametrize("name", ["fsdp", "zero1"])
def test_bf16_computes_in_bf16_and_returns_fp32(name):
    out = phalanx.spawn(compute_dtypes, nprocs=2, args=(name, "bf16"), cpu=True, timeout=TIMEOUT)[0]
    assert out == {"inside": "torch.bfloat16", "output": "torch.float32"}


PIPELINES = {  # id: (strategy, micro_batch_size)
    "1f1b": ({"name": "pipeline", "pipeline": {"schedule": "1f1b", "microbatches": 4}}, None),
    "gpipe-accumulation": ({"name": "pipeline", "pipeline": {"schedule": "gpipe", "microbatches": 2}}, 8),
    "1f1b-accumulation-split": ({"name": "pipeline", "pipeline": {"split_points": ["4"], "microbatches": 2}}, 8),
}


@pytest.mark.parametrize("strategy, micro", PIPELINES.values(), ids=PIPELINES.keys())
def test_pipeline_matches_one_process(strategy, micro):
    out = phalanx.spawn(train, nprocs=2, args=(strategy, 16, micro, 6), cpu=True, timeout=TIMEOUT)[0]
    assert out["steps"] == out["scheduler_steps"] == 6
    assert out["accumulation"] == (2 if micro else 1)
    ref = reference(16, 6)
    assert list(out["state"]) == list(ref)
    assert rel_diff(out["state"], ref) < 1e-5


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_loss_norm_and_evaluation_match_one_process(schedule):
    results = phalanx.spawn(pipeline_eval_and_clip, nprocs=2, args=(schedule,), cpu=True, timeout=TIMEOUT)
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
    from tests.helpers.models import make_data

    return make_data(16).tensors


@pytest.mark.parametrize("name", ["ddp", "fsdp", "pipeline"])
def test_sharded_state_dict_round_trips_through_torch_distributed_checkpoint(name, tmp_path):
    from tests.helpers.probes import dcp_roundtrip

    out = phalanx.spawn(dcp_roundtrip, nprocs=2, args=(name, str(tmp_path / "ckpt")), cpu=True, timeout=TIMEOUT)[0]
    assert out["before"] and list(out["after"]) == list(out["before"])
    assert rel_diff(out["after"], out["before"]) == 0
    assert any(v.abs().sum() > 0 for v in out["after"].values())


def test_pipeline_evaluation_takes_any_batch_size():
    from tests.helpers.models import make_data
    from tests.helpers.probes import pipeline_eval_sizes

    results = phalanx.spawn(pipeline_eval_sizes, nprocs=2, cpu=True, timeout=TIMEOUT)
    x = make_data(16).tensors[0]
    with torch.no_grad():
        expected = [make_model()(x[:n]) for n in (16, 6, 1)]
    for out in results:
        for got, want in zip(out[:3], expected):
            torch.testing.assert_close(got, want)
        assert out[3] == 3.0  # every stage saw the same samples: nothing to add up
