"""Resume across parallel layouts: the small GPT of tensor_parallel.py trained for some steps under
one layout, saved, and continued under another (fsdp -> tp -> single), or under the same one."""

from __future__ import annotations

from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session
from tests.helpers import tensor_parallel as tp_harness

TOTAL = 6  # steps of the whole run; the data holds this many global batches


def train(strategy: str, tp: int | None, checkpoints: str, until: int, save_at: int | None = None) -> dict:
    """Train (resuming from ``checkpoints`` when it holds a checkpoint) until step ``until``;
    ``save_at``: also save after that step (the run goes on to ``until``)."""
    session = Session(
        Config(),
        strategy={"name": strategy, "tp": {"size": tp}},
        batch={"global_batch_size": tp_harness.GLOBAL_BATCH},
        train={"progress": False, "seed": 0, "metrics": False, "max_steps": until},
        checkpoint={"dir": checkpoints, "resume": "auto", "resume_any_run": True},
    )
    model = tp_harness.build()
    model, opt = session.setup(model, tp_harness.optimizer(model.parameters()))
    data = DataLoader(TensorDataset(tp_harness.tokens(TOTAL)), batch_size=tp_harness.GLOBAL_BATCH)
    loader = session.setup_loader(data, train=True)
    started = session.step_count
    for _ in session.epochs():
        for (batch,) in loader:
            with session.accumulate(model):
                session.backward(tp_harness.lm_loss(model, batch))
            if session.sync_gradients and session.step_count == save_at:
                session.save()
    out = {
        "started": started,
        "steps": session.step_count,
        "state": {k: v.detach().cpu() for k, v in session.model_state_dict().items()},
    }
    session.close()
    return out


def run(args: tuple, kwargs: dict) -> dict:
    return train(*args, **kwargs)
