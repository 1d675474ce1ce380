"""Planted: a shuffling DistributedSampler that is never told the epoch."""

import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dataset = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
sampler = DistributedSampler(dataset)  # planted
loader = DataLoader(dataset, batch_size=8, sampler=sampler)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).cuda())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x.cuda()), y.cuda())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
