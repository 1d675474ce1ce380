"""Planted: hand-written accumulation whose scheduler steps on every micro-step."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = DDP(torch.nn.Linear(4, 1).cuda(), device_ids=[local_rank])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
accumulation_steps = 4
for i in range(1000):
    x, y = torch.randn(8, 4).cuda(), torch.randn(8, 1).cuda()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if (i + 1) % accumulation_steps == 0:
        optimizer.step()
        optimizer.zero_grad()
    scheduler.step()  # planted
