"""Rank-0 progress bar: position, loss, global samples/s and the share of time spent waiting for
data, refreshed a few times a second.

The loss is read from the device only at refresh time, so the bar never forces a sync per step.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable, Iterator

_REFRESH_S = 0.25


class Throughput:
    """Samples per second over one pass of a loader, and how much of it the loop waited for data."""

    def __init__(self) -> None:
        self.samples = 0
        self.start = time.perf_counter()
        self.end: float | None = None
        self.first_batch: float | None = None  # when the first batch arrived
        self.data_wait = 0.0  # seconds spent waiting for batches after the first
        self.batches = 0  # batches that arrived

    def add(self, n: int) -> None:
        self.samples += n

    def waited(self, seconds: float) -> None:
        """The loop waited ``seconds`` for a batch that has just arrived."""
        self.batches += 1
        if self.first_batch is None:
            # Starting the pass (worker start-up, the first load) is left out: it is paid once
            # per pass and would hide the steady state for the first part of every epoch.
            self.first_batch = time.perf_counter()
        else:
            self.data_wait += seconds

    def stop(self) -> None:
        self.end = time.perf_counter()

    @property
    def seconds(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    @property
    def per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def data_share(self) -> float | None:
        """Share of the time since the first batch arrived that the loop spent waiting for the
        next one (None before a second batch)."""
        if self.first_batch is None or self.batches < 2:
            return None
        span = (self.end or time.perf_counter()) - self.first_batch
        return min(self.data_wait / span, 1.0) if span > 0 else None


def track(
    batches: Iterable[Any],
    *,
    total: int | None,
    samples_per_batch: int,
    description: str,
    show: bool,
    loss: Callable[[], float | None],
    meter: Throughput,
    joined: Callable[[], int] | None = None,
) -> Iterator[Any]:
    """Yield from ``batches``, counting samples and data waits into ``meter`` and drawing a bar when ``show``.
    ``joined``: how many of the loader's batches the one just yielded holds (batch.adaptive joins them;
    None: always one)."""
    if not show:
        yield from _timed(batches, meter, samples_per_batch, joined, None)
        meter.stop()
        return

    # Only the rank that draws the bar loads rich (every worker imports this module).
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

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
    # Drawn from the training thread at its redraws: rich's own refresh thread would wake 4 times a
    # second to render, taking its time from the training threads where they fill the cores.
    with Progress(*columns, console=console, auto_refresh=False) as bar:
        task = bar.add_task(description, total=total, status="")
        last = 0.0

        def maybe_redraw() -> None:
            nonlocal last
            now = time.perf_counter()
            if now - last >= _REFRESH_S:
                last = now
                _redraw(bar, task, meter, samples_per_batch, loss)

        yield from _timed(batches, meter, samples_per_batch, joined, maybe_redraw)
        meter.stop()
        status = _redraw(bar, task, meter, samples_per_batch, loss)
    if console.file is not stream:
        done = _count(meter, samples_per_batch)
        print(
            f"{description}: {done}{f'/{total}' if total is not None else ''} batches in "
            f"{meter.seconds:.1f}s, {status}",
            file=stream.log,
            flush=True,
        )


def _redraw(bar: Any, task: Any, meter: Throughput, per_batch: int, loss: Callable[[], float | None]) -> str:
    """A refresh of the bar, every ``_REFRESH_S`` seconds: the only place it reads the loss from
    the device."""
    status = _status(loss(), meter.per_second, meter.data_share)
    bar.update(task, completed=_count(meter, per_batch), status=status, refresh=True)
    return status


def _timed(
    batches: Iterable[Any],
    meter: Throughput,
    per_batch: int,
    joined: Callable[[], int] | None,
    after: Callable[[], None] | None,
) -> Iterator[Any]:
    """``batches``, timing how long each one takes to arrive once the loop asks for it and counting
    its samples once the loop is done with it; then ``after``. One generator for all of it: this
    runs once per batch, and each layer of generators costs the step a resumption."""
    iterator = iter(batches)
    clock = time.perf_counter
    while True:
        asked = clock()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        meter.waited(clock() - asked)
        yield batch
        meter.add(per_batch * joined() if joined is not None else per_batch)
        if after is not None:
            after()


def _count(meter: Throughput, per_batch: int) -> int:
    return meter.samples // max(per_batch, 1)


def _status(loss: float | None, rate: float, data_share: float | None = None) -> str:
    parts = [f"loss {loss:.4f}"] if loss is not None else []
    parts.append(f"{rate:,.0f} samples/s")
    if data_share is not None:
        parts.append(f"data {100 * data_share:.0f}%")
    return "  ".join(parts)
