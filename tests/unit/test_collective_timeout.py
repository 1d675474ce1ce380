"""The process group's timeout outlasts every limit phalanx sets itself (faults.hang_timeout,
faults.first_step_timeout, the checkpoint I/O bound, faults.preempt_grace), so that the watchdog, with
its report of every rank, stops a hang before torch.distributed's own timeout aborts a collective;
and the group is made with it. No process group is made: init_process_group is faked."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import device_mesh

from phalanx import Config
from phalanx._torch_compat import set_group_timeout
from phalanx.config.sections import A_WEEK, FaultsConfig
from phalanx.faults.watchdog import IO_TIMEOUT_S
from phalanx.strategies import base as strategies_base
from phalanx.strategies import create_strategy
from phalanx.strategies.collective_timeout import MARGIN_S, collective_timeout
from phalanx.topology import Topology

FAST = settings(derandomize=True, database=None, max_examples=300, deadline=None)
TORCH_DEFAULT = timedelta(minutes=30)  # init_process_group's, for "cpu:gloo,cuda:nccl" and gloo


def test_the_defaults_outlast_the_first_step_and_checkpoint_limits_and_torchs_own():
    timeout = collective_timeout(FaultsConfig())
    assert timeout == timedelta(seconds=max(1800.0, IO_TIMEOUT_S) + MARGIN_S)
    assert timeout > TORCH_DEFAULT


def test_a_first_step_without_a_limit_gets_no_collective_limit_short_of_a_week():
    assert collective_timeout(FaultsConfig(first_step_timeout=0)) == timedelta(seconds=A_WEEK + MARGIN_S)


def test_without_the_watchdog_the_first_step_and_checkpoint_limits_still_hold():
    off = collective_timeout(FaultsConfig(hang_timeout=0, first_step_timeout=7200))
    assert off == timedelta(seconds=7200 + MARGIN_S)
    assert collective_timeout(FaultsConfig(hang_timeout=0, first_step_timeout=0)) == timedelta(
        seconds=IO_TIMEOUT_S + MARGIN_S
    )


seconds = st.floats(min_value=0, max_value=A_WEEK, allow_nan=False)


@FAST
@given(hang=seconds, first=seconds, grace=seconds.filter(lambda s: s > 0))
def test_the_timeout_outlasts_every_limit_of_phalanx_by_the_margin(hang, first, grace):
    faults = FaultsConfig(hang_timeout=hang, first_step_timeout=first, preempt_grace=grace)
    timeout = collective_timeout(faults).total_seconds()
    for limit in (hang, first, IO_TIMEOUT_S, grace):
        assert timeout >= limit + MARGIN_S - 1e-6  # timedelta keeps microseconds
    if hang > 0 and first == 0:  # no first-step limit: nothing phalanx sets ends it, nor should this
        assert timeout >= A_WEEK
    assert timeout <= A_WEEK + MARGIN_S + 1e-6  # finite: with the watchdog off, this ends a hang


def _init_kwargs(monkeypatch, config: Config) -> dict:
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(kw))
    topology = Topology(rank=1, world_size=2, local_world_size=2, launched=True)
    create_strategy(config, topology).setup_environment()
    (kwargs,) = calls
    return kwargs


def test_the_process_group_is_made_with_phalanx_s_timeout(monkeypatch):
    assert _init_kwargs(monkeypatch, Config())["timeout"] == collective_timeout(FaultsConfig())
    longer = Config.model_validate({"faults": {"hang_timeout": 3600, "first_step_timeout": 10800}})
    assert _init_kwargs(monkeypatch, longer)["timeout"] == timedelta(seconds=10800 + MARGIN_S)


class _Mesh:
    def __init__(self, names):
        self.names = names

    def get_group(self, name):
        return f"group {name}"


def _mesh_timeouts(monkeypatch, *, script_made_group: bool) -> list:
    # init_device_mesh takes no timeout and gives its groups torch's default: they are set after.
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: script_made_group)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: None)
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda kind, shape, mesh_dim_names: _Mesh(mesh_dim_names))
    monkeypatch.setattr(strategies_base, "set_group_timeout", lambda group, timeout: seen.append((group, timeout)))
    topology = Topology(rank=0, world_size=2, local_world_size=2, launched=True)
    strategy = create_strategy(Config.model_validate({"strategy": {"name": "ddp"}}), topology)
    strategy.setup_environment()
    strategy.mesh
    return seen


def test_the_mesh_groups_get_the_timeout_too_unless_the_script_made_the_process_group(monkeypatch):
    assert _mesh_timeouts(monkeypatch, script_made_group=False) == [
        ("group dp_replicate", collective_timeout(FaultsConfig()))
    ]
    assert _mesh_timeouts(monkeypatch, script_made_group=True) == []


def test_a_real_subgroup_gets_torchs_default_until_it_is_set():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore(), timeout=timedelta(seconds=100))
    try:
        group = dist.new_group([0])
        gloo = group._get_backend(torch.device("cpu"))  # a test may read torch's private state
        assert gloo.options._timeout == TORCH_DEFAULT  # not the world's 100 s
        assert set_group_timeout(group, timedelta(seconds=2100))
        assert gloo.options._timeout == timedelta(seconds=2100)
    finally:
        dist.destroy_process_group()
