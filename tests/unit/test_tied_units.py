"""Tied weights under fsdp, without transformers: a weight shared by two modules is sharded in one
unit (``fully_shard([embed, head])``), found automatically and for ``strategy.fsdp.wrap`` lists;
a listed class that would split one (or, under deferred construction, a unit an initialiser
outside it writes into) is refused in one line; ``phalanx plan`` counts the same units; a
1-process fsdp run keeps the tie, eager or deferred."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx import Config, Session
from phalanx.errors import ConfigError
from phalanx.plan import count_shard_units
from phalanx.strategies.construction import empty_parameters
from phalanx.strategies.fsdp import FSDPConfig, shard_units
from phalanx.strategies.fsdp_units import shard_groups
from tests.helpers.tied_models import TinyTied


def _names(model: nn.Module, groups: list[list[nn.Module]]) -> list[list[str]]:
    names = {id(m): name for name, m in model.named_modules()}
    return [[names[id(m)] for m in group] for group in groups]


def test_automatic_wrapping_shards_a_tied_weight_with_every_holder():
    model = TinyTied()
    groups = _names(model, shard_groups(model, [], 1000, "strategy.fsdp.wrap"))
    # The embedding (4,096 parameters) takes the output layer that shares its weight; each block's
    # Linear (1,056) is a unit of its own; the norm (64) stays with the model.
    assert groups == [["embed", "head"], ["blocks.0.0"], ["blocks.1.0"]]
    # plan counts what training shards: three groups and the model itself.
    units = count_shard_units(model, FSDPConfig(min_params=1000))
    assert units.count == 4 and units.largest_name == "embed" and units.largest == 128 * 32
    assert [type(m).__name__ for m in shard_units(model, FSDPConfig(min_params=1000))] == [
        "Embedding",
        "Linear",
        "Linear",
    ]


def test_a_listed_class_brings_the_modules_sharing_its_weight():
    model = TinyTied()
    assert _names(model, shard_groups(model, ["Embedding"], 1, "strategy.fsdp.wrap")) == [["embed", "head"]]
    # Listing the other holder too changes nothing: it is in the group already.
    groups = [["embed", "head"], ["blocks.0.0"], ["blocks.1.0"]]
    assert _names(model, shard_groups(model, ["Embedding", "Linear"], 1, "s")) == groups


class Enclosing(nn.Module):
    """The model itself holds a weight of one of its layers (as a scale table might be shared)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(64, 64)
        self.outer = nn.Linear(64, 64)
        self.shared = self.inner.weight

    def forward(self, x):
        return self.outer(self.inner(x)) @ self.shared


def test_a_tie_with_an_enclosing_module_cannot_be_a_unit():
    model = Enclosing()
    # Automatically: inner is left to the model, which holds both uses; outer is a unit.
    assert _names(model, shard_groups(model, [], 1000, "s")) == [["outer"]]
    with pytest.raises(ConfigError) as err:
        shard_groups(model, ["Linear"], 1, "strategy.fsdp.wrap")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("strategy.fsdp.wrap makes inner (Linear) a shard unit, but its inner.weight is also")
    assert "shared, held by the model (Enclosing), which contains the unit" in message
    assert "take Linear out of the list, or list a class that holds every use of the weight" in message


def _attention() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.MultiheadAttention(16, 2))


def test_under_deferred_construction_a_unit_holds_what_initialisers_write_into_it():
    # MultiheadAttention's own init zeroes its out_proj's bias: a parameter of a child. Built for
    # real, nothing is initialised at set-up and out_proj may be a unit; deferred, it may not.
    eager = _attention()
    assert _names(eager, shard_groups(eager, [], 200, "s")) == [["0"], ["1.out_proj"], ["1"]]
    with empty_parameters():
        deferred = _attention()
    assert _names(deferred, shard_groups(deferred, [], 200, "s")) == [["0"], ["1"]]
    assert _names(deferred, shard_groups(deferred, ["MultiheadAttention"], 1, "s")) == [["1"]]
    with pytest.raises(ConfigError, match=r"^s makes 1.out_proj \(NonDynamicallyQuantizableLinear\) a shard unit, "):
        shard_groups(deferred, ["NonDynamicallyQuantizableLinear"], 1, "s")
    with pytest.raises(ConfigError, match=r"initialised by 1 \(MultiheadAttention\), outside it, which under "):
        shard_groups(deferred, ["NonDynamicallyQuantizableLinear"], 1, "s")
    assert [type(p.data) for p in deferred.parameters()] and all(p.is_meta for p in deferred.parameters())


def _session(strategy: str, **fsdp) -> Session:
    settings = {"name": strategy, "fsdp": fsdp} if fsdp else {"name": strategy}
    return Session(Config(), strategy=settings, train={"progress": False, "metrics": False, "seed": 3})


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
def test_one_process_fsdp_keeps_the_tie_and_trains(deferred):
    def run(strategy: str, **fsdp) -> tuple[bool, dict, dict]:
        session = _session(strategy, **fsdp)
        if deferred:
            with session.init_module():
                model = TinyTied()
        else:
            torch.manual_seed(0)
            model = TinyTied()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer = session.setup(model, optimizer)
        inner = session.unwrap(model)
        start = {k: v.clone() for k, v in session.model_state_dict(model).items()}
        ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            with session.accumulate(model):
                session.backward(F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()))
        tied = inner.head.weight is inner.embed.weight
        state = {k: v.clone() for k, v in session.model_state_dict(model).items()}
        session.close()
        return tied, start, state

    _, start, reference = run("single")
    for options in ({"min_params": 1000}, {"wrap": ["Embedding", "Linear"]}):
        tied, got_start, got = run("fsdp", **options)
        assert tied  # one sharded parameter, registered under both names
        for key in reference:
            assert torch.equal(got_start[key], start[key]), key
            assert torch.allclose(got[key], reference[key], rtol=1e-5, atol=1e-7), key


def test_automatic_wrapping_never_makes_a_container_without_forward_a_unit():
    # The demo GPT's blocks share a ModuleList whose attention and norms, unclaimed by the MLP
    # units, add up past min_params: fully_shard refuses a ModuleList, so the model takes them.
    from phalanx.demo.gpt import TinyGPT

    model = TinyGPT()
    groups = shard_groups(model, [], 100_000, "strategy.fsdp.wrap")
    assert groups and all(type(m).forward is not nn.Module.forward for group in groups for m in group)
    assert model.blocks not in [m for group in groups for m in group]
