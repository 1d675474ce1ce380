"""``train.memory_cap``: the most memory one rank may use, so that ``phalanx tune`` (and a user who
wants headroom) can find the largest micro-batch that fits under a limit smaller than the device.

On CUDA the caching allocator enforces it (``torch.cuda.set_per_process_memory_fraction``), on
every device the strategy computes on (dp and model_parallel drive several from one process): an
allocation past it raises torch's own ``OutOfMemoryError``, exactly as a full GPU does. A CPU has no
such allocator limit, so the Session checks after every backward and optimizer step how far this
process's peak resident memory has grown since ``setup()``, and raises the same exception when it is
over the cap. Counting from ``setup()`` leaves out what was there before training: the interpreter,
torch's libraries, the model's parameters, an in-memory dataset; what is counted is what training
adds and what grows with the micro-batch (activations, gradients, optimizer state, buffers). This
keeps the out-of-memory path (one rank failing, the job ending, ``phalanx tune`` reading the outcome)
testable on a CPU-only machine.

Set-up has a check of its own on a CPU: at the end of ``setup()``, the model weights that arrived
built (what a GPU run would copy onto the device) plus the peak growth during ``setup()`` (the
shards, stages or buckets it made) must be under the cap. A model built whole therefore fails there
when its weights alone are over the cap, as it would on a GPU; one built under
``session.init_module()`` arrives with nothing and counts only what its rank materialises.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from pathlib import Path
from typing import Sequence

import torch

from phalanx.util.sizes import size_bytes
from phalanx.util.units import format_bytes

_STATUS = Path("/proc/self/status")
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
_MMAP_THRESHOLD = 128 * 1024
_CLEAR_REFS = Path("/proc/self/clear_refs")


class MemoryCap:
    """One per Session; ``check()`` is cheap enough to call after every micro-step (a small read)."""

    def __init__(self, cap_bytes: int, device: torch.device, devices: Sequence[torch.device] | None = None):
        self.cap_bytes = cap_bytes
        self.device = device
        # Every device the strategy computes on (Strategy.devices): the cap holds on each of them.
        self.devices = list(devices or [device])
        self._baseline = 0
        self._reset_peak = False
        self._arrived = 0  # bytes of built model weights handed to the setup() in progress
        if device.type == "cuda":
            for each in self.devices:
                total = torch.cuda.get_device_properties(each).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), each)
        else:
            track_live_memory()
            self.start()

    @classmethod
    def create(
        cls, cap: int | str | None, device: torch.device, devices: Sequence[torch.device] | None = None
    ) -> "MemoryCap | None":
        if cap is None:
            return None
        return cls(cap if isinstance(cap, int) else size_bytes(cap), device, devices)

    def start(self) -> None:
        """CPU: count from here (the Session calls it at the end of ``setup()``, before training)."""
        if self.device.type == "cuda":
            return
        # Memory freed earlier but still resident (glibc keeps it for reuse) would be reused
        # unseen: what training allocates must show as growth.
        _release_free_memory()
        # Linux lets a process reset its own peak (VmHWM) to the current resident size, so the peak
        # read later is this training's alone, not an earlier transient (loading a file, say).
        try:
            _CLEAR_REFS.write_text("5")
            self._reset_peak = True
        except OSError:
            self._reset_peak = False
        self._baseline = _current_rss() if self._reset_peak else _peak_rss()

    def begin_setup(self) -> None:
        """CPU: a ``setup()`` starts; what it adds and the built weights it is given count from here."""
        self._arrived = 0
        self.start()

    def add_arrived(self, nbytes: int) -> None:
        """A model reached ``setup()`` with ``nbytes`` of its weights built (in host memory)."""
        self._arrived += nbytes

    def check_setup(self, *, shards_model: bool) -> None:
        """Raise ``torch.OutOfMemoryError`` when the set-up peak (see the module docstring) is over the
        cap. ``shards_model``: the strategy divides the weights among the ranks (fsdp, pipeline)."""
        if self.device.type == "cuda":
            return
        added = self.used_bytes() or 0
        if self._arrived + added <= self.cap_bytes:
            return
        mib = lambda n: format_bytes(n, unit="MiB", decimals=1)  # noqa: E731
        if not shards_model:
            fix = "this strategy keeps the whole model on every rank: use fsdp or pipeline with session.init_module()"
        elif self._arrived:
            fix = "build the model under `with session.init_module():` so that only this rank's share is materialised"
        else:
            fix = "use more processes"
        raise torch.OutOfMemoryError(
            f"phalanx memory cap: set-up needs {mib(self._arrived + added)} on this rank ({mib(self._arrived)} of "
            f"model weights that arrived built, {mib(added)} added by session.setup()), over train.memory_cap "
            f"{mib(self.cap_bytes)}; {fix}, or raise the cap"
        )

    def used_bytes(self) -> int | None:
        """Peak growth since :meth:`start` (CPU), or the allocator's peak on the fullest device (CUDA)."""
        if self.device.type == "cuda":
            return max(torch.cuda.max_memory_reserved(d) for d in self.devices)
        return max(0, _peak_rss() - self._baseline)

    def check(self, fix: str = "lower batch.micro_batch_size or raise the cap") -> None:
        """Raise ``torch.OutOfMemoryError`` when the CPU peak is over the cap (CUDA raises by itself)."""
        if self.device.type == "cuda":
            return
        used = self.used_bytes()
        if used is not None and used > self.cap_bytes:
            raise torch.OutOfMemoryError(
                "phalanx memory cap: this process's peak resident memory grew by "
                f"{format_bytes(used, unit='MiB', decimals=1)} since session.setup(), "
                f"over train.memory_cap {format_bytes(self.cap_bytes, unit='MiB', decimals=1)}; {fix}"
            )


def track_live_memory() -> bool:
    """Make this process's resident size follow its live tensors (glibc): every allocation above
    128 KiB gets pages of its own, returned to the kernel when freed. By default glibc raises that
    threshold as large blocks are freed and serves them from its heap, which keeps freed memory
    resident: measured under fsdp on 2 CPU processes, a step's resident peak grew by 1,000 MiB
    where 140 MiB of tensors were alive. Returns False where this is not glibc."""
    try:
        return bool(_libc().mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def _release_free_memory() -> None:
    """Give the kernel back the pages of freed heap blocks (glibc's malloc_trim), where it exists."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
