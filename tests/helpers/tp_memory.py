"""Bytes a rank holds under tensor parallelism (tp, fsdp x tp) after one step and one more backward,
for comparing with `phalanx plan`'s rows; run inside phalanx.spawn processes."""

from __future__ import annotations

import torch

from phalanx import Config, Session
from tests.helpers import tensor_parallel as tpx


def held_bytes(strategy: str, tp: int) -> dict:
    session = Session(
        Config(),
        strategy={"name": strategy, "tp": {"size": tp}},
        batch={"global_batch_size": tpx.GLOBAL_BATCH},
        train={"progress": False, "metrics": False},
    )
    model = tpx.build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = session.setup(model, optimizer)
    batch = tpx.tokens(1)[: tpx.GLOBAL_BATCH // session.strategy.data_parallel_size]
    with session.accumulate(model):
        session.backward(tpx.lm_loss(model, batch))
    session.backward(tpx.lm_loss(model, batch))  # gradients present, not yet stepped
    held = session.strategy.held_bytes(model, optimizer)
    session.close()
    return held
