"""A ddp replica whose weights drift apart stops the job at the next check, in one line that names
the step, the parameter and the ranks (faults/replicas.py). A run without drift that checks
completes: test_faults.py's reference run checks every 4 steps."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers.cli import run_phalanx

pytestmark = pytest.mark.multiprocess

SCRIPT = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import phalanx

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(128, 8, generator=g), torch.randn(128, 2, generator=g))
    session = phalanx.Session(batch={"global_batch_size": 16}, train={"progress": False, "metrics": False})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = session.setup(model, optimizer, DataLoader(data, batch_size=16, shuffle=True))
    for _ in session.epochs():
        for x, y in loader:
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(x), y))
            if session.step_count == 3 and session.rank == 1:  # a change on one rank only
                with torch.no_grad():
                    session.unwrap(model)[2].weight[0, 0] += 1e-6
    print("phalanx-test: finished", flush=True)
    session.close()
    """
)


@pytest.mark.timeout(120)
def test_a_rank_that_changes_a_weight_stops_the_job_at_the_next_check(tmp_path):
    script = tmp_path / "drift.py"
    script.write_text(SCRIPT)
    result = run_phalanx(
        "launch",
        "--cpu",
        "--nproc",
        "2",
        "--set",
        "faults.replica_check_every=2",
        str(script),
        cwd=tmp_path,
        timeout=90,
    )
    assert result.returncode == 2, result.output
    assert "phalanx-test: finished" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("phalanx: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert errors[0].startswith(
        "phalanx: error: replicas drifted apart at step 4 (they were equal at step 2): "
        "2.weight differs between ranks 0 and 1 (sum of its values: "
    ), errors[0]
    assert errors[0].endswith("(docs/faults.md#replicas-that-drift-apart)")
