"""Planted: a barrier that rank 0 alone reaches (the other ranks never arrive)."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = torch.nn.Linear(4, 4).cuda()
if rank == 0:
    torch.save(model.state_dict(), "model.pt")
    dist.barrier()  # planted
dist.destroy_process_group()
