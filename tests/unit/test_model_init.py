"""A model's own initialisation under deferred construction, without transformers: a model with a
per-module ``_init_weights`` and a ``config`` (Hugging Face's convention, duck-typed) gets it on
every module as it is materialised, after the modules' ``reset_parameters()``, the same under
every strategy; a model-level ``init_weights()`` (torchtitan's) runs where the whole model is
materialised and is refused, in one line, where it is not."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from phalanx import Config, Session
from phalanx.errors import PhalanxError
from phalanx.strategies.construction import empty_parameters
from phalanx.strategies.fsdp_units import shard_groups
from phalanx.strategies.model_init import ModelInit, init_writes

WHOLE = ["single", "ddp", "zero1", "dp", "model_parallel"]


class Gain(nn.Module):
    """A parameter and no reset_parameters(): only a model-level init gives it a value."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(width))

    def forward(self, x):
        return x * self.gain


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.gain = Gain(width)

    def forward(self, x):
        return self.gain(self.proj(torch.tanh(self.inner(x))))


class Settings:
    initializer_range = 0.02


class Pretrained(nn.Module):
    """Hugging Face's shape: a config, and _init_weights(module) applied to every module."""

    def __init__(self, width: int = 32, std: float = 0.02):
        super().__init__()
        self.config = Settings()
        self.std = std
        self.embed = nn.Embedding(64, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, 64, bias=False)
        self.head.weight = self.embed.weight

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Gain):
            nn.init.ones_(module.gain)
        elif isinstance(module, Block):  # a parent re-initialising a child, as GPT-2's attention does
            nn.init.normal_(module.proj.weight, std=self.std / math.sqrt(8))

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class Composite(nn.Module):
    """A plain model around a pretrained one, which dispatches its own init to its own modules."""

    def __init__(self):
        super().__init__()
        self.lm = Pretrained(std=0.05)
        self.extra = nn.Linear(32, 32)

    def forward(self, ids):
        return self.lm(ids)


def _session(strategy: str, **strategy_options) -> Session:
    return Session(
        Config(),
        strategy={"name": strategy, **strategy_options},
        train={"progress": False, "metrics": False, "seed": 5},
    )


def _initial(strategy: str, build, **options) -> tuple[dict[str, torch.Tensor], Session, nn.Module]:
    session = _session(strategy, **options)
    with session.init_module():
        model = build()
    model = session.setup(model)
    return {k: v.clone() for k, v in session.model_state_dict(model).items()}, session, model


def test_the_model_own_per_module_init_wins_over_reset_parameters():
    state, session, model = _initial("single", Pretrained)
    assert session.strategy.uninitialised(session.unwrap(model)) == {}
    for key in ("embed.weight", "blocks.0.inner.weight", "blocks.1.inner.weight"):
        assert abs(state[key].std().item() - 0.02) < 0.002, key  # not nn.Linear's kaiming bound, not N(0, 1)
    # The parent's init ran after its child's: the projection has the smaller std.
    assert abs(state["blocks.0.proj.weight"].std().item() - 0.02 / math.sqrt(8)) < 0.001
    assert torch.equal(state["blocks.0.inner.bias"], torch.zeros(32))
    assert torch.equal(state["blocks.0.gain.gain"], torch.ones(32))  # no reset_parameters(): the model's init
    inner = session.unwrap(model)
    assert inner.head.weight is inner.embed.weight
    model(torch.tensor([[1, 2, 3]]))  # nothing left uninitialised: it runs
    session.close()


def test_a_tied_weight_is_initialised_by_its_first_holder_only():
    # The head's Linear init would write the embedding's weight too; in an eager build the tie is
    # made after both, so the value is the embedding's. Here too: as if there were no head.
    state, session, _ = _initial("single", Pretrained)
    session.close()
    other, session, _ = _initial("single", lambda: _without_head(Pretrained()))
    session.close()
    assert torch.equal(state["embed.weight"], other["embed.weight"])


def _without_head(model: Pretrained) -> Pretrained:
    model.head = nn.Identity()
    return model


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "dp", "model_parallel", "fsdp"])
def test_the_model_own_init_gives_the_same_weights_under_every_strategy(strategy):
    reference, session, _ = _initial("single", Pretrained)
    session.close()
    options = {"fsdp": {"min_params": 500}} if strategy == "fsdp" else {}
    got, session, model = _initial(strategy, Pretrained, **options)
    session.close()
    assert got.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(got[key], value), key


def test_a_nested_pretrained_model_initialises_its_own_modules():
    state, session, _ = _initial("single", Composite)
    session.close()
    assert abs(state["lm.blocks.0.inner.weight"].std().item() - 0.05) < 0.005  # lm's std
    bound = 1 / math.sqrt(32)  # the plain module outside it keeps torch's default
    assert state["extra.weight"].abs().max() <= bound and state["extra.weight"].std() > 0.1 * bound


def test_what_the_model_own_init_does_not_cover_is_refused_until_loaded():
    class Partial(Pretrained):
        def _init_weights(self, module):
            if not isinstance(module, Gain):
                super()._init_weights(module)

    _, session, model = _initial("single", Partial)
    with pytest.raises(PhalanxError, match=r"Gain \(blocks\.0\.gain, blocks\.1\.gain\) hold parameters and have no"):
        model(torch.tensor([[1, 2]]))
    session.close()


def test_init_writes_finds_a_parent_writing_into_a_child():
    with empty_parameters():
        model = Pretrained()
    writes = init_writes(model)
    names = {id(m): n for n, m in model.named_modules()}
    proj = model.blocks[0].proj.weight
    assert sorted(names[m] for m in writes[id(proj)]) == ["blocks.0", "blocks.0.proj"]
    assert sorted(names[m] for m in writes[id(model.embed.weight)]) == ["embed", "head"]
    assert all(p.is_meta for p in model.parameters())  # a dry run on meta: nothing was allocated
    # So under fsdp, proj is never a unit apart from its block.
    groups = [[names[id(m)] for m in g] for g in shard_groups(model, [], 500, "s")]
    assert ["blocks.0.proj"] not in groups and ["blocks.0"] in groups and ["embed", "head"] in groups


class Titan(nn.Module):
    """torchtitan's convention: init_weights() on the model initialises everything."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.norm = Gain(16)
        self.register_buffer("freqs", torch.arange(4.0))

    def init_weights(self, buffer_device: torch.device | None = None):
        for layer in self.layers:
            nn.init.trunc_normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)
        nn.init.ones_(self.norm.gain)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class SequentialTitan(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(16, 16), Gain(16))

    def init_weights(self):
        nn.init.ones_(self[1].gain)


@pytest.mark.parametrize("strategy", WHOLE)
def test_a_model_level_init_weights_runs_where_the_whole_model_is_materialised(strategy):
    state, session, model = _initial(strategy, Titan)
    assert abs(state["layers.0.weight"].std().item() - 0.02) < 0.003
    assert torch.equal(state["norm.gain"], torch.ones(16)) and torch.equal(state["freqs"], torch.arange(4.0))
    model(torch.randn(2, 16))  # nothing left uninitialised
    session.close()
    reference, session, _ = _initial("single", Titan)
    session.close()
    assert all(torch.equal(state[k], reference[k]) for k in reference)


@pytest.mark.parametrize(
    ("strategy", "build", "how"),
    [("fsdp", Titan, "one shard unit at a time"), ("pipeline", SequentialTitan, "in parts, each rank its own")],
)
def test_a_model_level_init_weights_is_refused_where_the_model_is_materialised_in_parts(strategy, build, how):
    session = _session(strategy)
    with session.init_module():
        model = build()
    with pytest.raises(PhalanxError) as err:
        session.setup(model)
    session.close()
    name = type(model).__name__
    assert str(err.value).startswith(
        f"strategy {strategy} materialises the model {how}, so {name}.init_weights(), which initialises the whole model"
    )
    assert "init_module(initialize=False) and load its weights" in str(err.value) and "\n" not in str(err.value)


def test_a_model_level_init_weights_is_not_refused_when_nothing_is_to_initialise():
    session = _session("fsdp")
    with session.init_module(initialize=False):  # weights loaded next
        model = Titan()
    model = session.setup(model)
    session.close()
    session = _session("fsdp")
    torch.manual_seed(0)
    model = session.setup(Titan())  # built for real: nothing to initialise
    session.close()


def test_which_convention_wins():
    assert ModelInit(Titan()).whole is not None
    # A Hugging Face model has an init_weights() too: its per-module _init_weights is what counts.
    pretrained = Pretrained()
    pretrained.init_weights = lambda: None
    assert ModelInit(pretrained).whole is None
    assert ModelInit(nn.Linear(2, 2)).whole is None  # neither: each module's reset_parameters()
