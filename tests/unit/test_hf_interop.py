"""Hugging Face checkpoints in and out of phalanx in one process, with real transformers models built
from small configs (no download): what save_pretrained writes in shards loads strictly into a model
set up by phalanx (single, and ddp over one process), the tied GPT-2 head included; a checkpoint of
a trained model exports (`phalanx checkpoint export --format hf`) to a directory that
from_pretrained loads with no missing or unexpected key, the same weights, the tie, and the config."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import phalanx
from phalanx.cli.main import main
from phalanx.errors import PhalanxError
from tests.helpers import hf_models

transformers = pytest.importorskip("transformers")


def _session(strategy: str, **kwargs) -> phalanx.Session:
    return phalanx.Session(strategy=strategy, train={"progress": False, "metrics": False, "seed": 0}, **kwargs)


@pytest.mark.parametrize("strategy", ["single", "ddp"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_save_pretrained_shards_load_strictly(tmp_path, kind, strategy):
    source = hf_models.pretrained(kind, str(tmp_path / "hf"))
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1  # sharded, with its index
    if kind == "gpt2":
        assert (
            "lm_head.weight"
            not in json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
        )
    session = _session(strategy)
    model = session.setup(hf_models.build(kind))
    session.load_weights(tmp_path / "hf")  # strict
    state = session.model_state_dict(model)
    assert state.keys() == source.keys()
    assert all(torch.equal(state[k], v) for k, v in source.items())
    bare = session.unwrap(model)
    if kind == "gpt2":
        assert bare.lm_head.weight is bare.transformer.wte.weight
    session.close()


def test_a_directory_of_another_model_is_one_line(tmp_path):
    hf_models.pretrained("llama", str(tmp_path / "hf"))
    session = _session("single")
    session.setup(hf_models.build("gpt2"))
    with pytest.raises(PhalanxError, match=rf"^'{tmp_path / 'hf'}' does not match the model: \d+ keys of the model"):
        session.load_weights(tmp_path / "hf")
    session.close()


def test_names_load_as_the_state_dict_has_them_with_no_prefix_or_conversion(tmp_path):
    # from_pretrained strips or adds base_model_prefix ("transformer."); phalanx does not.
    lm = hf_models.build("gpt2")
    transformers.GPT2Model(lm.config).save_pretrained(tmp_path / "base")
    session = _session("single")
    session.setup(lm)
    with pytest.raises(PhalanxError) as refused:
        session.load_weights(tmp_path / "base")
    assert "\n" not in str(refused.value)
    assert "shares no tensor name with the model (the model's names are its names with 'transformer.' in front)" in (
        str(refused.value)
    )
    session.close()
    # transformers 5 fuses a Mixtral's experts and save_pretrained writes them back per expert,
    # unless save_original_format=False: only then are the names the state dict's.
    config = transformers.MixtralConfig(
        vocab_size=hf_models.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    mixtral = transformers.MixtralForCausalLM(config)
    mixtral.save_pretrained(tmp_path / "original")
    mixtral.save_pretrained(tmp_path / "as-is", save_original_format=False)
    session = _session("single")
    model = session.setup(transformers.MixtralForCausalLM(config))
    with pytest.raises(PhalanxError, match=r"does not match the model: \d+ keys of the model missing \(.*experts"):
        session.load_weights(tmp_path / "original")
    session.load_weights(tmp_path / "as-is")
    assert all(torch.equal(v, mixtral.state_dict()[k]) for k, v in model.state_dict().items())
    session.close()


def test_an_untied_checkpoint_into_a_tied_model_is_one_line(tmp_path):
    # An untied Llama's save_pretrained writes its head and its embedding, with different values;
    # the same Llama built with tie_word_embeddings=True holds one tensor for both.
    hf_models.pretrained("llama", str(tmp_path / "hf"))
    untied = hf_models.build("llama")
    config = copy.deepcopy(untied.config)
    config.tie_word_embeddings = True
    tied = transformers.LlamaForCausalLM(config)
    session = _session("single")
    model = session.setup(tied)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PhalanxError) as refused:
        session.load_weights(tmp_path / "hf")
    assert str(refused.value) == (
        f"'{tmp_path / 'hf'}' holds model.embed_tokens.weight and lm_head.weight with different values, but the "
        "model ties them (one tensor); build the model untied (for a Hugging Face model, tie_word_embeddings=False) "
        "or load weights that hold only one of them"
    )
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    session.close()
    session = _session("single")
    session.setup(untied)
    session.load_weights(tmp_path / "hf")  # untied, as the checkpoint is: it loads
    session.close()


def _trained_checkpoint(kind: str, root, strategy: str = "single"):
    session = _session(strategy, checkpoint={"dir": str(root), "resume": "never"})
    model = hf_models.build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = session.setup(model, optimizer)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(0, hf_models.VOCAB, (4, hf_models.SEQUENCE), generator=g)
        with session.accumulate(model):
            session.backward(model(input_ids=ids, labels=ids).loss)
    path = session.save()
    weights = {k: v.clone() for k, v in session.model_state_dict(model).items()}
    session.close()
    return path, weights


@pytest.mark.parametrize("kind, strategy", [("gpt2", "single"), ("llama", "single"), ("gpt2", "fsdp")])
def test_an_export_loads_with_from_pretrained(capsys, tmp_path, kind, strategy):
    path, weights = _trained_checkpoint(kind, tmp_path / "ck", strategy)
    out = tmp_path / "export"
    capsys.readouterr()
    architecture = "GPT2LMHeadModel" if kind == "gpt2" else "LlamaForCausalLM"
    assert main(["checkpoint", "info", str(path)]) == 0
    assert f"tensors ({architecture}, with its config: export it with --format hf)" in capsys.readouterr().out
    assert main(["checkpoint", "export", "--format", "hf", "--max-shard-size", "20K", str(path), str(out)]) == 0
    line = capsys.readouterr().out
    assert f"with config.json and generation_config.json; load it with {architecture}.from_pretrained('{out}')" in line
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names and "model-00002-of-" in " ".join(names)
    hf_models.quiet()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(loaded).__name__ == architecture
    state = loaded.state_dict()
    assert state.keys() == weights.keys() and all(torch.equal(state[k], v) for k, v in weights.items())
    if kind == "gpt2":
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert "lm_head.weight" not in index["weight_map"]  # as save_pretrained leaves it out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["bos_token_id"] == 0
    # phalanx reads its own export back, strictly, as it reads save_pretrained's.
    session = _session("single")
    again = session.setup(hf_models.build(kind, seed=5))
    session.load_weights(out)
    assert all(torch.equal(session.model_state_dict(again)[k], v) for k, v in weights.items())
    session.close()
