"""Which devices a launch uses and how many processes it starts on them."""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.config.sections import gpu_indices
from phalanx.errors import PhalanxError

CPU_DEFAULT_NPROC = 2


@dataclass(frozen=True)
class DevicePlan:
    kind: str  # "cuda" or "cpu"
    nproc: int
    cuda_visible_devices: str | None  # value for the workers' CUDA_VISIBLE_DEVICES, None to leave it
    omp_num_threads: int

    def describe(self) -> str:
        if self.kind == "cpu":
            return (
                f"{self.nproc} CPU process{'es' if self.nproc != 1 else ''} (gloo), "
                f"{self.omp_num_threads} thread{'s' if self.omp_num_threads != 1 else ''} each"
            )
        return f"{self.nproc} process{'es' if self.nproc != 1 else ''} on GPU {self.cuda_visible_devices}"


def parse_gpus(text: str) -> list[int]:
    """The indices of ``--gpus``, by the rule of its setting ``launch.gpus``."""
    try:
        return gpu_indices(text)
    except ValueError as err:
        raise PhalanxError(f"--gpus {err}, got '{text}'") from None


def plan_devices(
    *,
    gpus: str | None,
    nproc: int | None,
    cpu: bool,
    processes_per_node: int | None,
    cuda_count: int,
    visible: list[str] | None,
    cores: int,
) -> DevicePlan:
    """``visible`` is the launcher's own CUDA_VISIBLE_DEVICES (None when unset): --gpus indexes into it,
    as torch does, so an outer restriction is respected rather than overridden."""
    if nproc is not None and nproc < 1:
        raise PhalanxError(f"--nproc must be at least 1, got {nproc}")
    if cpu or cuda_count == 0:
        if gpus is not None and not cpu:
            raise PhalanxError(
                f"--gpus {gpus}: no CUDA device is visible here (torch.cuda.device_count() is 0); "
                "drop --gpus to run CPU processes, or add --cpu"
            )
        n = nproc or processes_per_node or CPU_DEFAULT_NPROC
        return DevicePlan("cpu", n, None, max(1, cores // n))

    ids = parse_gpus(gpus) if gpus is not None else list(range(cuda_count))
    missing = [i for i in ids if i >= cuda_count]
    if missing:
        raise PhalanxError(
            f"--gpus {gpus}: GPU {', '.join(map(str, missing))} does not exist; "
            f"{cuda_count} visible GPU{'s are' if cuda_count != 1 else ' is'} numbered 0-{cuda_count - 1}"
        )
    names = [visible[i] for i in ids] if visible else [str(i) for i in ids]
    n = nproc or processes_per_node or len(ids)
    if processes_per_node is None and n > len(ids):
        raise PhalanxError(
            f"--nproc {n} needs {n} GPUs but {len(ids)} {'are' if len(ids) != 1 else 'is'} selected; "
            "one process per GPU"
        )
    if processes_per_node is None and n < len(ids):
        names = names[:n]
    return DevicePlan("cuda", n, ",".join(names), max(1, cores // n))
