"""``--profile steps=A:B``: a torch.profiler trace of optimizer steps A to B-1 on chosen ranks.

Steps are counted from 1, like the ``step`` of the metrics records, and the window is half-open
like a Python slice: ``steps=5:8`` traces steps 5, 6 and 7. The profiler starts when step A-1
ends (for A = 1: when the first training batch is requested) and stops when step B-1 ends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from phalanx.errors import ConfigError

_SPEC = re.compile(r"^\s*steps\s*=\s*(\d+)\s*:\s*(\d+)\s*$")
_TOP = 10


@dataclass(frozen=True)
class ProfileWindow:
    start: int  # first optimizer step traced
    stop: int  # first step after the window

    @classmethod
    def parse(cls, spec: str) -> "ProfileWindow":
        match = _SPEC.match(str(spec))
        if not match:
            raise ConfigError(
                f"profile '{spec}' is not of the form steps=A:B; e.g. steps=5:8 traces optimizer steps 5, 6 and 7"
            )
        start, stop = int(match.group(1)), int(match.group(2))
        if start < 1 or stop <= start:
            raise ConfigError(
                f"profile '{spec}' traces no step: steps=A:B needs 1 <= A < B "
                "(optimizer steps A to B-1, counted from 1), e.g. steps=5:8"
            )
        return cls(start, stop)

    def describe(self) -> str:
        last = self.stop - 1
        return f"step {self.start}" if last == self.start else f"steps {self.start}-{last}"


def parse_ranks(text: str) -> list[int]:
    """``"0,1"`` -> ``[0, 1]``, for ``--profile-ranks``."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or not all(p.isascii() and p.isdigit() for p in parts):
        raise ConfigError(f"--profile-ranks expects comma-separated ranks such as 0,1; got '{text}'")
    return sorted({int(p) for p in parts})


def profile_overrides(spec: str | None, ranks: str | None) -> list[str]:
    """The ``--set`` lines that ``--profile`` and ``--profile-ranks`` stand for; they reach the
    workers with the other ``--set`` lines."""
    lines = []
    if spec is not None:
        lines.append(f"train.profile={spec}")
    if ranks is not None:
        lines.append(f"train.profile_ranks=[{','.join(map(str, parse_ranks(ranks)))}]")
    return lines


class StepProfiler:
    """Starts and stops torch.profiler at optimizer-step boundaries and writes a Chrome trace."""

    def __init__(self, window: ProfileWindow, rank: int, device: torch.device, out_dir: Path):
        self.window = window
        self.rank = rank
        self.device = device
        self.path = out_dir / f"rank{rank}.json"
        self._profiler: torch.profiler.profile | None = None
        self._done = False

    def step_end(self, step: int) -> bool:
        """Called with 0 when the first batch is requested, then after each optimizer step; True
        when this call saved the trace (slow: the caller leaves it out of the step's time)."""
        if self._done:
            return False
        if self._profiler is None and step == self.window.start - 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
        elif self._profiler is not None and step >= self.window.stop - 1:
            self.finish()
            return True
        return False

    def close(self, last_step: int) -> None:
        """At the end of the run: save a trace cut short by it, or say the window was never reached."""
        if self._profiler is not None:
            self.finish()
        elif not self._done:
            print(
                f"phalanx: no profile on rank {self.rank}: the run ended after step {last_step}, "
                f"before {self.window.describe()}",
                flush=True,
            )
        self._done = True

    def finish(self) -> None:
        if self._profiler is None:
            return
        self._done = True
        self._profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(self.path))
        print(
            f"phalanx: profile of {self.window.describe()} on rank {self.rank}: {self.path} "
            "(open it in https://ui.perfetto.dev or chrome://tracing)",
            flush=True,
        )
        print(top_operators(self._profiler.key_averages(), on_device=self.device.type == "cuda"), flush=True)
        self._profiler = None


def top_operators(averages, *, on_device: bool, limit: int = _TOP) -> str:
    """The operators with the most self time, as a few aligned lines."""
    attr = "self_device_time_total" if on_device else "self_cpu_time_total"
    events = sorted(averages, key=lambda e: getattr(e, attr), reverse=True)[:limit]
    total = sum(getattr(e, attr) for e in averages) or 1.0
    where = "GPU" if on_device else "CPU"
    lines = [
        f"phalanx: top {len(events)} operators by self {where} time",
        f"  {'self time':>11}  {'share':>6}  {'calls':>6}  operator",
    ]
    for event in events:
        micros = getattr(event, attr)
        lines.append(f"  {micros / 1e3:>8.2f} ms  {100 * micros / total:>5.1f}%  {event.count:>6}  {event.key}")
    return "\n".join(lines)
