"""Deferred construction in one process: ``session.init_module()`` allocates no parameters,
``setup()`` materialises and initialises them the same way under every strategy, buffers built in
``__init__`` survive, and a module that cannot initialise itself is named before it runs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx import Config, Session
from phalanx.errors import PhalanxError
from phalanx.strategies.construction import empty_parameters, is_deferred
from tests.helpers.models import Scale, TiedLM

STRATEGIES = ["single", "ddp", "zero1", "fsdp", "model_parallel", "dp"]


class Rotary(nn.Module):
    """A buffer computed in __init__ (as rotary tables are), and no parameters."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("freqs", 1.0 / 10000 ** (torch.arange(0, width, 2).float() / width), persistent=False)

    def forward(self, x):
        return x * self.freqs.repeat(2)


def _model(extra: nn.Module | None = None) -> nn.Sequential:
    layers = [nn.Linear(8, 16), nn.LayerNorm(16), Rotary(16), nn.Linear(16, 4)]
    return nn.Sequential(*layers, *([extra] if extra is not None else []))


def _session(strategy: str, **train) -> Session:
    return Session(Config(), strategy=strategy, train={"progress": False, "metrics": False, "seed": 3, **train})


def test_parameters_go_to_meta_and_buffers_stay_as_built():
    with empty_parameters():
        model = _model()
    assert all(p.is_meta for p in model.parameters())
    assert model[2].freqs.device.type == "cpu" and model[2].freqs[0] == 1.0
    assert is_deferred(model)
    assert not nn.Linear(2, 2).weight.is_meta  # the block is over: construction is normal again


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_materialises_the_same_weights(strategy):
    session = _session(strategy)
    with session.init_module():
        model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = session.setup(model, optimizer)
    state = session.model_state_dict(model)
    reference = _reference_weights()
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(state[key], value), key
    with session.accumulate(model):  # the optimizer steers the materialised parameters
        session.backward(F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 4)))
    after = session.model_state_dict(model)
    assert not torch.equal(after["0.weight"], reference["0.weight"])
    session.close()


def _reference_weights() -> dict[str, torch.Tensor]:
    session = _session("single")
    with session.init_module():
        model = _model()
    model = session.setup(model)
    state = {k: v.clone() for k, v in session.model_state_dict(model).items()}
    session.close()
    return state


def test_initialisation_follows_the_seed_and_is_each_module_own():
    a, b = _reference_weights(), _reference_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # reset_parameters ran: LayerNorm's are ones and zeros, Linear's within its kaiming bound.
    assert torch.equal(a["1.weight"], torch.ones(16)) and torch.equal(a["1.bias"], torch.zeros(16))
    assert a["0.weight"].abs().max() <= 1 / math.sqrt(8) and a["0.weight"].std() > 0
    # Two modules of one class do not get the same values: the seed depends on the module's name.
    assert not torch.equal(a["0.bias"][:4], a["3.bias"])
    other = Session(Config(), strategy="single", train={"progress": False, "metrics": False, "seed": 4})
    with other.init_module():
        model = _model()
    model = other.setup(model)
    assert not torch.equal(other.model_state_dict(model)["0.weight"], a["0.weight"])
    other.close()


def test_buffers_and_norm_statistics_are_in_place_after_setup():
    session = _session("single")
    with session.init_module():
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), Rotary(6))
    model = session.setup(model)
    assert torch.equal(model[1].running_var, torch.ones(6)) and torch.equal(model[1].running_mean, torch.zeros(6))
    assert torch.allclose(model[2].freqs, 1.0 / 10000 ** (torch.arange(0, 6, 2).float() / 6))
    session.close()


def test_multihead_attention_is_initialised():
    session = _session("single")
    with session.init_module():
        model = nn.Sequential(nn.MultiheadAttention(8, 2))
    model = session.setup(model)
    attention = model[0]
    assert torch.equal(attention.in_proj_bias, torch.zeros(24)) and attention.in_proj_weight.std() > 0
    assert torch.equal(attention.out_proj.bias, torch.zeros(8))  # the parent's init ran after the child's
    session.close()


def test_a_tied_weight_stays_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x):
            return self.head(self.embed(x))

    session = _session("single")
    with session.init_module():
        model = Tied()
    model = session.setup(model)
    assert model.head.weight is model.embed.weight and not model.embed.weight.is_meta
    session.close()


def test_a_module_without_reset_parameters_is_named_until_weights_are_loaded():
    session = _session("single")
    with session.init_module():
        model = _model(Scale(4))
    model = session.setup(model)
    with pytest.raises(PhalanxError, match=r"Scale \(4\) hold parameters and have no reset_parameters\(\)"):
        model(torch.randn(2, 8))
    session.load_weights({**_reference_weights(), "4.gain": torch.full((4,), 2.0)})
    assert torch.equal(model[4].gain, torch.full((4,), 2.0))
    model(torch.randn(2, 8))  # loaded: it runs
    session.close()


def test_a_lazy_module_is_refused_in_one_line():
    with pytest.raises(PhalanxError, match="lazy module"):
        with empty_parameters():
            nn.LazyLinear(4)
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is undone after an error too


def test_the_memory_cap_refuses_a_whole_model_over_it_at_setup():
    # 16 MiB of weights built whole, under an 8 MiB cap: refused at setup(), naming the fix.
    session = _session("single", memory_cap="8MiB")
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    with pytest.raises(torch.OutOfMemoryError, match=r"set-up needs .* keeps the whole model on every rank: use fsdp"):
        session.setup(model)
    session.close()


def test_initialize_false_skips_the_init_and_refuses_a_forward_until_loaded():
    session = _session("single")
    with session.init_module(initialize=False):
        model = _model()
    model = session.setup(model)
    with pytest.raises(PhalanxError, match=r"initialize=False.*were not loaded"):
        model(torch.randn(2, 8))
    weights = _reference_weights()
    session.load_weights(weights)
    assert torch.equal(model[0].weight, weights["0.weight"])
    model(torch.randn(2, 8))
    session.close()


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_activation_checkpointing_does_not_change_the_initial_weights(strategy):
    session = Session(
        Config(),
        strategy={"name": strategy, "activation_checkpointing": ["Linear"]},
        train={"progress": False, "metrics": False, "seed": 3},
    )
    with session.init_module():
        model = _model()
    model = session.setup(model)
    state = session.model_state_dict(model)
    reference = _reference_weights()
    for key, value in reference.items():
        assert torch.equal(state[key], value), key
    session.close()


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_tied_weight_gets_the_same_init_under_every_strategy(strategy):
    def initial(name):
        session = _session(name)
        with session.init_module():
            model = TiedLM()
        model = session.setup(model)
        state = {k: v.clone() for k, v in session.model_state_dict(model).items()}
        model(torch.tensor([[1, 2]]))  # nothing left uninitialised
        session.close()
        return state

    ref, got = initial("single"), initial(strategy)
    for key in ref:
        assert torch.equal(got[key], ref[key]), key
    assert torch.equal(ref["head.weight"], ref["embed.weight"])


def test_a_parameter_keeps_its_class_and_attributes():
    class Flagged(nn.Parameter):
        pass

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = Flagged(torch.empty(3))
            self.w.no_decay = True

        def reset_parameters(self):
            nn.init.ones_(self.w)

    session = _session("single")
    with session.init_module():
        model = Holder()
    model = session.setup(model)
    assert type(model.w) is Flagged and model.w.no_decay and torch.equal(model.w, torch.ones(3))
    session.close()
