"""Hang watchdog: a thread that notices when a rank stops making progress, prints where it is stuck
(Python stack, and the collective it waits in), and stops the job long before a collective
timeout (10 minutes in PyTorch) would.

The main thread calls ``beat()`` at every step, batch and collective; that is one attribute write.
When one rank fires it leaves a file in ``<run dir>/hang/``; the other ranks' watchdogs see it
within a second and dump their own stacks too, so the user sees every rank, not only the first.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Callable, Iterator

from phalanx.faults.markers import HANG_DIR, HANG_EXIT

# While a checkpoint is written or read, the disk sets the pace: a hang there is only called one
# after this long (or hang_timeout, if longer).
IO_TIMEOUT_S = 1800.0

# Frames in these files are the library, not the place the user's code is stuck.
_LIBRARY = (os.sep + "torch" + os.sep, os.sep + "phalanx" + os.sep, "threading.py", "runpy.py")


class Watchdog:
    """``timeout`` is faults.hang_timeout; ``first_step_timeout`` (faults.first_step_timeout, 0: no
    limit) replaces it from :meth:`expect_first_step` (training begins) until :meth:`stepped`
    (the first optimizer step finished): a first step compiles, autotunes and warms up
    communication, which may take many times as long as the steps after it."""

    def __init__(
        self,
        timeout: float,
        rank: int,
        run_dir: str | None,
        attempt: int = 0,
        *,
        first_step_timeout: float = 0.0,
        exit: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.timeout = timeout
        self.first_step_timeout = first_step_timeout
        self.rank = rank
        # One directory per restart attempt: a restarted job must not see the last attempt's dumps.
        self.dump_dir = Path(run_dir) / HANG_DIR / f"attempt{attempt}" if run_dir else None
        self._exit = exit
        self._clock = clock
        self._last: float | None = None  # armed by the first beat: setup may take long
        self._paused = 0
        self._first_step = False  # between the start of training and the end of its first step
        self.has_stepped = False
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self.fired: str | None = None
        self._thread = threading.Thread(target=self._watch, name="phalanx-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last = self._clock()

    def expect_first_step(self) -> None:
        """Training begins: the first-step limit holds until :meth:`stepped`."""
        if not self.has_stepped:
            self._first_step = True

    def stepped(self) -> None:
        """An optimizer step finished: hang_timeout holds from here on."""
        self.has_stepped = True
        self._first_step = False
        self.beat()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Saving and loading take as long as the disk takes: allow IO_TIMEOUT_S inside."""
        self._paused += 1
        self.beat()
        try:
            yield
        finally:
            self._paused -= 1
            self.beat()

    def close(self) -> None:
        self._stop.set()

    def limit(self) -> float | None:
        """Seconds without progress that count as a hang now; None: no limit."""
        if self._first_step:
            if not self.first_step_timeout:
                return None
            limit = max(self.first_step_timeout, self.timeout)  # never shorter than a later step's
        else:
            limit = self.timeout
        return max(limit, IO_TIMEOUT_S) if self._paused else limit

    def overdue(self) -> str | None:
        """Why this rank counts as hung now (the headline of its dump), or None."""
        last, limit = self._last, self.limit()
        if last is None or limit is None:
            return None
        idle = self._clock() - last
        if idle <= limit:
            return None
        during = " while reading or writing a checkpoint" if self._paused else ""
        if self._first_step:
            setting = (
                f"before the first optimizer step finished (faults.first_step_timeout is {self.first_step_timeout:g} s)"
            )
        else:
            setting = f"(faults.hang_timeout is {self.timeout:g} s)"
        return f"rank {self.rank}: no progress for {idle:.1f} s{during} {setting}"

    def _watch(self) -> None:
        poll = min(1.0, max(0.05, self.timeout / 10))
        while not self._stop.wait(poll):
            last = self._last
            if last is None:
                continue
            peer = self._peer_dump()
            if peer is not None:
                idle = self._clock() - last
                self._fire(f"rank {self.rank}: stopping because {peer} hung; this rank had been idle for {idle:.1f} s")
                self._exit(HANG_EXIT)
                return
            headline = self.overdue()
            if headline is not None:
                self._fire(headline)
                # Give the other ranks a moment to see the marker and dump their stacks before the
                # launcher, seeing this process gone, stops them.
                time.sleep(min(2.0, 4 * poll) if self.dump_dir is not None else 0)
                self._exit(HANG_EXIT)
                return

    def _peer_dump(self) -> str | None:
        if self.dump_dir is None or not self.dump_dir.is_dir():
            return None
        for entry in self.dump_dir.iterdir():
            if entry.name != f"rank{self.rank}.txt":
                return entry.stem.replace("rank", "rank ")
        return None

    def _fire(self, headline: str) -> None:
        frame = sys._current_frames().get(self._main)  # noqa: SLF001 - the only way to read another thread's frame
        where = describe_wait(frame) if frame is not None else "unknown (main thread not found)"
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        text = (
            f"phalanx: hang: {headline}; waiting in {where}\n"
            f"stack of rank {self.rank} (most recent call last):\n{stack}"
        )
        self.fired = text
        print(text, file=sys.stderr, flush=True)
        if self.dump_dir is not None:
            try:
                self.dump_dir.mkdir(parents=True, exist_ok=True)
                (self.dump_dir / f"rank{self.rank}.txt").write_text(text, encoding="utf-8")
            except OSError:
                pass


def describe_wait(frame: FrameType) -> str:
    """Where the main thread waits: the collective it is in, else the innermost line of user code."""
    frames = traceback.extract_stack(frame)
    for entry in reversed(frames):
        if entry.filename.endswith(os.path.join("distributed", "distributed_c10d.py")) and not entry.name.startswith(
            "_"
        ):
            return f"collective {entry.name} ({_user_line(frames)})"
    for entry in reversed(frames):
        if os.sep + "autograd" + os.sep in entry.filename:
            return f"backward, where DDP/FSDP exchange gradients ({_user_line(frames)})"
    return _user_line(frames)


def _user_line(frames: traceback.StackSummary) -> str:
    for entry in reversed(frames):
        if not any(part in entry.filename for part in _LIBRARY):
            return f"{entry.name} at {entry.filename}:{entry.lineno}"
    last = frames[-1]
    return f"{last.name} at {last.filename}:{last.lineno}"
