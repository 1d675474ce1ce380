"""All-reduce bandwidth between local processes, measured as nccl-tests measure it.

For each message size: a first all-reduce whose result is checked (a transport that corrupts data
is worse than a slow one), warm-up iterations, then timed iterations. The time of a size is the
mean over the timed iterations on the slowest rank. Algorithm bandwidth is bytes / time; bus
bandwidth is algorithm bandwidth x 2(n-1)/n, the share of the data each link really carries in a
ring all-reduce, so it can be compared with the link's own bandwidth whatever n is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from phalanx.errors import PhalanxError
from phalanx.launch.spawn import spawn
from phalanx.topology import Topology
from phalanx.util.units import parse_size

CPU_SIZES = "4K,64K,1M,16M,64M"
GPU_SIZES = "4K,64K,1M,16M,256M,1G"
CPU_ITERS = 10
GPU_ITERS = 20
ELEMENT_BYTES = 4  # float32


@dataclass(frozen=True)
class SizeResult:
    bytes: int
    seconds: float
    algorithm_bandwidth: float  # bytes / second
    bus_bandwidth: float  # bytes / second


def parse_sizes(text: str) -> list[int]:
    """``"4K,1M,64M"`` -> byte counts, rounded up to whole float32 elements, ascending, no repeats."""
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes or any(size <= 0 for size in sizes):
        raise PhalanxError(f"--sizes expects positive sizes separated by commas, e.g. 4K,1M,64M; got '{text}'")
    return sorted({-(-size // ELEMENT_BYTES) * ELEMENT_BYTES for size in sizes})


def warmup_for(iters: int) -> int:
    return max(1, min(5, iters // 2))


def size_result(nbytes: int, seconds: float, world_size: int) -> SizeResult:
    algorithm = nbytes / seconds
    return SizeResult(nbytes, seconds, algorithm, algorithm * 2 * (world_size - 1) / world_size)


def measure(sizes: Sequence[int], nproc: int, *, cuda: bool, iters: int, timeout: float) -> list[SizeResult]:
    """Start ``nproc`` processes (one per GPU with ``cuda``, else CPU processes on gloo) and time an
    all-reduce of each size. Raises what the processes raised, or TimeoutError."""
    per_rank = spawn(
        _rank_times, nprocs=nproc, args=(list(sizes), iters, warmup_for(iters)), cpu=not cuda, timeout=timeout
    )
    return [size_result(nbytes, seconds, nproc) for nbytes, seconds in zip(sizes, per_rank[0])]


def _rank_times(sizes: list[int], iters: int, warmup: int) -> list[float]:
    """Runs on every rank; returns the time of one all-reduce per size (the same on every rank)."""
    topology = Topology.from_env()
    cuda = topology.device.type == "cuda"
    if cuda:
        torch.cuda.set_device(topology.device)
    # device_id binds NCCL to this rank's GPU up front, so barrier() need not guess it.
    extra = {"device_id": topology.device} if cuda else {}
    dist.init_process_group(topology.backend, rank=topology.rank, world_size=topology.world_size, **extra)
    return [_time_one(nbytes, topology, iters, warmup) for nbytes in sizes]


def _time_one(nbytes: int, topology: Topology, iters: int, warmup: int) -> float:
    tensor = torch.ones(nbytes // ELEMENT_BYTES, dtype=torch.float32, device=topology.device)
    dist.all_reduce(tensor)
    if not bool(torch.all(tensor == topology.world_size)):
        raise RuntimeError(f"an all-reduce of {nbytes} bytes summed to wrong values: the transport corrupts data")
    tensor.zero_()  # repeated sums of ones would grow toward overflow
    for _ in range(warmup - 1):
        dist.all_reduce(tensor)
    _synchronize(topology.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    _synchronize(topology.device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=topology.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace of a collective
    return float(elapsed.item())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # collectives on GPU return before the transfer ends
