"""``session.load_weights`` in one process: state dicts, .safetensors and .pt files load exactly;
what does not match the model is one line naming the keys; bad calls are refused."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from phalanx import Config, Session
from phalanx.errors import PhalanxError
from tests.helpers.models import Scale, TiedLM


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3))


def _session(strategy: str = "single") -> Session:
    return Session(Config(), strategy=strategy, train={"progress": False, "metrics": False, "seed": 0})


def _pretrained() -> dict[str, torch.Tensor]:
    torch.manual_seed(11)
    return _model().state_dict()


@pytest.mark.parametrize("kind", ["dict", "safetensors", "pt"])
@pytest.mark.parametrize("strategy", ["single", "fsdp", "ddp"])
def test_weights_load_exactly_from_each_source(kind, strategy, tmp_path):
    weights = _pretrained()
    source = weights
    if kind == "safetensors":
        from safetensors.torch import save_file

        source = tmp_path / "w.safetensors"
        save_file(weights, source)
    elif kind == "pt":
        source = tmp_path / "w.pt"
        torch.save(weights, source)
    session = _session(strategy)
    with session.init_module():
        model = _model()
    model = session.setup(model)
    session.load_weights(str(source) if kind != "dict" else source)
    state = session.model_state_dict(model)
    for key, value in weights.items():
        assert torch.equal(state[key], value), key
    session.close()


def test_a_bf16_file_loads_into_fp32_weights():
    weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _pretrained().items()}
    session = _session()
    model = session.setup(_model())
    session.load_weights(weights)
    assert model[0].weight.dtype == torch.float32 and torch.equal(model[0].weight, weights["0.weight"].float())
    session.close()


def test_mismatches_are_one_line_naming_the_keys():
    session = _session()
    model = session.setup(_model())
    weights = _pretrained()
    missing = {k: v for k, v in weights.items() if k != "2.bias"}
    with pytest.raises(PhalanxError, match=r"1 key of the model missing \(2\.bias\).*strict=False"):
        session.load_weights(missing)
    with pytest.raises(PhalanxError, match=r"1 key the model does not have \(extra\)"):
        session.load_weights({**weights, "extra": torch.zeros(1)})
    with pytest.raises(PhalanxError, match=r"0\.weight is \(5, 7\) in the file, \(5, 6\) in the model"):
        session.load_weights({**weights, "0.weight": torch.zeros(5, 7)})
    with pytest.raises(PhalanxError, match=r"another kind \(0\.weight is torch\.int64"):
        session.load_weights({**weights, "0.weight": torch.zeros(5, 6, dtype=torch.long)})
    before = model[2].bias.clone()
    session.load_weights({**missing, "extra": torch.zeros(1)}, strict=False)  # skips both
    assert torch.equal(model[2].bias, before) and torch.equal(model[0].weight, weights["0.weight"])
    session.close()


def test_bad_calls_are_refused():
    session = _session()
    with pytest.raises(PhalanxError, match=r"after session\.setup\(model\)"):
        session.load_weights(_pretrained())
    model = session.setup(_model())
    with pytest.raises(PhalanxError, match="takes a state dict or the path"):
        session.load_weights(42)
    with pytest.raises(PhalanxError, match="takes a model that session.setup"):
        session.load_weights(_pretrained(), nn.Linear(2, 2))
    with pytest.raises(PhalanxError, match="maps 'x' to int"):
        session.load_weights({"x": 3})
    del model
    session.close()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    keys=st.lists(st.sampled_from(["0.weight", "0.bias", "2.weight", "9.weight", "1.running_mean"]), unique=True),
    rows=st.integers(1, 7),
)
def test_any_partial_or_reshaped_state_dict_loads_or_is_one_line(keys, rows):
    session = _session()
    session.setup(_model())
    weights = _pretrained()
    given_ = {k: (weights[k] if k in weights and rows == 5 else torch.zeros(rows, 6)) for k in keys}
    try:
        session.load_weights(given_, strict=False)
    except PhalanxError as err:
        assert "\n" not in str(err)
        assert "does not match the model" in str(err) or "shares no tensor name with the model" in str(err)
    session.close()


def test_a_source_sharing_no_name_with_the_model_is_refused_even_without_strict():
    session = _session()
    model = session.setup(_model())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prefixed = {f"model.{k}": v for k, v in _pretrained().items()}  # e.g. a base model's file for a head model
    refusal = r"shares no tensor name with the model \(its names are the model's with 'model\.' in front\)"
    for strict in (True, False):
        with pytest.raises(PhalanxError, match=refusal):
            session.load_weights(prefixed, strict=strict)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    session.close()


def test_a_file_without_the_tied_copy_loads_strictly_and_once():
    session = _session()
    model = session.setup(TiedLM())
    # As Hugging Face files leave the head out: the tied copy is not in the file.
    weights = {"embed.weight": torch.arange(40.0).view(10, 4), "body.weight": torch.eye(4), "body.bias": torch.zeros(4)}
    session.load_weights(weights)
    assert torch.equal(model.head.weight, weights["embed.weight"]) and model.head.weight is model.embed.weight
    session.close()


def test_the_uninitialised_guard_is_per_model():
    session = _session()
    with session.init_module():
        deferred = nn.Sequential(nn.Linear(6, 4), Scale(4))
    teacher = _model()  # built whole: nothing to guard
    deferred, teacher = session.setup(deferred, teacher)
    teacher(torch.randn(2, 6))
    with pytest.raises(PhalanxError, match="Scale"):
        deferred(torch.randn(2, 6))
    # A key of the same name loaded into the teacher does not count for the deferred model.
    session.load_weights(_pretrained(), teacher)
    with pytest.raises(PhalanxError, match="Scale"):
        deferred(torch.randn(2, 6))
    session.load_weights({"0.weight": torch.zeros(4, 6), "0.bias": torch.zeros(4), "1.gain": torch.ones(4)}, deferred)
    deferred(torch.randn(2, 6))
    session.close()


def _as_source(kind: str, tmp_path, weights: dict[str, torch.Tensor]):
    """``weights`` as a source of ``kind``: a state dict, one file, or two shards with an index that
    put the two names of the tie in different shards (read one after the other)."""
    if kind == "dict":
        return weights
    from safetensors.torch import save_file

    if kind == "pt":
        torch.save(weights, tmp_path / "w.pt")
        return str(tmp_path / "w.pt")
    if kind == "safetensors":
        save_file({k: v.clone() for k, v in weights.items()}, tmp_path / "w.safetensors")
        return str(tmp_path / "w.safetensors")
    first = ["embed.weight", "body.weight"]
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": []}
    shards["model-00002-of-00002.safetensors"] = [k for k in weights if k not in first]
    for file, names in shards.items():
        save_file({n: weights[n].clone() for n in names}, tmp_path / file, metadata={"format": "pt"})
    weight_map = {n: file for file, names in shards.items() for n in names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(tmp_path)


def _tied_weights(head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    embed = torch.arange(40.0).view(10, 4)
    return {
        "embed.weight": embed,
        "body.weight": torch.eye(4),
        "body.bias": torch.zeros(4),
        "head.weight": embed.clone() if head is None else head,
    }


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", ["dict", "pt", "safetensors", "shards"])
def test_a_source_with_both_names_of_a_tie_and_different_values_is_refused(kind, strict, tmp_path):
    session = _session()
    model = session.setup(TiedLM())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    head = torch.arange(40.0).view(10, 4).flip(0)  # an untied checkpoint: the head learned its own values
    source = _as_source(kind, tmp_path, _tied_weights(head))
    name = "the state dict" if kind == "dict" else f"'{source}'"
    with pytest.raises(PhalanxError) as refused:
        session.load_weights(source, strict=strict)
    assert str(refused.value) == (
        f"{name} holds embed.weight and head.weight with different values, but the model ties them (one tensor); "
        "build the model untied (for a Hugging Face model, tie_word_embeddings=False) or load weights that hold "
        "only one of them"
    )
    # Refused before anything was loaded: the model is as it was, its tie too.
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.head.weight is model.embed.weight
    session.close()


@pytest.mark.parametrize("kind", ["dict", "pt", "safetensors", "shards"])
def test_a_source_with_both_names_of_a_tie_and_equal_values_loads(kind, tmp_path):
    session = _session()
    model = session.setup(TiedLM())
    weights = _tied_weights()
    session.load_weights(_as_source(kind, tmp_path, weights))
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert model.head.weight is model.embed.weight
    session.close()


def test_a_tie_given_twice_compares_as_the_model_holds_it():
    session = _session()
    model = session.setup(TiedLM())
    embed = torch.arange(40.0).view(10, 4)
    embed[0, 0] = float("nan")  # the same NaN under both names is the same value
    session.load_weights({**_tied_weights(), "embed.weight": embed, "head.weight": embed.clone()})
    assert torch.equal(model.embed.weight[1:], embed[1:]) and model.embed.weight[0, 0].isnan()
    # A bf16 copy equal after the cast into the model's fp32 weights is the same value, too.
    session.load_weights({**_tied_weights(), "head.weight": _tied_weights()["embed.weight"].bfloat16()})
    assert torch.equal(model.head.weight, _tied_weights()["embed.weight"])
    session.close()
