"""Hugging Face models (GPT-2, Llama; tiny configs, nothing downloaded) under deferred
construction in one process: the model's own ``_init_weights`` gives each module the values an
eager build has (statistically), the tie stays one tensor, fsdp starts from exactly the weights of
``single``, and fsdp's units keep what one init writes together."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx import Config, Session
from phalanx.errors import ConfigError
from phalanx.plan import count_shard_units
from phalanx.strategies.construction import empty_parameters
from phalanx.strategies.fsdp import FSDPConfig
from phalanx.strategies.fsdp_units import shard_groups
from tests.helpers import tied_models as tm

pytest.importorskip("transformers")


def _deferred(kind: str, strategy: str = "single", **options):
    session = Session(
        Config(), strategy={"name": strategy, **options}, train={"progress": False, "metrics": False, "seed": 0}
    )
    with session.init_module():
        model = tm.build(kind)
    model = session.setup(model)
    state = {k: v.clone() for k, v in session.model_state_dict(model).items()}
    return state, session, model


def _near(value: float, expected: float, within: float = 0.1) -> bool:
    return abs(value - expected) <= within * expected


def test_gpt2_from_scratch_gets_its_own_init():
    state, session, model = _deferred("gpt2")
    assert session.strategy.uninitialised(session.unwrap(model)) == {}
    torch.manual_seed(0)
    eager = tm.build("gpt2").state_dict()
    residual = 0.02 / math.sqrt(2 * tm.gpt2_config().n_layer)  # GPT-2's scaled output projections
    stds = {}
    for key, value in state.items():
        if key.endswith(".weight") and value.dim() == 2:
            expected = residual if key.endswith("c_proj.weight") else 0.02
            stds[key] = round(value.std().item(), 4)
            assert _near(value.std().item(), expected), (key, value.std().item())
            assert _near(eager[key].std().item(), expected), key  # what an eager build has
        elif key.endswith(".bias"):
            assert torch.equal(value, torch.zeros_like(value)), key
        elif "ln_" in key:
            assert torch.equal(value, torch.ones_like(value)), key  # LayerNorm weights
    print(f"\ndeferred GPT-2 weight stds: {stds}")
    assert stds["transformer.wte.weight"] and "transformer.h.0.attn.c_attn.weight" in stds
    inner = session.unwrap(model)
    assert inner.lm_head.weight is inner.transformer.wte.weight
    session.close()


def test_llama_from_scratch_gets_its_own_init():
    state, session, model = _deferred("llama")
    assert session.strategy.uninitialised(session.unwrap(model)) == {}
    torch.manual_seed(0)
    eager = tm.build("llama")
    for key, value in state.items():
        if key.endswith("proj.weight") or key == "model.embed_tokens.weight":
            assert _near(value.std().item(), 0.02), (key, value.std().item())
        elif key.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), key  # RMSNorm: no reset_parameters of its own
    # The padding token's embedding is zero, as in an eager build: the output layer that shares it
    # did not write it again.
    assert torch.equal(state["model.embed_tokens.weight"][0], torch.zeros(32))
    inner = session.unwrap(model)
    assert torch.equal(inner.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)
    assert inner.lm_head.weight is inner.model.embed_tokens.weight
    session.close()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fsdp_starts_from_the_weights_of_single_and_keeps_the_tie(kind):
    reference, session, _ = _deferred(kind)
    session.close()
    for options in ({"min_params": 1000}, {"wrap": ["Embedding", "GPT2Block", "LlamaDecoderLayer"]}):
        got, session, model = _deferred(kind, "fsdp", fsdp=options)
        inner = session.unwrap(model)
        assert inner.get_output_embeddings().weight is inner.get_input_embeddings().weight  # one DTensor
        session.close()
        for key, value in reference.items():
            assert torch.equal(got[key], value), (options, key)


def test_gpt2_units_keep_what_one_init_writes_together():
    with empty_parameters():
        model = tm.build("gpt2")
    names = {id(m): n for n, m in model.named_modules()}
    groups = [[names[id(m)] for m in g] for g in shard_groups(model, [], 1000, "s")]
    # The tie's two holders in one group; each attention's output projection with its attention,
    # whose init re-initialises it.
    assert groups[0] == ["transformer.wte", "lm_head"]
    assert ["transformer.h.0.attn"] in groups and ["transformer.h.0.attn.c_proj"] not in groups
    assert count_shard_units(model, FSDPConfig(min_params=1000)).count == len(groups) + 1
    with pytest.raises(ConfigError, match=r"transformer.h.0.attn.c_proj \(Conv1D\) a shard unit, but its .* is "):
        shard_groups(model, ["Conv1D"], 1, "strategy.fsdp.wrap")
    torch.manual_seed(0)
    eager = tm.build("gpt2")
    shard_groups(eager, ["Conv1D"], 1, "strategy.fsdp.wrap")  # built for real, nothing is initialised at set-up


def test_gpt2_loads_its_own_save_pretrained_file_under_fsdp(tmp_path):
    path = tm.save_pretrained(str(tmp_path / "gpt2"))  # transformers keeps one name of the tied weight
    session = Session(
        Config(), strategy={"name": "fsdp", "fsdp": {"min_params": 1000}}, train={"progress": False, "metrics": False}
    )
    with session.init_module(initialize=False):
        model = tm.build("gpt2")
    model = session.setup(model)
    session.load_weights(path)
    state = session.model_state_dict(model)
    torch.manual_seed(7)
    saved = tm.build("gpt2").state_dict()
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    session.close()
