"""The launcher's hang summary names the rank that hung, not the rank whose watchdog fired first:
here rank 1 sleeps while rank 0 waits for it in an all-reduce, and rank 0's watchdog (the shorter
limit) fires first."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers.cli import run_phalanx

# serial: the verdicts depend on wall-clock timeouts, which a second test process would stretch.
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]


@pytest.mark.timeout(150)
def test_the_summary_names_the_sleeping_rank_though_the_waiting_rank_fired_first(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time
            import torch
            import phalanx
            rank = int(os.environ["RANK"])
            # Rank 0 waits with the shorter limit, so its watchdog fires first; rank 1 is the one stuck.
            session = phalanx.Session(faults={"hang_timeout": 3 if rank == 0 else 6})
            session.barrier()  # both ranks beat here: the watchdogs are armed
            if rank == 1:
                time.sleep(600)
            session.reduce(torch.ones(1), "sum")
            """
        )
    )
    result = run_phalanx("launch", "--cpu", "--nproc", "2", str(script), cwd=tmp_path, timeout=120)
    assert result.returncode == 124, result.output
    lines = result.stderr.splitlines()
    # Rank 0's own dump comes first (the terminal shows rank 0), then the launcher's summary.
    listing = lines.index("phalanx: hang: the watchdog stopped the job; where each rank was (2 dumped):")
    assert lines[listing - 1] == (
        "phalanx: hang: rank 1 stopped making progress (at hang.py:10: time.sleep(600)); "
        "rank 0 was waiting for it in all_reduce"
    ), result.stderr
    # Rank 0's own headline is the one that fired first, as the fixture intends.
    assert "  rank 0: no progress for" in result.stderr
    assert "  rank 1: stopping because rank 0's watchdog fired first" in result.stderr
