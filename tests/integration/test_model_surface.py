"""What setup() returns keeps the user's model's surface on 2 gloo processes: methods, attributes,
submodules and state-dict keys are the user's, and training still matches one plain process."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers.surface import probe, reference_steps
from tests.helpers.training import rel_diff

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180

STRATEGIES = {
    "ddp": "ddp",
    "zero1": "zero1",
    "fsdp": "fsdp",
    "pipeline": {"name": "pipeline", "pipeline": {"split_points": ["body"]}},
}


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("strategy", STRATEGIES.values(), ids=STRATEGIES.keys())
def test_the_model_keeps_its_surface_on_two_processes(strategy):
    ranks = phalanx.spawn(probe, nprocs=2, args=(strategy,), cpu=True, timeout=TIMEOUT)
    pipeline = isinstance(strategy, dict)
    for out in ranks:
        assert out["world"] == 2
        assert out["hidden"] == ((3, 32), True)  # model.init_hidden(bsz), on this process's device
        assert out["hidden_size"] == 32 and out["encoder_is_users"]
        assert out["set_on_user"] == (2.0, 16, 16)
        assert out["isinstance"]["module"]
        assert out["wrapper_calls"] == 2 and out["steps"] == 2  # model(x) went through the strategy
        if pipeline:  # each stage's entries, under the user's names
            assert set(out["state_keys"]) < set(out["user_keys"])
        else:
            assert out["state_keys"] == out["user_keys"]
    if pipeline:
        assert sorted(ranks[0]["state_keys"] + ranks[1]["state_keys"]) == sorted(ranks[0]["user_keys"])
        assert ranks[0]["state_keys"] == ["encoder.weight", "encoder.bias"]
    assert ranks[0]["loaded"] is True
    ref = reference_steps(16, 2)
    assert list(ranks[0]["state"]) == list(ref)
    assert rel_diff(ranks[0]["state"], ref) < 1e-5  # gradients were synchronised: the plain loop's weights
    if strategy in ("ddp", "zero1"):
        assert ranks[0]["predict_no_grad"] == ranks[1]["predict_no_grad"] == (4,)
        assert "skip the strategy's all-reduce" in ranks[0]["predict_training"]
        assert rel_diff(ranks[1]["own_state"], ref) < 1e-5  # model.state_dict(): the same full weights
    if pipeline:
        assert "its own stage's layers" in ranks[0]["predict_no_grad"]
    if strategy == "fsdp":
        assert ranks[0]["predict_training"] == (4,)  # the returned model is the user's own, sharded in place
