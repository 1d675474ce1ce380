"""`phalanx env` and `phalanx doctor`: the real CLI on this (CPU) machine, and the live all-reduce on
three gloo processes."""

from __future__ import annotations

import json

import pytest
import torch

from phalanx.diagnose import allreduce
from phalanx.diagnose.checks import OK, PROBLEM, SKIPPED, WARNING
from tests.helpers.cli import run_phalanx
from tests.helpers.diagnose import ALL_CHECKS, GPU_CHECKS

# ---------------------------------------------------------------- the real CLI on this machine


def test_env_prints_every_section(tmp_path):
    (tmp_path / "phalanx.yaml").write_text("precision:\n  mode: bf16\n")
    result = run_phalanx(
        "env", "--set", "train.epochs=3", cwd=tmp_path, timeout=60, env={"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.output
    out = result.stdout
    for label in (
        "phalanx ",
        "Python ",
        "torch ",
        "OS ",
        "CPUs ",
        "RAM ",
        "/dev/shm ",
        "open files ",
        "GPUs ",
        "config ",
        "distributed environment variables",
    ):
        assert f"\n{label}" in out or out.startswith(label), label
    torch_line = next(ln for ln in out.splitlines() if ln.startswith("torch "))
    assert "(CUDA " in torch_line and ", NCCL " in torch_line  # "none" for each on a CPU build
    line = next(ln for ln in out.splitlines() if "precision.mode" in ln)
    assert "bf16" in line and "[file phalanx.yaml]" in line
    assert "[--set]" in next(ln for ln in out.splitlines() if "train.epochs" in ln)
    assert "NCCL_DEBUG=WARN" in out and "OMP_NUM_THREADS=1" in out


def test_env_json(tmp_path):
    result = run_phalanx(
        "env", "--json", "--set", "train.epochs=3", cwd=tmp_path, timeout=60, env={"GLOO_SOCKET_IFNAME": "lo"}
    )
    assert result.returncode == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {
        "phalanx",
        "python",
        "torch",
        "os",
        "cpus",
        "ram",
        "shm",
        "open_files",
        "gpus",
        "config",
        "environment",
    }
    assert data["cpus"]["usable"] >= 1 and data["cpus"]["total"] >= data["cpus"]["usable"]
    assert data["ram"]["total_bytes"] > 0
    assert data["config"]["train.epochs"] == {"value": 3, "source": "--set"}
    assert data["environment"]["GLOO_SOCKET_IFNAME"] == "lo"
    if data["torch"]["cuda"] == "none":  # this machine: a CPU build of torch
        assert data["torch"]["nccl"] == "none"
        assert data["gpus"]["devices"] == [] and "CPU build" in data["gpus"]["note"]


def test_env_still_prints_with_a_bad_config(tmp_path):
    result = run_phalanx("env", "--set", "train.epochs=0", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.output
    assert "cannot be resolved: invalid value 0 for 'train.epochs'" in result.stdout
    assert "\ntorch " in result.stdout


@pytest.mark.multiprocess
def test_doctor_json_on_this_machine(tmp_path):
    # The live check on CPU processes (--cpu), so it holds with any number of GPUs; the GPU checks
    # still look at whatever GPUs there are.
    result = run_phalanx("doctor", "--json", "--cpu", "--sizes", "4K,64K", "--iters", "3", cwd=tmp_path, timeout=120)
    data = json.loads(result.stdout)
    checks = {c["check"]: c for c in data["checks"]}
    assert list(checks) == ALL_CHECKS, result.output
    assert result.returncode == data["exit_code"] == (1 if data["summary"]["problem"] else 0)
    for check in data["checks"]:
        assert check["status"] in (OK, WARNING, PROBLEM, SKIPPED) and check["detail"]
        if check["status"] in (WARNING, PROBLEM):
            assert check["fix"], check
    if torch.cuda.device_count() == 0:  # no GPU here: the GPU checks say why they did not run
        for name in GPU_CHECKS:
            assert checks[name]["status"] == SKIPPED and (
                "GPU" in checks[name]["detail"] or "CPU build" in checks[name]["detail"]
            ), checks[name]
    assert data["live"]["device"] == "cpu"
    assert checks["live all-reduce"]["status"] == OK
    assert data["live"]["backend"] == "gloo" and "loopback TCP" in data["live"]["link"]
    assert data["live"]["expected_bytes_per_second"] is None
    live = data["live"]
    n = live["nproc"]
    assert [r["bytes"] for r in live["results"]] == [4096, 65536]
    assert live["latency_seconds"] == live["results"][0]["seconds"]
    for r in live["results"]:
        assert r["seconds"] > 0 and r["algorithm_bandwidth"] > 0 and r["bus_bandwidth"] > 0
        assert r["algorithm_bandwidth"] == r["bytes"] / r["seconds"]
        assert r["bus_bandwidth"] == r["algorithm_bandwidth"] * 2 * (n - 1) / n


def test_doctor_table_without_live(tmp_path):
    result = run_phalanx("doctor", "--no-live", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.output
    for name in ALL_CHECKS:
        assert name in result.stdout, name
    assert "--no-live: not run" in result.stdout and "no problem found" in result.stdout


def test_doctor_exit_code_1_on_a_problem(tmp_path):
    result = run_phalanx(
        "doctor", "--no-live", "--json", cwd=tmp_path, timeout=60, env={"GLOO_SOCKET_IFNAME": "nosuchnic0"}
    )
    assert result.returncode == 1, result.output
    check = next(c for c in json.loads(result.stdout)["checks"] if c["check"] == "env GLOO_SOCKET_IFNAME")
    assert check["status"] == PROBLEM and "nosuchnic0" in check["detail"] and "unset it" in check["fix"]


# ---------------------------------------------------------------- the live all-reduce, in-process


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_allreduce_bus_bandwidth_on_three_gloo_processes():
    n = 3
    results = allreduce.measure([4096, 65536], n, cuda=False, iters=2, timeout=80)
    assert [r.bytes for r in results] == [4096, 65536]
    for r in results:
        assert r.seconds > 0 and r.algorithm_bandwidth > 0
        assert r.bus_bandwidth == r.algorithm_bandwidth * 2 * (n - 1) / n
        assert r.bus_bandwidth > r.algorithm_bandwidth  # 2(n-1)/n = 4/3 for three processes
