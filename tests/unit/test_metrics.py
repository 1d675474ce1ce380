"""Per-step metrics, the run summary, the straggler rule and MFU: pure functions first, then the
Session in one process."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from phalanx import Topology
from phalanx.metrics.flops import count_on_first_forward, flops_per_sample, peak_flops_per_s
from phalanx.metrics.recorder import StepRecorder
from phalanx.metrics.straggler import MIN_STEPS, WARMUP_STEPS, find_straggler
from phalanx.metrics.summary import percentile, read_records, summarize
from phalanx.metrics.summary_display import verdict
from tests.helpers.metrics import FIELDS, run_session


# -- pure functions ---------------------------------------------------------------------------
@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_interpolates_like_numpy(q):
    values = [random.Random(q).uniform(0, 10) for _ in range(17)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([3.0], q) == 3.0


def work_times(
    slow_rank: int | None, ranks: int = 4, steps: int = 30, factor: float = 1.5
) -> dict[int, dict[int, float]]:
    rng = random.Random(0)
    return {
        r: {s: 0.010 * (factor if r == slow_rank else 1.0) * rng.uniform(0.97, 1.03) for s in range(1, steps + 1)}
        for r in range(ranks)
    }


def test_a_consistently_slow_rank_is_the_straggler():
    found = find_straggler(work_times(slow_rank=2))
    assert found is not None and found.rank == 2
    assert found.slow_share == 1.0 and found.steps == 30 - WARMUP_STEPS
    assert found.excess_s == pytest.approx(0.005, rel=0.2)


def test_no_straggler_in_a_balanced_run_or_below_the_threshold():
    assert find_straggler(work_times(slow_rank=None)) is None
    assert find_straggler(work_times(slow_rank=1, factor=1.05)) is None  # 5% is within the 10% margin


def test_slow_only_in_warmup_or_in_a_minority_of_steps_is_no_straggler():
    work = work_times(slow_rank=None)
    for step in range(1, WARMUP_STEPS + 1):  # compilation, cache warm-up, ...
        work[3][step] *= 5
    assert find_straggler(work) is None
    for step in range(WARMUP_STEPS + 1, 15):  # 11 of 27 compared steps: under 60%
        work[3][step] *= 2
    assert find_straggler(work) is None


def test_too_few_steps_or_one_rank_names_nobody():
    assert find_straggler(work_times(slow_rank=0, steps=WARMUP_STEPS + MIN_STEPS - 1)) is None
    assert find_straggler(work_times(slow_rank=0, ranks=1)) is None


def synthetic(rank: int, steps: int, step_time: float = 0.1, sync_time: float = 0.05, wait: float = 0.01) -> list[dict]:
    return [
        {
            "rank": rank,
            "step": s,
            "epoch": 0,
            "time": 1e9 + s,
            "step_time": step_time,
            "data_wait": wait,
            "sync_time": sync_time,
            "samples": 64,
            "samples_per_s": 64 / step_time,
            "loss": 2.0 / s,
            "lr": 0.1,
            "grad_norm": None,
            "peak_mem_bytes": None,
        }
        for s in range(1, steps + 1)
    ]


def test_summary_of_a_balanced_run():
    summary = summarize({0: synthetic(0, 20), 1: synthetic(1, 20)})
    assert summary["world_size"] == 2 and summary["steps"] == 20 and summary["warmup_steps_left_out"] == WARMUP_STEPS
    assert summary["straggler"] is None and summary["mfu"] is None
    row = summary["ranks"][1]
    assert row["samples_per_s"] == pytest.approx(640) and row["step_time_p50"] == pytest.approx(0.1)
    assert row["work_p50"] == pytest.approx(0.05) and row["data_wait_share"] == pytest.approx(0.1)
    assert (row["loss_first"], row["loss_last"]) == (2.0, 0.1)
    assert verdict(summary)[0].startswith("phalanx: no straggler")


def test_summary_names_the_rank_with_more_work_and_computes_mfu():
    # Equal step times (the all-reduce evens them out); rank 1 spends less of it waiting in the sync.
    records = {0: synthetic(0, 20), 1: synthetic(1, 20, sync_time=0.01, wait=0.04), 2: synthetic(2, 20)}
    summary = summarize(records, {"flops_per_sample": 1e9, "peak_flops_per_s": 1e12})
    assert summary["straggler"]["rank"] == 1 and summary["straggler"]["slow_share"] == 1.0
    assert summary["mfu"] == pytest.approx(1e9 * 640 / (3 * 1e12))
    line = verdict(summary)[0]
    assert line.startswith("phalanx: straggler: rank 1:") and "mostly waiting for its data loader" in line


def test_summary_needs_two_steps():
    assert summarize({0: synthetic(0, 1)}) is None
    assert summarize({}) is None


def test_read_records_keeps_the_last_record_of_a_step_and_skips_torn_lines(tmp_path):
    lines = [json.dumps(r) for r in synthetic(0, 3)] + [
        json.dumps({**synthetic(0, 2)[1], "loss": 9.0}),
        '{"rank": 0, "st',
    ]
    (tmp_path / "rank0.jsonl").write_text("\n".join(lines) + "\n")
    records = read_records(tmp_path)
    assert [r["step"] for r in records[0]] == [1, 2, 3] and records[0][1]["loss"] == 9.0


def test_peak_table_matches_device_names():
    assert peak_flops_per_s("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops_per_s("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops_per_s("NVIDIA H200", "fp32", tf32=True) == 494e12
    assert peak_flops_per_s("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert peak_flops_per_s("NVIDIA A10", "bf16") == 125e12
    assert peak_flops_per_s("NVIDIA L4", "fp16") == 121e12
    assert peak_flops_per_s("NVIDIA L40S", "bf16") == 362e12
    assert peak_flops_per_s("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert peak_flops_per_s("NVIDIA GeForce GTX 1080", "bf16") is None


def test_flops_per_sample_counts_forward_and_backward():
    model = nn.Linear(8, 4, bias=False)
    # forward: 2 * 8 * 4 per sample; training: 3 times that
    assert flops_per_sample(model, torch.randn(5, 8)) == 3 * 2 * 8 * 4


def test_counting_flops_on_the_first_forward_changes_nothing():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))

    x = torch.randn(4, 8)
    watched, plain, got = build(), build(), []
    count_on_first_forward(watched, watched, got.append)
    torch.manual_seed(1)
    out_watched = watched(x)
    torch.manual_seed(1)
    out_plain = plain(x)
    assert got == [3 * 2 * (8 * 8 + 8 * 2)]
    assert torch.equal(out_watched, out_plain)  # the same dropout mask: the RNG was restored
    assert torch.equal(watched[1].running_mean, plain[1].running_mean)  # BatchNorm saw one forward
    assert watched.training and watched[1].training and not watched._forward_pre_hooks


# -- the Session in one process ---------------------------------------------------------------
def test_session_records_every_optimizer_step_in_memory(capsys):
    session = run_session(optim={"max_grad_norm": 1.0, "lr_scaling": "linear", "reference_batch_size": 4})
    session.close()
    records = list(session.metrics.records)
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        assert list(r) == FIELDS
        assert r["rank"] == 0 and r["epoch"] == 0 and r["samples"] == 8
        assert r["lr"] == pytest.approx(0.2)  # 0.1 x (8 / 4): the lr the step used
        assert isinstance(r["loss"], float) and isinstance(r["grad_norm"], float)
        assert (r["peak_mem_bytes"] is None) == (session.device.type == "cpu")
        assert (r["device_work"] is None) == (session.device.type == "cpu")  # timed by CUDA events
        assert 0 <= r["data_wait"] <= r["step_time"] and 0 <= r["sync_time"] <= r["step_time"]
        assert r["samples_per_s"] == pytest.approx(8 / r["step_time"])
    out = capsys.readouterr().out
    assert "phalanx: 6 steps, " in out and "samples/s" in out and "loss " in out


def test_metrics_off_records_nothing_and_prints_no_summary(capsys):
    session = run_session(metrics=False)
    session.close()
    assert not session.metrics.records and "samples/s" not in capsys.readouterr().out


def test_mfu_once_flops_and_peak_are_known(capsys):
    recorder = StepRecorder(Topology(), peak_flops_per_s=1e12, summary_at_close=True)
    model = nn.Linear(8, 4, bias=False)
    recorder.watch_model(model, model)
    model(torch.randn(2, 8))
    assert recorder.flops_per_sample == 3 * 2 * 8 * 4
    for step in (1, 2, 3):
        recorder.record(True, step, 0, 16, torch.tensor(1.0), 0.1)
    recorder.close()
    assert "MFU " in capsys.readouterr().out


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from phalanx.metrics.board import Board

    board = Board.open(tmp_path)
    rows = synthetic(0, 5)
    board.write(rows[:2])  # a flush: one point, the means of its records, at its last step
    board.write(rows[2:])
    board.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [2, 5]
    assert [e.value for e in loss] == pytest.approx([(2.0 + 1.0) / 2, (2 / 3 + 2 / 4 + 2 / 5) / 3])
    assert "perf/samples_per_s" in events.Tags()["scalars"]
