"""A rank's GPU under plain torchrun: more local ranks than visible GPUs would put two ranks on one
GPU, which NCCL refuses ("Duplicate GPU") long after start; phalanx refuses it at once, in one line.
phalanx.spawn's gloo-on-CUDA mode shares GPUs on purpose and keeps wrapping. torch.cuda is faked."""

from __future__ import annotations

import pytest
import torch

from phalanx.errors import PhalanxError
from phalanx.topology import LaunchContext, Topology, pick_device


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def _torchrun(local_rank: int, **more: str) -> dict[str, str]:
    return {"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", **more}


def test_a_local_rank_past_the_visible_gpus_is_refused_in_one_line(two_gpus):
    with pytest.raises(PhalanxError) as err:
        Topology.from_env(_torchrun(2, CUDA_VISIBLE_DEVICES="0,1"))
    assert str(err.value) == (
        "LOCAL_RANK 2 but only 2 CUDA devices are visible (CUDA_VISIBLE_DEVICES=0,1): two ranks would share one "
        "GPU, which NCCL refuses; start at most 2 processes per node (--nproc-per-node 2) or make more GPUs visible"
    )


def test_the_refusal_says_when_cuda_visible_devices_is_unset(monkeypatch, two_gpus):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(
        PhalanxError, match=r"^LOCAL_RANK 1 but only 1 CUDA device is visible \(CUDA_VISIBLE_DEVICES=unset\)"
    ):
        pick_device(1, env={})


def test_each_local_rank_within_the_gpus_gets_its_own(two_gpus):
    assert [Topology.from_env(_torchrun(r)).device for r in (0, 1)] == [torch.device("cuda", r) for r in (0, 1)]


def test_gloo_on_cuda_shares_the_gpus_as_phalanx_spawn_asks(two_gpus):
    env = _torchrun(2, **LaunchContext(gloo_on_cuda=True).to_env())
    assert Topology.from_env(env).device == torch.device("cuda", 0)


def test_a_cpu_run_takes_any_local_rank(two_gpus):
    assert Topology.from_env(_torchrun(5), force_cpu=True).device == torch.device("cpu")
