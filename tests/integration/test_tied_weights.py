"""Tied language models on 2 gloo processes equal one process: GPT-2 and Llama (tiny Hugging Face
configs, the embedding tied to the output layer) and a pure-torch tied model, under ddp and fsdp
(built eagerly and deferred), a few SGD steps each. The tie survives on every rank; deferred
construction starts from exactly the weights of one process, with the model's own init (GPT-2:
std 0.02); GPT-2 loads its own save_pretrained file (which holds one name of the tie) under fsdp."""

from __future__ import annotations

import math

import pytest
import torch

import phalanx
from tests.helpers import tied_models as tm

pytestmark = pytest.mark.multiprocess
TIMEOUT = 240
FSDP = {"fsdp": {"min_params": 1000}}  # tiny models: units of a few thousand parameters, the tie's among them
CASES = {
    "ddp-deferred": ("ddp", True, {}),
    "fsdp-eager": ("fsdp", False, FSDP),
    "fsdp-deferred": ("fsdp", True, FSDP),
}


def _relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item() for k in b)


@pytest.fixture(scope="module")
def references() -> dict:
    """One process (strategy single), eager and deferred, per model."""
    return {}


def _reference(references: dict, kind: str, deferred: bool) -> dict:
    if (kind, deferred) not in references:
        references[kind, deferred] = tm.train(kind, "single", deferred, {})
    return references[kind, deferred]


@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_tied_language_model_trains_on_two_processes_as_on_one(kind, case, references):
    pytest.importorskip("transformers")
    strategy, deferred, options = CASES[case]
    one = _reference(references, kind, deferred)
    ranks = phalanx.spawn(tm.train, nprocs=2, args=(kind, strategy, deferred, options), cpu=True, timeout=TIMEOUT)
    assert all(out["tied"] and out["tied_after"] for out in ranks)
    difference = _relative_difference(ranks[0]["final"], one["final"])
    print(f"\n{kind} {case}: max relative weight difference to one process after 3 SGD steps {difference:.1e}")
    assert difference < 1e-5
    if deferred:  # the same initial weights, exactly, on any number of processes
        for key, value in one["initial"].items():
            assert torch.equal(ranks[0]["initial"][key], value), key
    if deferred and kind == "gpt2":  # from scratch, with GPT-2's own init
        initial = ranks[0]["initial"]
        residual = 0.02 / math.sqrt(2 * tm.gpt2_config().n_layer)
        for key in ("transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight"):
            assert abs(initial[key].std().item() - 0.02) < 0.002, key
        assert abs(initial["transformer.h.0.attn.c_proj.weight"].std().item() - residual) < 0.1 * residual


@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize(
    "options", [{"fsdp": {"min_params": 1000}}, {"fsdp": {"wrap": ["Embedding", "Linear"]}}], ids=["auto", "wrap"]
)
@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
def test_a_pure_torch_tied_model_trains_under_fsdp_on_two_processes_as_on_one(deferred, options, references):
    one = _reference(references, "tiny", deferred)
    ranks = phalanx.spawn(tm.train, nprocs=2, args=("tiny", "fsdp", deferred, options), cpu=True, timeout=TIMEOUT)
    assert all(out["tied"] and out["tied_after"] for out in ranks)
    assert _relative_difference(ranks[0]["final"], one["final"]) < 1e-5
    for key, value in one["initial"].items():
        assert torch.equal(ranks[0]["initial"][key], value), key


@pytest.mark.timeout(2 * TIMEOUT)
def test_gpt2_loads_its_own_save_pretrained_file_under_fsdp_on_two_processes(tmp_path):
    pytest.importorskip("transformers")
    path = tm.save_pretrained(str(tmp_path / "gpt2"))
    settings = {**FSDP, "weights": path, "steps": 1}
    ranks = phalanx.spawn(tm.train, nprocs=2, args=("gpt2", "fsdp", True, settings), cpu=True, timeout=TIMEOUT)
    torch.manual_seed(7)
    saved = tm.build("gpt2").state_dict()
    for key, value in saved.items():
        assert torch.equal(ranks[0]["initial"][key], value), key
    assert all(out["tied"] for out in ranks)
