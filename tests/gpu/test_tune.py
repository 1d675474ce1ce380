"""`phalanx tune` on a GPU: the memory cap is the caching allocator's limit, and a real tune under it."""

from __future__ import annotations

import pytest
import torch

from phalanx.runtime.memory_cap import MemoryCap
from tests.helpers.tune import tune_under_a_320_mib_cap

MIB = 2**20


@pytest.mark.cuda
def test_memory_cap_on_cuda_is_the_allocators_limit():
    device = torch.device("cuda", torch.cuda.current_device())
    MemoryCap(256 * MIB, device)
    try:
        small = torch.ones(64 * MIB // 4, device=device)
        with pytest.raises(torch.OutOfMemoryError):
            torch.ones(512 * MIB // 4, device=device)
        del small
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.timeout(240)
def test_tune_finds_the_largest_micro_batch_under_the_cuda_allocator_cap(tmp_path):
    # One GPU: global batch 48 is 48 per process; the cap is the caching allocator's, a real CUDA OOM.
    tune_under_a_320_mib_cap(tmp_path, "--nproc", "1")
