"""What a rank's GPU has done, for the hang report.

Under NCCL a collective returns to the host as soon as it is queued on the GPU; a rank waiting for
a stuck peer blocks later, in a device sync (a ``.item()``, the step agreement's read), outside any
collective, so its stack no longer says that it waits. Its device does: the collective kernel it
queued never completes, while the stuck rank's device has run out of work. The training thread
records a CUDA event at the end of every optimizer step (no sync); when the watchdog fires, its
thread asks the events and the stream whether they are done (a query, never a sync) and writes the
answer into the rank's dump, where the launcher's hang summary reads it.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

# Step-end events kept: the host runs ahead of the device by at most a few dozen steps before a
# full launch queue or a sync stops it, so the last completed one is almost always among these.
KEPT = 32
# A stream still busy this long after the hang was noticed (itself hang_timeout after the last
# progress) holds work that waits for something; one that is merely finishing a kernel is done by then.
_SETTLE_S = 0.25
# The query runs in a thread of its own: a driver call that blocked would otherwise cost the dump.
_ANSWER_S = 1.0
# How much longer a firing rank waits for its peers' dumps on a GPU (their device queries take this).
ALLOWANCE_S = _SETTLE_S + _ANSWER_S


@dataclass(frozen=True)
class DeviceFacts:
    """``host_steps``: optimizer steps that ended on the host in this attempt; ``device_steps``: of
    those, how many the device has finished (None: none of the kept ones, so fewer than the host's
    count minus KEPT); ``pending``: the device holds queued work that does not complete (None: it did
    not answer)."""

    device: str
    host_steps: int
    device_steps: int | None
    pending: bool | None

    def line(self) -> str:
        done = "an unknown number" if self.device_steps is None else str(self.device_steps)
        state = {True: _PENDING, False: _IDLE, None: _SILENT}[self.pending]
        host = f"{self.host_steps} steps ended on the host"
        return f"on the device ({self.device}): {host}, {done} on the device; {state}"


_PENDING = "work pending on the device"
_IDLE = "the device is idle"
_SILENT = "the device did not answer"
_LINE = re.compile(
    r"^on the device \((?P<device>[^)]*)\): (?P<host>\d+) steps ended on the host, "
    rf"(?P<done>\d+|an unknown number) on the device; (?P<state>{_PENDING}|{_IDLE}|{_SILENT})$"
)


def parse_device_line(text: str) -> DeviceFacts | None:
    """The device facts in a rank's dump, or None where it has none (a CPU rank, an older dump)."""
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is not None:
            done = match["done"]
            pending = {_PENDING: True, _IDLE: False, _SILENT: None}[match["state"]]
            return DeviceFacts(match["device"], int(match["host"]), int(done) if done.isdigit() else None, pending)
    return None


class DeviceProgress:
    """Step-end events of one rank's CUDA device. ``step_ended`` runs on the training thread (the
    stream it records on is that thread's current one); ``facts`` on any other thread."""

    def __init__(
        self,
        device: torch.device,
        *,
        make_event: Callable[[], Any] | None = None,
        stream_idle: Callable[[], bool] | None = None,
        settle_s: float = _SETTLE_S,
        answer_s: float = _ANSWER_S,
    ):
        self.device = device
        self._make_event = make_event or torch.cuda.Event
        self._stream_idle = stream_idle or (lambda: torch.cuda.default_stream(device).query())
        self._settle_s = settle_s
        self._answer_s = answer_s
        self.steps = 0
        # Replaced whole at every step, never changed in place: the watchdog's thread reads it whole.
        self._ends: tuple[tuple[int, Any], ...] = ()

    @classmethod
    def of(cls, device: torch.device) -> DeviceProgress | None:
        """None off CUDA: there a rank's host waits inside the collective, and its stack says so."""
        return cls(device) if device.type == "cuda" else None

    def step_ended(self) -> None:
        event = self._make_event()
        event.record()
        self.steps += 1
        self._ends = (*self._ends[-(KEPT - 1) :], (self.steps, event))

    def facts(self) -> DeviceFacts:
        """Asked from the watchdog's thread; returns within about a second whatever the driver does."""
        box: list[DeviceFacts] = []
        asker = threading.Thread(target=lambda: box.append(self._ask()), name="phalanx-device-facts", daemon=True)
        asker.start()
        asker.join(self._settle_s + self._answer_s)
        return box[0] if box else DeviceFacts(str(self.device), self.steps, None, None)

    def _ask(self) -> DeviceFacts:
        steps, ends = self.steps, self._ends
        try:
            if self.device.type == "cuda" and self.device.index is not None:
                # Without it this thread's CUDA calls would create a context on GPU 0.
                torch.cuda.set_device(self.device)
            done = next((step for step, event in reversed(ends) if event.query()), None)
            if done is None and not ends:
                done = 0
            pending = done != (ends[-1][0] if ends else 0) or not self._idle()
        except Exception:  # noqa: BLE001 - a broken device must not stop the dump of the stack
            return DeviceFacts(str(self.device), steps, None, None)
        return DeviceFacts(str(self.device), steps, done, pending)

    def _idle(self) -> bool:
        if self._stream_idle():
            return True
        time.sleep(self._settle_s)
        return self._stream_idle()
