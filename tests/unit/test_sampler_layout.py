"""The layout of a training global batch (docs/data.md#the-layout-of-a-global-batch), over any
dataset length, process count W, micro batch m, accumulation k and resume position: global batch b
is k micro-step blocks of W*m positions, rank r's micro-step j the r-th share of m of block j. So a
micro-step of W processes is one process's micro-step of W*m (SyncBatchNorm sees the same samples),
and each process's micro-batch is one process's micro-batch of m with W*k accumulation steps
(BatchNorm that is not synced does too). Pure logic."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.runtime.data import ShardedSampler

SEED = 5


def sampler(n: int, rank: int, world: int, micro: int, accumulation: int, **kw) -> ShardedSampler:
    return ShardedSampler(n, rank, world, seed=SEED, multiple_of=world * micro * accumulation, chunk=micro, **kw)


def micro_batches(order: list[int], micro: int) -> list[list[int]]:
    """What a DataLoader with ``batch_size=micro`` makes of a rank's sampler."""
    return [order[i : i + micro] for i in range(0, len(order), micro)]


def ranks(n: int, world: int, micro: int, accumulation: int, start: int = 0, **kw) -> list[list[int]]:
    out = []
    for rank in range(world):
        s = sampler(n, rank, world, micro, accumulation, **kw)
        s.start = start
        got = list(s)
        assert len(got) == (s.global_len - start) // world  # len() is what it yields
        out.append(got)
    return out


layouts = st.tuples(
    st.integers(1, 120),  # dataset length
    st.integers(1, 4),  # processes
    st.integers(1, 5),  # micro batch
    st.integers(1, 3),  # accumulation steps
    st.booleans(),  # shuffle
    st.integers(0, 2),  # epoch
)


@settings(max_examples=200, deadline=None)
@given(layouts)
def test_each_micro_step_is_its_block_and_each_rank_its_share(layout):
    n, world, micro, accumulation, shuffle, epoch = layout
    order = sampler(n, 0, world, micro, accumulation, shuffle=shuffle)
    order.set_epoch(epoch)
    positions = order.global_order().tolist()
    g = world * micro * accumulation
    assert len(positions) % g == 0
    per_rank = []
    for rank in range(world):
        s = sampler(n, rank, world, micro, accumulation, shuffle=shuffle)
        s.set_epoch(epoch)
        per_rank.append(micro_batches(list(s), micro))
    steps = len(positions) // g
    for rank in range(world):
        assert len(per_rank[rank]) == steps * accumulation
    for b in range(steps):
        batch = positions[b * g : (b + 1) * g]
        taken = []
        for j in range(accumulation):
            block = batch[j * world * micro : (j + 1) * world * micro]
            for rank in range(world):
                mine = per_rank[rank][b * accumulation + j]
                assert mine == block[rank * micro : (rank + 1) * micro]
                taken += mine
        assert sorted(taken) == sorted(batch)  # each global batch, exactly once


@settings(max_examples=200, deadline=None)
@given(layouts)
def test_n_processes_group_samples_as_one_process_does(layout):
    n, world, micro, accumulation, shuffle, epoch = layout
    per_rank = []
    for rank in range(world):
        s = sampler(n, rank, world, micro, accumulation, shuffle=shuffle)
        s.set_epoch(epoch)
        per_rank.append(micro_batches(list(s), micro))
    # (a) one process, micro batch world*micro, the same accumulation: micro-step by micro-step.
    one = sampler(n, 0, 1, world * micro, accumulation, shuffle=shuffle)
    one.set_epoch(epoch)
    wide = micro_batches(list(one), world * micro)
    assert len(wide) == len(per_rank[0])
    for i, together in enumerate(wide):
        assert sum((per_rank[rank][i] for rank in range(world)), []) == together
    # (b) one process, micro batch micro, world*accumulation steps: rank r's micro-step j of a global
    # batch is that process's micro-step j*world + r.
    narrow_sampler = sampler(n, 0, 1, micro, world * accumulation, shuffle=shuffle)
    narrow_sampler.set_epoch(epoch)
    narrow = micro_batches(list(narrow_sampler), micro)
    for i in range(len(per_rank[0])):
        for rank in range(world):
            assert per_rank[rank][i] == narrow[i * world + rank]


@settings(max_examples=200, deadline=None)
@given(layouts, st.data())
def test_a_resume_from_any_position_takes_the_rest(layout, data):
    n, world, micro, accumulation, shuffle, epoch = layout
    whole = ranks(n, world, micro, accumulation, shuffle=shuffle)
    total = sum(len(r) for r in whole)
    positions = sampler(n, 0, world, micro, accumulation, shuffle=shuffle).global_order().tolist()
    # A position where every rank has run whole micro-batches (a step or micro-step boundary):
    # each rank goes on exactly where it was.
    boundary = data.draw(st.integers(0, total // (world * micro))) * world * micro
    resumed = ranks(n, world, micro, accumulation, boundary, shuffle=shuffle)
    for rank in range(world):
        assert resumed[rank] == whole[rank][boundary // world :]
    # Any position (a resume under another plan): the ranks together take the rest of the order,
    # but for fewer than W positions at its very end that cannot be shared out equally.
    start = data.draw(st.integers(0, total))
    rest = positions[start:]
    resumed = ranks(n, world, micro, accumulation, start, shuffle=shuffle)
    left_out = (len(rest) % (world * micro)) % world
    assert sorted(sum(resumed, [])) == sorted(rest[: len(rest) - left_out])
    assert len({len(r) for r in resumed}) == 1  # every rank runs as many forwards


@settings(max_examples=150, deadline=None)
@given(layouts, st.data())
def test_a_resume_at_another_process_count_trains_on_the_same_global_batches(layout, data):
    n, world, micro, accumulation, shuffle, epoch = layout
    g = world * micro * accumulation
    # The same global batch over another number of processes and micro batch.
    splits = [(w, m) for w in range(1, 5) for m in range(1, g + 1) if g % (w * m) == 0]
    world2, micro2 = data.draw(st.sampled_from(splits))
    accumulation2 = g // (world2 * micro2)
    whole = ranks(n, world, micro, accumulation, shuffle=shuffle)
    steps = len(whole[0]) // (micro * accumulation)
    done = data.draw(st.integers(0, steps))  # optimizer steps before the checkpoint
    resumed = ranks(n, world2, micro2, accumulation2, done * g, shuffle=shuffle)

    def global_batches(per_rank, w, m, k):
        take = m * k
        return [
            sorted(sum((r[s * take : (s + 1) * take] for r in per_rank), [])) for s in range(len(per_rank[0]) // take)
        ]

    assert (
        global_batches(resumed, world2, micro2, accumulation2)
        == global_batches(whole, world, micro, accumulation)[done:]
    )


def test_evaluation_keeps_dealing_positions_one_by_one():
    s = ShardedSampler(10, 1, 4, shuffle=False, seed=0, multiple_of=4)
    assert list(s) == [1, 5, 9]
