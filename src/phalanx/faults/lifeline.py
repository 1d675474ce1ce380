"""A worker ends when the process that started it does, however that process died.

torch elastic starts every worker in a session of its own, so a SIGKILL of ``phalanx launch`` (the
OOM killer, a scheduler's kill after its grace period, a closed terminal) reaches no worker: each
would train on, holding its GPU and writing into a checkpoint directory a relaunch then shares.
A signal handler cannot help (SIGKILL has none), and ``PR_SET_PDEATHSIG`` would kill the worker
but not its own children (data-loader workers). So a daemon thread polls the parent's pid: once
the worker has been re-parented, it kills every descendant and then itself. The thread needs the
GIL only for a moment, which torch releases while a rank waits in a collective, so a rank blocked
in an all-reduce still goes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

ENV_LAUNCHER_PID = "PHALANX_LAUNCHER_PID"
POLL_SECONDS = 0.1


class Lifeline:
    """Watches ``parent`` (a pid) from a daemon thread; see the module docstring. ``parent`` need
    not be this process's parent: a forkserver's child watches the process that asked the server
    for it (the server outlives its caller while any child it forked lives)."""

    def __init__(self, parent: int, *, who: str = "this worker", poll: float = POLL_SECONDS):
        self.parent, self.who, self.poll = parent, who, poll
        # Re-parenting says at once, and without a pid that could be reused, that a parent is gone.
        self._child = os.getppid() == parent
        self._thread = threading.Thread(target=self._watch, name="phalanx-lifeline", daemon=True)

    def start(self) -> "Lifeline":
        if not self.parent_alive():  # it died before this process got here
            self._end()
        self._thread.start()
        return self

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent if self._child else _running(self.parent)

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll)
            if not self.parent_alive():
                self._end()

    def _end(self) -> None:
        # Each /proc read below gives the GIL up; a main thread busy in Python then holds it for a
        # switch interval (5 ms) before this thread gets it back, which over a few hundred reads
        # let the worker outlive its launcher by seconds. The process is ending: switch at once.
        sys.setswitchinterval(1e-6)
        children = descendants(os.getpid())
        try:
            print(
                f"phalanx: {self.who}: its launcher (pid {self.parent}) is gone; stopping it and "
                f"{len(children)} child process{'es' if len(children) != 1 else ''}",
                file=sys.__stderr__,
                flush=True,
            )
        except (OSError, ValueError):
            pass  # the terminal went with the launcher
        kill_all(children)
        os.kill(os.getpid(), signal.SIGKILL)


_active: Lifeline | None = None  # one per process, however many places ask for it


def _forget() -> None:
    global _active
    _active = None  # a forked child has the object but not the thread; it watches its own parent


os.register_at_fork(after_in_child=_forget)


def watch(parent: int, who: str) -> Lifeline:
    global _active
    if _active is None:
        _active = Lifeline(parent, who=who).start()
    return _active


def watch_launcher(who: str, env: dict[str, str] | None = None) -> Lifeline | None:
    """Watch the launcher whose pid ``phalanx launch`` exported; under plain torchrun, its agent
    (this process's parent). None when neither started this process."""
    env = os.environ if env is None else env
    raw = env.get(ENV_LAUNCHER_PID, "")
    if raw.isascii() and raw.isdigit():
        launcher = int(raw)
        if os.getppid() != launcher and _exists(launcher):
            return _active  # a process the script started: its worker's watch ends it too
        return watch(launcher, who)
    if env.get("TORCHELASTIC_RUN_ID"):
        return watch(os.getppid(), who)
    return _active


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _running(pid: int) -> bool:
    """``pid`` exists and has not exited: a killed process stays a zombie until its parent reaps it."""
    if not Path("/proc/self/stat").exists():  # no /proc: a zombie counts as running
        return _exists(pid)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False  # gone
    return state not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid``, children before grandchildren (Linux ``/proc``; elsewhere
    only what ``pid`` leads as its process group, found by the group kill in :func:`kill_all`)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat") if Path("/proc/self/stat").exists() else ():
        try:
            # The command name (field 2) may hold spaces and parentheses: parse after its last ')'.
            fields = entry.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # it exited while we looked
        parents.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in parents.get(queue.pop(0), ()):
            found.append(child)
            queue.append(child)
    return found


def kill_all(pids: list[int]) -> None:
    # Stop them first so none can start another process between our listing and the kill.
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    if os.getpgid(0) == os.getpid():  # this worker leads its group: anything listed too late is in it
        try:
            os.killpg(os.getpid(), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
