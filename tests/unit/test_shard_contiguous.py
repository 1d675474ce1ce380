"""session.shard() hands back contiguous tensors at every world size: a share along dim 1 is a
strided view from 2 processes on, and nanoGPT-style get_batch calls .view(-1) on what it gets."""

from __future__ import annotations

import pytest
import torch

from phalanx.config.batch import plan_batch
from phalanx.runtime.shares import shard_tensors


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("plan", [None, plan_batch(2, 8, 2)])
def test_a_share_along_dim_1_is_contiguous_and_views_flat(world_size, plan):
    data = torch.arange(3 * 16).view(3, 16)  # [time, columns], a batchified stream
    for rank in range(world_size):
        mine = shard_tensors([data], dim=1, rank=rank, world_size=world_size, plan=plan, micro_steps=False)
        assert mine.is_contiguous()
        block = 16 if plan is None else plan.global_batch_size
        steps = 1 if plan is None else plan.accumulation_steps
        micro = block // (world_size * steps)
        # This rank's columns of each global batch, micro-step after micro-step (docs/data.md).
        starts = [b + (m * world_size + rank) * micro for b in range(0, 16, block) for m in range(steps)]
        assert torch.equal(mine.view(-1), torch.cat([data[:, s : s + micro] for s in starts], dim=1).reshape(-1))


def test_every_micro_step_piece_is_contiguous():
    plan = plan_batch(2, 8, 2)
    columns = torch.arange(24).view(3, 8)
    for rank in range(2):
        pieces = shard_tensors([columns, -columns], dim=1, rank=rank, world_size=2, plan=plan, micro_steps=True)
        for x, y in pieces:
            assert x.is_contiguous() and y.is_contiguous()
            assert torch.equal(x.view(-1), -y.view(-1))


def test_a_share_that_is_already_contiguous_is_not_copied():
    x = torch.arange(16)
    mine = shard_tensors([x], dim=0, rank=1, world_size=2, plan=None, micro_steps=False)
    assert mine.data_ptr() == x[8:].data_ptr()  # a view, as before
