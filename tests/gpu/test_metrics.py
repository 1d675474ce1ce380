"""Per-step metrics on a GPU: peak memory, device work, and MFU where the GPU's peak is known."""

from __future__ import annotations

import pytest
import torch

from phalanx.metrics.flops import peak_flops_per_s
from tests.helpers.metrics import run_session


@pytest.mark.cuda
def test_cuda_records_peak_memory_and_mfu_where_the_gpu_is_known(capsys):
    session = run_session(steps=8, precision="bf16")
    session.close()
    assert all(isinstance(r["peak_mem_bytes"], int) and r["peak_mem_bytes"] > 0 for r in session.metrics.records)
    # Each step's work on the device, from its CUDA events: the forward at least, never negative.
    assert all(isinstance(r["device_work"], float) and r["device_work"] > 0 for r in session.metrics.records)
    out = capsys.readouterr().out
    assert "peak memory" in out
    if peak_flops_per_s(torch.cuda.get_device_name(), "bf16") is not None:
        assert session.metrics.flops_per_sample == 3 * 2 * (
            8 * 32 + 32 * 32 + 32 * 2
        )  # make_model's three Linear layers
        assert "MFU " in out
