"""strategy.ddp.find_unused_parameters: auto on 2 gloo processes: right from the first step, then
DDP's fast path when nothing needs the search; one line naming the parameters when something does;
one clear error when a parameter stops getting gradients after the switch."""

from __future__ import annotations

import pytest
import torch

import phalanx
from tests.helpers.training import reference, rel_diff, run

pytestmark = pytest.mark.multiprocess
TIMEOUT = 240
TORCH_NOTICE = "find_unused_parameters=True was specified"


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_unused_head_trains_like_one_process_and_is_named_once(strategy, capfd):
    # micro-batch 4 of a global 16 on 2 processes: 2 accumulation steps, so no_sync windows too.
    outs = phalanx.spawn(run, nprocs=2, args=((strategy, 16, 4, 5), {"model": "two_heads"}), cpu=True, timeout=TIMEOUT)
    printed = capfd.readouterr()
    ref = reference(16, 5, model="two_heads")
    for out in outs:
        assert out["error"] is None and out["steps"] == 5
        assert rel_diff(out["state"], ref) < 1e-5
        assert torch.equal(out["state"]["head2.weight"], ref["head2.weight"])  # never trained
        assert out["unused"] == [["head2.weight", "head2.bias"]]
        assert out["searching"] == [True]
    line = (
        "phalanx: 2 parameters got no gradient in the first step (head2.weight, head2.bias); DDP will look for unused "
        "parameters every step (slower). Remove them from the model, or set strategy.ddp.find_unused_parameters: true "
        "to silence this."
    )
    assert printed.out.count(line) == 1  # rank 0 only, once
    assert TORCH_NOTICE not in printed.err


def test_model_without_unused_parameters_ends_on_the_fast_path(capfd):
    auto = phalanx.spawn(run, nprocs=2, args=(("ddp", 16, 4, 5), {"model": "mlp"}), cpu=True, timeout=TIMEOUT)
    printed = capfd.readouterr()
    no_search = {"name": "ddp", "ddp": {"find_unused_parameters": False}}
    fast = phalanx.spawn(run, nprocs=2, args=((no_search, 16, 4, 5), {"model": "mlp"}), cpu=True, timeout=TIMEOUT)
    for a, f in zip(auto, fast):
        assert a["searching"] == [False] and a["unused"] == [[]]
        # The reducer rebuilt after step 1 hands over the same gradients: bit for bit.
        assert all(torch.equal(a["state"][k], f["state"][k]) for k in f["state"])
    assert rel_diff(auto[0]["state"], reference(16, 5, model="mlp")) < 1e-5
    assert "got no gradient" not in printed.out
    assert (
        TORCH_NOTICE not in printed.err
    )  # torch's notice that the search found nothing is phalanx's cue, not the user's


def test_comm_hook_survives_the_switch_to_the_fast_path():
    strategy = {"name": "ddp", "ddp": {"comm_hook": "fp16"}}
    auto = phalanx.spawn(run, nprocs=2, args=((strategy, 16, None, 4), {"model": "mlp"}), cpu=True, timeout=TIMEOUT)[0]
    plain = {"name": "ddp", "ddp": {"comm_hook": "fp16", "find_unused_parameters": False}}
    fast = phalanx.spawn(run, nprocs=2, args=((plain, 16, None, 4), {"model": "mlp"}), cpu=True, timeout=TIMEOUT)[0]
    assert auto["searching"] == [False]
    # Step 1 runs under the first reducer, steps 2-4 under the rebuilt one: the fp16 hook runs in
    # both, so the weights match a run that never switched (and differ from uncompressed training).
    assert all(torch.equal(auto["state"][k], fast["state"][k]) for k in fast["state"])
    assert rel_diff(auto["state"], reference(16, 4, model="mlp")) > 0


def test_parameter_unused_after_the_switch_is_one_clear_error():
    # head2 takes part in step 1 only: auto switches to the fast path, then step 2 leaves it out.
    args = (("ddp", 16, None, 4), {"model": "two_heads", "head2_until": 1, "catch_errors": True})
    outs = phalanx.spawn(run, nprocs=2, args=args, cpu=True, timeout=TIMEOUT)
    for out in outs:
        assert out["steps"] == 1
        assert out["error"] == (
            "a parameter got no gradient in this step (head2.weight, head2.bias), although every parameter had one in "
            "the "
            "first step, after which phalanx turned DDP's search for unused parameters off; set "
            "strategy.ddp.find_unused_parameters: true"
        )


def test_find_unused_false_with_an_unused_parameter_is_one_clear_error():
    strategy = {"name": "ddp", "ddp": {"find_unused_parameters": False}}
    args = ((strategy, 16, None, 3), {"model": "two_heads", "catch_errors": True})
    outs = phalanx.spawn(run, nprocs=2, args=args, cpu=True, timeout=TIMEOUT)
    for out in outs:
        assert out["steps"] == 0
        assert out["error"].startswith(
            "a parameter got no gradient in this step (head2.weight, head2.bias), and "
            "strategy.ddp.find_unused_parameters is false"
        )
