"""``phalanx.spawn``: run a function on N local processes, for notebooks and tests.

Uses torch.multiprocessing's own process starting; each process gets the same environment torchrun
would give it, so a Session inside ``fn`` behaves exactly as under ``phalanx launch``.

The default start method is a forkserver that has imported torch and the Session once: a fresh
interpreter per process pays ``import torch`` (seconds) on every call, a fork from the server
does not, so a notebook or a test suite that spawns often pays it once.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.reduction
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp

from phalanx.errors import PhalanxError
from phalanx.faults.lifeline import watch
from phalanx.topology import LaunchContext, cpu_count

BACKENDS = ("auto", "gloo")
# What the forkserver imports before it forks anyone: what every Session needs.
_PRELOAD = ["torch", "torch.distributed", "phalanx.session", "phalanx.launch.spawn"]


def default_start_method() -> str:
    """``forkserver`` where the platform has it (Linux, macOS), else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def spawn(
    fn: Callable[..., Any],
    nprocs: int = 2,
    args: Sequence[Any] = (),
    *,
    timeout: float | None = 300.0,
    cpu: bool | None = None,
    backend: str = "auto",
    start_method: str | None = None,
) -> list[Any]:
    """Call ``fn(*args)`` on ``nprocs`` processes; returns each rank's return value, by rank.

    ``cpu``: None (the default) uses CUDA when torch sees a GPU, as ``phalanx launch`` does, and CPU
    processes on gloo otherwise; True always runs CPU processes; False puts process r on ``cuda:r``
    (modulo the GPU count). ``backend``: ``"auto"`` is NCCL on CUDA and gloo on CPU; ``"gloo"`` uses
    gloo for CUDA tensors too, so several processes can share one GPU (for DDP and zero1: gloo
    all-reduces and broadcasts CUDA tensors, NCCL refuses two ranks on one GPU).

    ``start_method``: None (the default) is :func:`default_start_method`; any other
    ``torch.multiprocessing`` start method (``"spawn"``, ``"fork"``) is used as given. Every process
    sees the caller's environment as it is at this call, whichever method starts it. ``fn`` must be
    importable (defined in a module, not a notebook cell) unless the method is ``fork``.

    After ``timeout`` seconds every process is killed and ``TimeoutError`` raised; if one process
    raises, the others are stopped and its traceback re-raised here.
    """
    if backend not in BACKENDS:
        raise PhalanxError(f"phalanx.spawn: backend must be 'auto' or 'gloo', got {backend!r}")
    # device_count, not is_available: it asks NVML, which leaves start_method='fork' usable.
    gpus = 0 if cpu else torch.cuda.device_count()
    if cpu is None:
        cpu = gpus == 0
    if not cpu and backend == "auto" and 0 < gpus < nprocs:
        raise PhalanxError(
            f"phalanx.spawn: {nprocs} processes on NCCL need {nprocs} GPUs but {gpus} "
            f"{'is' if gpus == 1 else 'are'} visible; pass backend='gloo' to share GPUs, or cpu=True"
        )
    method = start_method or default_start_method()
    if method == "forkserver":
        # Only before the server's first start; a running server keeps what it has imported.
        mp.set_forkserver_preload(_PRELOAD)
    port = _free_port()
    launch = LaunchContext(force_cpu=cpu, gloo_on_cuda=backend == "gloo")
    with tempfile.TemporaryDirectory(prefix="phalanx-spawn-") as tmp:
        context = mp.start_processes(
            _entry,
            args=(fn, tuple(args), nprocs, port, tmp, launch, os.getpid(), dict(os.environ), _streams(method)),
            nprocs=nprocs,
            join=False,
            start_method=method,
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
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple,
    nprocs: int,
    port: int,
    out_dir: str,
    launch: LaunchContext,
    parent: int,
    environ: dict[str, str],
    streams: _Streams | None,
) -> None:
    watch(parent, f"phalanx.spawn rank {local_rank}")  # a killed notebook kernel takes its ranks along
    # A forkserver's child inherits the server's environment, from when it started: the caller's
    # is the one that counts, as it would with spawn.
    os.environ.clear()
    os.environ.update(environ)
    if streams is not None:
        streams.attach()
    os.environ.update(
        {
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **launch.to_env(),
        }
    )
    if launch.force_cpu:
        # As `phalanx launch` does with OMP_NUM_THREADS: share the cores instead of oversubscribing them.
        torch.set_num_threads(max(1, cpu_count() // nprocs))
    try:
        result = fn(*args)
        torch.save(result, Path(out_dir) / f"rank{local_rank}.pt")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class _Streams:
    """The caller's stdout and stderr for a forkserver's child, which has the server's: what the
    ranks print goes where the caller's own output goes now (a notebook cell's, a test's capture),
    as with spawn. The descriptors travel with the process object (SCM_RIGHTS), so they can only
    be taken while it is pickled: :meth:`__reduce__` does it."""

    def __init__(self, fds: tuple[int, ...] = (), inherited: tuple[int, ...] = ()):
        self.fds, self.inherited = fds, inherited

    def __reduce__(self):
        return (_received_streams, (self.fds, tuple(multiprocessing.reduction.DupFd(fd) for fd in self.fds)))

    def attach(self) -> None:
        for fd, inherited in zip(self.fds, self.inherited):
            os.dup2(inherited, fd)
            os.close(inherited)


def _received_streams(fds: tuple[int, ...], handles: tuple) -> _Streams:
    return _Streams(fds, tuple(handle.detach() for handle in handles))


def _streams(method: str) -> _Streams | None:
    if method != "forkserver":
        return None  # spawn and fork children inherit the caller's descriptors already
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            return None  # a caller without them (a daemon): the server's are all there is
    return _Streams((1, 2))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
