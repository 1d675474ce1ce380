"""Host-device synchronisation per optimizer step on a GPU (issue 26): phalanx's own code must make
the host wait for the device only at its documented read points, never once per step. Counted two
ways in the same run, against a hand-written loop and a control loop that reads its loss every step:

1. torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) warns at each call that makes
   the host wait for the device. A warning whose innermost caller outside torch is a phalanx source
   file is phalanx's; outside the read points that the CPU test allows (tests/helpers/tensor_reads.py)
   it is a stray sync.
2. CUDA events: one is recorded as each step is queued. Once the host has queued step i, has the
   device already finished step i-1? A loop that waits for the device every step finds it so each
   time (the device then idles while the host queues the next step); one that never waits keeps
   work queued. The share of such "drained" steps and the device's time per step, event to event,
   are given for each loop.

The workload is GPU-bound on purpose (an MLP of 4 layers of 2048, 2048 samples per step, about 3 ms
on an H200), so the host can run ahead whenever nothing makes it wait.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

import phalanx
from tests.gpu.acceptance import workloads
from tests.gpu.acceptance.report import Check
from tests.gpu.acceptance.workloads import batched_loader, mlp, on_cuda, quiet, sync, teacher_data
from tests.helpers.tensor_reads import SOURCE, at_read_point

FEATURES, WIDTH, DEPTH, MICRO = 1024, 2048, 4, 2048
STEPS, WARMUP = 300, 20
DRAINED_SLACK = 0.05  # phalanx may find the device drained on at most 5 more steps in 100 than raw
DEVICE_RATIO = 1.02  # the device's median step under phalanx at most 2% longer than under raw
SYNC_WARNING = "synchronizing CUDA operation"
_TORCH = os.path.dirname(torch.__file__) + os.sep
_WARNINGS = os.path.dirname(warnings.__file__) + os.sep + "warnings.py"


@dataclass
class SyncLog:
    counting: bool = False
    stray: Counter = field(default_factory=Counter)  # "file:line in function" -> syncs, phalanx's outside a read point
    allowed: int = 0  # phalanx's, at a read point
    other: int = 0  # the loop's own (the control's loss reads), or this check's

    def note(self, frame) -> None:
        while frame is not None and _inside_torch(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(SOURCE):
            self.other += 1
        elif at_read_point(frame):
            self.allowed += 1
        else:
            where = f"{frame.f_code.co_filename[len(SOURCE) :]}:{frame.f_lineno} in {frame.f_code.co_qualname}"
            self.stray[where] += 1


def _inside_torch(path: str) -> bool:
    """The warning machinery's frames and torch's own Python code: a sync torch makes for its
    caller belongs to that caller."""
    return path == _WARNINGS or path.startswith(_TORCH)


@contextlib.contextmanager
def capturing(log: SyncLog) -> Iterator[SyncLog]:
    """Every sync warning while ``log.counting``, from whatever thread gives it (the metrics
    thread's reads are at a read point), goes to ``log``; other warnings are shown as usual."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every sync, not the first per place
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                if log.counting:
                    log.note(sys._getframe(1))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield log


@contextlib.contextmanager
def recording() -> Iterator[SyncLog]:
    """torch's sync debug mode on, its warnings captured. Without CUDA nothing is recorded (a
    smoke run)."""
    log = SyncLog()
    if not on_cuda():
        yield log
        return
    with capturing(log):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield log
        finally:
            torch.cuda.set_sync_debug_mode("default")


@dataclass
class Measured:
    steps: int
    log: SyncLog
    drained: float  # share of steps that found the device done with the step before
    device_ms: float  # median, event to event


def timed(batches: Iterable, body: Callable, log: SyncLog) -> Measured:
    """``body(x, y)`` queues one optimizer step; events and counting from step WARMUP on."""
    events, drained = [], 0
    for i, (x, y) in enumerate(batches):
        if i == WARMUP:
            sync()
            log.counting = True
        body(x, y)
        if i < WARMUP or not on_cuda():
            continue
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if events and events[-1].query():  # not a sync: a look at whether the device got there
            drained += 1
        events.append(event)
    log.counting = False
    sync()
    device = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    return Measured(len(events), log, drained / max(len(events) - 1, 1), statistics.median(device) if device else 0.0)


def loader():
    pool = teacher_data(8 * MICRO, features=FEATURES)
    return batched_loader(pool, MICRO * (WARMUP + STEPS), MICRO, shuffle=True, pin_memory=on_cuda())


def raw(read_loss: bool = False) -> Measured:
    """A careful hand-written loop; with ``read_loss`` it reads its loss every step (the control)."""
    device = workloads.DEVICE
    model = mlp(FEATURES, WIDTH, DEPTH).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    seen = []

    def body(x, y):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if read_loss:
            seen.append(loss.item())

    with recording() as log:
        return timed(loader(), body, log)


def with_phalanx() -> Measured:
    """phalanx's defaults on one GPU: metrics and the progress bar on, as a user's run has them."""
    with quiet():
        session = phalanx.Session(
            phalanx.Config(), strategy="single", train={"progress": True}, checkpoint={"resume": "never"}
        )
        model = mlp(FEATURES, WIDTH, DEPTH)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model, optimizer, data = session.setup(model, optimizer, loader())

        def body(x, y):
            with session.accumulate(model):
                session.backward(F.cross_entropy(model(x), y))

        with recording() as log:
            measured = timed(session.progress(data), body, log)
        session.close()
    return measured


def run(repeats: int) -> list[Check]:
    runs: dict[str, list[Measured]] = {"raw": [], "phalanx": [], "control": []}
    contenders = [("raw", raw), ("phalanx", with_phalanx), ("control", lambda: raw(read_loss=True))]
    for repeat in range(repeats):
        shift = repeat % len(contenders)
        for name, fn in contenders[shift:] + contenders[:shift]:
            started = time.perf_counter()
            runs[name].append(fn())
            print(f"gpu_check: syncs, {name} {repeat + 1}/{repeats}: {time.perf_counter() - started:.1f}s", flush=True)

    stray = sum((m.log.stray for m in runs["phalanx"]), Counter())
    steps = sum(m.steps for m in runs["phalanx"])
    allowed = sum(m.log.allowed for m in runs["phalanx"])
    control_syncs = min(m.log.other for m in runs["control"])
    drained = {name: statistics.median(m.drained for m in ms) for name, ms in runs.items()}
    device = {name: statistics.median(m.device_ms for m in ms) for name, ms in runs.items()}
    values = {"drained": drained, "device_ms": device, "stray": dict(stray), "allowed": allowed, "steps": steps}
    listed = "; ".join(f"{n}x {where}" for where, n in stray.most_common(5))
    return [
        Check(
            "the sync counter sees a loop that reads its loss each step",
            control_syncs >= STEPS and drained["control"] >= 0.9,
            f"control: {control_syncs} syncs over {STEPS} steps, device drained on {drained['control']:.0%} of them",
            "at least one sync a step and at least 90% drained (else the two measures below could not fail)",
            values,
        ),
        Check(
            "no sync per step in phalanx's own code",
            not stray,
            f"{sum(stray.values())} stray syncs over {steps} steps"
            + (f": {listed}" if listed else "")
            + f"; {allowed} at read points (flushes, redraws)",
            "none outside a documented read point",
            values,
        ),
        Check(
            "the device waits on phalanx no more than on a hand-written loop",
            drained["phalanx"] <= drained["raw"] + DRAINED_SLACK,
            f"drained on {drained['phalanx']:.1%} of steps against raw's {drained['raw']:.1%}; "
            f"device step {device['phalanx']:.3f} ms against {device['raw']:.3f} ms "
            f"({device['phalanx'] / max(device['raw'], 1e-9):.3f}x)",
            f"at most {DRAINED_SLACK:.0%} more steps drained",
            values,
        ),
        Check(
            "phalanx's step on the device (CUDA events)",
            device["phalanx"] <= device["raw"] * DEVICE_RATIO,
            f"{device['phalanx']:.3f} ms against raw's {device['raw']:.3f} ms, medians of {repeats}",
            f"at most {DEVICE_RATIO:.2f}x the raw loop's",
            values,
        ),
    ]
