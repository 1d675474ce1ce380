"""``phalanx.spawn``: run a function on N local processes, for notebooks and tests.

Uses torch.multiprocessing's own process starting; each process gets the same environment torchrun
would give it, so a Session inside ``fn`` behaves exactly as under ``phalanx launch``.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp

from phalanx.topology import LaunchContext, cpu_count


def spawn(
    fn: Callable[..., Any],
    nprocs: int = 2,
    args: Sequence[Any] = (),
    *,
    timeout: float | None = 300.0,
    cpu: bool = True,
    start_method: str = "spawn",
) -> list[Any]:
    """Call ``fn(*args)`` on ``nprocs`` processes; returns each rank's return value, by rank.

    ``fn`` must be importable (defined in a module, not a notebook cell) with the default ``spawn``
    start method. After ``timeout`` seconds every process is killed and ``TimeoutError`` raised; if
    one process raises, the others are stopped and its traceback re-raised here.
    """
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="phalanx-spawn-") as tmp:
        context = mp.start_processes(
            _entry, args=(fn, tuple(args), nprocs, port, tmp, cpu), nprocs=nprocs, join=False, start_method=start_method
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"phalanx.spawn: {nprocs} processes did not finish within {timeout:g}s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        return [torch.load(Path(tmp) / f"rank{rank}.pt", weights_only=False) for rank in range(nprocs)]


def _entry(
    local_rank: int, fn: Callable[..., Any], args: tuple, nprocs: int, port: int, out_dir: str, cpu: bool
) -> None:
    os.environ.update(
        {
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **LaunchContext(force_cpu=cpu).to_env(),
        }
    )
    if cpu:
        # As `phalanx launch` does with OMP_NUM_THREADS: share the cores instead of oversubscribing them.
        torch.set_num_threads(max(1, cpu_count() // nprocs))
    try:
        result = fn(*args)
        torch.save(result, Path(out_dir) / f"rank{local_rank}.pt")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
