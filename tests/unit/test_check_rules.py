"""Each rule of ``phalanx check`` on small sources: the mistake found at its line (marked ``# here``),
and the correct forms beside it left alone."""

from __future__ import annotations

import textwrap

import pytest

from phalanx.check import check_source

DDP_HEAD = """
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
"""
SESSION_HEAD = """
import torch
import phalanx
session = phalanx.Session()
"""


def _found(source: str, rule: str) -> list[int]:
    return [f.line for f in check_source(textwrap.dedent(source)) if f.rule == rule]


def _marked(source: str) -> list[int]:
    return [n for n, line in enumerate(textwrap.dedent(source).splitlines(), 1) if "# here" in line]


POSITIVE = {
    "rank-guarded-collective": [
        DDP_HEAD + "if rank == 0:\n    dist.all_reduce(t)  # here\n",
        DDP_HEAD + "if dist.get_rank() == 0:\n    dist.barrier()  # here\n",
        "import os\nimport torch.distributed as d\nif int(os.environ['RANK']) == 0:\n    d.broadcast(t, 0)  # here\n",
        "from torch.distributed import all_reduce\nif local_rank == 0:\n    all_reduce(t)  # here\n",
        "import torch\nif master_process:\n    torch.distributed.barrier()  # here\n",
        SESSION_HEAD + "if session.is_main:\n    session.save()  # here\n",
        SESSION_HEAD + "def end():\n    if not session.is_main:\n        return\n    session.barrier()  # here\n",
        "from accelerate import Accelerator\nacc = Accelerator()\nif acc.is_main_process:\n"
        "    acc.wait_for_everyone()  # here\n",
        "import torch.distributed.checkpoint as dcp\nif is_main:\n    dcp.save(state, checkpoint_id='c')  # here\n",
        DDP_HEAD + "def sync(t):\n    dist.all_reduce(t)\nif rank == 0:\n    sync(t)  # here\n",
        DDP_HEAD + "master = rank == 0\nif master and epoch % 10 == 0:\n    dist.barrier()  # here\n",
        DDP_HEAD + "class T:\n    def save(self):\n        dist.barrier()\n    def run(self):\n"
        "        if self.gpu_id == 0:\n            self.save()  # here\n",
    ],
    "set-epoch-missing": [
        DDP_HEAD + "sampler = DistributedSampler(ds)  # here\nloader = DataLoader(ds, sampler=sampler)\n",
        DDP_HEAD + "loader = DataLoader(ds, sampler=DistributedSampler(ds, shuffle=True))  # here\n",
    ],
    "loss-divided-in-accumulate": [
        SESSION_HEAD + "with session.accumulate(model):\n    loss = loss_fn(model(x), y) / accum_steps  # here\n",
        "with accelerator.accumulate(model):\n    loss /= args.gradient_accumulation_steps  # here\n",
        SESSION_HEAD + "with session.accumulate(model):\n    session.backward(loss / grad_acc)  # here\n",
    ],
    "scheduler-in-accumulate": [
        SESSION_HEAD + "with session.accumulate(model):\n    session.backward(loss)\n    lr_sched.step()  # here\n",
        SESSION_HEAD
        + "s = torch.optim.lr_scheduler.StepLR(opt, 3)\nwith session.accumulate(model):\n    s.step()  # here\n",
    ],
    "step-in-accumulate": [
        SESSION_HEAD + "with session.accumulate(model):\n    session.backward(loss)\n    optimizer.step()  # here\n",
        SESSION_HEAD
        + "with session.accumulate(model):\n    optimizer.zero_grad()  # here\n    session.backward(loss)\n",
        SESSION_HEAD + "with session.accumulate(model):\n    model.zero_grad()  # here\n",
    ],
    "scheduler-per-micro-step": [
        "for i, (x, y) in enumerate(loader):\n    loss = model(x).mean()\n    loss.backward()\n"
        "    if (i + 1) % accum == 0:\n        optimizer.step()\n        optimizer.zero_grad()\n"
        "    scheduler.step()  # here\n",
    ],
    "unguarded-torch-save": [
        DDP_HEAD + "torch.save(model.state_dict(), 'm.pt')  # here\n",
        SESSION_HEAD + "def main():\n    torch.save(model.state_dict(), 'm.pt')  # here\nmain()\n",
        DDP_HEAD + "def save():\n    torch.save(model, 'm.pt')  # here\nif rank == 0:\n    save()\nsave()\n",
    ],
    "cuda-without-index": [
        "import torch.distributed as dist\ndist.init_process_group('nccl')\nmodel = model.cuda()  # here\n",
        "import os\nr = os.environ['LOCAL_RANK']\nx = x.to('cuda')  # here\n",
        "import os\nr = os.environ['LOCAL_RANK']\nd = torch.device('cuda:0')  # here\n",
        "import os\nr = os.environ['LOCAL_RANK']\nx = torch.zeros(3, device='cuda')  # here\n",
        "import os\nr = os.environ['LOCAL_RANK']\ndevice = 'cuda'  # here\n",
    ],
    "data-parallel": ["import torch.nn as nn\nmodel = nn.DataParallel(model)  # here\n"],
    "batchnorm-unsynced": [
        DDP_HEAD + "net = torch.nn.Sequential(torch.nn.BatchNorm2d(3))  # here\n",
        SESSION_HEAD + "import torchvision\nmodel = torchvision.models.resnet50()  # here\n",
    ],
    "unreduced-loss-print": [DDP_HEAD + "print(f'global loss {loss.item()}')  # here\n"],
    "shuffled-eval-loader": [
        "val_loader = DataLoader(val_set, batch_size=8, shuffle=True)  # here\n",
        DDP_HEAD + "test_sampler = DistributedSampler(test_set)  # here\n",
    ],
    "untimed-cuda-sync": [
        "import time\ndef bench():\n    x = x.cuda(0)\n    t0 = time.perf_counter()\n    out = model(x)\n"
        "    out.sum().backward()\n    elapsed = time.perf_counter() - t0  # here\n",
    ],
    "sum-loss": [
        DDP_HEAD + "loss = F.cross_entropy(out, y, reduction='sum')  # here\nloss.backward()\n",
        SESSION_HEAD + "loss = model(x).sum()  # here\nsession.backward(loss)\n",
    ],
    "rank-dependent-seed": [
        "import torch\nfrom torch.distributed.fsdp import fully_shard\ntorch.manual_seed(1337 + rank)  # here\n"
        "model = Net()\nfully_shard(model)\n",
    ],
}

NEGATIVE = {
    "rank-guarded-collective": [
        DDP_HEAD + "dist.all_reduce(t)\nif rank == 0:\n    print(t)\n    torch.save(model.state_dict(), 'm.pt')\n",
        DDP_HEAD + "if epoch % 10 == 0:\n    dist.barrier()\nif world_size > 1:\n    dist.all_reduce(t)\n",
        "ddp = int(os.environ.get('RANK', -1)) != -1\nif ddp:\n    dist.barrier()\n",
        SESSION_HEAD + "if session.is_main:\n    session.print('x')\n    session.log(loss=1.0)\nsession.save()\n",
        DDP_HEAD + "if rank == 0:\n    dist.broadcast(x, 0)\nelse:\n    dist.broadcast(y, 0)\n",
        DDP_HEAD + "if args.rank is not None:\n    dist.barrier()\n",
        "import functools\nif rank == 0:\n    functools.reduce(f, xs)\n",
        # The "rank 0 first" pair (YOLOv5's torch_distributed_zero_first, older HF example scripts).
        DDP_HEAD + "def zero_first(local_rank):\n    if local_rank not in [-1, 0]:\n        dist.barrier()\n"
        "    yield\n    if local_rank == 0:\n        dist.barrier()\n",
    ],
    "set-epoch-missing": [
        DDP_HEAD + "sampler = DistributedSampler(ds)\nfor e in range(3):\n    sampler.set_epoch(e)\n",
        DDP_HEAD + "loader = DataLoader(ds, sampler=DistributedSampler(ds))\nloader.sampler.set_epoch(1)\n",
        DDP_HEAD + "sampler = DistributedSampler(ds)\nrun(loader, on_epoch=sampler.set_epoch)\n",
        DDP_HEAD + "sampler = DistributedSampler(ds, shuffle=False)\n",
        SESSION_HEAD + "sampler = DistributedSampler(ds)\nfor epoch in session.epochs():\n    pass\n",
    ],
    "loss-divided-in-accumulate": [
        SESSION_HEAD + "with session.accumulate(model):\n    session.backward(loss)\nprint(loss / accum_steps)\n",
        SESSION_HEAD + "with session.accumulate(model):\n    loss = loss_fn(model(x), y) / n_tokens\n",
    ],
    "scheduler-in-accumulate": [
        SESSION_HEAD + "model, opt, scheduler = session.setup(model, opt, scheduler)\n"
        "with session.accumulate(model):\n    scheduler.step()\n",
        SESSION_HEAD + "with session.accumulate(model):\n    session.backward(loss)\nif session.sync_gradients:\n"
        "    scheduler.step()\n",
        "with accelerator.accumulate(model):\n    accelerator.backward(loss)\n    lr_scheduler.step()\n",
    ],
    "step-in-accumulate": [
        "with accelerator.accumulate(model):\n    accelerator.backward(loss)\n    optimizer.step()\n"
        "    optimizer.zero_grad()\n",
        SESSION_HEAD + "with session.accumulate(model):\n    session.backward(loss)\n",
    ],
    "scheduler-per-micro-step": [
        "for i, (x, y) in enumerate(loader):\n    loss = model(x).mean()\n    loss.backward()\n"
        "    if (i + 1) % accum == 0:\n        optimizer.step()\n        scheduler.step()\n",
        "for x, y in loader:\n    loss = model(x).mean()\n    loss.backward()\n    optimizer.step()\n"
        "    scheduler.step()\n",
    ],
    "unguarded-torch-save": [
        "import torch\ntorch.save(model.state_dict(), 'm.pt')\n",
        DDP_HEAD + "if rank == 0:\n    torch.save(model.state_dict(), 'm.pt')\n",
        DDP_HEAD + "torch.save(shard, f'shard-{rank}.pt')\n",
        DDP_HEAD + "def save():\n    torch.save(model, 'm.pt')\nif rank == 0:\n    save()\n",
        DDP_HEAD + "def unused():\n    torch.save(model, 'm.pt')\n",
        SESSION_HEAD + "if session.is_main:\n    torch.save(session.model_state_dict(), 'm.pt')\n",
        DDP_HEAD + "def is_main_process():\n    return dist.get_rank() == 0\ndef save_on_master(*a):\n"
        "    if is_main_process():\n        torch.save(*a)\nsave_on_master(model, 'm.pt')\n",
        DDP_HEAD + "def first():\n    return get_rank() == 0\nif first():\n    torch.save(model, 'm.pt')\n",
        DDP_HEAD + "import io\ntorch.save(state, io.BytesIO())\nbuf = io.BytesIO()\ntorch.save(state, buf)\n",
    ],
    "cuda-without-index": [
        DDP_HEAD + "model = model.cuda()\nx = x.to('cuda')\n",
        "import os\nr = int(os.environ['LOCAL_RANK'])\nx = x.to(f'cuda:{r}')\nm = m.cuda(r)\n",
        "model = model.cuda()\nx = x.to('cuda:0')\n",
        SESSION_HEAD + "import os\nr = os.environ['LOCAL_RANK']\nmodel = model.cuda()\n",
        "import os\nr = os.environ['LOCAL_RANK']\ndevice = 'cuda'\nif r:\n    device = f'cuda:{r}'\n",
        "import os\nfrom accelerate import Accelerator\nacc = Accelerator()\nr = os.environ.get('LOCAL_RANK')\n"
        "model = model.cuda()\nx = x.to('cuda')\n",
    ],
    "data-parallel": [DDP_HEAD + "model = DDP(model)\n"],
    "batchnorm-unsynced": [
        DDP_HEAD + "net = torch.nn.BatchNorm2d(3)\nnet = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)\n",
        "import torch\nnet = torch.nn.BatchNorm2d(3)\n",
        DDP_HEAD + "import torchvision\nmodel = torchvision.models.convnext_tiny()\n",
    ],
    "unreduced-loss-print": [
        DDP_HEAD + "dist.all_reduce(loss)\nprint(f'global loss {loss.item()}')\n",
        DDP_HEAD + "print(f'loss {loss.item()}')\n",
        "print(f'global loss {loss}')\n",
    ],
    "shuffled-eval-loader": [
        "train_loader = DataLoader(train_set, shuffle=True)\nval_loader = DataLoader(val_set, shuffle=False)\n",
        "latest_loader = DataLoader(ds, shuffle=True)\n",
        DDP_HEAD + "val_sampler = DistributedSampler(val_set, shuffle=False)\n",
    ],
    "untimed-cuda-sync": [
        "import time\ndef bench():\n    x = x.cuda(0)\n    t0 = time.perf_counter()\n    out = model(x)\n"
        "    torch.cuda.synchronize()\n    elapsed = time.perf_counter() - t0\n",
        "import time\ndef bench():\n    x = x.cuda(0)\n    t0 = time.time()\n    loss = model(x)\n"
        "    print(loss.item())\n    elapsed = time.time() - t0\n",
        "import time\nt0 = time.time()\nout = model(x)\nelapsed = time.time() - t0\n",
    ],
    "sum-loss": [
        DDP_HEAD + "loss = F.cross_entropy(out, y, reduction='sum') / n_tokens\n",
        "loss = F.cross_entropy(out, y, reduction='sum')\nloss.backward()\n",
        DDP_HEAD + "loss = F.cross_entropy(out, y)\nloss.backward()\ntotal = correct.sum()\n",
    ],
    "rank-dependent-seed": [
        DDP_HEAD + "torch.manual_seed(1337 + rank)\nmodel = DDP(Net())\n",
        "import torch\nfrom torch.distributed.fsdp import fully_shard\ntorch.manual_seed(1337)\nmodel = Net()\n",
        "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\ntorch.manual_seed(1 + rank)\n",
    ],
}


@pytest.mark.parametrize(
    "rule,source", [(rule, s) for rule, sources in POSITIVE.items() for s in sources], ids=lambda v: v[:40]
)
def test_each_rule_finds_its_mistake_at_its_line(rule, source):
    assert _marked(source), "an example marks the line of its mistake"
    assert _found(source, rule) == _marked(source)


@pytest.mark.parametrize(
    "rule,source", [(rule, s) for rule, sources in NEGATIVE.items() for s in sources], ids=lambda v: v[:40]
)
def test_each_rule_leaves_the_correct_form_alone(rule, source):
    assert _found(source, rule) == []


def test_every_rule_has_both_kinds_of_example():
    from phalanx.check import RULES

    assert set(POSITIVE) == set(NEGATIVE) == set(RULES)


def test_a_collective_in_a_called_function_names_the_inner_line():
    source = DDP_HEAD + "def sync(t):\n    dist.all_reduce(t)\nif rank == 0:\n    sync(t)\n"
    (finding,) = check_source(source)
    assert finding.line == len(source.splitlines()) and "at line 10" in finding.message


def test_recursive_functions_end():
    source = DDP_HEAD + "def a():\n    b()\ndef b():\n    a()\n    dist.barrier()\nif rank == 0:\n    a()\n"
    assert [f.rule for f in check_source(source)] == ["rank-guarded-collective"]
