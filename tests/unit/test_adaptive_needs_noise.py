"""batch.adaptive chooses from the noise scale: a run that cannot measure it is refused at set-up,
and ddp without accumulation measures in its comm hook under batch.adaptive (the default keeps
DDP's built-in all-reduce)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session
from phalanx.errors import ConfigError
from phalanx.strategies.ddp import DDP
from phalanx.topology import Topology

TWO = Topology(rank=0, world_size=2, local_world_size=2, launched=True)


@pytest.mark.parametrize(
    ("overrides", "measures"),
    [
        ([], False),
        (["train.noise_scale=hook"], True),
        (["batch.adaptive=goodput"], True),
        (["batch.adaptive=goodput", "train.noise_scale=false"], False),
    ],
)
def test_ddp_measures_in_its_comm_hook_when_asked_or_adaptive(overrides, measures):
    strategy = DDP(Config.load(overrides=overrides), TWO)
    assert (strategy.local_norms is not None) is measures


def _setup(tmp_path, batch: dict, train: dict | None = None) -> Session:
    session = Session(
        Config(),
        batch=batch,
        train={"progress": False, "metrics": False, **(train or {})},
        launch={"run_dir": str(tmp_path)},
    )
    data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    model = nn.Linear(3, 1)
    session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8, shuffle=True))
    return session


def test_one_process_without_accumulation_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as caught:
        _setup(tmp_path, {"adaptive": "goodput"})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("batch.adaptive needs the gradient noise scale, which this run cannot measure")
    assert "batch.micro_batch_size" in message  # the fix


def test_one_process_with_accumulation_is_planned(tmp_path):
    session = _setup(tmp_path, {"adaptive": "goodput", "micro_batch_size": 4})
    assert session.noise.estimate is not None and session.batch.accumulation_steps == 2
    session.close()


def test_an_asked_for_estimate_says_once_why_there_is_none(tmp_path, capsys):
    session = _setup(tmp_path, {}, {"noise_scale": True})
    session.setup_loader(
        DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=8, shuffle=True), train=True
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if "train.noise_scale" in line]
    assert lines == [
        "phalanx: train.noise_scale: no estimate in this run: one process without accumulation has a single "
        "batch size; set batch.micro_batch_size below the global batch to measure it"
    ]
    session.close()


def test_the_default_estimate_stays_quiet_where_there_is_none(tmp_path, capsys):
    _setup(tmp_path, {}).close()
    assert "train.noise_scale" not in capsys.readouterr().out
