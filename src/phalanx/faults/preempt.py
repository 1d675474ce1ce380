"""SIGTERM in a worker: pre-emption (checkpoint at the end of this step, then stop) or an order to
stop now (torch elastic stops the surviving ranks with SIGTERM when one rank fails).

``phalanx launch`` leaves ``<run dir>/preempt-requested`` before it passes a SIGTERM on, so the
two cases can be told apart. Without phalanx's launcher (torchrun, plain python) every SIGTERM is
treated as pre-emption; a deadline still ends the process if the step never finishes.

The signal is also written to a wake-up pipe that a thread reads: Python runs signal handlers in
the main thread only between bytecodes, and a main thread blocked in a collective would not run
one until the collective ends, which after a peer's death may be never.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

from phalanx.faults.markers import PREEMPT_REQUEST, TERMINATED_EXIT, resize_held

# How long a worker waits for the launcher's marker after a SIGTERM: slurm signals every process
# of a job at once, so a worker may see the signal a moment before the launcher writes the file.
_MARKER_WAIT_S = 1.0


class TermWatch:
    # The watches in the order they were installed: signal handlers belong to the process, and a
    # watch closed under a newer one hands that one what it had replaced.
    installed_watches: ClassVar[list["TermWatch"]] = []

    def __init__(self, run_dir: str | None, grace: float, rank: int):
        self.request = Path(run_dir) / PREEMPT_REQUEST if run_dir else None
        self.grace = grace
        self.rank = rank
        self.requested = False  # read by the Session at step boundaries
        self._deadline: threading.Timer | None = None
        self.installed = False
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            self.replaced_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd)
            os.close(write_fd)
            return
        self.replaced_handler = signal.signal(signal.SIGTERM, lambda *_: None)  # the thread below acts on it
        self._read_fd, self._write_fd = read_fd, write_fd
        threading.Thread(target=self._listen, name="phalanx-sigterm", daemon=True).start()
        self.installed = True
        TermWatch.installed_watches.append(self)

    def close(self) -> None:
        """Give SIGTERM back to whoever had it (a test process may create many Sessions)."""
        if not self.installed or threading.current_thread() is not threading.main_thread():
            return
        self.installed = False
        above = TermWatch.installed_watches.index(self) + 1
        TermWatch.installed_watches.remove(self)
        if above <= len(TermWatch.installed_watches):
            # A newer Session's watch was installed over this one (Sessions closed out of order): it
            # stays, and gives back what this one replaced when it closes.
            newer = TermWatch.installed_watches[above - 1]
            newer.replaced_fd, newer.replaced_handler = self.replaced_fd, self.replaced_handler
        else:
            signal.set_wakeup_fd(self.replaced_fd)
            handler = self.replaced_handler
            signal.signal(signal.SIGTERM, handler if handler is not None else signal.SIG_DFL)
        os.close(self._write_fd)  # the listening thread reads end-of-file and closes its side

    def _listen(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:
                os.close(self._read_fd)
                return
            if signal.SIGTERM in data:
                self._on_term()

    def _on_term(self) -> None:
        if self.requested:
            return
        if not self._is_preemption():
            # Another rank failed and the launcher is stopping the job: go now, as without a handler.
            os._exit(TERMINATED_EXIT)
        self.requested = True
        print(
            f"phalanx: rank {self.rank}: SIGTERM: checkpointing at the end of this step (grace {self.grace:g} s)",
            file=sys.stderr,
            flush=True,
        )
        self._deadline = threading.Timer(self.grace, self._too_late)
        self._deadline.daemon = True
        self._deadline.start()

    def checkpointed(self) -> None:
        """The pre-emption's checkpoint is written: the grace deadline no longer applies (the script
        may finish the step's iteration before the rank exits)."""
        if self._deadline is not None:
            self._deadline.cancel()

    def _is_preemption(self) -> bool:
        if self.request is None:
            return True
        if resize_held(self.request.parent):
            return False  # this rank saved for a node joining: its agent restarts it with the node
        end = time.monotonic() + _MARKER_WAIT_S
        while time.monotonic() < end:
            if self.request.exists():
                return True
            time.sleep(0.05)
        return self.request.exists()

    def _too_late(self) -> None:
        print(
            f"phalanx: rank {self.rank}: no checkpoint within faults.preempt_grace ({self.grace:g} s) of SIGTERM; "
            "stopping without one",
            file=sys.stderr,
            flush=True,
        )
        os._exit(TERMINATED_EXIT)
