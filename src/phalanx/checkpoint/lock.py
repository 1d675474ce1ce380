"""One job per checkpoint directory.

Two jobs writing into one directory delete each other's staging directories and move each other's
``latest``. A job therefore holds an exclusive ``flock`` on ``<dir>/.lock`` for its lifetime: the
kernel releases it when the holder dies, however it dies, so a lock is never left stale. The file
also records who holds it, for the refusal message. ``phalanx launch`` takes it before any worker
starts and keeps it across restarts; its workers recognise their own job by its ``job`` key (a
token unique to each launch) and do not take it again. A Session started some other way takes it on rank 0.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from phalanx.errors import PhalanxError

LOCK_FILE = ".lock"

try:
    import fcntl
except ImportError:  # Windows: no flock; phalanx's launcher is POSIX-only anyway
    fcntl = None  # type: ignore[assignment]


class DirectoryLock:
    """An exclusive lock on checkpoint directory ``directory`` for job ``job`` (None: no job name,
    so it is never mistaken for another process's)."""

    def __init__(self, directory: str | Path, job: str | None, *, holder: str | None = None):
        self.directory = Path(directory)
        self.job = job
        self.holder = holder or " ".join(Path(a).name if i == 0 else a for i, a in enumerate(sys.argv))
        self._fd: int | None = None
        self.shared_with_job = False  # True: our own launcher holds it for us

    @property
    def path(self) -> Path:
        return self.directory / LOCK_FILE

    @property
    def held(self) -> bool:
        return self._fd is not None or self.shared_with_job

    def acquire(self) -> "DirectoryLock":
        if fcntl is None or self.held:
            return self
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise PhalanxError(
                f"cannot use checkpoint directory '{self.directory}': {err.strerror or err}; "
                "make it writable or set checkpoint.dir to a directory you can write"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            owner = read_owner(self.path)
            # Our own launcher, or another Session of this very process (a notebook, a test).
            if (self.job is not None and owner.get("job") == self.job) or owner.get("pid") == os.getpid():
                self.shared_with_job = True
                return self
            raise PhalanxError(_refusal(self.directory, owner)) from None
        self._fd = fd
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "job": self.job,
            "command": self.holder,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays, its content now stale
            self._fd = None
        self.shared_with_job = False

    def __enter__(self) -> "DirectoryLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def read_owner(path: Path) -> dict[str, Any]:
    """What the lock file says about its holder ({} when unreadable, e.g. written a moment ago)."""
    try:
        owner = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _refusal(directory: Path, owner: dict[str, Any]) -> str:
    if owner.get("pid"):
        who = f"pid {owner['pid']} on {owner.get('host', '?')}"
        if owner.get("command"):
            who += f" ({owner['command']}"
            who += f", since {owner['since']})" if owner.get("since") else ")"
    else:
        who = "another process"
    return (
        f"checkpoint directory '{directory}' is in use by another job: {who}; "
        "wait for it to end, stop it, or give this job its own with --set checkpoint.dir=DIR"
    )
