"""The table ``phalanx tune`` prints: every trial, what it set, how fast it ran, how it ended."""

from __future__ import annotations

from rich.table import Table

from phalanx.tune.trials import OK, Trial
from phalanx.util.units import format_bytes

TABLE_NOTE = (
    "samples/s: global samples per second, median step after warm-up; data wait: the share of the step "
    "the slowest rank waited for its loader; peak memory: the largest rank's (CUDA: allocator peak; "
    "CPU: resident growth, under a memory cap only)."
)


def tune_table(trials: list[Trial]) -> Table:
    table = Table(title="phalanx tune: trials")
    for name, justify in (
        ("#", "right"),
        ("stage", "left"),
        ("setting", "left"),
        ("samples/s", "right"),
        ("data wait", "right"),
        ("peak memory", "right"),
        ("outcome", "left"),
    ):
        table.add_column(name, justify=justify)
    for trial in trials:
        ok = trial.outcome == OK
        share = trial.data_wait_share
        peak = trial.figures.peak_mem_bytes if trial.figures else None
        outcome = trial.describe_outcome() + (", chosen" if trial.chosen else "")
        table.add_row(
            str(trial.number),
            trial.stage,
            trial.label,
            f"{trial.samples_per_s:,.0f}" if ok else "-",
            f"{share:.0%}" if share is not None else "-",
            format_bytes(peak) if peak else "-",
            f"[bold]{outcome}[/bold]" if trial.chosen else outcome,
        )
    return table
