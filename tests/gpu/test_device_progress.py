"""The hang report's device facts on a real GPU: step-end events that the training thread records,
asked from another thread without waiting for the device (see faults/device_progress.py)."""

from __future__ import annotations

import pytest
import torch

from phalanx.faults.device_progress import DeviceFacts, DeviceProgress

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_queued_work_shows_as_pending_and_finished_work_as_idle():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(device)
    progress = DeviceProgress.of(device)
    a, out = torch.randn(8192, 8192, device=device), torch.empty(8192, 8192, device=device)
    progress.step_ended()
    torch.cuda.synchronize(device)
    for _ in range(300):  # seconds of float32 matmuls, queued without a sync
        torch.matmul(a, a, out=out)
    progress.step_ended()
    facts = progress.facts()
    assert facts == DeviceFacts(str(device), 2, 1, True)
    torch.cuda.synchronize(device)
    assert progress.facts() == DeviceFacts(str(device), 2, 2, False)
