"""Who this process is: rank, local rank, world size, device.

This is the one module that reads the environment: what torchrun's elastic agent sets for each
worker (RANK, LOCAL_RANK, ...) and what ``phalanx launch`` adds (PHALANX_*). Everything else is
handed a :class:`Topology` or a :class:`LaunchContext` explicitly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from phalanx.errors import PhalanxError

# Names of the variables phalanx's launcher passes to its workers.
ENV_CONTEXT = "PHALANX_CONTEXT"
# An elastic job's attempt on this node (launch/elastic.py): torch's restart count skips the restarts
# a node joining causes.
ENV_ATTEMPT = "PHALANX_ATTEMPT"


@dataclass(frozen=True)
class LaunchContext:
    """What ``phalanx launch`` tells each worker: config sources, run directory, output policy."""

    config_file: str | None = None
    overrides: tuple[str, ...] = ()
    run_dir: str | None = None
    show_ranks: str = "0"  # "0" or "all"
    force_cpu: bool = False
    # gloo for CUDA tensors too, so several processes can share one GPU (NCCL refuses two ranks on a device).
    gloo_on_cuda: bool = False
    # This launch's own token (unique per launch): whose checkpoint-directory lock is the job's own.
    job: str | None = None
    # The run as the launcher resolved it (counted settings, the script's hash and arguments): what
    # checkpoints record so that the next launch can tell its own (checkpoint/run_identity.py).
    run: dict | None = field(default=None, hash=False)

    def to_env(self) -> dict[str, str]:
        payload = {
            "config_file": self.config_file,
            "overrides": list(self.overrides),
            "run_dir": self.run_dir,
            "show_ranks": self.show_ranks,
            "force_cpu": self.force_cpu,
            "gloo_on_cuda": self.gloo_on_cuda,
            "job": self.job,
            "run": self.run,
        }
        return {ENV_CONTEXT: json.dumps(payload)}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "LaunchContext | None":
        env = os.environ if env is None else env
        raw = env.get(ENV_CONTEXT)
        if not raw:
            return None
        data = json.loads(raw)
        return cls(
            config_file=data.get("config_file"),
            overrides=tuple(data.get("overrides", ())),
            run_dir=data.get("run_dir"),
            show_ranks=data.get("show_ranks", "0"),
            force_cpu=bool(data.get("force_cpu", False)),
            gloo_on_cuda=bool(data.get("gloo_on_cuda", False)),
            job=data.get("job"),
            run=data.get("run") if isinstance(data.get("run"), dict) else None,
        )

    @property
    def log_dir(self) -> Path | None:
        return Path(self.run_dir) / "logs" if self.run_dir else None


@dataclass(frozen=True)
class Topology:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    restart_count: int = 0
    # Set when torch elastic's agent hosts the store the workers meet at (MASTER_ADDR:MASTER_PORT).
    agent_store: tuple[str, int] | None = None
    launched: bool = False  # True under torchrun / phalanx launch / phalanx.spawn
    elastic: bool = False  # a worker of an elastic job (--nnodes MIN:MAX): its size may change
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    gloo_on_cuda: bool = False  # see LaunchContext.gloo_on_cuda

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" and not self.gloo_on_cuda else "gloo"

    @property
    def comm_device(self) -> torch.device:
        """Where the tensors of phalanx's own small collectives live: NCCL takes only CUDA tensors,
        gloo is fastest with CPU ones."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, force_cpu: bool | None = None) -> "Topology":
        env = os.environ if env is None else env
        ctx = LaunchContext.from_env(env)
        if force_cpu is None:
            force_cpu = bool(ctx and ctx.force_cpu)
        launched = "RANK" in env and "WORLD_SIZE" in env
        local_rank = int(env.get("LOCAL_RANK", 0))
        world_size = int(env.get("WORLD_SIZE", 1))
        gloo_on_cuda = bool(ctx and ctx.gloo_on_cuda)
        return cls(
            rank=int(env.get("RANK", 0)),
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            node_rank=int(env.get("GROUP_RANK", 0)),
            restart_count=int(env.get(ENV_ATTEMPT) or env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            agent_store=(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
            if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in env
            else None,
            launched=launched,
            elastic=ENV_ATTEMPT in env,
            device=pick_device(local_rank, force_cpu, shares_gpus=gloo_on_cuda, env=env),
            gloo_on_cuda=gloo_on_cuda,
        )


def pick_device(
    local_rank: int, force_cpu: bool = False, *, shares_gpus: bool = False, env: Mapping[str, str] | None = None
) -> torch.device:
    """One CUDA device per local rank when CUDA is there, else the CPU. ``shares_gpus``: the process
    group is gloo's (LaunchContext.gloo_on_cuda), so local ranks past the GPU count wrap around and
    share them; under NCCL, which refuses two ranks on one GPU, that is refused here, in one line."""
    if force_cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count and not shares_gpus:
        visible = visible_cuda_devices(env)
        shown = "unset" if visible is None else ",".join(visible)
        plural = "s are" if count != 1 else " is"
        raise PhalanxError(
            f"LOCAL_RANK {local_rank} but only {count} CUDA device{plural} visible (CUDA_VISIBLE_DEVICES={shown}): "
            f"two ranks would share one GPU, which NCCL refuses; start at most {count} process"
            f"{'es' if count != 1 else ''} per node (--nproc-per-node {count}) or make more GPUs visible"
        )
    return torch.device("cuda", local_rank % count)


def visible_cuda_devices(env: Mapping[str, str] | None = None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list, or None when it is not set."""
    env = os.environ if env is None else env
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [d.strip() for d in raw.split(",") if d.strip()]


def user_omp_threads(env: Mapping[str, str] | None = None) -> str | None:
    """OMP_NUM_THREADS as the user exported it, if they did."""
    env = os.environ if env is None else env
    return env.get("OMP_NUM_THREADS")


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    nnodes: int
    node_id: int
    nodelist: str


def slurm_job(env: Mapping[str, str] | None = None) -> SlurmJob | None:
    """The SLURM allocation this process runs in, if any (what `phalanx launch` uses for multi-node)."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env:
        return None
    try:
        nnodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
        node_id = int(env.get("SLURM_NODEID", 0))
    except ValueError:
        return None
    return SlurmJob(
        env["SLURM_JOB_ID"], nnodes, node_id, env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    )


def cpu_count() -> int:
    """Cores this process may use (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


# What a bug report or `phalanx doctor` needs to see of the environment: the variables torchrun,
# the launcher and the collective libraries read. Prefixes cover whole families (NCCL_IB_HCA, ...).
_DISTRIBUTED_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "CUDA_LAUNCH_BLOCKING",
    "NVIDIA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    ENV_CONTEXT,
)
_DISTRIBUTED_PREFIXES = ("NCCL_", "GLOO_", "TORCH_DISTRIBUTED_", "TORCH_NCCL_", "TORCHELASTIC_", "TORCH_CPP_LOG")


def distributed_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The distributed-training variables that are set, sorted by name."""
    env = os.environ if env is None else env
    return {
        name: value
        for name, value in sorted(env.items())
        if name in _DISTRIBUTED_NAMES or name.startswith(_DISTRIBUTED_PREFIXES)
    }
