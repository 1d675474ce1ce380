"""The input pipeline's real CUDA path: batches copied on a side stream match the plain path's."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import phalanx.runtime.transfer as transfer_mod
from phalanx.runtime.transfer import PlainTransfer, StreamTransfer
from tests.helpers.loaders import sharded


# -- the CUDA path -------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.cuda
def test_stream_prefetch_yields_the_plain_path_batches_from_a_side_stream(monkeypatch, workers):
    device = torch.device("cuda", 0)
    data = TensorDataset(torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))
    copy_streams, recorded = [], []
    real_to_device, real_record = transfer_mod.to_device, torch.Tensor.record_stream

    def spy_to_device(value, dev, non_blocking=False):
        copy_streams.append(torch.cuda.current_stream(dev))
        return real_to_device(value, dev, non_blocking)

    def spy_record(tensor, stream):
        recorded.append(stream)
        return real_record(tensor, stream)

    monkeypatch.setattr(transfer_mod, "to_device", spy_to_device)
    monkeypatch.setattr(torch.Tensor, "record_stream", spy_record)

    plain = sharded(data, workers=workers, batch_size=8, device=device, prefetch_to_device=False)
    fast = sharded(data, workers=workers, batch_size=8, device=device)
    assert isinstance(plain.transfer, PlainTransfer) and isinstance(fast.transfer, StreamTransfer)
    assert fast.fetch_ahead == (workers > 0) and fast.loader.pin_memory and fast.non_blocking
    compute = torch.cuda.current_stream(device)
    assert fast.transfer.stream != compute

    expected = [(x.clone(), y.clone()) for x, y in plain]
    copy_streams.clear()
    got = []
    for x, y in fast:
        assert x.is_cuda and y.is_cuda
        torch.cuda._sleep(100_000)  # keep the compute stream busy, as a training step would
        got.append((x * 1, y + 0))  # read on the compute stream
    torch.cuda.synchronize()
    assert len(got) == len(expected) == 8
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(expected, got))
    assert copy_streams and all(s == fast.transfer.stream for s in copy_streams)
    assert len(recorded) == 2 * len(got) and all(s == compute for s in recorded)
    assert fast.position == plain.position == 64
