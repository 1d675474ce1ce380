"""batch.adaptive through `phalanx launch` on 2 CPU processes: the global batch grows during
training, and a run whose rank is killed with SIGKILL mid-run, restarted and resumed from its last
checkpoint ends with the weights of an uninterrupted run, bit for bit (the batch choices, the
noise-scale averages and the learning-rate gain are in the checkpoint). The throughput model is
given (batch.adaptive_step_times), so that both runs' choices depend on the data alone."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import run_phalanx

pytestmark = pytest.mark.multiprocess

SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import phalanx

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(768, 8, generator=g)
    y = x.sum(1, keepdim=True) + 10 * torch.randn(768, 1, generator=g)  # noisy: a large noise scale
    session = phalanx.Session(
        batch={"global_batch_size": 16, "micro_batch_size": 4, "adaptive": "goodput", "adapt_every": 3,
               "adaptive_step_times": [0.001, 0.05]},
        train={"epochs": 2, "progress": False, "metrics": False, "noise_scale_every": 1},
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 20, 0.5)
    model, optimizer, loader, scheduler = session.setup(
        model, optimizer, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True), scheduler
    )
    kill_at = int(os.environ.get("KILL_AT", "0"))
    for _ in session.epochs():
        for xb, yb in loader:
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(xb), yb))
            if kill_at and session.step_count == kill_at and session.rank == 1 and session.topology.restart_count == 0:
                os.kill(os.getpid(), 9)
    state = session.model_state_dict()
    if session.is_main:
        torch.save({"weights": state, "k": session.adaptive.k, "history": session.adaptive.history}, os.environ["OUT"])
    session.close()
    """
)


def _launch(tmp_path: Path, out: str, *args: str, env: dict | None = None):
    (tmp_path / "train.py").write_text(SCRIPT)
    return run_phalanx(
        "launch",
        "--cpu",
        "--nproc",
        "2",
        *args,
        "train.py",
        cwd=tmp_path,
        timeout=200,
        env={"OUT": str(tmp_path / out), **(env or {})},
    )


# joined: batch.max_micro_batch_size lets a forward join up to 4 of the loader's micro-batches of 4.
@pytest.mark.timeout(420)
@pytest.mark.parametrize("joined", [False, True], ids=["one-micro-batch-per-forward", "joined-forwards"])
def test_an_adaptive_run_killed_and_resumed_equals_an_uninterrupted_one(tmp_path, joined):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir()
    run_dir.mkdir()
    limit = ["--set", "batch.max_micro_batch_size=16"] if joined else []
    reference = _launch(ref_dir, "out.pt", "--set", "checkpoint.resume=never", *limit)
    assert reference.returncode == 0, reference.output
    assert ("micro-batches at once" in reference.output) is joined, reference.output
    killed = _launch(
        run_dir, "out.pt", "--max-restarts", "1", "--set", "checkpoint.save_every=4", *limit, env={"KILL_AT": "10"}
    )
    assert killed.returncode == 0, killed.output
    assert "restart 1 after a failure" in killed.output
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000008'}" in killed.output
    ref, got = torch.load(ref_dir / "out.pt"), torch.load(run_dir / "out.pt")
    # The batch did grow (the loss's check may take it back before the end: the history is what must match).
    assert max(k for _, k in ref["history"]) > 1, ref["history"]
    assert got["history"] == ref["history"] and got["k"] == ref["k"]
    for key, value in ref["weights"].items():
        assert torch.equal(value, got["weights"][key]), key
