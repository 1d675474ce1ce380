"""On NCCL a rank waiting for a stuck peer blocks in a device sync, outside any collective, so the
stacks alone blame every rank. Each rank's dump then says what its GPU had done (step-end CUDA
events, asked without a sync), and the hang summary names the rank whose device ran out of work
while the others' devices hold collectives that do not complete. Fake events stand in for CUDA."""

from __future__ import annotations

import os
import threading
import time
import traceback

import torch

import phalanx
from phalanx.faults.device_progress import KEPT, DeviceFacts, DeviceProgress, parse_device_line
from phalanx.faults.watchdog import Watchdog
from phalanx.launch.outcome import hang_summary, report_hang

PHALANX = os.path.dirname(phalanx.__file__)
TORCH = os.path.dirname(torch.__file__)
# Where a rank waiting for a peer under NCCL blocks: the step agreement reads its all-reduce's result.
IN_DEVICE_SYNC = [
    ("/job/train.py", 24, "<module>", "session.step()"),
    (f"{PHALANX}/session/recovery.py", 378, "after_step", "stop, timed, resize = self.agreement.poll("),
    (f"{PHALANX}/faults/agreement.py", 61, "poll", "stop, save, slowest, resize = flags.tolist()"),
]
ASLEEP = [("/job/train.py", 42, "<module>", "time.sleep(600)")]
IN_BARRIER = [
    ("/job/train.py", 35, "<module>", "session.barrier()"),
    (f"{TORCH}/distributed/distributed_c10d.py", 4150, "barrier", "work.wait()"),
]


class FakeEvent:
    def __init__(self, done: bool = True):
        self.done = done
        self.recorded = 0

    def record(self) -> None:
        self.recorded += 1

    def query(self) -> bool:
        return self.done


def progress(events: list[FakeEvent], idle: bool = True, device: str = "cuda:1") -> DeviceProgress:
    made = iter(events)
    record = DeviceProgress(
        torch.device(device), make_event=lambda: next(made), stream_idle=lambda: idle, settle_s=0.01, answer_s=0.5
    )
    for _ in events:
        record.step_ended()
    return record


def dump(rank: int, frames, host: int, done: int | None, pending: bool | None) -> str:
    """A rank's dump as the watchdog writes it on a GPU (see Watchdog._fire)."""
    stack = "".join(
        traceback.format_list(
            [traceback.FrameSummary(f, n, name, lookup_line=False, line=c) for f, n, name, c in frames]
        )
    )
    device = DeviceFacts(f"cuda:{rank}", host, done, pending).line()
    return (
        f"phalanx: hang: rank {rank}: no progress for 5.1 s (faults.hang_timeout is 5 s); waiting in ...\n"
        f"{device}\nstack of rank {rank} (most recent call last):\n{stack}"
    )


# -- what a rank's dump says about its device ------------------------------------------------------


def test_the_last_finished_step_and_pending_work_come_from_the_events(monkeypatch):
    asked: list[tuple[torch.device, str]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: asked.append((d, threading.current_thread().name)))
    behind = progress([FakeEvent(True), FakeEvent(True), FakeEvent(False)]).facts()
    assert behind == DeviceFacts("cuda:1", 3, 2, True)
    # The query ran on a thread that first made the rank's own GPU current, not GPU 0.
    assert asked == [(torch.device("cuda:1"), "phalanx-device-facts")]
    assert progress([FakeEvent(True)] * 3).facts() == DeviceFacts("cuda:1", 3, 3, False)
    # Every step done, but work queued after the last one (the next step's collective) is not.
    assert progress([FakeEvent(True)] * 3, idle=False).facts() == DeviceFacts("cuda:1", 3, 3, True)


def test_only_the_last_steps_are_kept_and_none_recorded_means_none_done(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    events = [FakeEvent(True) for _ in range(5)] + [FakeEvent(False) for _ in range(KEPT)]
    record = progress(events)
    assert all(e.recorded == 1 for e in events)
    assert record.facts() == DeviceFacts("cuda:1", 5 + KEPT, None, True)  # none of the kept ones finished
    assert progress([], idle=True).facts() == DeviceFacts("cuda:1", 0, 0, False)


def test_a_device_that_does_not_answer_does_not_hold_up_the_dump(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    stuck = FakeEvent()
    stuck.query = lambda: time.sleep(30)  # a driver call that blocks
    began = time.monotonic()
    assert progress([stuck]).facts() == DeviceFacts("cuda:1", 1, None, None)
    assert time.monotonic() - began < 5


def test_the_device_line_reads_back():
    for facts in (
        DeviceFacts("cuda:3", 12, 9, True),
        DeviceFacts("cuda:0", 9, 9, False),
        DeviceFacts("cuda:0", 40, None, True),
        DeviceFacts("cuda:7", 2, None, None),
    ):
        assert parse_device_line(f"phalanx: hang: ...\n{facts.line()}\nstack of rank 0 ...\n") == facts
    assert parse_device_line("phalanx: hang: ...\nstack of rank 0 (most recent call last):\n") is None


def test_the_watchdog_writes_its_device_s_facts_into_the_dump(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    events = [FakeEvent(True), FakeEvent(False)]
    made = iter(events)
    device = DeviceProgress(torch.device("cuda:0"), make_event=lambda: next(made), stream_idle=lambda: False)
    exits: list[int] = []
    dog = Watchdog(0.2, 0, str(tmp_path), progress=device, exit=exits.append)
    try:
        dog.stepped()
        dog.stepped()  # each optimizer step's end is recorded on the device
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        dog.close()
    assert exits == [124] and [e.recorded for e in events] == [1, 1]
    lines = dog.dump.read_text().splitlines()
    assert lines[1] == "on the device (cuda:0): 2 steps ended on the host, 1 on the device; work pending on the device"
    assert lines[2] == "stack of rank 0 (most recent call last):"
    capsys.readouterr()
    report_hang(tmp_path)
    err = capsys.readouterr().err.splitlines()
    assert err[2].startswith("  rank 0: no progress") and err[3] == f"    {lines[1]}"
    assert err[4].startswith("    |   File ")


# -- the verdict over every rank, NCCL-shaped --------------------------------------------------------


def test_the_rank_whose_device_ran_out_of_work_is_named_when_every_host_is_outside_a_collective():
    dumps = {
        0: dump(0, IN_DEVICE_SYNC, 12, 9, True),
        1: dump(1, ASLEEP, 9, 9, False),
        2: dump(2, IN_DEVICE_SYNC, 12, 9, True),
        3: dump(3, IN_DEVICE_SYNC, 12, 9, True),
    }
    assert hang_summary(dumps) == (
        "phalanx: hang: rank 1 stopped making progress after step 9 (at train.py:42: time.sleep(600)) with nothing "
        "left to run on its device; ranks 0, 2, 3 were waiting for it on the device "
        "(collectives queued on their GPUs do not complete)"
    )


def test_a_rank_in_a_host_side_collective_with_an_idle_device_waits_and_silent_ranks_are_noted():
    dumps = {
        0: dump(0, IN_DEVICE_SYNC, 12, 9, True),
        1: dump(1, ASLEEP, 9, 9, False),
        2: dump(2, IN_BARRIER, 9, 9, False),
    }
    assert hang_summary(dumps, silent=[3]) == (
        "phalanx: hang: rank 1 stopped making progress after step 9 (at train.py:42: time.sleep(600)) with nothing "
        "left to run on its device; rank 0 was waiting for it on the device "
        "(collectives queued on their GPUs do not complete), rank 2 in barrier; "
        "rank 3 left no stack (stuck in native code, or already gone)"
    )


def test_with_every_device_idle_the_ranks_with_fewest_host_steps_are_behind():
    dumps = {0: dump(0, ASLEEP, 10, 10, False), 1: dump(1, IN_DEVICE_SYNC, 9, 9, False)}
    assert hang_summary(dumps) == (
        "phalanx: hang: rank 1 is behind: 9 steps ended on its host, 10 on the others' "
        "(rank 1 at train.py:24: session.step()); every device is idle and no rank is in a collective "
        "(the others: rank 0 at train.py:42: time.sleep(600))"
    )
    # The same step everywhere: the devices decide nothing, the stacks speak as on gloo.
    same = {0: dump(0, ASLEEP, 9, 9, False), 1: dump(1, IN_DEVICE_SYNC, 9, 9, False)}
    assert hang_summary(same).startswith("phalanx: hang: every rank stopped making progress outside any collective")


def test_with_work_pending_on_every_device_the_one_that_finished_fewer_steps_is_behind():
    dumps = {0: dump(0, IN_DEVICE_SYNC, 12, 9, True), 1: dump(1, IN_DEVICE_SYNC, 12, 8, True)}
    assert hang_summary(dumps).startswith(
        "phalanx: hang: every device holds work that does not complete; rank 1 is behind "
        "(its device finished 8 steps, the others 9)"
    )
    level = {0: dump(0, IN_DEVICE_SYNC, 12, 9, True), 1: dump(1, IN_BARRIER, 10, 9, True)}
    line = hang_summary(level)
    assert line.startswith("phalanx: hang: every device holds work that does not complete and none is behind")
    assert line.endswith(
        "(their hosts: rank 0 at train.py:24: session.step(), rank 1 at train.py:35: session.barrier())"
    )


def test_a_silent_rank_is_the_suspect_when_every_device_that_answered_waits():
    dumps = {0: dump(0, IN_DEVICE_SYNC, 12, 9, True), 1: dump(1, IN_DEVICE_SYNC, 12, 9, True)}
    assert hang_summary(dumps, silent=[2]) == (
        "phalanx: hang: rank 2 left no stack (stuck in native code, or already gone), so it is the likely hung rank; "
        "ranks 0, 1 were waiting for it on the device (collectives queued on their GPUs do not complete)"
    )


def test_a_device_that_did_not_answer_leaves_the_verdict_to_the_stacks():
    dumps = {0: dump(0, IN_DEVICE_SYNC, 12, 9, True), 1: dump(1, ASLEEP, 9, None, None)}
    assert hang_summary(dumps).startswith("phalanx: hang: every rank stopped making progress outside any collective")
