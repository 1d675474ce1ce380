"""session.should_stop: a loop that draws from no Session loader ends at train.max_steps."""

from __future__ import annotations

import torch

from phalanx import Config, Session


def _steps_taken(max_steps):
    session = Session(Config(), train={"progress": False, "metrics": False, "max_steps": max_steps})
    model = torch.nn.Linear(2, 1)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    states = []
    for _ in range(10):  # tensors indexed by hand, no loader
        if session.should_stop:
            break
        with session.accumulate(model):
            session.backward(model(torch.ones(4, 2)).sum())
        states.append(session.should_stop)
    session.close()
    return session.step_count, states


def test_a_hand_loop_ends_at_max_steps():
    steps, states = _steps_taken(3)
    assert steps == 3 and states == [False, False, True]


def test_without_a_limit_it_never_stops():
    steps, states = _steps_taken(None)
    assert steps == 10 and not any(states)
