"""Issue 14, friction 8: bench ends each run through the Session's step limit, not a signal, so a
script's own KeyboardInterrupt handler (one that would crash, as a user's did) never runs, and the
script's end-of-training code does; a script whose loop phalanx cannot end is still stopped, and
what it then raised is shown in the terminal, not only in a per-run log."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import run_phalanx

# Sets up the model and optimizer first and the loader after, loops without session.progress, and
# gathers a per-step number: what a ported script does (issue 14's frictions 3, 6 and 8 together).
HANDLER = """
import torch
import phalanx

session = phalanx.Session(train={{"epochs": 10_000}})
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = session.setup(model, optimizer)
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
loader = session.setup(torch.utils.data.DataLoader(data, batch_size=16, shuffle=True))
losses = []
try:
    {loop}
except KeyboardInterrupt:
    open("model.pt", "rb").read()  # there is no model.pt: this handler crashes, as the user's did
gathered = torch.cat(losses)
session.print(f"training done after {{session.step_count}} steps, gathered {{tuple(gathered.shape)}}")
"""

THROUGH_THE_SESSION = """for epoch in session.epochs():
        for x, y in loader:
            with session.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                session.backward(loss)
            losses.append(session.gather_for_metrics(loss.item()))"""

# Batches phalanx never sees: the step limit cannot end this loop.
ITS_OWN_LOOP = """x, y = torch.randn(16, 8), torch.randn(16, 1)
    while True:
        with session.accumulate(model):
            session.backward(torch.nn.functional.mse_loss(model(x), y))
        losses.append(session.gather_for_metrics(0.0))"""


def _bench(tmp_path: Path, loop: str, counts: str):
    (tmp_path / "train.py").write_text(HANDLER.format(loop=loop))
    result = run_phalanx(
        "bench", "--nproc-list", counts, "--steps", "4", "--warmup", "1", "--cpu", "train.py", cwd=tmp_path, timeout=200
    )
    (bench,) = (tmp_path / "runs").glob("*-bench")
    return result, bench


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_bench_ends_runs_through_the_step_limit_and_the_handler_never_runs(tmp_path):
    result, bench = _bench(tmp_path, THROUGH_THE_SESSION, "1,2")
    assert result.returncode == 0, result.output
    for n, values in ((1, 4), (2, 8)):  # 4 steps; one gathered loss per rank and step
        log = (bench / f"n{n}" / "launch.log").read_text()
        assert f"training done after 4 steps, gathered ({values},)" in log, log
        assert "train.max_steps=4 reached" in log
        assert "stopped by signal" not in log and "KeyboardInterrupt" not in log and "FileNotFoundError" not in log
    assert "FileNotFoundError" not in result.output and "warning" not in result.output
    assert (bench / "bench.json").is_file()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_loop_the_limit_cannot_end_is_stopped_and_its_error_shown_in_the_terminal(tmp_path):
    result, bench = _bench(tmp_path, ITS_OWN_LOOP, "1")
    assert result.returncode == 0, result.output  # it ran its steps: the figures stand
    (line,) = [line for line in result.stdout.splitlines() if "warning" in line]
    assert "the 1-process run went on after train.max_steps=4" in line and "was stopped like Ctrl-C" in line
    assert "FileNotFoundError: [Errno 2] No such file or directory: 'model.pt'" in line, line
    assert str(bench / "n1" / "launch.log") in line
