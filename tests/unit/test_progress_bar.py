"""The progress bar (runtime/progress.py) on a terminal: drawn while the loop runs, from the training
thread at its redraws, with no refresh thread of rich's own (which woke 4 times a second to render,
taking its time from training threads that fill the cores)."""

from __future__ import annotations

import io
import threading

import pytest

from phalanx.runtime import progress
from phalanx.runtime.progress import Throughput, track


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("batches", [1, 5, 40])
def test_the_bar_is_drawn_during_the_loop_without_a_thread(monkeypatch, batches):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    monkeypatch.setattr(progress, "_REFRESH_S", 0.0)  # every batch redraws
    threads = threading.active_count()
    drawn_while_looping = []
    for i in track(
        range(batches),
        total=batches,
        samples_per_batch=4,
        description="epoch 1/1",
        show=True,
        loss=lambda: 0.25,
        meter=Throughput(),
    ):
        assert threading.active_count() == threads
        if i == batches - 1:
            drawn_while_looping.append(terminal.getvalue())
    assert "loss 0.2500" in drawn_while_looping[0] or batches == 1
    final = terminal.getvalue()
    assert f"{batches}/{batches}" in final and "loss 0.2500" in final and "samples/s" in final
