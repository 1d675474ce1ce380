"""How nodes find each other (flags, config and SLURM variables to a torch elastic rendezvous),
and the settings that decide when ranks save: steps or a period, agreed at a step end."""

from __future__ import annotations

import pytest

from phalanx.config.schema import Config, parse_period
from phalanx.errors import PhalanxError
from phalanx.launch.rendezvous import first_host, plan_rendezvous
from phalanx.topology import slurm_job


def _plan(**kwargs):
    args = {
        "nnodes": 1,
        "node_rank": None,
        "master": None,
        "rdzv_endpoint": None,
        "rdzv_id": None,
        "slurm": None,
        **kwargs,
    }
    return plan_rendezvous(**args)


def test_single_node_uses_a_free_loopback_port():
    rdzv = _plan()
    assert (rdzv.backend, rdzv.endpoint, rdzv.multi_node) == ("c10d", "127.0.0.1:0", False)


def test_master_is_static_with_a_shared_job_id():
    rdzv = _plan(nnodes=2, node_rank=1, master="node01:29500")
    assert (rdzv.backend, rdzv.endpoint, rdzv.configs, rdzv.run_id, rdzv.local_addr) == (
        "static",
        "node01:29500",
        {"rank": 1},
        "phalanx",
        None,
    )
    assert _plan(nnodes=2, node_rank=0, master="127.0.0.1:29500").local_addr == "127.0.0.1"


def test_rdzv_endpoint_is_c10d():
    rdzv = _plan(nnodes=2, rdzv_endpoint="head:29400", rdzv_id="job7")
    assert (rdzv.backend, rdzv.endpoint, rdzv.node_rank, rdzv.run_id) == ("c10d", "head:29400", None, "job7")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nnodes": 2}, "needs to know where node 0 is"),
        ({"nnodes": 2, "master": "h:1"}, "--master needs --node-rank"),
        ({"nnodes": 2, "node_rank": 2, "master": "h:1"}, "outside 0..1"),
        ({"nnodes": 2, "node_rank": 0, "master": "h"}, "expects HOST:PORT"),
        ({"nnodes": 2, "master": "h:1", "rdzv_endpoint": "h:2"}, "not both"),
        ({"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "h:2"}, "assigns node ranks itself"),
    ],
)
def test_bad_multi_node_flags_are_one_clear_line(kwargs, message):
    with pytest.raises(PhalanxError, match=message):
        _plan(**kwargs)


def test_slurm_allocation_is_detected():
    job = slurm_job(
        {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09]"}
    )
    rdzv = _plan(slurm=job)
    assert (rdzv.backend, rdzv.endpoint, rdzv.nnodes, rdzv.node_rank, rdzv.run_id) == (
        "static",
        "gpu07:29500",
        3,
        2,
        "4242",
    )
    assert slurm_job({}) is None
    single = slurm_job({"SLURM_JOB_ID": "1", "SLURM_NNODES": "1"})
    assert _plan(slurm=single).endpoint == "127.0.0.1:0"


@pytest.mark.parametrize(
    "nodelist, host",
    [("gpu[07-09,12],cpu1", "gpu07"), ("node01", "node01"), ("n[001-004]-ib", "n001-ib"), ("a,b", "a")],
)
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_save_every_takes_steps_or_a_period():
    assert Config(checkpoint={"save_every": 500}).checkpoint.save_every == 500
    assert parse_period("30m") == 1800 and parse_period("2h") == 7200 and parse_period("45s") == 45
    for bad in (0, "often", "-3m"):
        with pytest.raises(ValueError):
            Config(checkpoint={"save_every": bad})


def test_timed_saves_and_stop_requests_come_out_of_the_step_agreement():
    import time

    import torch

    from phalanx.faults.agreement import StepAgreement

    agreement = StepAgreement(1, torch.device("cpu"), save_period_s=0.05)
    assert agreement.poll(1, stop_requested=False) == (False, False, False)
    time.sleep(0.06)
    assert agreement.poll(2, stop_requested=False) == (False, True, False)
    agreement.saved()
    assert agreement.poll(3, stop_requested=True) == (True, False, False)
