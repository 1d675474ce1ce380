"""Tensor parallelism on one GPU: what a machine with a single GPU can run of strategy tp and of
fsdp x tp. The small GPT of tests/helpers/tensor_parallel.py, fp32, trained on cuda:0 and compared
with the plain one-process loop on the CPU (CUDA's kernels sum in another order; TF32 is off).

- tp alone (strategy.tp.size 1): the DTensor path on CUDA, a one-device mesh over a one-rank NCCL group;
- tp 2 on 2 processes sharing cuda:0 over gloo (NCCL refuses two ranks on one GPU): the split
  layers' all-reduces are gloo's on CUDA tensors;
- tp 2 x dp 2 on 4 processes sharing cuda:0 over gloo: the replicas' flat gradient all-reduce too;
- fsdp x tp 1 x 2 on 2 processes sharing cuda:0 over gloo: the 2-D path with a data axis of one
  (FSDP's reduce-scatter over one rank is a copy; its all-gather runs on a one-rank gloo group).
  fsdp x tp 2 x 2 on one GPU cannot run: gloo has no reduce-scatter for CUDA tensors.

benchmarks/gpu_check.sh runs this file as a part of its own. Never run on a GPU yet (docs/gpu-status.md)."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers import tensor_parallel as h
from tests.helpers.training import rel_diff

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]
TIMEOUT = 150
TOLERANCE = 1e-4  # as tests/gpu/test_shared_gpu.py: fp32 on CUDA against fp32 on the CPU


@pytest.fixture(scope="module")
def reference() -> dict:
    return h.reference()


def _train_on_the_gpu(nprocs: int, strategy: str, tp: int) -> list[dict]:
    backend = "auto" if nprocs == 1 else "gloo"  # alone: a one-rank NCCL group; shared: gloo on CUDA
    return phalanx.spawn(h.run, nprocs=nprocs, args=((strategy, tp), {}), cpu=False, backend=backend, timeout=TIMEOUT)


def _trains_like_one(ranks: list[dict], reference: dict, describe: str) -> None:
    for out in ranks:
        assert out["describe"].startswith(describe), out["describe"]
        assert out["steps"] == h.STEPS
    state = ranks[0]["state"]  # the full weights are gathered onto rank 0 only
    assert state.keys() == reference["state"].keys()
    difference = rel_diff(state, reference["state"])
    print(f"\n{ranks[0]['describe']}: max relative weight difference to one CPU process {difference:.1e}")
    assert difference < TOLERANCE


@pytest.mark.timeout(TIMEOUT + 30)
def test_tp_alone_runs_the_dtensor_path_on_cuda(reference):
    _trains_like_one(_train_on_the_gpu(1, "tp", 1), reference, "tp over 1 process")


@pytest.mark.timeout(TIMEOUT + 30)
def test_tp_on_two_processes_sharing_the_gpu(reference):
    _trains_like_one(_train_on_the_gpu(2, "tp", 2), reference, "tp over 2 tensor-parallel")


@pytest.mark.timeout(TIMEOUT + 30)
def test_tp_with_data_parallel_replicas_on_four_processes_sharing_the_gpu(reference):
    _trains_like_one(_train_on_the_gpu(4, "tp", 2), reference, "tp over 2 data-parallel x 2 tensor-parallel")


@pytest.mark.timeout(TIMEOUT + 30)
def test_fsdp_x_tp_with_a_data_axis_of_one_on_two_processes_sharing_the_gpu(reference):
    _trains_like_one(_train_on_the_gpu(2, "fsdp", 2), reference, "fsdp x tp over 2 tensor-parallel")
