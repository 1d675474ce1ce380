"""Find and end every process of a job a test started, wherever it went: torch elastic puts each
worker in a session of its own, so killing the launcher's process group does not reach them. A
test tags its job with an environment variable that every descendant inherits."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Iterable

TAG = "PHALANX_TEST_JOB"


def new_tag() -> dict[str, str]:
    """The environment entry that marks one job's processes."""
    return {TAG: uuid.uuid4().hex}


def tagged(env: dict[str, str]) -> list[int]:
    """Living processes (zombies excluded) whose environment carries ``env``'s tag."""
    needle = f"{TAG}={env[TAG]}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue  # gone, or not ours
        if state != "Z":
            found.append(int(proc.name))
    return found


def wait_gone(env: dict[str, str], within: float, known: Iterable[int] = ()) -> tuple[float, list[int]]:
    """Seconds until no tagged process is left (polled), and those still alive at ``within``.
    ``known``: pids seen tagged before they were killed. A dying process's environment turns
    unreadable before it closes its files (and so releases its locks), so these count until its
    /proc entry says it has exited."""
    started = time.monotonic()
    known = set(known)
    while True:
        alive = sorted(set(tagged(env)) | {pid for pid in known if living(pid)})
        if not alive or time.monotonic() - started > within:
            return time.monotonic() - started, alive
        time.sleep(0.05)


def living(pid: int) -> bool:
    """``pid`` has not exited (a zombie has)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def kill_tagged(env: dict[str, str]) -> None:
    for pid in tagged(env):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
