"""A model written like Meta's llama/model.py (tests/helpers/llama_style.py) trains like one process
on CPU gloo processes, from one script whose strategy is the config's one line: with a plan of
session.set_tp_plan() (attention split by heads, the SwiGLU FeedForward, the model's own RMSNorm
class sequence-parallel) under single and ddp, which keep it and say so, and tp and fsdp x tp,
which split with it; and with the automatic plan, which finds w1, w3 -> w2, under tp and fsdp x tp.
An attention whose whole head count the plan's checks cannot see is refused at its first forward."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers import llama_style as ls
from tests.helpers.training import rel_diff

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180


@pytest.fixture(scope="module")
def reference() -> dict:
    return ls.reference()


def _matches(out: dict, reference: dict) -> None:
    assert out["state"].keys() == reference.keys()
    difference = rel_diff(out["state"], reference)
    print(f"\n{out['describe']}: max relative weight difference to one process {difference:.1e}")
    assert difference < 1e-5
    assert out["steps"] == ls.STEPS


@pytest.mark.timeout(TIMEOUT)
def test_set_tp_plan_under_single_keeps_the_plan_and_says_so(reference, capsys):
    out = ls.train("single", None, ls.FULL_PLAN)
    _matches(out, reference)
    assert out["split"] == []
    said = [line for line in capsys.readouterr().out.splitlines() if "set_tp_plan" in line]
    assert said == [
        "phalanx: strategy single splits no layers over tensor-parallel peers; session.set_tp_plan() is kept for "
        "strategy tp, or fsdp with strategy.tp.size > 1"
    ]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(
    "strategy, nprocs, tp, split",
    [("ddp", 2, 1, 0), ("tp", 2, 2, 19), ("fsdp", 4, 2, 19)],
    ids=["ddp", "tp", "fsdp-x-tp"],
)
def test_one_set_tp_plan_script_trains_like_one_process_under_every_strategy(reference, strategy, nprocs, tp, split):
    ranks = phalanx.spawn(ls.run, nprocs=nprocs, args=((strategy, tp, ls.FULL_PLAN),), cpu=True, timeout=TIMEOUT)
    out = ranks[0]
    _matches(out, reference)
    assert len(out["split"]) == split
    if split:
        assert f"{split} modules split (the plan given to setup())" in out["describe"]
        assert {"layers.0.attention.wq", "layers.1.ffn_norm", "norm"} <= set(out["split"])


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("strategy, nprocs", [("tp", 2), ("fsdp", 4)], ids=["tp", "fsdp-x-tp"])
def test_the_automatic_plan_splits_metas_swiglu(reference, strategy, nprocs):
    out = phalanx.spawn(ls.run, nprocs=nprocs, args=((strategy, 2, None),), cpu=True, timeout=TIMEOUT)[0]
    _matches(out, reference)
    assert "6 modules split (automatic: MLP blocks)" in out["describe"]
    assert out["split"] == sorted(f"layers.{i}.feed_forward.w{j}" for i in range(2) for j in (1, 2, 3))


@pytest.mark.timeout(TIMEOUT)
def test_a_whole_head_count_the_checks_cannot_see_is_refused_at_the_first_forward():
    ranks = phalanx.spawn(ls.run, nprocs=2, args=(("tp", 2, ls.FULL_PLAN, "args"),), cpu=True, timeout=TIMEOUT)
    for out in ranks:
        refused = out["refused"]
        assert "\n" not in refused
        assert refused.startswith(
            "the plan given to setup() splits 'layers.0.attention' (ArgsAttention) by heads over 2 peers, but its "
            "forward reshapes with the whole model's head count (shape '[8, 16, 4, 8]' is invalid for input of size "
            "2048), where a peer holds 1/2 of the heads"
        ), refused
        assert "n_heads // tp_size" in refused and "-1" in refused
