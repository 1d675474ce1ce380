"""phalanx.spawn's device choice and its gloo-on-CUDA switch, without a process or a GPU (the GPU
count and the process-group calls are faked)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx import Config
from phalanx.errors import PhalanxError
from phalanx.strategies import create_strategy
from phalanx.topology import LaunchContext, Topology


def _never_called():
    raise AssertionError("no process should start")


@pytest.mark.parametrize("cpu", [None, False])
def test_more_processes_than_gpus_on_nccl_is_one_line(monkeypatch, cpu):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(PhalanxError) as err:
        phalanx.spawn(_never_called, nprocs=2, cpu=cpu)
    assert str(err.value) == (
        "phalanx.spawn: 2 processes on NCCL need 2 GPUs but 1 is visible; "
        "pass backend='gloo' to share GPUs, or cpu=True"
    )


def test_an_unknown_backend_is_one_line():
    with pytest.raises(PhalanxError, match="^phalanx.spawn: backend must be 'auto' or 'gloo', got 'nccl'$"):
        phalanx.spawn(_never_called, nprocs=2, cpu=True, backend="nccl")


# -- gloo on CUDA devices: what a spawned process's Topology and process group get ----------------
def test_the_launch_context_carries_gloo_on_cuda_to_the_topology():
    env = {"RANK": "1", "WORLD_SIZE": "2", **LaunchContext(gloo_on_cuda=True).to_env()}
    assert Topology.from_env(env).gloo_on_cuda and not Topology.from_env({"RANK": "1", "WORLD_SIZE": "2"}).gloo_on_cuda
    cuda = torch.device("cuda", 0)
    assert Topology(device=cuda).backend == "nccl"
    assert Topology(device=cuda, gloo_on_cuda=True).backend == "gloo"


@pytest.mark.parametrize("gloo_on_cuda, backend", [(False, "cpu:gloo,cuda:nccl"), (True, "gloo")])
def test_the_process_group_on_cuda_is_nccl_unless_gloo_is_asked_for(monkeypatch, gloo_on_cuda, backend):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda name, **kw: calls.append((name, sorted(kw))))
    cuda = torch.device("cuda", 0)
    topology = Topology(rank=0, world_size=2, local_world_size=2, launched=True, device=cuda, gloo_on_cuda=gloo_on_cuda)
    create_strategy(Config(), topology).setup_environment()
    # device_id binds NCCL's communicator to the GPU; gloo has none to bind.
    kwargs = ["device_id", "rank", "timeout", "world_size"] if backend != "gloo" else ["rank", "timeout", "world_size"]
    assert calls == [("set_device", cuda), (backend, kwargs)]
