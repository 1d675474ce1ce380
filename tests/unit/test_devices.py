"""Device selection for a launch: pure logic, with the CUDA count passed in."""

from __future__ import annotations

import pytest

from phalanx.errors import PhalanxError
from phalanx.launch.devices import plan_devices


def plan(**kw):
    args = dict(gpus=None, nproc=None, cpu=False, processes_per_node=None, cuda_count=0, visible=None, cores=8)
    args.update(kw)
    return plan_devices(**args)


def test_cpu_default_two_processes_sharing_cores():
    p = plan()
    assert (p.kind, p.nproc, p.omp_num_threads, p.cuda_visible_devices) == ("cpu", 2, 4, None)


def test_cpu_nproc_and_single_process_strategies():
    assert plan(nproc=3, cores=2).omp_num_threads == 1
    assert plan(processes_per_node=1).nproc == 1


def test_every_gpu_by_default():
    p = plan(cuda_count=4)
    assert (p.kind, p.nproc, p.cuda_visible_devices) == ("cuda", 4, "0,1,2,3")


def test_gpus_index_into_existing_visible_devices():
    p = plan(cuda_count=3, visible=["4", "5", "7"], gpus="0,2")
    assert (p.nproc, p.cuda_visible_devices) == (2, "4,7")


def test_dp_uses_one_process_over_all_selected_gpus():
    p = plan(cuda_count=4, gpus="1,3", processes_per_node=1)
    assert (p.nproc, p.cuda_visible_devices) == (1, "1,3")


def test_cpu_flag_ignores_gpus():
    assert plan(cuda_count=4, cpu=True).kind == "cpu"


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(gpus="0"), "--gpus 0: no CUDA device is visible here"),
        (dict(gpus="2,5", cuda_count=4), "GPU 5 does not exist; 4 visible GPUs are numbered 0-3"),
        (dict(gpus="a,b", cuda_count=2), "--gpus expects comma-separated GPU indices"),
        (dict(gpus="1,1", cuda_count=2), "names a GPU twice"),
        (dict(nproc=3, cuda_count=2), "--nproc 3 needs 3 GPUs but 2 are selected"),
        (dict(nproc=0), "--nproc must be at least 1"),
    ],
)
def test_bad_device_requests(kw, message):
    with pytest.raises(PhalanxError) as err:
        plan(**kw)
    assert message in str(err.value)
