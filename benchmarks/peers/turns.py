"""Contenders that take turns: every launch is started at once and waits, and a conductor lets one
of them run a block of steps at a time, in rotation (benchmarks/overhead.py, the default there).

Launched one after another, two contenders are minutes apart, and a shared machine's load moves
that far by up to 30% (the raw loop against a second launch of itself, docs/benchmarks.md). Taking
turns puts their blocks seconds apart and pairs each contender's block with the raw loop's of the
same round, so a ratio compares steps taken under nearly the same load.

The protocol is files in one directory, so that it crosses every launcher (torchrun, ``phalanx
launch``) through one environment variable and needs no port:

- a worker rank that wants its next turn writes ``<contender>.<rank>`` holding the turn's number
  (1, 2, ...), then polls ``turn`` until it reads ``<contender> <number>``; at the end it writes
  ``done`` there;
- the conductor grants a turn once every rank of the contender asks for the same number, and
  waits until each has asked for the next (or is done) before it grants the next contender's.

Every contender's worker asks for the same sequence of turns (the same workloads, split into the
same blocks), so the rounds line up: round r is every contender's r-th turn. Waiting is never
timed: a worker's clock restarts when its turn comes. Standard library only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

ENV = "PHALANX_BENCH_TURNS"
POLL_S = 0.005  # a waiting rank's wake-ups cost the running one under 1% of a core
TURN_FILE = "turn"
DONE = "done"


def _write(path: Path, text: str) -> None:
    """Whole or not at all: a reader polling the file never sees half of it."""
    part = path.with_name(path.name + f".{os.getpid()}.part")
    part.write_text(text, encoding="utf-8")
    os.replace(part, path)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


class Turns:
    """A worker rank's side: ``wait()`` before each block of work, ``done()`` after the last."""

    def __init__(self, directory: Path, contender: str, rank: int):
        self.directory, self.contender, self.rank = Path(directory), contender, rank
        self.number = 0

    @classmethod
    def from_env(cls, contender: str, rank: int) -> Turns | None:
        directory = os.environ.get(ENV)
        return cls(Path(directory), contender, rank) if directory else None

    @property
    def _mine(self) -> Path:
        return self.directory / f"{self.contender}.{self.rank}"

    def wait(self) -> None:
        self.number += 1
        _write(self._mine, str(self.number))
        wanted = f"{self.contender} {self.number}"
        while _read(self.directory / TURN_FILE) != wanted:
            time.sleep(POLL_S)

    def done(self) -> None:
        _write(self._mine, DONE)


class Stuck(Exception):
    """A contender neither asked for its next turn nor ended within the time allowed."""


class Conductor:
    """The driver's side: grants turns to the contenders, ``ranks`` processes each."""

    def __init__(self, directory: Path, ranks: dict[str, int]):
        self.directory, self.ranks = Path(directory), dict(ranks)
        self.granted: dict[str, int] = {name: 0 for name in ranks}  # turns given so far

    def asks(self, name: str) -> list[str | None]:
        return [_read(self.directory / f"{name}.{rank}") for rank in range(self.ranks[name])]

    def grant(self, name: str, number: int) -> None:
        _write(self.directory / TURN_FILE, f"{name} {number}")
        self.granted[name] = number

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
                    if number is None:
                        active.discard(name)
                        continue
                    self.grant(name, number)
                    finished = self._await(name, lambda asked, n=number: _all_past(asked, n), alive, turn_timeout)
                    if finished is None:
                        active.discard(name)
                except Stuck:
                    active.discard(name)
                    on_stuck(name)
            round_ += 1

    def _await(self, name: str, ready: Callable[[list[str | None]], int | bool | None], alive, timeout: float):
        """Polls until ``ready`` gives a value (returned), the contender is done or has ended
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
            if time.monotonic() > deadline:
                raise Stuck(name)
            time.sleep(POLL_S)


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
