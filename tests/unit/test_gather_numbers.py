"""Issue 14, friction 6: `session.gather_for_metrics` takes a per-batch Python number or 0-d tensor
and returns a 1-d tensor of every process's value, in rank order (one value in one process)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, PhalanxError, Session
from phalanx.session import collectives


@pytest.fixture
def two_ranks(monkeypatch) -> dict:
    """gather_in_order's arguments for two ranks, whose all_gather fills this rank's value and the
    other's (this one's plus 10)."""

    def all_gather(parts, local, group=None):
        parts[0].copy_(local)
        parts[1].copy_(local + 10)

    monkeypatch.setattr(collectives.dist, "all_gather", all_gather)
    return {"data_parallel_size": 2, "group": None, "comm_device": torch.device("cpu"), "loader": None}


@pytest.fixture
def session():
    s = Session(Config(), train={"progress": False}, checkpoint={"resume": "never"})
    yield s
    s.close()


@pytest.mark.parametrize(
    "value, dtype",
    [(0.25, torch.float64), (3, torch.int64), (True, torch.int64), (torch.tensor(1.5), torch.float32)],
    ids=["float", "int", "bool", "0-d tensor"],
)
def test_one_process_gives_a_one_element_vector(session, value, dtype):
    gathered = session.gather_for_metrics(value)
    assert gathered.shape == (1,) and gathered.dtype == dtype
    assert gathered.item() == pytest.approx(float(value))


def test_a_loss_comes_back_detached_and_losses_concatenate(session):
    weight = torch.ones(2, requires_grad=True)
    losses = [session.gather_for_metrics((weight * k).sum()) for k in range(3)]
    assert all(not loss.requires_grad for loss in losses)
    assert torch.cat(losses).tolist() == [0.0, 2.0, 4.0]


def test_numbers_inside_an_evaluation_loop_are_per_batch_values(session):
    data = TensorDataset(torch.arange(10.0).unsqueeze(1))
    loader = session.setup(DataLoader(data, batch_size=4))
    sums = [session.gather_for_metrics(x.sum().item()) for (x,) in loader]
    assert torch.cat(sums).tolist() == [6.0, 22.0, 17.0]


def test_several_processes_give_every_rank_value_in_rank_order(two_ranks):
    args = two_ranks
    gathered = collectives.gather_in_order(0.5, **args)
    assert gathered.tolist() == [0.5, 10.5] and gathered.dtype == torch.float64
    assert collectives.gather_in_order(torch.tensor(2), **args).tolist() == [2, 12]
    rows = collectives.gather_in_order(torch.tensor([1.0, 2.0]), **args)  # rows are unchanged: concatenated
    assert rows.tolist() == [1.0, 2.0, 11.0, 12.0]


def test_other_values_are_one_line(session):
    with pytest.raises(PhalanxError, match="gather_for_metrics takes a tensor, a number, or a tuple of them, not str"):
        session.gather_for_metrics("0.5")


def test_a_tuple_gathers_each_entry_as_accelerate_does(two_ranks):
    entries = (torch.tensor([1, 2]), torch.tensor([3]), 0.5)
    predictions, labels, loss = collectives.gather_in_order(entries, **two_ranks)
    assert predictions.tolist() == [1, 2, 11, 12] and labels.tolist() == [3, 13] and loss.tolist() == [0.5, 10.5]


def test_a_tuple_in_an_evaluation_loop_drops_the_padding_of_each_entry(session):
    data = TensorDataset(torch.arange(5.0), torch.arange(5) * 2)
    loader = session.setup(DataLoader(data, batch_size=2))
    pairs = [session.gather_for_metrics([x, y]) for x, y in loader]
    assert all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs)
    assert torch.cat([x for x, _ in pairs]).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert torch.cat([y for _, y in pairs]).tolist() == [0, 2, 4, 6, 8]
