"""Issue 14, friction 3: models, optimizers, schedulers and loaders set up in any order and in several
calls give the same batch plan, the same training, and a session.json (what tune and bench read)
that holds the whole set-up. Single-process Sessions with a run directory, as under the launcher."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session
from phalanx.config.batch import BatchPlan
from phalanx.session.facts import read_run_facts
from phalanx.topology import LaunchContext

GLOBAL, MICRO = 16, 4


def _session(tmp_path, monkeypatch, **batch) -> Session:
    # A run directory, as `phalanx launch` gives one: the Session writes session.json into it.
    monkeypatch.setenv("PHALANX_CONTEXT", LaunchContext(run_dir=str(tmp_path)).to_env()["PHALANX_CONTEXT"])
    return Session(
        Config(),
        batch={"micro_batch_size": MICRO, **batch},
        train={"progress": False, "epochs": 1},
        checkpoint={"dir": str(tmp_path / "ck"), "resume": "never"},
    )


def _objects():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=GLOBAL, shuffle=True)
    test_loader = DataLoader(data, batch_size=8)
    return model, optimizer, scheduler, loader, test_loader


def _one_call(session, model, optimizer, scheduler, loader, test_loader):
    return session.setup(model, optimizer, loader, test_loader, scheduler)


def _model_first_then_loaders(session, model, optimizer, scheduler, loader, test_loader):
    model, optimizer = session.setup(model, optimizer)
    scheduler = session.setup(scheduler)
    loader = session.setup_loader(loader, train=True)
    test_loader = session.setup(test_loader)
    return model, optimizer, loader, test_loader, scheduler


def _model_first_then_loader_through_setup(session, model, optimizer, scheduler, loader, test_loader):
    model, optimizer, scheduler = session.setup(model, optimizer, scheduler)
    loader, test_loader = session.setup(loader, test_loader)
    return model, optimizer, loader, test_loader, scheduler


def _loader_first(session, model, optimizer, scheduler, loader, test_loader):
    loader = session.setup_loader(loader, train=True)
    test_loader = session.setup_loader(test_loader, train=False)
    model, optimizer, scheduler = session.setup(model, optimizer, scheduler)
    return model, optimizer, loader, test_loader, scheduler


def _loader_first_through_setup(session, model, optimizer, scheduler, loader, test_loader):
    loader = session.setup(loader)
    model = session.setup(model)
    optimizer, scheduler, test_loader = session.setup(optimizer, scheduler, test_loader)
    return model, optimizer, loader, test_loader, scheduler


ORDERS = [
    _one_call,
    _model_first_then_loaders,
    _model_first_then_loader_through_setup,
    _loader_first,
    _loader_first_through_setup,
]


def _train(session, model, optimizer, loader, test_loader) -> dict[str, torch.Tensor]:
    for _ in session.epochs():
        for x, y in loader:
            with session.accumulate(model):
                session.backward(F.mse_loss(model(x), y))
    with torch.no_grad():
        for x, _ in test_loader:
            session.gather_for_metrics(model(x))
    return {k: v.detach().clone() for k, v in session.unwrap(model).state_dict().items()}


@pytest.mark.parametrize("order", ORDERS, ids=lambda f: f.__name__.strip("_"))
def test_every_order_plans_the_batch_and_announces_it_whole(order, tmp_path, monkeypatch, capsys):
    session = _session(tmp_path, monkeypatch)
    model, optimizer, loader, test_loader, _ = order(session, *_objects())
    plan = BatchPlan(GLOBAL, MICRO, GLOBAL // MICRO, 1)
    assert session.batch == plan and session.accumulation_steps == GLOBAL // MICRO
    facts = read_run_facts(tmp_path)  # what tune and bench read
    assert facts is not None and facts.batch == plan, order.__name__
    assert facts.trainable_parameters == 5 and len(facts.models) == 1
    out = capsys.readouterr().out
    assert f"global batch {GLOBAL} = micro batch {MICRO} x 4 accumulation steps x 1 process" in out
    weights = _train(session, model, optimizer, loader, test_loader)
    assert session.step_count == 64 // GLOBAL
    session.close()
    (tmp_path / "ref").mkdir()
    reference = _session(tmp_path / "ref", monkeypatch)
    expected = _train(reference, *_one_call(reference, *_objects())[:4])
    reference.close()
    for key in expected:  # the order changed nothing about what trains
        torch.testing.assert_close(weights[key], expected[key])


def test_a_later_call_that_changes_nothing_announces_nothing_new(tmp_path, monkeypatch, capsys):
    session = _session(tmp_path, monkeypatch)
    model, optimizer, _, loader, test_loader = _objects()
    session.setup(model, optimizer, loader)
    first = (tmp_path / "session.json").read_text()
    capsys.readouterr()
    session.setup(test_loader)  # an evaluation loader: the plan and the models stay
    assert capsys.readouterr().out == ""
    assert (tmp_path / "session.json").read_text() == first
    session.close()


def test_the_batch_from_the_config_alone_is_announced_at_the_first_call(tmp_path, monkeypatch):
    session = _session(tmp_path, monkeypatch, global_batch_size=8)
    model, optimizer, *_ = _objects()
    session.setup(model, optimizer)
    document = json.loads((tmp_path / "session.json").read_text())
    assert document["batch"]["global_batch_size"] == 8 and document["batch"]["accumulation_steps"] == 2
    session.close()
