"""Data beyond the shuffled DataLoader (docs/data.md) trains the same on 1 and 2 processes, with and
without accumulation, as a plain one-process loop on the same global batches: truncated BPTT with a
hidden state carried per micro-step slot (from a stream of columns and from an ordered training
loader), an iterable dataset, and tensors already in memory."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers.cli import run_phalanx
from tests.helpers.data_streams import CHUNKS, SAMPLES, G, linear_reference, lm_reference, run_all
from tests.helpers.training import rel_diff

pytestmark = pytest.mark.multiprocess


def _check(results: dict, world: int, accumulation: int, rank: int = 0) -> None:
    lm, linear = lm_reference(), linear_reference()
    mb = G // (world * accumulation)
    stream = results["lm_stream"]
    assert (stream["world"], stream["accumulation"], stream["steps"]) == (world, accumulation, CHUNKS)
    assert stream["widths"] == [mb] * accumulation
    assert rel_diff(stream["state"], lm) < 1e-5

    ordered = results["lm_ordered_loader"]
    assert ordered["steps"] == CHUNKS
    assert rel_diff(ordered["state"], lm) < 1e-5
    # Micro-step slot m of rank r sees the same columns at every step: its share of micro-step m's
    # block of world*mb columns (docs/data.md).
    for m, steps in ordered["columns"].items():
        start = (m * world + rank) * mb
        assert steps == [list(range(start, start + mb))] * CHUNKS

    it = results["iterable"]
    assert it["steps"] == SAMPLES // G and it["batches"] == it["len"] == it["steps"] * accumulation
    assert rel_diff(it["state"], linear) < 1e-5

    memory = results["in_memory"]
    assert memory["steps"] == 5 and memory["rows"] == 5 * G // world
    assert rel_diff(memory["state"], linear_reference(5 * G)) < 1e-5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("micro, accumulation", [(None, 1), (G // 2, 2)])
def test_one_process_matches_the_plain_loop(micro, accumulation):
    _check(run_all(micro), 1, accumulation)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("micro, accumulation", [(None, 1), (G // 4, 2)])
def test_two_processes_match_the_plain_loop(micro, accumulation):
    results = phalanx.spawn(run_all, nprocs=2, args=(micro,), cpu=True, timeout=240)
    for rank, out in enumerate(results):
        _check(out, 2, accumulation, rank)
    assert rel_diff(results[0]["lm_stream"]["state"], results[1]["lm_stream"]["state"]) == 0


LOCKED = """
import phalanx
import torch
from torch.utils.data import DataLoader, TensorDataset

session = phalanx.Session(batch={"fixed_layout": True}, train={"progress": False})
session.setup_loader(DataLoader(TensorDataset(torch.arange(80.0)), batch_size=20), train=True)
print("trained on the script's own layout")
"""


@pytest.mark.timeout(180)
def test_a_launch_that_would_change_a_fixed_layout_stops_in_one_line(tmp_path):
    (tmp_path / "locked.py").write_text(LOCKED)
    result = run_phalanx(
        "launch", "--cpu", "--set", "batch.global_batch_size=40", "locked.py", cwd=tmp_path, timeout=150
    )
    assert result.returncode == 2, result.output
    assert result.stderr.strip() == (
        "phalanx: error: batch.global_batch_size 40 (from --set) would change the batch layout, which is fixed "
        "(batch.fixed_layout, set in the script): it would train on global batch 40 in micro batches of 20, the "
        "script's data is laid out for global batch 20 in micro batches of 10; remove it, or change the sizes in "
        "the script"
    )
    same = run_phalanx("launch", "--cpu", "--set", "batch.global_batch_size=20", "locked.py", cwd=tmp_path, timeout=150)
    assert same.returncode == 0 and "trained on the script's own layout" in same.stdout, same.output
