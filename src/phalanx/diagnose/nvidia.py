"""The NVIDIA driver's view of the machine: ``nvidia-smi`` (always with a timeout) and nvidia-ml-py
when it is installed. The driver sees every GPU of the machine, whatever CUDA_VISIBLE_DEVICES says,
which is what lets ``phalanx doctor`` compare the two. Parsers are pure functions of the tool's text."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Callable

from phalanx.util.units import MIB

TOOL_TIMEOUT_S = 10.0
QUERY_GPU = "index,name,memory.total,memory.used,driver_version,uuid,pcie.link.gen.max,pcie.link.width.max"
QUERY_APPS = "pid,process_name,used_memory,gpu_uuid"


class ToolError(Exception):
    """A query that gave no answer; the message says why, for a skipped verdict."""


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_bytes: int | None = None
    memory_used_bytes: int | None = None
    uuid: str | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    compute_capability: str | None = None  # only torch knows it


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int | None
    gpu: str  # the GPU's UUID as the driver reports it


@dataclass(frozen=True)
class DriverView:
    installed: bool = False  # nvidia-smi is on PATH: a driver is (or was meant to be) here
    answered: bool = False  # and it answered
    gpus: tuple[Gpu, ...] = ()
    driver: str | None = None
    driver_cuda: str | None = None  # the newest CUDA the driver supports
    links: tuple[tuple[int, int, str], ...] | None = None  # (gpu, gpu, code of `nvidia-smi topo -m`)
    processes: tuple[GpuProcess, ...] | None = None
    process_source: str = ""  # nvidia-ml-py or nvidia-smi
    notes: dict[str, str] = field(default_factory=dict)  # why a fact is missing


Runner = Callable[[list[str]], str]


def run_tool(command: list[str]) -> str:
    """stdout of ``command``; a missing tool, a hang or a failure become a :class:`ToolError`."""
    shown = " ".join(command)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise ToolError(f"{command[0]} not found on PATH") from None
    except subprocess.TimeoutExpired:
        raise ToolError(f"`{shown}` did not answer within {TOOL_TIMEOUT_S:g}s") from None
    except OSError as err:
        raise ToolError(f"`{shown}` could not run: {err.strerror}") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise ToolError(f"`{shown}` failed (exit {done.returncode}){': ' + said[0] if said else ''}")
    return done.stdout


def driver_view(run: Runner = run_tool, installed: bool | None = None) -> DriverView:
    if installed is None:
        installed = shutil.which("nvidia-smi") is not None
    try:
        gpus, driver = parse_query_gpu(run(["nvidia-smi", f"--query-gpu={QUERY_GPU}", "--format=csv,noheader,nounits"]))
    except ToolError as err:
        return DriverView(installed=installed, notes={"nvidia-smi": str(err)})
    notes: dict[str, str] = {}
    driver_cuda = links = None
    try:
        driver_cuda = parse_driver_cuda(run(["nvidia-smi"]))
    except ToolError as err:
        notes["driver cuda"] = str(err)
    try:
        links = tuple(parse_topology(run(["nvidia-smi", "topo", "-m"])))
    except ToolError as err:
        notes["topology"] = str(err)
    processes, how = gpu_processes(run)
    if processes is None:
        notes["gpu processes"] = how
    return DriverView(
        True, True, tuple(gpus), driver, driver_cuda, links, processes, how if processes is not None else "", notes
    )


def gpu_processes(run: Runner = run_tool) -> tuple[tuple[GpuProcess, ...] | None, str]:
    """Compute processes on every GPU, from NVML when nvidia-ml-py is installed, else from nvidia-smi;
    with the source, or with why there is no answer."""
    try:
        found = nvml_processes()
        if found is not None:
            return tuple(found), "nvidia-ml-py"
    except ToolError:
        pass  # nvidia-smi may still answer
    try:
        return tuple(
            parse_compute_apps(
                run(["nvidia-smi", f"--query-compute-apps={QUERY_APPS}", "--format=csv,noheader,nounits"])
            )
        ), "nvidia-smi"
    except ToolError as err:
        return None, str(err)


def nvml_processes() -> list[GpuProcess] | None:
    """None when nvidia-ml-py is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise ToolError(f"NVML: {err}") from None
    try:
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                found.append(GpuProcess(proc.pid, _nvml_name(pynvml, proc.pid), proc.usedGpuMemory, uuid))
        return found
    except pynvml.NVMLError as err:
        raise ToolError(f"NVML: {err}") from None
    finally:
        pynvml.nvmlShutdown()


def _nvml_name(pynvml, pid: int) -> str:
    try:
        return _text(pynvml.nvmlSystemGetProcessName(pid))
    except pynvml.NVMLError:
        return "?"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older nvidia-ml-py returns bytes


def _number(text: str) -> int | None:
    """nvidia-smi writes '[N/A]' or '[Not Supported]' where it has no value."""
    try:
        return int(float(text))
    except ValueError:
        return None


def _rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in row] for row in csv.reader(text.splitlines(), skipinitialspace=True) if row]


def parse_query_gpu(text: str) -> tuple[list[Gpu], str | None]:
    """Rows of ``--query-gpu=QUERY_GPU --format=csv,noheader,nounits`` -> GPUs and the driver version."""
    gpus, driver = [], None
    for index, name, total, used, version, uuid, gen, width in (row[:8] for row in _rows(text) if len(row) >= 8):
        mib_total, mib_used = _number(total), _number(used)
        gpus.append(
            Gpu(
                index=int(index),
                name=name,
                memory_bytes=mib_total * MIB if mib_total is not None else None,
                memory_used_bytes=mib_used * MIB if mib_used is not None else None,
                uuid=uuid,
                pcie_gen=_number(gen),
                pcie_width=_number(width),
            )
        )
        driver = driver or version
    return gpus, driver


def parse_compute_apps(text: str) -> list[GpuProcess]:
    """Rows of ``--query-compute-apps=QUERY_APPS --format=csv,noheader,nounits``."""
    found = []
    for pid, name, used, uuid in (row[:4] for row in _rows(text) if len(row) >= 4):
        mib = _number(used)
        found.append(GpuProcess(int(pid), name, mib * MIB if mib is not None else None, uuid))
    return found


def parse_driver_cuda(text: str) -> str | None:
    """'CUDA Version: 12.4' from the banner of plain ``nvidia-smi``."""
    match = re.search(r"CUDA Version\s*:\s*(\d+\.\d+)", text)
    return match.group(1) if match else None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU = re.compile(r"^GPU(\d+)$")


def parse_topology(text: str) -> list[tuple[int, int, str]]:
    """The GPU-to-GPU part of ``nvidia-smi topo -m``: one (i, j, code) per pair, i < j, with codes
    such as NV12, PIX, PXB, PHB, NODE, SYS. NIC columns and the legend are ignored."""
    lines = [_ANSI.sub("", line).split() for line in text.splitlines()]
    header = next((tokens for tokens in lines if tokens[:1] == ["GPU0"] and tokens[1:2] != ["X"]), None)
    if header is None:
        return []
    columns = [int(_GPU.match(tok).group(1)) for tok in takewhile(_GPU.match, header)]
    links = []
    for tokens in lines:
        row = _GPU.match(tokens[0]) if tokens and tokens is not header else None
        if row is None or len(tokens) < len(columns) + 1:
            continue
        i = int(row.group(1))
        links += [(i, j, code) for j, code in zip(columns, tokens[1:]) if i < j]
    return links
