"""The training state object on its own: counters, loader positions and RNG through
state_dict()/load_state_dict(), without a Session or a process group."""

from __future__ import annotations

import random

import torch

from phalanx.session.state import TrainState


class FakeLoader:
    def __init__(self, epoch: int = 0, position: int | None = None, length: int = 64):
        self.epoch, self.position, self.length = epoch, position, length
        self.passing = 0  # no pass is being iterated

    def resume_at(self, epoch: int, position: int | None) -> None:
        self.epoch, self.position = epoch, position

    def epoch_done(self) -> bool:
        return self.position is not None and self.position >= self.length


def test_round_trip_restores_counters_and_positions():
    saved = TrainState(torch.device("cpu"))
    saved.step, saved.epoch, saved.micro = 7, 2, 1
    saved.add_loader(FakeLoader(2, 48))
    state = saved.state_dict()
    assert (state["step"], state["epoch"], state["data"]) == (7, 2, [{"epoch": 2, "position": 48}])

    fresh = TrainState(torch.device("cpu"))
    loader = FakeLoader()
    fresh.add_loader(loader)
    fresh.micro = 3
    fresh.load_state_dict(state)
    assert (fresh.step, fresh.epoch, fresh.micro) == (7, 2, 0)
    assert (loader.epoch, loader.position) == (2, 48)


def test_rng_waits_for_the_next_training_pass():
    saved = TrainState(torch.device("cpu"))
    saved.add_loader(FakeLoader())
    torch.manual_seed(1)
    random.seed(1)
    state = saved.state_dict()
    expected = (torch.rand(3), random.random())

    fresh = TrainState(torch.device("cpu"))
    fresh.add_loader(FakeLoader())
    fresh.load_state_dict(state)
    torch.manual_seed(99)  # what the loader's first draw would see is not the checkpoint's state yet
    fresh.restore_rng()
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    torch.manual_seed(5)
    fresh.restore_rng()  # only once: a second pass does not rewind the generators
    assert not torch.equal(torch.rand(3), expected[0])


def test_without_a_training_loader_rng_is_restored_at_once():
    torch.manual_seed(3)
    state = TrainState(torch.device("cpu")).state_dict()
    expected = torch.rand(2)
    torch.manual_seed(4)
    TrainState(torch.device("cpu")).load_state_dict(state)
    assert torch.equal(torch.rand(2), expected)


def test_a_checkpoint_of_another_process_count_leaves_rng_alone():
    state = {**TrainState(torch.device("cpu")).state_dict(), "rng": None}
    torch.manual_seed(6)
    expected = torch.rand(2)
    torch.manual_seed(6)
    TrainState(torch.device("cpu")).load_state_dict(state)
    assert torch.equal(torch.rand(2), expected)


def test_a_state_taken_at_an_epochs_end_is_the_next_epochs_start():
    saved = TrainState(torch.device("cpu"))
    saved.step, saved.epoch, saved.epochs_driven = 8, 1, True
    loader = FakeLoader(1, 64)  # every sample of epoch 1 handed out
    saved.add_loader(loader)
    loader.passing = 1  # still inside the last pass (a save in the loop body): that epoch replays
    assert saved.state_dict()["epoch"] == 1
    loader.passing = 0  # the pass has ended: what is saved is the next epoch's start
    torch.manual_seed(3)
    state = saved.state_dict()
    expected = torch.rand(2)
    assert (state["epoch"], state["data"], state["epoch_start"]) == (2, [{"epoch": 2, "position": 0}], True)

    fresh = TrainState(torch.device("cpu"))
    resumed = FakeLoader()
    fresh.add_loader(resumed)
    fresh.load_state_dict(state)
    torch.manual_seed(99)
    fresh.restore_rng()  # a pass's start is not where these generators belong
    fresh.restore_rng(at_epoch=True)  # session.epochs() beginning epoch 2 is
    assert torch.equal(torch.rand(2), expected)
    assert (fresh.epoch, resumed.epoch, resumed.position) == (2, 2, 0)


def test_a_loop_without_session_epochs_never_moves_to_the_next_epoch():
    saved = TrainState(torch.device("cpu"))
    saved.add_loader(FakeLoader(0, 64))  # `while ...: for batch in loader:` keeps epoch 0's order
    assert saved.state_dict()["data"] == [{"epoch": 0, "position": 64}]


def test_a_loader_set_up_after_the_resume_gets_its_position():
    saved = TrainState(torch.device("cpu"))
    saved.add_loader(FakeLoader(0, 16))
    state = saved.state_dict()
    fresh = TrainState(torch.device("cpu"))
    fresh.load_state_dict(state)  # setup() resumed before the script set its loader up
    late = FakeLoader()
    fresh.add_loader(late)
    assert (late.epoch, late.position) == (0, 16)
