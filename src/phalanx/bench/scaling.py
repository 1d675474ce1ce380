"""Figures at 1..N devices -> efficiency and step-time split: what bench adds to the short runs'
figures (harness/figures.py)."""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.errors import PhalanxError
from phalanx.harness.figures import RunFigures


@dataclass(frozen=True)
class Scaling:
    """One device count against the 1-device run."""

    run: RunFigures
    speedup: float
    efficiency: float  # samples/s(N) / (N x samples/s(1))
    compute: float  # the 1-device step time minus its data wait
    comm_wait: float  # step time - compute - data wait, at least 0

    @property
    def nproc(self) -> int:
        return self.run.nproc


def scaling(runs: list[RunFigures], *, strong: bool = False) -> list[Scaling]:
    """Each run against the 1-device one. The split is an estimate: the 1-device compute is assumed
    to hold at N devices, which needs the same micro-batch per device (bench keeps it); ``strong``:
    the global batch was kept instead, so each device computes 1/N of it, taken as 1/N of the time."""
    base = next((r for r in runs if r.nproc == 1), None)
    if base is None:
        raise PhalanxError("scaling needs the 1-device run as its baseline")
    compute = max(base.step_time - base.data_wait, 0.0)
    rows = []
    for run in sorted(runs, key=lambda r: r.nproc):
        ideal = run.nproc * base.samples_per_s
        rows.append(
            Scaling(
                run=run,
                speedup=run.samples_per_s / base.samples_per_s if base.samples_per_s else 0.0,
                efficiency=run.samples_per_s / ideal if ideal else 0.0,
                compute=compute / run.nproc if strong else compute,
                comm_wait=max(run.step_time - (compute / run.nproc if strong else compute) - run.data_wait, 0.0),
            )
        )
    return rows
