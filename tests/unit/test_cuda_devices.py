"""Which CUDA devices a process drives, without a GPU (torch.cuda is faked: two devices): the rank's
device is made current even when the script made the process group; and where one process drives
several GPUs (dp, model_parallel), memory is measured and capped, and random generators kept, on
every one of them, not on cuda:0 alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from phalanx import Config
from phalanx.checkpoint import rng
from phalanx.metrics.recorder import StepRecorder
from phalanx.runtime.memory_cap import MemoryCap
from phalanx.strategies import create_strategy
from phalanx.topology import Topology

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
GIB = 1 << 30


def _config(strategy: str) -> Config:
    return Config.model_validate({"strategy": {"name": strategy}})


@pytest.fixture
def two_gpus(monkeypatch):
    """Two fake GPUs of 8 GiB: what each was asked, by function name."""
    calls: dict[str, list] = {}

    def record(name, result=None):
        return lambda *args: calls.setdefault(name, []).append(args) or (result(*args) if result else None)

    peaks = {0: 1 * GIB, 1: 3 * GIB}
    generators = {0: torch.tensor([0], dtype=torch.uint8), 1: torch.tensor([1], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", record("set_device"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=8 * GIB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", record("set_per_process_memory_fraction"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", record("max_memory_allocated", lambda d: peaks[d.index]))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", record("max_memory_reserved", lambda d: peaks[d.index]))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", record("reset_peak_memory_stats"))
    monkeypatch.setattr(torch.cuda, "get_rng_state", record("get_rng_state", lambda d: generators[d.index].clone()))
    monkeypatch.setattr(torch.cuda, "set_rng_state", record("set_rng_state"))
    return calls


# -- 7a: the rank's device is current, whoever made the process group ---------------------------
def test_the_ranks_device_is_made_current_when_the_script_made_the_process_group(monkeypatch, two_gpus):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: pytest.fail("the script's group is kept"))
    topology = Topology(rank=1, local_rank=1, world_size=2, local_world_size=2, launched=True, device=CUDA1)
    create_strategy(_config("ddp"), topology).setup_environment()
    assert two_gpus["set_device"] == [(CUDA1,)]


def test_a_cpu_rank_sets_no_cuda_device(monkeypatch, two_gpus):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    create_strategy(_config("ddp"), Topology(rank=1, world_size=2, launched=True)).setup_environment()
    assert "set_device" not in two_gpus


# -- 7b: the devices a strategy drives ---------------------------------------------------------
@pytest.mark.parametrize("strategy", ["dp", "model_parallel"])
def test_one_process_over_every_gpu_drives_them_all(two_gpus, strategy):
    assert create_strategy(_config(strategy), Topology(device=CUDA0)).devices == [CUDA0, CUDA1]
    assert create_strategy(_config(strategy), Topology()).devices == [torch.device("cpu")]


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_a_process_of_one_gpu_drives_its_own(two_gpus, strategy):
    topology = Topology(device=CUDA1) if strategy == "single" else Topology(rank=1, world_size=2, device=CUDA1)
    assert create_strategy(_config(strategy), topology).devices == [CUDA1]


def test_the_recorded_peak_is_the_fullest_devices_and_every_peak_restarts(two_gpus):
    recorder = StepRecorder(Topology(device=CUDA0), enabled=False, devices=[CUDA0, CUDA1])
    assert recorder.peak_memory() == 3 * GIB
    assert two_gpus["reset_peak_memory_stats"] == [(CUDA0,), (CUDA1,)]


def test_the_memory_cap_holds_on_every_device(two_gpus):
    cap = MemoryCap.create("2GiB", CUDA0, [CUDA0, CUDA1])
    assert two_gpus["set_per_process_memory_fraction"] == [(0.25, CUDA0), (0.25, CUDA1)]
    assert cap.used_bytes() == 3 * GIB  # cuda:1's, over the cap, though cuda:0 is under it


def test_the_random_generators_of_every_device_are_kept_and_restored(two_gpus):
    state = rng.capture([CUDA0, CUDA1])
    assert state["cuda"].tolist() == [0] and [t.tolist() for t in state["cuda_more"]] == [[1]]
    rng.restore(state, [CUDA0, CUDA1])
    assert [(t.tolist(), d) for t, d in two_gpus["set_rng_state"]] == [([0], CUDA0), ([1], CUDA1)]


def test_a_checkpoint_of_one_devices_generator_still_loads(two_gpus):
    old = rng.capture(CUDA0)  # what a checkpoint held before: "cuda" alone
    assert "cuda_more" not in old
    rng.restore(old, [CUDA0, CUDA1])  # cuda:1 keeps its own generator
    assert [(t.tolist(), d) for t, d in two_gpus["set_rng_state"]] == [([0], CUDA0)]
