"""Strategies in one process: model parallel against the plain loop, placement and pipeline split
rules, deferred pipeline outputs, and the combinations each strategy refuses."""

from __future__ import annotations

import pytest
import torch

import phalanx
from tests.helpers.models import make_model
from tests.helpers.training import reference, rel_diff, train


def test_fsdp_refuses_fp16():
    with pytest.raises(phalanx.ConfigError, match="fsdp does not support precision.mode fp16"):
        phalanx.Session(phalanx.Config(), strategy="fsdp", precision="fp16")


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
    per_device = [
        sum(p.numel() for (_, u), d in zip(units, devices) if d == k for p in u.parameters()) for k in range(3)
    ]
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


def test_pipeline_needs_a_sequential_model():
    from phalanx.strategies.pipeline import _split
    from phalanx.strategies.placement import placement_units

    units = placement_units(make_model())
    assert _split(units, 2, ["2"]) == [0, 0, 1, 1, 1]
    with pytest.raises(phalanx.ConfigError, match="split_points must name 1 of the model's children"):
        _split(units, 2, ["9"])
    with pytest.raises(phalanx.ConfigError, match="fewer than the 8 stages"):
        _split(units, 8, [])


def test_deferred_output_refuses_reads_and_finds_the_target():
    from phalanx.strategies.pipeline_output import DeferredOutput

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
    from phalanx.strategies.pipeline import _split
    from phalanx.strategies.placement import placement_units

    units = placement_units(make_model())
    with pytest.raises(phalanx.ConfigError, match="distinct children after the first"):
        _split(units, 3, ["2", "2"])
    with pytest.raises(phalanx.ConfigError, match="distinct children after the first"):
        _split(units, 2, ["0"])
