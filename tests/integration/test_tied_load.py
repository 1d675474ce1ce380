"""session.load_weights on 2 gloo processes from a source that holds both names of a tied weight:
different values are one refusal on every rank (rank 0 decides, nobody waits in a broadcast),
equal values load everywhere. Under pipeline the tie sits on stage 1, so rank 0, which reads the
source, holds only placeholders of it and must still see the two names as one tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.errors import PhalanxError

pytestmark = pytest.mark.multiprocess
TIMEOUT = 120


class Twin(nn.Module):
    """Two layers that share one weight (a tie inside one pipeline unit)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Twin())  # pipeline: stage 0 the Linear, stage 1 the Twin


def _weights(differ: bool) -> dict[str, torch.Tensor]:
    weights = {k: torch.full_like(v, i + 1.0) for i, (k, v) in enumerate(_model().state_dict().items())}
    weights["1.b.weight"] = weights["1.a.weight"] + (1.0 if differ else 0.0)
    return weights


def load(strategy: str, differ: bool) -> dict:
    session = phalanx.Session(phalanx.Config(), strategy=strategy, train={"progress": False, "metrics": False})
    model = session.setup(_model())
    try:
        # Only rank 0's source is read: the others pass an empty one.
        session.load_weights(_weights(differ) if session.rank == 0 else {})
        return {"state": session.model_state_dict(model)}
    except PhalanxError as err:
        return {"refused": str(err)}
    finally:
        session.close()


@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_two_ranks_refuse_a_tie_given_twice_with_different_values(strategy):
    out = phalanx.spawn(load, nprocs=2, args=(strategy, True), cpu=True, timeout=TIMEOUT)
    assert [o.get("refused", "") for o in out] == [
        "the state dict holds 1.a.weight and 1.b.weight with different values, but the model ties them "
        "(one tensor); build the model untied (for a Hugging Face model, tie_word_embeddings=False) "
        "or load weights that hold only one of them"
    ] * 2


@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_two_ranks_load_a_tie_given_twice_with_equal_values(strategy):
    out = phalanx.spawn(load, nprocs=2, args=(strategy, False), cpu=True, timeout=TIMEOUT)
    assert "refused" not in out[0] and "refused" not in out[1], out
    expected = _weights(False)
    state = out[0]["state"]  # the full model on rank 0, gathered from both stages under pipeline
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], v) for k, v in expected.items())
