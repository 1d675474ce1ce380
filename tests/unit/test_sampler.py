"""The sharded sampler: the union over ranks of every optimizer step is the same set of samples
whatever the number of processes. Pure logic."""

from __future__ import annotations

import pytest

from phalanx.errors import PhalanxError
from phalanx.runtime.data import ShardedSampler


def global_steps(n, world, micro, accumulation, *, shuffle=True, epoch=0, drop_last=False):
    """For each optimizer step, the sorted sample indices that all ranks together consume."""
    global_bs = micro * accumulation * world
    per_rank = []
    for rank in range(world):
        s = ShardedSampler(
            n, rank, world, shuffle=shuffle, seed=3, multiple_of=global_bs, drop_last=drop_last, chunk=micro
        )
        s.set_epoch(epoch)
        per_rank.append(list(s))
    steps = len(per_rank[0]) // (micro * accumulation)
    take = micro * accumulation
    return [sorted(i for r in range(world) for i in per_rank[r][k * take : (k + 1) * take]) for k in range(steps)]


@pytest.mark.parametrize("n", [96, 100, 37])
def test_world_size_does_not_change_the_global_batches(n):
    one = global_steps(n, world=1, micro=16, accumulation=1)
    two = global_steps(n, world=2, micro=8, accumulation=1)
    four_acc = global_steps(n, world=4, micro=2, accumulation=2)
    assert one == two == four_acc


def test_every_sample_seen_and_steps_full():
    steps = global_steps(100, world=2, micro=8, accumulation=2)
    assert all(len(s) == 32 for s in steps)
    assert set().union(*map(set, steps)) == set(range(100))


def test_drop_last_cuts_the_partial_global_batch():
    steps = global_steps(100, world=2, micro=8, accumulation=2, drop_last=True)
    assert len(steps) == 3 and all(len(s) == 32 for s in steps)


def test_epochs_reshuffle_deterministically():
    assert global_steps(64, 2, 8, 1, epoch=0) != global_steps(64, 2, 8, 1, epoch=1)
    assert global_steps(64, 2, 8, 1, epoch=1) == global_steps(64, 2, 8, 1, epoch=1)


def test_evaluation_padding_gives_equal_lengths():
    lengths = [len(ShardedSampler(10, r, 4, shuffle=False, seed=0, multiple_of=4)) for r in range(4)]
    assert lengths == [3, 3, 3, 3]
    assert list(ShardedSampler(10, 1, 4, shuffle=False, seed=0, multiple_of=4)) == [1, 5, 9]
    assert list(ShardedSampler(10, 3, 4, shuffle=False, seed=0, multiple_of=4)) == [3, 7, 1]  # 11 -> padded with 1


def test_bad_datasets():
    with pytest.raises(PhalanxError, match="empty"):
        ShardedSampler(0, 0, 1, shuffle=False, seed=0, multiple_of=1)
    with pytest.raises(PhalanxError, match="fewer than one global batch"):
        ShardedSampler(10, 0, 1, shuffle=False, seed=0, multiple_of=16, drop_last=True)
