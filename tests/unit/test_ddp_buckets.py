"""strategy.ddp.first_bucket_cap_mb: a small first bucket (the gradients ready first), every later
bucket bucket_cap_mb, and the same training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phalanx import Config, Session


def _layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])  # 257 KiB of fp32 gradients each


def _train(**ddp) -> tuple[list[int], dict[str, torch.Tensor], str]:
    session = Session(
        Config(), strategy={"name": "ddp", "ddp": ddp}, train={"progress": False}, checkpoint={"resume": "never"}
    )
    model = _layers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = session.setup(model, optimizer)
    g = torch.Generator().manual_seed(1)
    # DDP lays its buckets out again, in the order gradients arrive, one step after its reducer is
    # built: step 3 under find_unused_parameters auto (the reducer is rebuilt after step 1).
    for _ in range(4):
        x = torch.randn(8, 256, generator=g)
        with session.accumulate(model):
            session.backward(F.mse_loss(model(x), x))
    sizes = [int(s) for s in model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", ")]
    state = {k: v.clone() for k, v in session.model_state_dict().items()}
    description = session.strategy.describe()
    session.close()
    return sizes, state, description


def test_small_first_bucket_then_bucket_cap():
    sizes, state, description = _train(bucket_cap_mb=1.0, first_bucket_cap_mb=0.3)
    layer = 256 * 256 * 4 + 256 * 4
    # A bucket closes once it reaches its cap: the first after 2 layers (> 0.3 MiB), the others after 5.
    assert sizes == [2 * layer, 4 * layer]
    assert description.endswith("(bucket 1 MiB, first 0.3 MiB)")
    plain_sizes, plain, _ = _train(bucket_cap_mb=1.0, first_bucket_cap_mb=1.0)
    assert plain_sizes == [4 * layer, 2 * layer]  # a first bucket as large as the rest
    assert all(torch.equal(state[k], plain[k]) for k in plain)  # buckets change the schedule, not the sums


def test_first_bucket_larger_than_the_others_is_refused():
    with pytest.raises(
        ValueError, match=r"strategy.ddp.first_bucket_cap_mb \(30\) is larger than bucket_cap_mb \(25\)"
    ):
        Config(strategy={"ddp": {"first_bucket_cap_mb": 30}})


def test_the_default_is_ddps_own_first_bucket():
    """null: DDP's own 1 MiB first bucket, which DDP drops once a bucket size is given (phalanx
    always gives one); one bucket of every gradient would make the all-reduce wait for the whole
    backward."""
    sizes, _, description = _train()
    layer = 256 * 256 * 4 + 256 * 4
    assert sizes == [4 * layer, 2 * layer]  # closed at 1 MiB, then the rest under 25 MiB
    assert description.endswith("(bucket 25 MiB, first 1 MiB)")
    small, _, description = _train(bucket_cap_mb=0.5)  # a bucket size below 1 MiB: every bucket alike
    assert small == [2 * layer, 2 * layer, 2 * layer] and description.endswith("(bucket 0.5 MiB)")
