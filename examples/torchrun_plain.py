"""A plain torchrun-style script that knows nothing of phalanx: it reads the environment torchrun
sets and joins the process group itself. `phalanx launch --nproc 2 examples/torchrun_plain.py`."""

import os

import torch
import torch.distributed as dist

rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo")
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"rank {rank} (local {local_rank}) of {world_size}: sum of ranks+1 = {total.item():g}", flush=True)
dist.destroy_process_group()
