"""On CUDA with NCCL a collective returns to the host at once and a fast rank's host waits for the slow
one later, in a device sync that may fall in its own work: host times cannot tell who holds the others
back. Each step's two CUDA events (where it starts, where its synchronising part starts) give the
device's own work, and the straggler rule compares that. Fake events stand in for CUDA."""

from __future__ import annotations

import threading

import pytest
import torch

from phalanx import Topology
from phalanx.metrics.recorder import StepRecorder
from phalanx.metrics.summary import summarize
from phalanx.metrics.summary_display import verdict


class DeviceClock:
    """When the device reaches each event, set by the test before the event is recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.synchronized_on: list[str] = []


class FakeEvent:
    def __init__(self, clock: DeviceClock):
        self.clock = clock
        self.at: float | None = None
        self.recorded_on: str | None = None

    def record(self) -> None:
        self.at = self.clock.now
        self.recorded_on = threading.current_thread().name

    def synchronize(self) -> None:
        self.clock.synchronized_on.append(threading.current_thread().name)

    def elapsed_time(self, end: FakeEvent) -> float:
        if self.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end.at - self.at) * 1000  # milliseconds, as torch.cuda.Event's


def recorder_with(clock: DeviceClock, made: list[FakeEvent]) -> StepRecorder:
    def make() -> FakeEvent:
        made.append(FakeEvent(clock))
        return made[-1]

    return StepRecorder(Topology(), make_event=make)


def step(recorder: StepRecorder, clock: DeviceClock, step: int, sync_at: float, end_at: float, stepped=True) -> None:
    clock.now = sync_at
    recorder.sync_started()
    clock.now = end_at
    recorder.record(stepped, step, 0, 8, None, 0.1)


# -- the row ----------------------------------------------------------------------------------------------


def test_a_row_gets_the_device_time_from_the_step_start_to_its_synchronising_part():
    clock, made = DeviceClock(), []
    recorder = recorder_with(clock, made)
    recorder.add_wait(0.002)  # the first step starts when its first batch was requested
    step(recorder, clock, 1, sync_at=0.030, end_at=0.050)
    step(recorder, clock, 2, sync_at=0.070, end_at=0.100)
    recorder.close()
    rows = list(recorder.records)
    assert [r["device_work"] for r in rows] == pytest.approx([0.030, 0.020])
    # Recorded where the training thread works; waited for only on the metrics thread.
    assert {e.recorded_on for e in made} == {threading.current_thread().name}
    assert clock.synchronized_on and all(name.startswith("phalanx-metrics") for name in clock.synchronized_on)


def test_a_skipped_step_counts_in_the_next_one_and_a_step_nothing_started_has_no_device_figure():
    clock, made = DeviceClock(), []
    recorder = recorder_with(clock, made)
    step(recorder, clock, 1, sync_at=0.030, end_at=0.050)  # no loader: no start event
    step(recorder, clock, 1, sync_at=0.070, end_at=0.090, stepped=False)  # the fp16 scaler skipped it
    step(recorder, clock, 2, sync_at=0.120, end_at=0.150)
    recorder.close()
    assert [r["device_work"] for r in recorder.records] == [None, pytest.approx(0.070)]


def test_off_cuda_no_event_is_made(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: pytest.fail("a CUDA event made on CPU"))
    recorder = StepRecorder(Topology())
    recorder.add_wait(0.001)
    recorder.sync_started()
    recorder.record(True, 1, 0, 8, None, 0.1)
    recorder.close()
    assert [r["device_work"] for r in recorder.records] == [None]


# -- the straggler rule -----------------------------------------------------------------------------------


def records(rank: int, host_work: float, device_work: float | None, steps: int = 20) -> list[dict]:
    """Every rank leaves the gradient all-reduce together: the same step time everywhere."""
    return [
        {
            "rank": rank,
            "step": s,
            "step_time": 0.1,
            "data_wait": 0.001,
            "sync_time": 0.1 - host_work,
            "device_work": device_work,
            "samples_per_s": 640.0,
        }
        for s in range(1, steps + 1)
    ]


def test_the_rank_whose_device_work_is_long_is_named_though_every_host_took_as_long():
    # Rank 2's GPU is slower. The others' hosts, having queued the all-reduce, wait for it in a device
    # sync inside their next step's own work (a full launch queue, the Session's check), so every host
    # counts 80 ms of own work; their devices spent 50 ms on it and rank 2's 80 ms.
    summary = summarize({0: records(0, 0.08, 0.05), 1: records(1, 0.08, 0.05), 2: records(2, 0.08, 0.08)})
    assert summary["straggler"] is not None and summary["straggler"]["rank"] == 2
    assert summary["work_from"] == "device"
    assert summary["straggler"]["excess_s"] == pytest.approx(0.03)
    assert [row["work_p50"] for row in summary["ranks"]] == pytest.approx([0.05, 0.05, 0.08])
    assert "its own work (device time before the gradient sync)" in verdict(summary)[0]


def test_a_rank_that_reads_its_device_every_step_is_not_named():
    # Rank 0 logs loss.item() each step: its host waits there for the others' all-reduce, and its host
    # work looks long, while its device does no more than the others'.
    summary = summarize({0: records(0, 0.09, 0.05), 1: records(1, 0.05, 0.05), 2: records(2, 0.05, 0.05)})
    assert summary["straggler"] is None


def test_without_a_device_figure_on_every_rank_the_host_times_are_compared():
    summary = summarize({0: records(0, 0.05, None), 1: records(1, 0.09, 0.05)})
    assert summary["work_from"] == "host"
    assert summary["straggler"] is not None and summary["straggler"]["rank"] == 1
