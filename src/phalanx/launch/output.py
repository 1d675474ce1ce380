"""Each worker's output: the full text goes to ``<run dir>/logs/rank<N>.log``; the terminal shows
rank 0's lines (or every rank's, prefixed ``[rank N]``)."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import TextIO


class Tee(io.TextIOBase):
    """Writes to the terminal stream and a log file; optionally prefixes terminal lines."""

    def __init__(self, terminal: TextIO, log: TextIO, prefix: str = ""):
        self.terminal = terminal
        self.log = log
        self.prefix = prefix
        self._pending = ""  # prefixed mode: the unfinished line

    def write(self, text: str) -> int:
        self.log.write(text)
        if not self.prefix:
            return self.terminal.write(text)
        # Whole lines only, one write each: several ranks share the terminal, and a line written in
        # pieces would interleave with another rank's.
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        if lines:
            self.terminal.write("".join(f"{self.prefix}{line}\n" for line in lines))
            self.terminal.flush()
        return len(text)

    def flush(self) -> None:
        self.log.flush()
        self.terminal.flush()

    def finish(self) -> None:
        """Emit an unfinished last line (at exit)."""
        if self._pending:
            self.terminal.write(f"{self.prefix}{self._pending}\n")
            self._pending = ""
        self.flush()

    def isatty(self) -> bool:
        # A prefixed stream cannot host cursor-moving live displays.
        return not self.prefix and self.terminal.isatty()

    def fileno(self) -> int:
        return self.terminal.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.terminal, "encoding", "utf-8")

    def writable(self) -> bool:
        return True


def log_path(log_dir: Path, rank: int, restart_count: int) -> Path:
    suffix = f".attempt{restart_count}" if restart_count else ""
    return log_dir / f"rank{rank}{suffix}.log"


def route_output(log_file: Path, *, show: bool, prefix: str) -> None:
    """Point this process's stdout and stderr at the log file, and at the terminal when ``show``."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    if show:
        log = open(log_file, "w", buffering=1, encoding="utf-8")
        sys.stdout = Tee(sys.stdout, log, prefix)
        sys.stderr = Tee(sys.stderr, log, prefix)
        return
    # Hidden ranks: redirect the file descriptors themselves, so C++ and NCCL output lands too.
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)
