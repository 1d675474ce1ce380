"""The fields of a metrics record, pending records as the recorder hands them to its RowWriter, and
a short Session run whose metrics the tests read."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from phalanx import Config, Session
from phalanx.metrics import rows
from tests.helpers.models import make_data, make_model

FIELDS = [
    "rank", "step", "epoch", "time", "step_time", "data_wait", "sync_time", "device_work", "samples", "samples_per_s",
    "loss", "lr", "grad_norm", "noise_scale", "noise_estimated", "peak_mem_bytes",
]  # fmt: skip


def pending_records(steps: range) -> list[tuple]:
    """One pending record per step, in rows.FIELDS' order: the loss a tensor still to be read."""
    records = []
    for s in steps:
        row = {**dict.fromkeys(rows.FIELDS), "step": s, "loss": torch.tensor(float(s)), "lr": 0.1}
        row["noise_estimated"] = False
        records.append(tuple(row[f] for f in rows.FIELDS))
    return records


def run_session(steps: int = 6, metrics: bool = True, **sections) -> Session:
    train = {"progress": False, "metrics": metrics}
    session = Session(Config(), train=train, batch={"global_batch_size": 8, "micro_batch_size": 4}, **sections)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = session.setup(
        model, optimizer, DataLoader(make_data(8 * steps), batch_size=8, shuffle=True)
    )
    for _ in session.epochs():
        for x, y in loader:
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(x), y))
    return session
