"""Tensor parallelism on CPU gloo processes trains like one process: final weights within 1e-5 of
a plain one-process loop over the same global batches, under strategy tp (2 peers; 2 peers x 2
data-parallel replicas), fsdp x tp (2 x 2; with accumulation, with clipping that bites) and a
Hugging Face Llama split by its own tp_plan. What the data-parallel collectives give (reduce,
gather_for_metrics over an evaluation set no process count divides) and the batch plan are those
of ddp for the same data: tensor peers count once."""

from __future__ import annotations

import pytest
import torch

import phalanx
from tests.helpers import tensor_parallel as h
from tests.helpers.training import rel_diff

pytestmark = pytest.mark.multiprocess
TIMEOUT = 120
CLIP = 0.3  # the reference's gradient norms are 0.59 to 0.68: every step is clipped


def _spawn(nprocs: int, *args, **kwargs) -> list[dict]:
    return phalanx.spawn(h.run, nprocs=nprocs, args=(args, kwargs), cpu=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def reference() -> dict:
    one = h.reference()
    one["eval_losses"] = h.eval_reference(one["state"])
    return one


@pytest.fixture(scope="module")
def ddp() -> list[dict]:
    """The same loop and evaluation under ddp on 2 processes: what the collectives should give."""
    return _spawn(2, "ddp", 1)


def _weights_match(out: dict, reference: dict, what: str) -> float:
    assert out["state"].keys() == reference["state"].keys()
    difference = rel_diff(out["state"], reference["state"])
    print(f"\n{what}: max relative weight difference to one process after {h.STEPS} SGD steps {difference:.1e}")
    assert difference < 1e-5
    assert out["steps"] == h.STEPS
    return difference


def _collectives_match(ranks: list[dict], ddp: list[dict], reference: dict) -> None:
    """Every rank's reduce and gather_for_metrics results equal ddp's, and one process's."""
    theirs = ddp[0]
    for out in ranks:
        # The training loss reduced (mean) and the global batch's rows reduced (sum) per step.
        assert out["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
        assert out["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert out["rows"] == theirs["rows"] == [float(h.GLOBAL_BATCH)] * h.STEPS
        # The evaluation set in dataset order, each sample once: the padding is cut.
        assert out["ids"] == theirs["ids"] == list(range(h.EVAL))
        assert torch.allclose(out["eval_losses"], theirs["eval_losses"], rtol=1e-4)
        assert torch.allclose(out["eval_losses"], reference["eval_losses"], rtol=1e-4)
        assert out["eval_max"] == pytest.approx(theirs["eval_max"], rel=1e-4)
        assert out["eval_min"] == pytest.approx(theirs["eval_min"], rel=1e-4)
        assert out["eval_max"] == pytest.approx(reference["eval_losses"].max().item(), rel=1e-4)
        # One number per data-parallel rank, not per process.
        assert out["dp_ranks"] == [float(r) for r in range(out["dp"])]


@pytest.mark.timeout(TIMEOUT)
def test_ddp_is_the_baseline_it_is_taken_for(ddp, reference):
    # What the other tests compare with: ddp itself trains like one process and cuts the padding.
    _weights_match(ddp[0], reference, "ddp 2")
    assert ddp[0]["ids"] == list(range(h.EVAL)) and ddp[0]["dp_ranks"] == [0.0, 1.0]
    assert ddp[0]["batch"] == {
        "global_batch_size": h.GLOBAL_BATCH,
        "micro_batch_size": h.GLOBAL_BATCH // 2,
        "accumulation_steps": 1,
        "data_parallel_size": 2,
    }


@pytest.mark.timeout(TIMEOUT)
def test_tp_on_two_processes_trains_like_one(reference, ddp):
    ranks = _spawn(2, "tp", 2)
    out = ranks[0]
    _weights_match(out, reference, "tp 2")
    assert out["describe"].startswith("tp over 2 tensor-parallel, 4 modules split (automatic: MLP blocks)")
    # Both peers see the whole global batch: one data-parallel process.
    assert out["batch"] == {**ddp[0]["batch"], "micro_batch_size": h.GLOBAL_BATCH, "data_parallel_size": 1}
    _collectives_match(ranks, ddp, reference)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("how", ["strategy.tp.plan", "set_tp_plan"])
def test_a_plan_of_the_users_own_trains_like_one(how, reference):
    # Rowwise and colwise embeddings (whole token ids in, whole vectors out), sequence-parallel norms,
    # and DTensor's own styles given in Python.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if how == "strategy.tp.plan":
        plan = {"embed": "rowwise", "blocks.*.norm[12]": "sequence_parallel"}
        plan |= {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
        kwargs, source, split = {"plan": plan}, "strategy.tp.plan", 9
    else:
        given = {"embed": "colwise", "blocks.*.mlp.0": ColwiseParallel(), "blocks.*.mlp.2": RowwiseParallel()}
        kwargs, source, split = {"given": given}, "the plan given to setup()", 5
    out = _spawn(2, "tp", 2, **kwargs)[0]
    _weights_match(out, reference, f"tp 2, {how}")
    assert out["plan"] == source and f", {split} modules split ({source})" in out["describe"]
    assert out["ids"] == list(range(h.EVAL))
    assert torch.allclose(out["eval_losses"], reference["eval_losses"], rtol=1e-4)


@pytest.mark.timeout(TIMEOUT)
def test_sequence_parallel_norms_are_clipped_by_their_whole_gradient():
    # A sequence-parallel norm's weight gradient is a partial sum on each peer: clipping must read
    # the sum (it read each peer's part as whole: 1.3e-3 off one process).
    plan = {"blocks.*.norm[12]": "sequence_parallel", "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
    out = _spawn(2, "tp", 2, plan=plan, optim={"max_grad_norm": CLIP})[0]
    _weights_match(out, {"state": h.reference(max_grad_norm=CLIP)["state"]}, "tp 2, sequence parallel, clipped")


@pytest.mark.timeout(TIMEOUT)
def test_tp_peers_as_data_parallel_replicas_train_like_one(reference, ddp):
    ranks = _spawn(4, "tp", 2)
    out = ranks[0]
    _weights_match(out, reference, "tp 2 x dp 2")
    assert out["describe"].startswith("tp over 2 data-parallel x 2 tensor-parallel")
    assert out["batch"] == ddp[0]["batch"]
    _collectives_match(ranks, ddp, reference)


@pytest.mark.timeout(TIMEOUT)
def test_fsdp_x_tp_trains_like_one_with_the_batch_plan_of_ddp(reference, ddp):
    ranks = _spawn(4, "fsdp", 2)
    out = ranks[0]
    _weights_match(out, reference, "fsdp x tp 2 x 2")
    assert out["describe"].startswith("fsdp x tp over 2 data-parallel (sharded) x 2 tensor-parallel")
    assert out["plan"] == "automatic: MLP blocks"
    # Global batch, micro batch, accumulation and data-parallel size: those of ddp on 2 processes.
    assert [r["batch"] for r in ranks] == [ddp[0]["batch"]] * 4
    _collectives_match(ranks, ddp, reference)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("clip", [None, CLIP], ids=["accumulation", "accumulation and clipping"])
def test_fsdp_x_tp_with_accumulation_and_clipping_trains_like_one(clip, reference):
    if clip is not None:
        expected = h.reference(max_grad_norm=clip)
        assert rel_diff(expected["state"], reference["state"]) > 1e-2  # the clipping bites
    else:
        expected = reference
    ranks = _spawn(4, "fsdp", 2, 2, optim={"max_grad_norm": clip})
    out = ranks[0]
    assert out["accumulation"] == 2 and out["batch"]["micro_batch_size"] == 2
    assert out["rows"] == [h.GLOBAL_BATCH / 2] * (2 * h.STEPS)  # each micro-step: 2 rows x 2 data-parallel ranks
    _weights_match(out, expected, f"fsdp x tp 2 x 2, 2 accumulation steps, max_grad_norm {clip}")


@pytest.mark.timeout(TIMEOUT)
def test_a_hugging_face_model_trains_through_its_own_tp_plan_like_one_process():
    pytest.importorskip("transformers")
    expected = h.hf_reference()
    ranks = phalanx.spawn(h.hf_train, nprocs=2, args=(2,), cpu=True, timeout=TIMEOUT)
    out = ranks[0]
    assert out["plan"] == "LlamaForCausalLM's own tp_plan"
    assert ", 14 modules split (LlamaForCausalLM's own tp_plan)" in out["describe"]
    assert "model.layers.1.self_attn.q_proj" in out["split"] and "model.layers.0.mlp.down_proj" in out["split"]
    assert out["steps"] == h.HF_STEPS and out["state"].keys() == expected.keys()
    difference = rel_diff(out["state"], expected)
    print(f"\nLlama tp 2: max relative weight difference to one process after {h.HF_STEPS} SGD steps {difference:.1e}")
    assert difference < 1e-5
    assert rel_diff(h.hf_reference(steps=1), expected) > 1e-3  # the steps move the weights
