"""Every strategy trains like one process under the optimizer kernels a CUDA run gets: foreach and
fused asked for in the optimizer's constructor (torch's default for CUDA tensors is foreach) and
each value of compute.optimizer_impl. On CPU torch's default is the for-loop, so the rest of the
suite never runs these kernels' calls over a strategy's parameters."""

from __future__ import annotations

import pytest

import phalanx
from tests.helpers import optimizer_kernels as k
from tests.helpers.compute import KERNEL_TOLERANCE
from tests.helpers.training import reference, rel_diff

pytestmark = pytest.mark.multiprocess
TIMEOUT = 180

STRATEGIES = {  # id: (strategy, processes)
    "single": ("single", 1),
    "ddp": ("ddp", 2),
    "zero1": ("zero1", 2),
    "fsdp": ("fsdp", 2),
    "pipeline": ({"name": "pipeline", "pipeline": {"schedule": "1f1b", "microbatches": 4}}, 2),
}


def _matches(out: dict, expected: dict, variant: str, what: str) -> None:
    assert out["runs"] == k.VARIANTS[variant][2]
    assert out["state"].keys() == expected.keys()
    difference = rel_diff(out["state"], expected)
    print(f"\n{what}, {variant}: max relative weight difference to one process {difference:.1e}")
    assert difference < KERNEL_TOLERANCE


@pytest.fixture(scope="module")
def mlp_reference() -> dict:
    return reference(k.GLOBAL_BATCH, k.STEPS, optimizer="adam", foreach=False)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("variant", k.VARIANTS)
@pytest.mark.parametrize("strategy, nprocs", STRATEGIES.values(), ids=STRATEGIES.keys())
def test_every_optimizer_kernel_trains_like_one_process(strategy, nprocs, variant, mlp_reference):
    if nprocs == 1:
        out = k.data_parallel(strategy, variant)
    else:
        out = phalanx.spawn(k.data_parallel, nprocs=nprocs, args=(strategy, variant), cpu=True, timeout=TIMEOUT)[0]
    _matches(out, mlp_reference, variant, str(strategy))


@pytest.fixture(scope="module")
def lm_reference() -> dict:
    return k.lm_reference()


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("variant", k.VARIANTS)
def test_tp_with_a_whole_layer_norm_trains_like_one_process(variant, lm_reference):
    # The plan splits the MLP and leaves the embedding, the LayerNorm and the head whole: one
    # foreach or fused call then got DTensors and plain tensors, and the first step crashed.
    out = phalanx.spawn(k.lm_train, nprocs=2, args=("tp", 2, variant), cpu=True, timeout=TIMEOUT)[0]
    assert out["steps"] == k.LM_STEPS
    assert out["whole"] == ["embed.weight", "head.bias", "head.weight", "norm.bias", "norm.weight"]
    _matches(out, lm_reference, variant, "tp 2")


# Four processes a run: the constructor's two kernels and what auto picks (fused on CPU).
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("variant", ["foreach=True", "fused=True", "optimizer_impl=auto"])
def test_fsdp_x_tp_trains_like_one_process_under_the_cuda_kernels(variant, lm_reference):
    out = phalanx.spawn(k.lm_train, nprocs=4, args=("fsdp", 2, variant), cpu=True, timeout=TIMEOUT)[0]
    assert out["whole"] == []  # every parameter a DTensor: sharded over the data axis
    _matches(out, lm_reference, variant, "fsdp x tp 2 x 2")
