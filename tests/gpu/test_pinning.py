"""A dataset that already holds CUDA tensors (as ported single-GPU loops often have) trains through
a Session: data.pin_memory null leaves it unpinned, true is refused in one line, and the side-stream
prefetcher hands its batches out unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Config, Session
from phalanx.errors import ConfigError
from phalanx.runtime.transfer import StreamTransfer
from tests.helpers.models import make_data, make_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _resident(n: int) -> TensorDataset:
    x, y = make_data(n).tensors
    return TensorDataset(x.cuda(), y.cuda())


def test_a_cuda_resident_dataset_trains_unpinned_through_the_side_stream():
    session = Session(Config(), strategy="single", batch={"global_batch_size": 16}, train={"progress": False})
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _resident(64)
    model, optimizer = session.setup(model, optimizer)
    loader = session.setup_loader(DataLoader(data, batch_size=16, shuffle=False), train=True)  # in order
    assert not loader.loader.pin_memory and not loader.non_blocking
    assert isinstance(loader.transfer, StreamTransfer)
    seen = []
    for x, y in loader:  # before the fix: torch's "cannot pin 'torch.cuda.FloatTensor'" here
        assert x.is_cuda and y.is_cuda
        seen.append(x.clone())
        with session.accumulate(model):
            session.backward(F.mse_loss(model(x), y))
    torch.cuda.synchronize()
    assert session.step_count == 4
    assert torch.equal(torch.cat(seen), data.tensors[0])  # the prefetcher changed nothing
    session.close()


def test_pin_memory_true_with_a_cuda_resident_dataset_is_refused():
    session = Session(Config(), strategy="single", data={"pin_memory": True}, train={"progress": False})
    with pytest.raises(ConfigError, match="data.pin_memory is true, but the DataLoader's batches already hold"):
        session.setup(DataLoader(_resident(16), batch_size=4, shuffle=True))
    session.close()


def test_host_batches_are_still_pinned_by_default():
    session = Session(Config(), strategy="single", train={"progress": False})
    loader = session.setup(DataLoader(make_data(16), batch_size=4, shuffle=True))
    assert loader.loader.pin_memory and loader.non_blocking
    session.close()
