"""``train.memory_cap``: the most memory one rank may use, so that ``phalanx tune`` (and a user who
wants headroom) can find the largest micro-batch that fits under a limit smaller than the device.

On CUDA the caching allocator enforces it (``torch.cuda.set_per_process_memory_fraction``): an
allocation past it raises torch's own ``OutOfMemoryError``, exactly as a full GPU does. A CPU has no
such allocator limit, so the Session checks after every backward and optimizer step how far this
process's peak resident memory has grown since ``setup()``, and raises the same exception when it is
over the cap. Counting from ``setup()`` leaves out what was there before training: the interpreter,
torch's libraries, the model's parameters, an in-memory dataset; what is counted is what training
adds and what grows with the micro-batch (activations, gradients, optimizer state, buffers). This
keeps the out-of-memory path (one rank failing, the job ending, ``phalanx tune`` reading the outcome)
testable on a CPU-only machine.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

from phalanx.util.sizes import size_bytes
from phalanx.util.units import format_bytes

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


class MemoryCap:
    """One per Session; ``check()`` is cheap enough to call after every micro-step (a small read)."""

    def __init__(self, cap_bytes: int, device: torch.device):
        self.cap_bytes = cap_bytes
        self.device = device
        self._baseline = 0
        self._reset_peak = False
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
        else:
            self.start()

    @classmethod
    def create(cls, cap: int | str | None, device: torch.device) -> "MemoryCap | None":
        if cap is None:
            return None
        return cls(cap if isinstance(cap, int) else size_bytes(cap), device)

    def start(self) -> None:
        """CPU: count from here (the Session calls it at the end of ``setup()``, before training)."""
        if self.device.type == "cuda":
            return
        # Linux lets a process reset its own peak (VmHWM) to the current resident size, so the peak
        # read later is this training's alone, not an earlier transient (loading a file, say).
        try:
            _CLEAR_REFS.write_text("5")
            self._reset_peak = True
        except OSError:
            self._reset_peak = False
        self._baseline = _current_rss() if self._reset_peak else _peak_rss()

    def used_bytes(self) -> int | None:
        """Peak growth since :meth:`start` (CPU), or the allocator's peak (CUDA)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device)
        return max(0, _peak_rss() - self._baseline)

    def check(self) -> None:
        """Raise ``torch.OutOfMemoryError`` when the CPU peak is over the cap (CUDA raises by itself)."""
        if self.device.type == "cuda":
            return
        used = self.used_bytes()
        if used is not None and used > self.cap_bytes:
            raise torch.OutOfMemoryError(
                "phalanx memory cap: this process's peak resident memory grew by "
                f"{format_bytes(used, unit='MiB', decimals=1)} since session.setup(), "
                f"over train.memory_cap {format_bytes(self.cap_bytes, unit='MiB', decimals=1)}; "
                "lower batch.micro_batch_size or raise the cap"
            )


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _current_rss() -> int:
    return _status_bytes("VmRSS") or _peak_rss()


def _peak_rss() -> int:
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, kB elsewhere
