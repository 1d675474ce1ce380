"""Saving and copying the model setup() returned: torch.save(model, f) works where the model loads
without the run (single, dp), and refuses in one line naming session.unwrap(model) where it cannot
(ddp: a process group); copy.deepcopy works under every one, and keeps the copy's own weights."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from phalanx import Config, PhalanxError, Session


class Probe(nn.Module):
    """Remembers whether its last forward ran under autocast."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 2)
        self.autocast_seen: bool | None = None

    def forward(self, x):
        self.autocast_seen = torch.is_autocast_enabled("cpu")
        return self.layer(x)


def _session(strategy, precision):
    return Session(Config(), strategy=strategy, precision=precision, train={"progress": False})


def _saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_under_single_torch_save_of_the_model_loads_back_as_the_users_model(precision):
    session = _session("single", precision)
    try:
        model = session.setup(Probe())
        loaded = _saved_and_loaded(model)
        x = torch.randn(4, 3)
        assert type(loaded) is Probe
        # The loaded model runs as written: the Session's autocast is not part of what was saved.
        out = loaded(x)
        assert loaded.autocast_seen is False and torch.equal(out, session.unwrap(model).layer(x))
        model(x)
        assert model.autocast_seen is (precision != "fp32")  # the live model keeps it
    finally:
        session.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_under_ddp_torch_save_of_the_wrapper_names_unwrap_in_one_line(precision):
    session = _session("ddp", precision)
    try:
        model = session.setup(Probe())
        with pytest.raises(PhalanxError) as caught:
            torch.save(model, io.BytesIO())
        message = str(caught.value)
        assert "\n" not in message and "DistributedDataParallel" in message
        assert "torch.save(session.unwrap(model), f)" in message and "session.model_state_dict()" in message
        loaded = _saved_and_loaded(session.unwrap(model))  # the fix it names works
        assert type(loaded) is Probe and torch.equal(loaded.layer.weight, session.unwrap(model).layer.weight)
    finally:
        session.close()


@pytest.mark.parametrize("strategy, precision", [("single", "bf16"), ("dp", "bf16"), ("ddp", "bf16"), ("ddp", "fp32")])
def test_deepcopy_runs_the_copys_own_weights_under_the_same_autocast(strategy, precision):
    session = _session(strategy, precision)
    try:
        model = session.setup(Probe())
        clone = copy.deepcopy(model)
        with torch.no_grad():
            for p in session.unwrap(clone).parameters():
                p.zero_()
        out = clone(torch.ones(1, 3))
        assert torch.equal(out, torch.zeros(1, 2)), "the copy ran the original's weights"
        assert session.unwrap(clone).autocast_seen is (precision != "fp32")
        assert session.unwrap(model).layer.weight.abs().sum() > 0
    finally:
        session.close()
