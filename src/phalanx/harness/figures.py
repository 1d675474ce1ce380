"""Per-step metrics of a short run -> its figures (medians after warm-up), which bench and tune
both read.

Pure functions of the records, so tests feed them synthetic metrics.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import PhalanxError


@dataclass(frozen=True)
class RunFigures:
    """One run, as medians over its steps after warm-up."""

    nproc: int
    global_batch: int  # samples per optimizer step over all devices
    steps: int  # steps measured (after warm-up)
    samples_per_s: float
    step_time: float  # seconds; a step's time is its slowest rank's
    data_wait: float  # seconds; a step's wait is its longest-waiting rank's
    peak_mem_bytes: int | None
    noise_scale: float | None = None  # the gradient noise scale at the run's last complete step


def read_metrics(metrics_dir: Path) -> dict[int, list[dict]]:
    """``rank<N>.jsonl`` files -> records per rank. A run stopped mid-write may end in half a line."""
    by_rank: dict[int, list[dict]] = {}
    for path in sorted(metrics_dir.glob("rank*.jsonl")):
        records = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        by_rank[int(path.stem.removeprefix("rank"))] = records
    return by_rank


def steps_recorded(metrics_dir: Path) -> int:
    """Optimizer steps every rank has written so far (0 before the files exist)."""
    counts = [sum(1 for _ in path.open(encoding="utf-8", errors="replace")) for path in metrics_dir.glob("rank*.jsonl")]
    return min(counts, default=0)


def run_figures(
    nproc: int, by_rank: dict[int, list[dict]], warmup: int, name: str, limit: int | None = None
) -> RunFigures:
    """Steps ``warmup + 1`` to ``limit``; ``name`` says which run in errors. Steps that not every
    rank recorded are left out, and so are those past ``limit``: a run stopped from outside goes
    on for a moment, and its last steps overlap the shutdown."""
    steps: dict[int, list[dict]] = {}
    for records in by_rank.values():
        # A rank that torch elastic restarted appends to its file: its last record of a step counts.
        for step, record in {int(r["step"]): r for r in records}.items():
            steps.setdefault(step, []).append(record)
    complete = [steps[s] for s in sorted(steps) if len(steps[s]) == len(by_rank)]
    if not complete:
        raise PhalanxError(
            f"{name} recorded no optimizer step in its metrics; bench reads the per-step metrics phalanx.Session writes"
        )
    measured = complete[warmup:limit]
    if not measured:
        raise PhalanxError(
            f"{name} recorded {len(complete)} step(s), all of them warm-up ({warmup}); raise --steps or lower --warmup"
        )
    if any(step[0].get("samples") is None for step in measured):
        raise PhalanxError(
            f"{name} recorded no samples per step: phalanx knows the global batch only from a training (shuffling) "
            "DataLoader or from batch.global_batch_size; add --set batch.global_batch_size=N"
        )
    # Steps that estimated the noise scale paid for it (phalanx tune --objective time estimates on
    # every other step): the time figures come from the others where there are any.
    timed = [step for step in measured if not any(r.get("noise_estimated") for r in step)] or measured
    step_time = statistics.median(max(r["step_time"] for r in step) for step in timed)
    data_wait = statistics.median(max(r["data_wait"] for r in step) for step in timed)
    batch = int(statistics.median(step[0]["samples"] for step in measured))
    peaks = [r["peak_mem_bytes"] for step in measured for r in step if r.get("peak_mem_bytes")]
    return RunFigures(
        nproc=nproc,
        global_batch=batch,
        steps=len(measured),
        samples_per_s=batch / step_time if step_time > 0 else 0.0,
        step_time=step_time,
        data_wait=data_wait,
        peak_mem_bytes=max(peaks) if peaks else None,
        noise_scale=complete[-1][0].get("noise_scale"),  # the smoothed estimate: its latest is its best
    )


def measure(run_dir: Path, nproc: int, warmup: int, name: str, limit: int | None = None) -> RunFigures:
    """The figures of a run the launcher made in ``run_dir``, from the metrics its ranks wrote."""
    return run_figures(nproc, read_metrics(run_dir / "metrics"), warmup, name, limit)
