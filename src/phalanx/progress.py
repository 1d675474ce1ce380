"""Rank-0 progress bar: position, loss and global samples/s, refreshed a few times a second.

The loss is read from the device only at refresh time, so the bar never forces a sync per step.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

_REFRESH_S = 0.25


class Throughput:
    """Samples per second over one pass of a loader."""

    def __init__(self) -> None:
        self.samples = 0
        self.start = time.perf_counter()
        self.end: float | None = None

    def add(self, n: int) -> None:
        self.samples += n

    def stop(self) -> None:
        self.end = time.perf_counter()

    @property
    def seconds(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    @property
    def per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def track(
    batches: Iterable[Any],
    *,
    total: int | None,
    samples_per_batch: int,
    description: str,
    show: bool,
    loss: Callable[[], float | None],
    meter: Throughput,
) -> Iterator[Any]:
    """Yield from ``batches``, counting samples into ``meter`` and drawing a bar when ``show``."""
    if not show:
        for batch in batches:
            yield batch
            meter.add(samples_per_batch)
        meter.stop()
        return

    # Under `phalanx launch` stdout is a tee to the log file; draw live frames on the terminal
    # behind it only, so the log keeps the final line and not hundreds of redraws.
    stream = sys.stdout
    terminal = getattr(stream, "terminal", None)
    console = Console(file=terminal if terminal is not None and stream.isatty() else stream)
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("<"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
    ]
    with Progress(*columns, console=console, refresh_per_second=1 / _REFRESH_S) as bar:
        task = bar.add_task(description, total=total, status="")
        last = 0.0
        for batch in batches:
            yield batch
            meter.add(samples_per_batch)
            now = time.perf_counter()
            if now - last >= _REFRESH_S:
                last = now
                bar.update(task, completed=_count(meter, samples_per_batch), status=_status(loss(), meter.per_second))
        meter.stop()
        status = _status(loss(), meter.per_second)
        bar.update(task, completed=_count(meter, samples_per_batch), status=status)
    if console.file is not stream:
        done = _count(meter, samples_per_batch)
        print(f"{description}: {done}{f'/{total}' if total is not None else ''} batches in {meter.seconds:.1f}s, {status}", file=stream.log, flush=True)


def _count(meter: Throughput, per_batch: int) -> int:
    return meter.samples // max(per_batch, 1)


def _status(loss: float | None, rate: float) -> str:
    text = f"{rate:,.0f} samples/s"
    return f"loss {loss:.4f}  {text}" if loss is not None else text
