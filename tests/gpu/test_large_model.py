"""Deferred construction on a GPU: the model is materialised on the device directly (no host copy),
initialised there, and loaded from a safetensors file with the file's exact values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx import Config, Session
from phalanx.runtime.memory_cap import track_live_memory
from tests.helpers.large_model import _reset_peak, _status

MiB = 1 << 20


@pytest.mark.cuda
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_deferred_model_goes_to_the_gpu_without_a_host_copy(strategy, tmp_path):
    from safetensors.torch import save_file

    build = lambda: nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(32)))  # noqa: E731  128 MiB
    torch.manual_seed(1)
    weights = build().state_dict()
    save_file(weights, tmp_path / "w.safetensors")
    track_live_memory()
    session = Session(Config(), strategy=strategy, train={"progress": False, "metrics": False})
    device = session.device
    torch.zeros(1, device=device)  # the CUDA context's host memory is not the model's
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    base = _reset_peak()
    with session.init_module():
        model = build()
    model = session.setup(model)
    session.load_weights(str(tmp_path / "w.safetensors"))
    torch.cuda.synchronize()
    host = _status("VmHWM") - base
    peak = torch.cuda.max_memory_allocated(device) - before
    print(f"\n{strategy}: host +{host / MiB:.0f} MiB, device peak +{peak / MiB:.0f} MiB for 128 MiB of weights")
    assert host < 64 * MiB  # the weights never sat in host memory whole (one tensor read at a time does)
    assert peak < 128 * MiB + 16 * MiB  # the weights and one tensor being loaded
    state = session.model_state_dict(model)
    for key, value in weights.items():
        assert torch.equal(state[key].cpu(), value), key
    session.close()
