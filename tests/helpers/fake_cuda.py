"""A stand-in for the bits of torch.cuda that decide which GPU a thread works on, for CPU-only tests.

CUDA's current device is per thread, and a new thread's is device 0: a stream switch or a tensor
operation there creates a context on GPU 0 (about 0.5 GiB) unless the thread made its own device
current first. The fake keeps that per-thread device and records, per thread, every device that
was current when work ran (a stream asked for, entered, or a device made current)."""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Any, Iterator

import torch


class FakeStream:
    def __init__(self, index: int):
        self.device = torch.device("cuda", index)


class FakeCuda:
    def __init__(self) -> None:
        self._local = threading.local()
        self.used: dict[str, set[int]] = defaultdict(set)  # thread name -> devices current during work

    def install(self, monkeypatch: Any) -> FakeCuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        return self

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device: Any) -> None:
        self._local.device = _index(device, self.current_device())
        self._note(self._local.device)

    def current_stream(self, device: Any = None) -> FakeStream:
        index = _index(device, self.current_device())
        self._note(index)
        return FakeStream(index)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[None]:
        """As torch.cuda.StreamContext: the current device's stream is asked for first, then the
        stream's device is made current until the context ends."""
        if stream is None:
            yield
            return
        before = self.current_device()
        self._note(before)
        self._local.device = stream.device.index
        self._note(stream.device.index)
        try:
            yield
        finally:
            self._local.device = before

    def _note(self, index: int) -> None:
        self.used[threading.current_thread().name].add(index)


def _index(device: Any, current: int) -> int:
    if device is None:
        return current
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else current
