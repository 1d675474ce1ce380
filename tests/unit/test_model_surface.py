"""What setup() returns keeps the user's model's surface in one process, under every strategy:
methods, attributes and submodules are the user's, state_dict() has the user's keys, and model(x)
still goes through the strategy's wrapper."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx import Config, PhalanxError, Session
from tests.helpers.surface import Tagger, probe, reference_steps
from tests.helpers.training import rel_diff

# Each runs alone here (ddp, fsdp and pipeline on a process group of one).
STRATEGIES = ["single", "dp", "ddp", "zero1", "fsdp", "model_parallel", "pipeline"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_keeps_the_models_surface(strategy):
    out = probe(strategy)
    assert out["hidden"] == ((3, 32), True)  # init_hidden on the session's device
    assert out["hidden_size"] == 32 and out["encoder_is_users"]
    assert out["set_on_user"] == (2.0, 16, 16)  # attributes set on it are set on the user's module
    assert out["state_keys"] == out["user_keys"]  # no module. / _orig_mod. / wrapper prefix
    assert out["loaded"] is True  # load_state_dict takes the user's keys
    assert out["isinstance"]["module"]
    assert out["wrapper_calls"] == 2 and out["steps"] == 2
    ref = reference_steps(16, 2)
    assert list(out["state"]) == list(ref) and rel_diff(out["state"], ref) < 1e-5
    # The returned object is the user's own module where the strategy does not wrap it; unwrap()
    # gives the user's module except under pipeline (this process's stage).
    assert out["isinstance"]["user_class"] == (strategy in ("single", "fsdp", "model_parallel"))
    assert out["unwrap_is_user"] == (strategy != "pipeline")


@pytest.mark.parametrize("strategy", ["single", "dp", "model_parallel", "fsdp"])
def test_methods_that_call_the_model_run_where_nothing_is_lost(strategy):
    out = probe(strategy)
    assert out["predict_no_grad"] == out["predict_training"] == (4,)


def test_under_ddp_a_method_calling_the_model_needs_no_grad():
    out = probe("ddp")
    assert out["predict_no_grad"] == (4,)
    assert out["predict_training"].startswith("model.predict() runs the model's layers itself")
    assert "skip the strategy's all-reduce" in out["predict_training"] and "torch.no_grad()" in out["predict_training"]


def test_under_pipeline_a_method_calling_the_model_is_refused():
    out = probe("pipeline")
    for key in ("predict_no_grad", "predict_training"):
        assert "each process holds and trains only its own stage's layers" in out[key]
        assert "model(...)" in out[key]


def _ddp():
    session = Session(Config(), strategy="ddp", train={"progress": False})
    bare = Tagger()
    return session, bare, session.setup(bare)


def test_ddp_stays_a_ddp_whose_own_attributes_win():
    session, bare, model = _ddp()
    try:
        assert isinstance(model, DistributedDataParallel) and type(model).__name__ == "DistributedDataParallel"
        assert model.module is bare  # the wrapper's own attribute
        assert session.unwrap(model) is bare
        assert [n for n, _ in model.named_parameters()][0] == "module.encoder.weight"  # the wrapper's view
        model._scratch = 1  # a private name neither has stays on the wrapper (torch sets such lazily)
        assert "_scratch" in vars(model) and not hasattr(bare, "_scratch")
        model.label = "x"
        del model.label  # deleting reaches the user's module too
        assert not hasattr(bare, "label")
        with pytest.raises(AttributeError, match="Tagger"):
            model.no_such_thing
        # The unused-parameter watch, no_sync and the checkpoint helpers see the same object.
        assert session.strategy.model_state_dict(model).keys() == bare.state_dict().keys()
        with session.strategy.no_sync(model):
            pass
    finally:
        session.close()


def test_a_user_compiled_model_keeps_its_surface():
    session = Session(Config(), strategy="ddp", train={"progress": False})
    bare = Tagger()
    model = session.setup(torch.compile(bare))
    try:
        assert getattr(model, "_compiled_call_impl", None) is not None  # compiled again, in place
        assert model.init_hidden(2).shape == (2, 32)
        assert list(model.state_dict()) == list(Tagger().state_dict())  # no _orig_mod.
        y = model(torch.randn(4, 8))
        session.backward(y.sum())
        session.step()
    finally:
        session.close()


def test_the_surface_copies_and_pickles():
    session = Session(Config(), strategy="dp", train={"progress": False})
    model = session.setup(Tagger())
    model.temperature = 3.0
    try:
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert isinstance(clone, nn.DataParallel) and clone.temperature == 3.0
            assert clone.init_hidden(1).shape == (1, 32) and clone.encoder is clone.module.encoder
            assert list(clone.state_dict()) == list(Tagger().state_dict())
    finally:
        session.close()


def test_a_method_that_computes_no_layer_is_never_refused():
    session, bare, model = _ddp()
    try:
        assert model.init_hidden(2).requires_grad is False  # under ddp, in training mode, gradients on
        with torch.no_grad():
            model.predict(torch.randn(2, 8))
        with pytest.raises(PhalanxError, match="outside the strategy's wrapper"):
            model.predict(torch.randn(2, 8))
        assert not any(m._forward_pre_hooks for m in bare.modules())  # the watch leaves nothing behind
    finally:
        session.close()
