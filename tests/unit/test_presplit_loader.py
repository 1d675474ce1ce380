"""A DataLoader the script split with torch's DistributedSampler is taken as split (issue 41): set up
for training with the sampler's shuffle and seed, its batch_size per process, said in one line; an
evaluation loader's DistributedSampler(drop_last=True) keeps its drop_last, so the script's own pass
over the remainder (PyTorch's ImageNet example) counts every sample once."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import phalanx
from phalanx.runtime.data import ShardedSampler


def _session():
    return phalanx.Session(phalanx.Config(), train={"progress": False}, checkpoint={"resume": "never"})


def test_a_distributed_sampler_trains_with_its_seed_and_its_per_process_batch(capsys):
    data = TensorDataset(torch.arange(12.0))
    session = _session()
    try:
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
        loader = session.setup_loader(DataLoader(data, batch_size=3, sampler=sampler), train=True)
        assert loader.train and loader.sampler.multiple_of == 3  # the global batch: 3 x 1 process
        assert "taken as split, its batch_size 3 is per process, so the global batch is 3" in capsys.readouterr().out
        expected = ShardedSampler(12, 0, 1, shuffle=True, seed=5, multiple_of=3).global_order().tolist()
        assert [x.item() for (batch,) in loader for x in batch] == expected
    finally:
        session.close()


def test_setup_takes_a_shuffling_distributed_sampler_for_training_without_the_ordered_line(capsys):
    data = TensorDataset(torch.arange(8.0))
    session = _session()
    try:
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = DistributedSampler(data, num_replicas=1, rank=0)
        _, _, loader = session.setup(model, optimizer, DataLoader(data, batch_size=2, sampler=sampler))
        assert loader.train and "does not shuffle" not in capsys.readouterr().out
    finally:
        session.close()


def test_an_evaluation_distributed_sampler_keeps_its_drop_last():
    data = TensorDataset(torch.arange(5.0))
    session = _session()
    try:
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=False, drop_last=True)
        loader = session.setup_loader(DataLoader(data, batch_size=2, sampler=sampler), train=False)
        assert not loader.train and loader.sampler.drop_last and len(loader.sampler) == len(sampler) == 5
    finally:
        session.close()
