"""Hang watchdog: a thread that notices when a rank stops making progress, prints where it is stuck
(Python stack, and the collective it waits in), and stops the job before the process group's own
timeout would: phalanx sets that one past every limit of its own (strategies/collective_timeout.py),
so a hang is reported with each rank's place instead of a collective's error that names none.

The main thread calls ``beat()`` at every step, batch and collective; that is one attribute write.
When one rank fires it leaves a file in ``<run dir>/hang/``; the other ranks' watchdogs see it
within a second and dump their own stacks too, so the user sees every rank, not only the first.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from types import FrameType
from typing import Callable, Iterator

from phalanx.faults.device_progress import ALLOWANCE_S, DeviceProgress
from phalanx.faults.markers import HANG_EXIT, hang_dump

# While a checkpoint is written or read, the disk sets the pace: a hang there is only called one
# after this long (or hang_timeout, if longer).
IO_TIMEOUT_S = 1800.0

# Where a frame's file lies, by module identity: the directories of torch and phalanx as imported
# here, and the standard library's own. A path substring would not do: a clone named `phalanx` or a
# user's `~/torch/train.py` would then count as library, and a hang report would name a wrong frame.
# Paths relative to torch's package directory:
_C10D = os.path.join("distributed", "distributed_c10d.py")
_TORCH_DISTRIBUTED = "distributed" + os.sep
_AUTOGRAD = "autograd" + os.sep
# torch.distributed packages whose frames are not communication: writing a checkpoint is the
# disk's pace (its collectives show as c10d frames), the elastic agent is not in a worker's stack.
_NOT_COMMUNICATION = ("checkpoint", "elastic", "launcher")
# DDP's forward broadcasts buffers through calls that leave no Python frame in torch.distributed.
_DDP = os.path.join("nn", "parallel", "distributed.py")
# Installed packages live below the standard library's directory on some layouts; they are not it.
_SITE_DIRS = ("site-packages", "dist-packages")


class Watchdog:
    """``timeout`` is faults.hang_timeout; ``first_step_timeout`` (faults.first_step_timeout, 0: no
    limit) replaces it from :meth:`expect_first_step` (training begins) until :meth:`stepped`
    (the first optimizer step finished): a first step compiles, autotunes and warms up
    communication, which may take many times as long as the steps after it. ``progress`` (on CUDA):
    the device's step ends, whose state goes into the dump (see device_progress.py)."""

    def __init__(
        self,
        timeout: float,
        rank: int,
        run_dir: str | None,
        attempt: int = 0,
        *,
        first_step_timeout: float = 0.0,
        progress: DeviceProgress | None = None,
        exit: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.timeout = timeout
        self.first_step_timeout = first_step_timeout
        self.rank = rank
        self.progress = progress
        self.dump = hang_dump(run_dir, attempt, rank)
        self.dump_dir = self.dump.parent if self.dump is not None else None
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
        if self.progress is not None:
            self.progress.step_ended()
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
                # The peer fired first, which says nothing about which rank is stuck: the launcher's
                # summary decides that from every rank's stack.
                self._fire(
                    f"rank {self.rank}: stopping because {peer}'s watchdog fired first; "
                    f"this rank had been idle for {idle:.1f} s"
                )
                self._exit(HANG_EXIT)
                return
            headline = self.overdue()
            if headline is not None:
                self._fire(headline)
                # Give the other ranks a moment to see the marker and dump their stacks before the
                # launcher, seeing this process gone, stops them.
                # On a GPU their dumps wait for their devices' answers too.
                allowance = ALLOWANCE_S if self.progress is not None else 0.0
                time.sleep(min(2.0, 4 * poll) + allowance if self.dump_dir is not None else 0)
                self._exit(HANG_EXIT)
                return

    def _peer_dump(self) -> str | None:
        if self.dump_dir is None or not self.dump_dir.is_dir():
            return None
        for entry in self.dump_dir.iterdir():
            if entry.name != self.dump.name:
                return entry.stem.replace("rank", "rank ")
        return None

    def _fire(self, headline: str) -> None:
        frame = sys._current_frames().get(self._main)  # noqa: SLF001 - the only way to read another thread's frame
        where = describe_wait(frame) if frame is not None else "unknown (main thread not found)"
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        # Asked after the stack is taken: the main thread's place is what it was when the hang was seen.
        device = f"{self.progress.facts().line()}\n" if self.progress is not None else ""
        text = (
            f"phalanx: hang: {headline}; waiting in {where}\n"
            f"{device}"
            f"stack of rank {self.rank} (most recent call last):\n{stack}"
        )
        self.fired = text
        print(text, file=sys.stderr, flush=True)
        if self.dump_dir is not None:
            try:
                self.dump_dir.mkdir(parents=True, exist_ok=True)
                self.dump.write_text(text, encoding="utf-8")
            except OSError:
                pass


@dataclass(frozen=True)
class Wait:
    """Where a rank's main thread is. ``kind``: ``collective`` (a torch.distributed call, ``op`` its
    name), ``backward`` (where DDP and FSDP exchange gradients), ``communication`` (inside another
    torch.distributed package, ``op`` its name, e.g. ``torch.distributed.fsdp``), or ``code``: none
    of those, so the rank is not waiting for the others. ``frame`` is the innermost frame of the
    user's code (the innermost frame, when the stack has none)."""

    kind: str
    op: str
    frame: traceback.FrameSummary | None

    @property
    def waiting(self) -> bool:
        """Inside communication with the other ranks, so it may be waiting for one of them."""
        return self.kind != "code"

    @property
    def place(self) -> str:
        f = self.frame
        return f"{f.name} at {f.filename}:{f.lineno}" if f is not None else "an empty stack"

    def describe(self) -> str:
        if self.kind == "collective":
            return f"collective {self.op} ({self.place})"
        if self.kind == "backward":
            return f"backward, where DDP/FSDP exchange gradients ({self.place})"
        if self.kind == "communication":
            return f"{self.op} communication ({self.place})"
        return self.place


def classify(frames: list[traceback.FrameSummary]) -> Wait:
    """Where a stack (outermost frame first) waits. Only the frames inside the innermost frame of
    the user's code count: a user's autograd function stuck in its own ``backward`` is the user's
    code, not a gradient exchange."""
    user = next((i for i in range(len(frames) - 1, -1, -1) if not _is_library(frames[i].filename)), None)
    inner = frames[user + 1 :] if user is not None else frames
    here = frames[user] if user is not None else (frames[-1] if frames else None)
    for entry in reversed(inner):
        if _torch_relative(entry.filename) == _C10D and not entry.name.startswith("_"):
            return Wait("collective", entry.name, here)
    for entry in reversed(inner):
        if (_torch_relative(entry.filename) or "").startswith(_AUTOGRAD):
            return Wait("backward", "backward", here)
    for entry in reversed(inner):
        package = _distributed_package(entry.filename)
        if package is not None:
            return Wait("communication", package, here)
    return Wait("code", "", here)


def describe_wait(frame: FrameType) -> str:
    """Where the main thread waits: the collective it is in, else the innermost line of user code."""
    return classify(traceback.extract_stack(frame)).describe()


# A frame as traceback.format_stack writes it; the source line follows, indented by four spaces.
_FRAME_LINE = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+), in (?P<name>.+)$')


def parse_stack(text: str) -> list[traceback.FrameSummary]:
    """The frames of a stack printed by :func:`traceback.format_stack` (as in a rank's hang dump)."""
    frames: list[traceback.FrameSummary] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = _FRAME_LINE.match(line)
        if match is None:
            continue
        source = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("    ") else ""
        frames.append(
            traceback.FrameSummary(
                match["file"], int(match["line"]), match["name"], lookup_line=False, line=source or None
            )
        )
    return frames


@functools.lru_cache(maxsize=1)
def _roots() -> tuple[str | None, str, tuple[str, ...]]:
    """torch's package directory (None where torch is not installed), phalanx's, and the standard
    library's, each ending in a separator. find_spec does not import torch."""
    spec = importlib.util.find_spec("torch")
    torch_dir = _directory(os.path.dirname(spec.origin)) if spec is not None and spec.origin else None
    phalanx_dir = _directory(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = sysconfig.get_paths()
    stdlib = tuple(dict.fromkeys(_directory(paths[key]) for key in ("stdlib", "platstdlib") if paths.get(key)))
    return torch_dir, phalanx_dir, stdlib


def _directory(path: str) -> str:
    return os.path.join(os.path.realpath(path), "")


@functools.lru_cache(maxsize=4096)
def _real(filename: str) -> str:
    return os.path.realpath(filename)


def _torch_relative(filename: str) -> str | None:
    """``filename``'s path inside torch's package directory, or None when it lies outside it."""
    torch_dir = _roots()[0]
    real = _real(filename)
    return real[len(torch_dir) :] if torch_dir is not None and real.startswith(torch_dir) else None


def _is_library(filename: str) -> bool:
    if filename.startswith("<frozen "):  # the standard library's frozen modules (runpy, importlib)
        return True
    if _torch_relative(filename) is not None:
        return True
    _, phalanx_dir, stdlib = _roots()
    real = _real(filename)
    if real.startswith(phalanx_dir):
        return True
    for root in stdlib:
        if real.startswith(root):
            return real[len(root) :].split(os.sep, 1)[0] not in _SITE_DIRS
    return False


def _distributed_package(filename: str) -> str | None:
    relative = _torch_relative(filename)
    if relative is None:
        return None
    if relative == _DDP:
        return "DistributedDataParallel"
    if not relative.startswith(_TORCH_DISTRIBUTED):
        return None
    package = relative[len(_TORCH_DISTRIBUTED) :].split(os.sep, 1)[0].removesuffix(".py")
    return None if package in _NOT_COMMUNICATION else f"torch.distributed.{package}"
