"""Facts about this machine, gathered once into a :class:`Facts` that the checks and reports read.

Gathering touches the system (torch.cuda, ``nvidia-smi``, /proc, /dev/shm); everything downstream
is a pure function of the result, so tests build a :class:`Facts` by hand instead.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from dataclasses import dataclass, field

import torch

from phalanx.diagnose.nvidia import DriverView, Gpu, Runner, driver_view, run_tool
from phalanx.topology import cpu_count, distributed_env
from phalanx.version import __version__

UNLIMITED = -1  # an rlimit without a ceiling


@dataclass(frozen=True)
class Facts:
    phalanx: str = __version__
    python: str = ""
    python_executable: str = ""
    torch: str = ""
    torch_cuda: str | None = None  # None: a CPU build
    nccl: str | None = None
    os: str = ""
    cpus_usable: int = 1
    cpus_total: int = 1
    ram_bytes: int | None = None
    ram_available_bytes: int | None = None
    shm_bytes: int | None = None  # None: no /dev/shm
    shm_free_bytes: int | None = None
    nofile_soft: int | None = None  # UNLIMITED or None (unknown) possible
    nofile_hard: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # distributed variables that are set
    interfaces: tuple[str, ...] = ()
    pid: int = 0
    cuda_gpus: tuple[Gpu, ...] = ()  # what torch sees, after CUDA_VISIBLE_DEVICES
    cuda_error: str | None = None  # why a CUDA build of torch sees no GPU, when it says
    peer_access: tuple[tuple[int, int, bool], ...] | None = None  # torch indices; None below 2 GPUs
    driver: DriverView = field(default_factory=DriverView)


def gather_facts(run: Runner = run_tool) -> Facts:
    cuda_gpus, cuda_error = torch_gpus()
    ram, available = memory()
    shm, shm_free = disk_space("/dev/shm")
    soft, hard = open_file_limit()
    return Facts(
        python=f"{platform.python_version()} ({platform.python_implementation()})",
        python_executable=sys.executable,
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        nccl=nccl_version(),
        os=os_name(),
        cpus_usable=cpu_count(),
        cpus_total=os.cpu_count() or 1,
        ram_bytes=ram,
        ram_available_bytes=available,
        shm_bytes=shm,
        shm_free_bytes=shm_free,
        nofile_soft=soft,
        nofile_hard=hard,
        env=distributed_env(),
        interfaces=network_interfaces(),
        pid=os.getpid(),
        cuda_gpus=cuda_gpus,
        cuda_error=cuda_error,
        peer_access=peer_access(len(cuda_gpus)),
        driver=driver_view(run),
    )


def torch_gpus() -> tuple[tuple[Gpu, ...], str | None]:
    """The GPUs torch can use, and, when a CUDA build finds none, CUDA's own reason."""
    if torch.version.cuda is None:
        return (), None
    try:
        torch.cuda.init()  # raises with the driver's message ("no NVIDIA driver", "driver too old")
        count = torch.cuda.device_count()
    except (RuntimeError, AssertionError) as err:
        return (), str(err).strip().splitlines()[0]
    gpus = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        uuid = getattr(props, "uuid", None)
        gpus.append(
            Gpu(
                index=i,
                name=props.name,
                memory_bytes=props.total_memory,
                uuid=f"GPU-{uuid}" if uuid is not None else None,  # the driver's spelling
                compute_capability=f"{props.major}.{props.minor}",
            )
        )
    return tuple(gpus), None


def peer_access(count: int) -> tuple[tuple[int, int, bool], ...] | None:
    if count < 2:
        return None
    return tuple(
        (i, j, torch.cuda.can_device_access_peer(i, j) and torch.cuda.can_device_access_peer(j, i))
        for i in range(count)
        for j in range(i + 1, count)
    )


def nccl_version() -> str | None:
    if torch.version.cuda is None:
        return None
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a build without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def os_name() -> str:
    try:
        pretty = platform.freedesktop_os_release().get("PRETTY_NAME")
    except (AttributeError, OSError):  # not Linux, or no os-release file
        pretty = None
    return f"{pretty}, {platform.platform()}" if pretty else platform.platform()


def memory() -> tuple[int | None, int | None]:
    """Total and available RAM in bytes, from /proc/meminfo (Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo if ":" in line)
    except OSError:
        return _sysconf_memory(), None

    def kib(name: str) -> int | None:
        value = fields.get(name, "").split()
        return int(value[0]) * 1024 if value else None

    return kib("MemTotal"), kib("MemAvailable")


def _sysconf_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def disk_space(path: str) -> tuple[int | None, int | None]:
    try:
        stat = os.statvfs(path)
    except (OSError, AttributeError):
        return None, None
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize


def open_file_limit() -> tuple[int | None, int | None]:
    try:
        import resource
    except ImportError:  # Windows
        return None, None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (
        UNLIMITED if soft == resource.RLIM_INFINITY else soft,
        UNLIMITED if hard == resource.RLIM_INFINITY else hard,
    )


def network_interfaces() -> tuple[str, ...]:
    try:
        return tuple(name for _, name in socket.if_nameindex())
    except (OSError, AttributeError):
        return ()
