"""phalanx's own threads work on their rank's GPU: none ever makes GPU 0 current on a rank whose
device is another, which would give GPU 0 a CUDA context (~0.5 GiB) per rank. torch.cuda is faked
(tests/helpers/fake_cuda.py). Of phalanx's other threads, the hang watchdog's device query makes
its device current itself (faults/device_progress.py, test_hang_device.py); the lifeline and
SIGTERM threads touch no CUDA, and batches are copied on the training thread."""

from __future__ import annotations

import threading
from collections import deque

import torch

from phalanx.metrics.rows import RowWriter
from tests.helpers.fake_cuda import FakeCuda
from tests.helpers.metrics import pending_records


def test_the_metrics_thread_works_on_the_ranks_own_gpu(monkeypatch):
    cuda = FakeCuda().install(monkeypatch)
    torch.cuda.set_device(3)  # as the Session does on the training thread of local rank 3
    records: deque = deque()
    writer = RowWriter(records, None, None, torch.device("cuda", 3))
    try:
        for start in (0, 4):
            writer.submit(pending_records(range(start, start + 4)), {})
            writer.drain()
    finally:
        writer.close()
    assert [row["loss"] for row in records] == [float(s) for s in range(8)]
    others = {name: devices for name, devices in cuda.used.items() if name != threading.main_thread().name}
    assert any(name.startswith("phalanx-metrics") for name in others), cuda.used  # the thread did run CUDA work
    assert all(devices == {3} for devices in others.values()), others


def test_an_unindexed_device_is_the_training_threads_current_one(monkeypatch):
    cuda = FakeCuda().install(monkeypatch)
    torch.cuda.set_device(2)
    writer = RowWriter(deque(), None, None, torch.device("cuda"))
    try:
        writer.submit(pending_records(range(2)), {})
        writer.drain()
    finally:
        writer.close()
    others = {name: devices for name, devices in cuda.used.items() if name != threading.main_thread().name}
    assert others and all(devices == {2} for devices in others.values()), others
