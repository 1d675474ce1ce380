"""Issue 25's pieces without processes: the node range in the config and on the command line, the
rendezvous it plans, the sizes refused before any node starts, and the rendezvous wrapper's
decisions (when the agent may see a joining node, which restarts are free, who was lost)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch.distributed as dist
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

from phalanx.config import yaml12
from phalanx.config.sections import MAX_NNODES, LaunchConfig
from phalanx.errors import PhalanxError
from phalanx.faults import markers
from phalanx.faults.agreement import StepAgreement
from phalanx.launch.elastic import ElasticRendezvous, JobFailed, JobStopped, NodesLost
from phalanx.launch.launcher import LaunchRequest, prepare
from phalanx.launch.rendezvous import plan_rendezvous
from phalanx.topology import ENV_ATTEMPT, ENV_CONTEXT, LaunchContext, Topology, slurm_job

# -- the node range ---------------------------------------------------------------------------------


@given(st.integers(1, MAX_NNODES), st.integers(0, MAX_NNODES))
def test_a_node_range_reads_back_as_given(low, extra):
    high = min(MAX_NNODES, low + extra)
    config = LaunchConfig(nnodes=f"{low}:{high}")
    assert config.node_range() == (low, high)
    assert config.nnodes == (low if low == high else f"{low}:{high}")  # 2:2 is just 2


@given(st.text(max_size=12))
def test_any_other_text_is_refused_with_the_form_it_takes(text):
    try:
        config = LaunchConfig(nnodes=text)
    except ValidationError as err:
        assert "expects" in str(err) or "must be at" in str(err)
        return
    low, high = config.node_range()
    assert 1 <= low <= high <= MAX_NNODES


@pytest.mark.parametrize("text", ["1:2", "10:30", "1:30.5", "2:1"])
def test_yaml_reads_colon_numbers_as_text_not_base_60(text):
    assert yaml.safe_load(text) != text  # what PyYAML's YAML 1.1 does (1:30 is 90)
    assert yaml12.load(f"nnodes: {text}") == {"nnodes": text}


@given(st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.booleans(), st.none()))
def test_yaml_reads_every_other_scalar_as_before(value):
    text = yaml.safe_dump(value)
    assert yaml12.load(text) == yaml.safe_load(text)


def test_yaml_keeps_infinity_nan_hex_and_underscores():
    loaded = yaml12.load("a: .inf\nb: .nan\nc: 0x1f\nd: 1_000\ne: 0.5")
    assert (
        loaded["a"] == math.inf
        and math.isnan(loaded["b"])
        and (loaded["c"], loaded["d"], loaded["e"]) == (31, 1000, 0.5)
    )


# -- the rendezvous a range plans -------------------------------------------------------------------


def _plan(**kwargs):
    args = {"nnodes": (1, 4), "node_rank": None, "master": None, "rdzv_endpoint": None, "rdzv_id": None, "slurm": None}
    return plan_rendezvous(**{**args, **kwargs})


def test_a_range_is_an_elastic_c10d_rendezvous():
    rdzv = _plan(rdzv_endpoint="head:29400", rdzv_id="job7")
    assert (rdzv.backend, rdzv.endpoint, rdzv.min_nodes, rdzv.nnodes, rdzv.run_id) == (
        "c10d",
        "head:29400",
        1,
        4,
        "job7",
    )
    assert rdzv.elastic and list(rdzv.node_counts) == [1, 2, 3, 4]
    assert rdzv.describe() == "1 to 4 nodes, c10d rendezvous at head:29400 (--rdzv-endpoint)"


def test_inside_slurm_a_range_meets_on_the_first_host():
    slurm = slurm_job(
        {"SLURM_JOB_ID": "42", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "g[07-08]"}
    )
    rdzv = _plan(slurm=slurm)
    assert (rdzv.backend, rdzv.endpoint, rdzv.run_id, rdzv.source) == ("c10d", "g07:29500", "42", "SLURM job 42")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "--nnodes 1:4 needs to know where the nodes meet: add --rdzv-endpoint HOST:PORT"),
        ({"master": "h:1", "node_rank": 0}, "node ranks are assigned at each rendezvous"),
        ({"rdzv_endpoint": "h:2", "node_rank": 1}, "instead of --master/--node-rank"),
        ({"rdzv_endpoint": "h"}, "--rdzv-endpoint expects HOST:PORT"),
    ],
)
def test_a_range_refuses_what_cannot_serve_it_in_one_line(kwargs, message):
    with pytest.raises(PhalanxError, match=message):
        _plan(**kwargs)


def _prepare(tmp_path, monkeypatch, *sets: str, nproc: int = 2):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    request = LaunchRequest(
        "x.py", cpu=True, nproc=nproc, nnodes="1:3", rdzv_endpoint="127.0.0.1:29400", overrides=list(sets)
    )
    return prepare(request)


def test_every_size_of_the_range_is_checked_before_any_node_starts(tmp_path, monkeypatch):
    assert _prepare(tmp_path, monkeypatch, "batch.global_batch_size=12").rendezvous.elastic
    with pytest.raises(
        PhalanxError, match=r"--nnodes 1:3: at 2 nodes \(4 processes\) the job cannot run: global_batch_size 6"
    ):
        _prepare(tmp_path, monkeypatch, "batch.global_batch_size=6")


def test_a_pipeline_whose_stage_count_no_longer_fits_is_refused(tmp_path, monkeypatch):
    sets = ("strategy.name=pipeline", "strategy.pipeline.schedule=1f1b", "strategy.pipeline.microbatches=2")
    with pytest.raises(PhalanxError, match=r"at 3 nodes \(3 processes\) the job cannot run: .*fewer than the 3"):
        _prepare(tmp_path, monkeypatch, *sets, nproc=1)


def test_a_global_batch_that_follows_the_node_count_is_refused(tmp_path, monkeypatch):
    with pytest.raises(PhalanxError, match="batch.micro_batch_size alone makes the global batch follow"):
        _prepare(tmp_path, monkeypatch, "batch.micro_batch_size=4")
    _prepare(tmp_path, monkeypatch, "batch.micro_batch_size=1", "batch.global_batch_size=12")


# -- the wrapper's decisions ------------------------------------------------------------------------


class FakeC10d:
    """torch's handler as far as the wrapper uses it: a round is one in-memory store."""

    def __init__(self, world: int = 2):
        self.waiting, self.world, self.base = 0, world, dist.HashStore()
        self.round, self.timeout = 0, False

    def next_rendezvous(self):
        from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

        if self.timeout:
            raise RendezvousTimeoutError("too few")
        store = dist.PrefixStore(f"round{self.round}", self.base)
        self.round += 1
        for rank in range(1, self.world):  # the other nodes say who they are
            store.set(f"phalanx.node{rank}", f"other{rank} (launcher pid {100 + rank})")
        return RendezvousInfo(store, 0, self.world, RendezvousStoreInfo("127.0.0.1", 1))

    def num_nodes_waiting(self) -> int:
        return self.waiting

    def get_run_id(self) -> str:
        return "test"

    use_agent_store = False


@pytest.fixture
def wrapper(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_ATTEMPT, raising=False)
    monkeypatch.setenv(ENV_ATTEMPT, "")  # restored after the test: the wrapper sets it per round
    said = []
    handler = ElasticRendezvous(
        FakeC10d(),
        tmp_path,
        min_nodes=2,
        max_nodes=3,
        restarts=1,
        grace=60,
        timeout=5,
        announce=lambda nodes, node: said.append((nodes, node)),
    )
    handler.said = said
    return handler


def test_the_first_round_announces_and_names_the_attempt(wrapper, tmp_path):
    wrapper.next_rendezvous()
    assert wrapper.said == [(2, 0)] and os.environ[ENV_ATTEMPT] == "0"
    assert wrapper.members == {0: wrapper.members[0], 1: "other1 (launcher pid 101)"}
    wrapper.next_rendezvous()
    assert wrapper.said == [(2, 0)] and os.environ[ENV_ATTEMPT] == "1"  # announced once
    rounds = [json.loads(line) for line in (tmp_path / markers.RENDEZVOUS_LOG).read_text().splitlines()]
    assert [r["attempt"] for r in rounds] == [0, 1]
    assert Topology.from_env({**os.environ, "RANK": "0", "WORLD_SIZE": "2"}).elastic


def test_a_joining_node_is_shown_to_the_agent_only_once_the_ranks_saved(wrapper, tmp_path):
    wrapper.next_rendezvous()
    wrapper.inner.waiting = 1
    assert wrapper.num_nodes_waiting() == 0 and (tmp_path / markers.RESIZE_REQUEST).exists()
    assert wrapper.num_nodes_waiting() == 0  # still saving
    (tmp_path / markers.RESIZE_SAVED).write_text(json.dumps({"nonce": "an earlier join's"}))
    assert wrapper.num_nodes_waiting() == 0  # an answer to another request does not count
    nonce = markers.resize_nonce(tmp_path, markers.RESIZE_REQUEST)
    (tmp_path / markers.RESIZE_SAVED).write_text(json.dumps({"nonce": nonce}))
    assert markers.resize_held(tmp_path)
    assert wrapper.num_nodes_waiting() == 1
    wrapper.next_rendezvous()  # the join: free, and the markers are gone for the next round
    assert not (tmp_path / markers.RESIZE_REQUEST).exists() and not (tmp_path / markers.RESIZE_SAVED).exists()


def test_a_node_that_gives_up_before_the_save_lets_training_go_on(wrapper, tmp_path):
    wrapper.next_rendezvous()
    wrapper.inner.waiting = 1
    wrapper.num_nodes_waiting()
    first = markers.resize_nonce(tmp_path, markers.RESIZE_REQUEST)
    wrapper.inner.waiting = 0
    assert wrapper.num_nodes_waiting() == 0 and not (tmp_path / markers.RESIZE_REQUEST).exists()
    wrapper.inner.waiting = 1  # the next node to come is asked for afresh, under a new name
    assert wrapper.num_nodes_waiting() == 0
    assert markers.resize_nonce(tmp_path, markers.RESIZE_REQUEST) not in (None, first)


def test_ranks_that_never_save_are_restarted_after_the_grace_period(wrapper, monkeypatch):
    wrapper.next_rendezvous()
    wrapper.inner.waiting, wrapper.grace = 2, 0.0
    assert wrapper.num_nodes_waiting() == 0
    assert wrapper.num_nodes_waiting() == 2


def _crash(tmp_path, attempt: int, rank: int = 0) -> None:
    record = markers.crash_record(tmp_path, attempt, rank)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"rank": rank, "local_rank": 0, "pid": 7, "exitcode": 1, "error_file": ""}))


def test_a_lost_peer_costs_no_restart_and_own_crashes_spend_max_restarts(wrapper, tmp_path):
    wrapper.next_rendezvous()
    for _ in range(2):
        wrapper.next_rendezvous()  # peers lost: no crash recorded here
    _crash(tmp_path, wrapper.attempt)
    wrapper.next_rendezvous()  # launch.max_restarts 1: this one is allowed
    _crash(tmp_path, wrapper.attempt)
    with pytest.raises(JobFailed) as failed:
        wrapper.next_rendezvous()
    assert list(failed.value.failure.failures) == [0]


def test_attempts_that_keep_failing_without_a_record_are_this_nodes_failures(wrapper, tmp_path):
    wrapper.next_rendezvous()
    for _ in range(3):  # the third quick one in a row is charged: launch.max_restarts 1
        wrapper.next_rendezvous()
    with pytest.raises(JobStopped, match="4 attempts in a row ended within 60 s"):
        wrapper.next_rendezvous()


def test_a_hang_is_this_nodes_failure(wrapper, tmp_path):
    wrapper.next_rendezvous()
    wrapper.restarts_left = 0
    dump = markers.hang_dump(tmp_path, wrapper.attempt, 1)
    dump.parent.mkdir(parents=True)
    dump.write_text("stack")
    with pytest.raises(JobStopped, match="it hung"):
        wrapper.next_rendezvous()


def test_a_job_that_cannot_re_form_names_the_nodes_that_did_not_come_back(wrapper):
    wrapper.next_rendezvous()
    wrapper.inner.timeout = True
    with pytest.raises(NodesLost) as lost:
        wrapper.next_rendezvous()
    assert "at least 2 nodes (--nnodes 2:3)" in str(lost.value)
    assert "lost: node 1 other1 (launcher pid 101)" in str(lost.value)


def test_too_few_nodes_at_the_start_say_how_to_go_on(wrapper):
    wrapper.inner.timeout = True
    with pytest.raises(NodesLost, match="fewer than 2 nodes joined within launch.rendezvous_timeout"):
        wrapper.next_rendezvous()


def test_every_round_of_the_job_carries_one_job_id_to_the_workers(wrapper, monkeypatch):
    monkeypatch.setenv(ENV_CONTEXT, json.dumps({}))
    monkeypatch.setenv(ENV_CONTEXT, LaunchContext(run_dir="r").to_env()[ENV_CONTEXT])
    jobs = []
    for _ in range(3):
        wrapper.next_rendezvous()
        jobs.append(LaunchContext.from_env().job)
    assert jobs[0] and jobs == [jobs[0]] * 3 and LaunchContext.from_env().run_dir == "r"


def test_a_lone_process_looks_for_a_joining_node_about_once_a_second():
    agreement = StepAgreement(1, None, None)
    looks = []

    def asked() -> bool:
        looks.append(1)
        return True

    assert agreement.poll(1, False, asked) == (False, False, True)
    assert agreement.poll(2, False, asked) == (False, False, False)
    assert len(looks) == 1
