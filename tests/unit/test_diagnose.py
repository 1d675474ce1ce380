"""`phalanx env` and `phalanx doctor` in-process: bad flags, and the checks as pure functions of
hand-made facts (GPU machines included)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from phalanx.cli.main import main
from phalanx.diagnose import allreduce
from phalanx.diagnose.checks import (
    OK,
    PROBLEM,
    SKIPPED,
    WARNING,
    cuda_driver,
    environment,
    gpu_processes,
    gpu_topology,
    gpu_visibility,
    open_files,
    peer_to_peer,
    run_checks,
    shared_memory,
)
from phalanx.diagnose.doctor import DoctorOptions, DoctorReport, LivePlan, LiveResult, judge, run_doctor
from phalanx.diagnose.facts import UNLIMITED, Facts
from phalanx.diagnose.links import expectation
from phalanx.diagnose.nvidia import DriverView, Gpu, GpuProcess, ToolError, driver_view, parse_topology
from phalanx.diagnose.printout import doctor_json, env_report, env_text
from phalanx.errors import PhalanxError
from phalanx.util.units import GIB, MIB
from tests.helpers.diagnose import ALL_CHECKS, GPU_CHECKS


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sizes", "4X"], "'4X' is not a size"),
        (["--nproc", "1", "--cpu"], "--nproc must be at least 2"),
        (["--iters", "0"], "--iters must be at least 1"),
    ],
)
def test_doctor_bad_flags(capsys, args, message):
    assert main(["doctor", *args]) == 2  # the CLI's own entry point, in this process: nothing starts
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_parse_sizes():
    assert allreduce.parse_sizes("4K,1M,64M") == [4096, MIB, 64 * MIB]
    assert allreduce.parse_sizes("64M, 4k,4KiB,6") == [8, 4096, 64 * MIB]  # sorted, deduplicated, whole float32s
    assert allreduce.parse_sizes("1G") == [GIB]
    for bad in ("4X", "", "0", "-1K"):
        with pytest.raises(PhalanxError):
            allreduce.parse_sizes(bad)


# ---------------------------------------------------------------- checks on hand-made facts

CPU_FACTS = Facts(
    torch="2.13.0+cpu",
    shm_bytes=8 * GIB,
    shm_free_bytes=8 * GIB,
    nofile_soft=65536,
    nofile_hard=65536,
    interfaces=("lo", "eth0"),
    pid=100,
    driver=DriverView(notes={"nvidia-smi": "nvidia-smi not found on PATH"}),
)


def gpu_facts(n: int = 4, link: str = "NV18", env: dict | None = None, **driver_changes) -> Facts:
    """An n-GPU H100 machine that torch sees whole, every pair joined by ``link``."""
    name = "NVIDIA H100 80GB HBM3"
    driver_gpus = tuple(Gpu(i, name, 80 * GIB, 5 * MIB, f"GPU-{i:04d}", 5, 16) for i in range(n))
    torch_gpus = tuple(Gpu(i, name, 80 * GIB, uuid=f"GPU-{i:04d}", compute_capability="9.0") for i in range(n))
    driver = DriverView(
        installed=True,
        answered=True,
        gpus=driver_gpus,
        driver="550.54.15",
        driver_cuda="12.4",
        links=tuple((i, j, link) for i in range(n) for j in range(i + 1, n)),
        processes=(),
        process_source="nvidia-smi",
    )
    return replace(
        CPU_FACTS,
        torch="2.5.1+cu124",
        torch_cuda="12.4",
        nccl="2.21.5",
        cuda_gpus=torch_gpus,
        env=env or {},
        peer_access=tuple((i, j, True) for i in range(n) for j in range(i + 1, n)) if n > 1 else None,
        driver=replace(driver, **driver_changes),
    )


def by_name(facts: Facts) -> dict[str, object]:
    return {v.check: v for v in run_checks(facts)}


def test_cpu_machine_skips_gpu_checks_and_says_why():
    verdicts = by_name(CPU_FACTS)
    for name in GPU_CHECKS:
        assert verdicts[name].status == SKIPPED and verdicts[name].detail
    assert "nvidia-smi not found on PATH" in verdicts["GPU visibility"].detail
    assert "CPU build" in verdicts["torch CUDA vs driver"].detail
    assert all(v.status == OK for n, v in verdicts.items() if n not in GPU_CHECKS)


def test_healthy_gpu_machine_is_all_ok():
    assert {v.check: v.status for v in run_checks(gpu_facts())} == {name: OK for name in ALL_CHECKS[:-1]}


def test_stray_nccl_p2p_disable_is_a_warning_with_a_fix():
    (verdict,) = environment(replace(CPU_FACTS, env={"NCCL_P2P_DISABLE": "1"}))
    assert verdict.status == WARNING and "NCCL_P2P_DISABLE=1" in verdict.detail
    assert verdict.fix.startswith("unset NCCL_P2P_DISABLE")
    assert environment(replace(CPU_FACTS, env={"NCCL_P2P_DISABLE": "0"}))[0].status == OK


@pytest.mark.parametrize(
    "env, flagged",
    [
        ({"NCCL_DEBUG": "INFO"}, ["NCCL_DEBUG"]),
        ({"NCCL_DEBUG": "WARN"}, []),
        ({"NCCL_IB_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, ["NCCL_SHM_DISABLE", "NCCL_IB_DISABLE"]),
        ({"NCCL_P2P_LEVEL": "LOC"}, ["NCCL_P2P_LEVEL"]),
        ({"NCCL_P2P_LEVEL": "NVL"}, []),
        (
            {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "CUDA_LAUNCH_BLOCKING": "1"},
            ["TORCH_DISTRIBUTED_DEBUG", "CUDA_LAUNCH_BLOCKING"],
        ),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]),
    ],
)
def test_environment_variable_warnings(env, flagged):
    verdicts = environment(replace(CPU_FACTS, env=env))
    if not flagged:
        assert [v.status for v in verdicts] == [OK]
        return
    assert sorted(v.check for v in verdicts) == sorted(f"env {name}" for name in flagged)
    assert all(v.status == WARNING and v.fix for v in verdicts)


@pytest.mark.parametrize(
    "variable, value, problem",
    [
        ("GLOO_SOCKET_IFNAME", "eth9", True),
        ("GLOO_SOCKET_IFNAME", "eth0", False),
        ("GLOO_SOCKET_IFNAME", "lo,eth1", True),  # gloo needs every named interface
        ("NCCL_SOCKET_IFNAME", "eth", False),  # a prefix: matches eth0
        ("NCCL_SOCKET_IFNAME", "ib", True),
        ("NCCL_SOCKET_IFNAME", "=eth", True),  # = asks for the exact name
        ("NCCL_SOCKET_IFNAME", "^docker", False),  # ^ only excludes
    ],
)
def test_socket_interface_names(variable, value, problem):
    verdicts = environment(replace(CPU_FACTS, env={variable: value}))
    if problem:
        (verdict,) = verdicts
        assert verdict.status == PROBLEM and "lo, eth0" in verdict.detail and f"{variable}=lo" in verdict.fix
    else:
        assert [v.status for v in verdicts] == [OK]


def test_small_shm_is_a_warning():
    verdict = shared_memory(replace(CPU_FACTS, shm_bytes=64 * MIB, shm_free_bytes=64 * MIB))
    assert verdict.status == WARNING and "64 MiB" in verdict.detail and "bus error" in verdict.detail
    assert "--shm-size" in verdict.fix
    full = shared_memory(replace(CPU_FACTS, shm_bytes=8 * GIB, shm_free_bytes=100 * MIB))
    assert full.status == WARNING and "100 MiB free" in full.detail
    missing = shared_memory(replace(CPU_FACTS, shm_bytes=None, shm_free_bytes=None))
    assert missing.status == SKIPPED and "does not exist" in missing.detail


def test_open_file_limit():
    low = open_files(replace(CPU_FACTS, nofile_soft=1024, nofile_hard=1048576))
    assert low.status == WARNING and "1024" in low.detail and "ulimit -n 65536" in low.fix
    capped = open_files(replace(CPU_FACTS, nofile_soft=1024, nofile_hard=1024))
    assert capped.status == WARNING and "limits.conf" in capped.fix
    assert open_files(replace(CPU_FACTS, nofile_soft=UNLIMITED, nofile_hard=UNLIMITED)).status == OK
    assert open_files(replace(CPU_FACTS, nofile_soft=None)).status == SKIPPED


@pytest.mark.parametrize(
    "built, supported, status",
    [
        ("12.4", "11.8", PROBLEM),  # a newer major: CUDA cannot start
        ("12.4", "12.2", WARNING),  # minor-version compatibility, but run-time compilation can fail
        ("12.1", "12.4", OK),
        ("11.8", "12.4", OK),
    ],
)
def test_cuda_build_against_driver(built, supported, status):
    verdict = cuda_driver(
        gpu_facts(driver_cuda=supported)
        if built == "12.4"
        else replace(gpu_facts(driver_cuda=supported), torch_cuda=built)
    )
    assert verdict.status == status
    if status != OK:
        assert "upgrade the NVIDIA driver" in verdict.fix


def test_cuda_driver_unknown_is_skipped():
    verdict = cuda_driver(gpu_facts(driver_cuda=None, notes={"driver cuda": "`nvidia-smi` did not answer within 10s"}))
    assert verdict.status == SKIPPED and "did not answer" in verdict.detail


def test_gpu_visibility():
    assert gpu_visibility(gpu_facts()).status == OK
    cpu_torch = replace(gpu_facts(), torch="2.5.1+cpu", torch_cuda=None, cuda_gpus=(), peer_access=None)
    verdict = gpu_visibility(cpu_torch)
    assert verdict.status == PROBLEM and "CPU build" in verdict.detail and "CUDA 12.4" in verdict.fix
    hidden = gpu_visibility(replace(gpu_facts(), cuda_gpus=(), env={"CUDA_VISIBLE_DEVICES": ""}))
    assert hidden.status == PROBLEM and "hides every GPU" in hidden.detail
    typo = gpu_visibility(
        replace(gpu_facts(), cuda_gpus=gpu_facts().cuda_gpus[:2], env={"CUDA_VISIBLE_DEVICES": "0,1,7"})
    )
    assert typo.status == PROBLEM and "names 3 GPU(s) but torch sees 2" in typo.detail
    subset = replace(gpu_facts(), cuda_gpus=gpu_facts().cuda_gpus[2:], env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert gpu_visibility(subset).status == OK
    broken = replace(
        gpu_facts(), cuda_gpus=(), cuda_error="CUDA driver version is insufficient for CUDA runtime version"
    )
    assert gpu_visibility(broken).status == PROBLEM and "insufficient" in gpu_visibility(broken).detail
    failing = replace(
        gpu_facts(),
        cuda_gpus=(),
        driver=DriverView(installed=True, notes={"nvidia-smi": "`nvidia-smi ...` failed (exit 9)"}),
    )
    assert gpu_visibility(failing).status == PROBLEM and "exit 9" in gpu_visibility(failing).detail
    assert gpu_visibility(replace(failing, torch_cuda=None)).status == WARNING  # a CPU build may not want GPUs


TOPO = (
    "\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV12\tSYS\tSYS\tPHB\t0-15\t0\t\tN/A\n"
    "GPU1\tNV12\t X \tSYS\tSYS\tPHB\t0-15\t0\t\tN/A\n"
    "GPU2\tSYS\tSYS\t X \tNV12\tSYS\t16-31\t1\t\tN/A\n"
    "GPU3\tSYS\tSYS\tNV12\t X \tSYS\t16-31\t1\t\tN/A\n"
    "NIC0\tPHB\tPHB\tSYS\tSYS\t X \t\t\t\t\n\n"
    "Legend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n\nNIC Legend:\n\n  NIC0: mlx5_0\n"
)


def test_parse_topology():
    links = parse_topology(TOPO)
    assert links == [(0, 1, "NV12"), (0, 2, "SYS"), (0, 3, "SYS"), (1, 2, "SYS"), (1, 3, "SYS"), (2, 3, "NV12")]
    assert parse_topology("nothing useful") == []


def test_topology_verdicts():
    assert gpu_topology(gpu_facts(link="NV18")).status == OK
    pcie = gpu_topology(gpu_facts(link="PIX"))
    assert pcie.status == OK and "PCIe only" in pcie.detail
    sockets = gpu_topology(gpu_facts(links=tuple(parse_topology(TOPO))))
    assert sockets.status == WARNING and "cross CPU sockets" in sockets.detail and "--gpus 0,1" in sockets.fix
    # Only GPUs 2 and 3 visible: torch calls them 0 and 1, joined by NVLink.
    pair = replace(
        gpu_facts(links=tuple(parse_topology(TOPO))),
        cuda_gpus=gpu_facts().cuda_gpus[2:],
        env={"CUDA_VISIBLE_DEVICES": "2,3"},
        peer_access=((0, 1, True),),
    )
    assert gpu_topology(pair).status == OK
    assert gpu_topology(gpu_facts(n=1)).status == SKIPPED
    assert gpu_topology(gpu_facts(links=None, notes={"topology": "`nvidia-smi topo -m` failed"})).status == SKIPPED


def test_peer_to_peer():
    blocked = replace(gpu_facts(n=2), peer_access=((0, 1, False),))
    verdict = peer_to_peer(blocked)
    assert verdict.status == WARNING and "0-1" in verdict.detail and "iommu=pt" in verdict.fix
    assert peer_to_peer(gpu_facts(n=2)).status == OK
    assert peer_to_peer(gpu_facts(n=1)).status == SKIPPED


def test_other_gpu_processes():
    facts = gpu_facts(
        processes=(GpuProcess(4242, "python", 10 * GIB, "GPU-0001"), GpuProcess(100, "phalanx", 500 * MIB, "GPU-0000"))
    )
    verdict = gpu_processes(facts)
    assert (
        verdict.status == WARNING
        and "pid 4242 (python) holds 10 GiB on GPU 1" in verdict.detail
        and "kill 4242" in verdict.fix
    )
    assert "100" not in verdict.fix.split("kill")[1]  # its own process is not a finding
    assert gpu_processes(gpu_facts()).status == OK
    ghost = gpu_facts(
        gpus=tuple(replace(g, memory_used_bytes=30 * GIB) if g.index == 3 else g for g in gpu_facts().driver.gpus)
    )
    assert gpu_processes(ghost).status == WARNING and "GPU 3 has 30 GiB in use" in gpu_processes(ghost).detail
    unknown = gpu_processes(gpu_facts(processes=None, notes={"gpu processes": "`nvidia-smi ...` failed"}))
    assert unknown.status == SKIPPED and "failed" in unknown.detail


def test_driver_view_from_nvidia_smi_text(monkeypatch):
    monkeypatch.setattr("phalanx.diagnose.nvidia.nvml_processes", lambda: None)  # as without nvidia-ml-py
    answers = {
        "--query-gpu": "0, NVIDIA A100-SXM4-80GB, 81920, 5, 535.104.05, GPU-0000, 4, 16\n1, NVIDIA A100-SXM4-80GB, "
        "81920, [N/A], 535.104.05, GPU-0001, 4, 16\n",
        "--query-compute-apps": "4242, python, 10240, GPU-0001\n",
        "topo": TOPO,
        "": "| NVIDIA-SMI 535.104.05    Driver Version: 535.104.05    CUDA Version: 12.2 |",
    }

    def run(command):
        return answers[next((key for key in answers if key and command[1:2] and command[1].startswith(key)), "")]

    view = driver_view(run, installed=True)
    assert view.answered and view.driver == "535.104.05" and view.driver_cuda == "12.2"
    assert [g.memory_bytes for g in view.gpus] == [80 * GIB, 80 * GIB] and view.gpus[1].memory_used_bytes is None
    assert view.links[0] == (0, 1, "NV12")
    assert view.processes == (GpuProcess(4242, "python", 10 * GIB, "GPU-0001"),) and view.process_source == "nvidia-smi"

    def missing(command):
        raise ToolError("nvidia-smi not found on PATH")

    assert driver_view(missing, installed=False) == DriverView(notes={"nvidia-smi": "nvidia-smi not found on PATH"})


def test_expectation_and_judgement():
    h100 = gpu_facts(n=8, link="NV18")
    expected = expectation(h100, 8, cpu=False)
    assert expected.bytes_per_second == 18 * 25e9 and "NV18" in expected.link
    pcie = expectation(gpu_facts(n=2, link="PHB"), 2, cpu=False)
    assert pcie.bytes_per_second == pytest.approx(3.938e9 * 16) and pcie.link == "PCIe Gen5 x16"
    crossing = expectation(gpu_facts(n=2, link="SYS"), 2, cpu=False)
    assert crossing.link == "PCIe Gen5 x16 across CPU sockets" and "less across sockets" in crossing.note
    cpu = expectation(CPU_FACTS, 2, cpu=True)
    assert cpu.bytes_per_second is None and "loopback TCP" in cpu.link

    plan = LivePlan(True, 8, [4096, 256 * MIB], 20)
    slow = LiveResult(
        plan, expected, [allreduce.size_result(4096, 30e-6, 8), allreduce.size_result(256 * MIB, 256 * MIB / 40e9, 8)]
    )
    assert judge(slow).status == WARNING and "NCCL_DEBUG=INFO" in judge(slow).fix
    fast = replace(slow, results=[slow.results[0], allreduce.size_result(256 * MIB, 256 * MIB / 400e9, 8)])
    assert judge(fast).status == OK
    small = replace(slow, results=slow.results[:1])
    assert judge(small).status == OK and "too small" in judge(small).detail


def test_doctor_report_exit_code_and_json():
    report = run_doctor(DoctorOptions(live=False), facts=replace(CPU_FACTS, env={"GLOO_SOCKET_IFNAME": "eth9"}))
    assert report.exit_code == 1
    data = doctor_json(report)
    assert data["exit_code"] == 1 and data["summary"][PROBLEM] == 1 and data["live"] is None
    assert data["checks"][-1] == {
        "check": "live all-reduce",
        "status": SKIPPED,
        "detail": "--no-live: not run",
        "fix": "",
    }
    assert run_doctor(DoctorOptions(live=False), facts=CPU_FACTS).exit_code == 0
    assert DoctorReport([]).exit_code == 0


def test_one_gpu_skips_the_live_check():
    report = run_doctor(DoctorOptions(), facts=gpu_facts(n=1))
    live = report.verdicts[-1]
    assert live.status == SKIPPED and "one GPU" in live.detail and "--cpu" in live.detail
    with pytest.raises(PhalanxError, match="needs 4 GPUs"):
        run_doctor(DoctorOptions(nproc=4), facts=gpu_facts(n=2))


def test_env_text_for_a_gpu_machine():
    report = env_report(gpu_facts(n=2, env={"NCCL_DEBUG": "WARN"}), None, "bad config")
    text = env_text(report)
    assert "2.5.1+cu124 (CUDA 12.4, NCCL 2.21.5)" in text
    assert "2 on the machine, 2 visible to torch; driver 550.54.15 (CUDA 12.4)" in text
    assert "GPU 1: NVIDIA H100 80GB HBM3, 80 GiB, GPU-0001" in text
    assert "cannot be resolved: bad config" in text and "NCCL_DEBUG=WARN" in text
