"""Contenders that take turns: every launch is started at once and waits, and a conductor lets one
of them run a block of steps at a time, in rotation (benchmarks/overhead.py, the default there).

Launched one after another, two contenders are minutes apart, and a shared machine's load moves
that far by up to 30% (the raw loop against a second launch of itself, docs/benchmarks.md). Taking
turns puts their blocks seconds apart and pairs each contender's block with the raw loop's of the
same round, so a ratio compares steps taken under nearly the same load.

The protocol is named pipes (FIFOs) in one directory, so that it crosses every launcher
(torchrun, ``phalanx launch``) through one environment variable and needs no port, and so that a
waiting rank blocks in a read and takes no CPU from the one whose turn it is (polling files every
5 ms from 8 waiting processes slowed a 2 ms step by a third on 2 cores):

- the conductor reads ``conductor``, to which each worker rank writes a line ``<contender> <rank>
  <n>`` when it wants its n-th turn (1, 2, ...), and ``<contender> <rank> done`` at the end;
- each worker rank blocks reading its own ``grant.<contender>.<rank>`` until the conductor writes
  the number of the turn it asked for there;
- the conductor grants a turn once every rank of the contender asks for the same number, and
  waits until each has asked for the next (or is done) before it grants the next contender's.

Every contender's worker asks for the same sequence of turns (the same workloads, split into the
same blocks), so the rounds line up: round r is every contender's r-th turn. Waiting is never
timed: a worker's clock restarts when its turn comes. Standard library only; Linux and macOS.
"""

from __future__ import annotations

import os
import select
import time
from pathlib import Path
from typing import Callable

ENV = "PHALANX_BENCH_TURNS"
CONDUCTOR = "conductor"
DONE = "done"
WAKE_S = 0.5  # how often a waiting conductor looks whether its launches still run
START_S = 60.0  # how long a worker waits for the conductor's pipe to appear
ORPHAN_CHECK_S = 1.0  # how often a waiting worker looks whether the conductor is still there


def grant_path(directory: Path, contender: str, rank: int) -> Path:
    return Path(directory) / f"grant.{contender}.{rank}"


class Turns:
    """A worker rank's side: ``wait()`` before each block of work, ``done()`` after the last."""

    def __init__(self, directory: Path, contender: str, rank: int):
        self.directory, self.contender, self.rank = Path(directory), contender, rank
        self.number = 0
        self._grants: int | None = None  # our pipe, read end
        self._conductor: int | None = None  # the conductor's, write end
        self._unread = b""

    @classmethod
    def from_env(cls, contender: str, rank: int) -> Turns | None:
        directory = os.environ.get(ENV)
        return cls(Path(directory), contender, rank) if directory else None

    def _open(self) -> None:
        if self._conductor is not None:
            return
        mine = grant_path(self.directory, self.contender, self.rank)
        os.mkfifo(mine)
        # Read and write: the open never blocks, and the pipe never reads as ended between grants.
        self._grants = os.open(mine, os.O_RDWR)
        deadline = time.monotonic() + START_S
        while True:  # the conductor may be a moment behind a worker of a fast launch
            try:
                self._conductor = os.open(self.directory / CONDUCTOR, os.O_WRONLY)
                return
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _tell(self, what: str) -> None:
        # One write of a short line: atomic on a pipe, so ranks writing at once never interleave.
        os.write(self._conductor, f"{self.contender} {self.rank} {what}\n".encode())

    def wait(self) -> None:
        self._open()
        self.number += 1
        self._tell(str(self.number))
        wanted = str(self.number).encode()
        while True:
            ready, _, _ = select.select([self._grants], [], [], ORPHAN_CHECK_S)
            if not ready:
                self._check_conductor()
                continue
            *lines, self._unread = (self._unread + os.read(self._grants, 64)).split(b"\n")
            if wanted in lines:
                return

    def _check_conductor(self) -> None:
        """A driver killed without its clean-up leaves no one to grant a turn: end, not wait for ever."""
        try:
            os.close(os.open(self.directory / CONDUCTOR, os.O_WRONLY | os.O_NONBLOCK))  # no reader: ENXIO
        except OSError:
            raise SystemExit(f"{self.contender} rank {self.rank}: the driver that grants the turns is gone") from None

    def done(self) -> None:
        self._open()
        self._tell(DONE)


class Stuck(Exception):
    """A contender neither asked for its next turn nor ended within the time allowed."""


class Conductor:
    """The driver's side: grants turns to the contenders, ``ranks`` processes each. Create it
    before the workers start (it makes the pipe they write to); ``close()`` when done."""

    def __init__(self, directory: Path, ranks: dict[str, int]):
        self.directory, self.ranks = Path(directory), dict(ranks)
        self.granted: dict[str, int] = {name: 0 for name in ranks}  # turns given so far
        self._asked: dict[str, list[str | None]] = {name: [None] * n for name, n in ranks.items()}
        path = self.directory / CONDUCTOR
        os.mkfifo(path)
        self._inbox = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self._unread = b""
        self._outboxes: dict[tuple[str, int], int] = {}

    def close(self) -> None:
        for fd in [self._inbox, *self._outboxes.values()]:
            os.close(fd)
        self._outboxes.clear()

    def asks(self, name: str) -> list[str | None]:
        """What each rank of ``name`` asked for last (a turn's number, or done), None before it asked."""
        return list(self._asked[name])

    def receive(self, timeout: float) -> None:
        """Takes in what the workers wrote, waiting at most ``timeout`` seconds for a first line."""
        readable, _, _ = select.select([self._inbox], [], [], max(0.0, timeout))
        if not readable:
            return
        try:
            data = os.read(self._inbox, 1 << 16)
        except BlockingIOError:
            return
        *lines, self._unread = (self._unread + data).split(b"\n")
        for line in lines:
            name, rank, what = line.decode().split(" ")
            if name in self._asked and 0 <= int(rank) < len(self._asked[name]):
                self._asked[name][int(rank)] = what

    def grant(self, name: str, number: int) -> bool:
        """Tells every rank of ``name`` that turn ``number`` is theirs; False when one of them is
        gone (its pipe has no reader left)."""
        try:
            for rank in range(self.ranks[name]):
                key = (name, rank)
                if key not in self._outboxes:
                    self._outboxes[key] = os.open(grant_path(self.directory, name, rank), os.O_WRONLY | os.O_NONBLOCK)
                os.write(self._outboxes[key], f"{number}\n".encode())
        except OSError:  # a rank that asked and then died: no reader (ENXIO), or a broken pipe
            return False
        self.granted[name] = number
        return True

    def run(
        self,
        order: Callable[[int], list[str]],
        alive: Callable[[str], bool],
        *,
        turn_timeout: float,
        on_stuck: Callable[[str], None] = lambda name: None,
    ) -> None:
        """Rounds until every contender is done or has ended: in round r, each contender of
        ``order(r)`` still running gets one turn. ``alive(name)``: whether its launch still runs
        (one that exits without saying done is dropped). A contender that takes longer than
        ``turn_timeout`` to ask or to finish a turn is dropped and ``on_stuck`` called."""
        active = set(self.ranks)
        round_ = 0
        while active:
            for name in [n for n in order(round_) if n in active]:
                try:
                    number = self._await(name, lambda asked: agreed_turn(asked), alive, turn_timeout)
                    if number is None or not self.grant(name, number):
                        active.discard(name)
                        continue
                    finished = self._await(name, lambda asked, n=number: _all_past(asked, n), alive, turn_timeout)
                    if finished is None:
                        active.discard(name)
                except Stuck:
                    active.discard(name)
                    on_stuck(name)
            round_ += 1

    def _await(self, name: str, ready: Callable[[list[str | None]], int | bool | None], alive, timeout: float):
        """Waits until ``ready`` gives a value (returned), the contender is done or has ended
        (None), or ``timeout`` passes (Stuck)."""
        deadline = time.monotonic() + timeout
        while True:
            asked = self.asks(name)
            if all(a == DONE for a in asked):
                return None
            value = ready(asked)
            if value:
                return value
            if not alive(name):
                return None
            left = deadline - time.monotonic()
            if left < 0:
                raise Stuck(name)
            self.receive(min(WAKE_S, left))


def agreed_turn(asked: list[str | None]) -> int | None:
    """The turn every rank asks for, once they all ask for the same one."""
    if not all(a is not None and a.isdigit() for a in asked):
        return None
    numbers = {int(a) for a in asked}
    return numbers.pop() if len(numbers) == 1 else None


def _all_past(asked: list[str | None], number: int) -> bool:
    return all(a == DONE or (a is not None and a.isdigit() and int(a) > number) for a in asked)


def rotation(names: list[str], round_: int) -> list[str]:
    """Round r's order: rotated by r and reversed every other round, so that no contender always
    runs right after the same one (a block can leave the caches or the clock warmer for the next)."""
    shift = round_ % len(names)
    order = names[shift:] + names[:shift]
    return list(reversed(order)) if round_ % 2 else order
