"""DDP gradient compression hooks on 2 gloo processes: close to uncompressed training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import phalanx
from tests.helpers.models import make_data, make_model
from tests.helpers.training import reference, rel_diff, train

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180


def _loss(state: dict, n: int) -> float:
    model = make_model()
    model.load_state_dict(state)
    x, y = make_data(n).tensors
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def test_fp16_compression_stays_close_to_uncompressed():
    strategy = {"name": "ddp", "ddp": {"comm_hook": "fp16"}}
    out = phalanx.spawn(train, nprocs=2, args=(strategy, 16, 4, 6), cpu=True, timeout=TIMEOUT)[0]
    ref = reference(16, 6)
    # fp16 keeps ~3 decimal digits of each summed gradient: close, but not the fp32 result.
    assert 0 < rel_diff(out["state"], ref) < 5e-3


def test_powersgd_with_error_feedback_converges():
    steps = 40
    plain = phalanx.spawn(train, nprocs=2, args=("ddp", 16, 8, steps), cpu=True, timeout=TIMEOUT)[0]
    strategy = {"name": "ddp", "ddp": {"comm_hook": "powersgd", "powersgd_rank": 1, "powersgd_start_step": 2}}
    compressed = phalanx.spawn(train, nprocs=2, args=(strategy, 16, 8, steps), cpu=True, timeout=TIMEOUT)[0]
    start = _loss(make_model().state_dict(), 16 * steps)
    assert _loss(compressed["state"], 16 * steps) < 0.75 * start
    assert _loss(compressed["state"], 16 * steps) < 1.5 * _loss(plain["state"], 16 * steps)
