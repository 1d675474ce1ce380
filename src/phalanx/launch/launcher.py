"""``phalanx launch``: validates everything it can, then hands the workers to torch's elastic agent
(``torch.distributed.launcher``, the library behind torchrun) and reports how they ended."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from phalanx.config.batch import plan_batch
from phalanx.config.loader import load_config
from phalanx.config.schema import Config
from phalanx.config.template import write_resolved
from phalanx.errors import PhalanxError
from phalanx.launch.devices import DevicePlan, plan_devices
from phalanx.strategies import strategy_class
from phalanx.topology import LaunchContext, cpu_count, user_omp_threads, visible_cuda_devices

_LOG_TAIL_LINES = 15


@dataclass
class LaunchRequest:
    script: str
    script_args: Sequence[str] = ()
    config_file: str | None = None
    overrides: Sequence[str] = ()
    nproc: int | None = None
    gpus: str | None = None
    cpu: bool = False
    ranks: str | None = None
    run_dir: str | None = None
    verbose: bool = False
    name: str | None = None  # names the run directory (default: the script's file name)
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchPlan:
    request: LaunchRequest
    config: Config
    devices: DevicePlan
    strategy: str
    run_dir: Path
    context: LaunchContext

    def describe(self) -> str:
        return f"phalanx: {self.devices.describe()}, strategy {self.strategy}, run dir {self.run_dir}"


def prepare(request: LaunchRequest) -> LaunchPlan:
    """Everything that can be wrong with the user's input is found here, before any process starts."""
    if not os.path.isfile(request.script):
        raise PhalanxError(f"script '{request.script}' not found; give the path of a Python file to run")
    config = load_config(request.config_file, overrides=request.overrides, context=LaunchContext())
    launch = config.launch
    name = config.strategy.name
    fixed = None if name == "auto" else strategy_class(name)  # unknown names fail here
    devices = plan_devices(
        gpus=request.gpus if request.gpus is not None else launch.gpus,
        nproc=request.nproc if request.nproc is not None else launch.nproc,
        cpu=request.cpu,
        processes_per_node=fixed.processes_per_node if fixed else None,
        cuda_count=0 if request.cpu else torch.cuda.device_count(),
        visible=visible_cuda_devices(),
        cores=cpu_count(),
    )
    exported = user_omp_threads()
    if exported is not None and exported.isdigit():
        devices = replace(devices, omp_num_threads=int(exported))  # the user's value is the one used
    strategy_cls = strategy_class(name, devices.nproc)
    strategy_cls.check_world(devices.nproc)
    if config.batch.global_batch_size is not None:
        plan_batch(strategy_cls.data_parallel_size_for(devices.nproc), config.batch.global_batch_size, config.batch.micro_batch_size)
    ranks = request.ranks if request.ranks is not None else launch.ranks
    if ranks not in ("0", "all"):
        raise PhalanxError(f"--ranks must be 0 or all, got '{ranks}'")
    # Absolute, so a script that changes directory still writes into its run directory.
    run_dir = _new_run_dir(Path(request.run_dir or launch.run_dir).resolve(), request.name or Path(request.script).stem)
    context = LaunchContext(
        config_file=str(Path(request.config_file).resolve()) if request.config_file else None,
        overrides=tuple(request.overrides),
        run_dir=str(run_dir),
        show_ranks=ranks,
        force_cpu=devices.kind == "cpu",
    )
    return LaunchPlan(request, config, devices, strategy_cls.name, run_dir, context)


def launch(request: LaunchRequest) -> int:
    """Run the job; returns the exit code for the CLI."""
    plan = prepare(request)
    plan.run_dir.mkdir(parents=True, exist_ok=False)
    write_resolved(plan.config, plan.run_dir / "config.yaml")  # the Session rewrites it with code settings
    print(plan.describe(), flush=True)
    return run_workers(plan)


def run_workers(plan: LaunchPlan) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=plan.devices.nproc,
        run_id=uuid.uuid4().hex[:12],
        role="worker",
        # Port 0: the store picks a free port itself, so two jobs on one machine never collide.
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"is_host": True},
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(plan.run_dir / "elastic")),
    )
    env = {**plan.context.to_env(), "PYTHONUNBUFFERED": "1"}
    if user_omp_threads() is None:  # a value the user exported wins, as with torchrun
        env["OMP_NUM_THREADS"] = str(plan.devices.omp_num_threads)
    if plan.devices.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = plan.devices.cuda_visible_devices
    env.update(plan.request.extra_env)
    args = ["-u", "-m", "phalanx.launch.worker", plan.request.script, *plan.request.script_args]
    started = time.perf_counter()
    try:
        with _environ(env), _quiet_elastic(not plan.request.verbose):
            elastic_launch(config, entrypoint=sys.executable)(*args)
    except ChildFailedError as failure:
        return _report_failure(plan, failure)
    except SignalException as sig:
        print(f"phalanx: stopped by signal {sig.sigval.name}; logs in {plan.run_dir / 'logs'}", file=sys.stderr)
        return 128 + int(sig.sigval)
    if plan.request.verbose:
        print(f"phalanx: finished in {time.perf_counter() - started:.1f}s", flush=True)
    return 0


def _report_failure(plan: LaunchPlan, failure) -> int:
    rank, first = failure.get_first_failure()
    message = first.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = str(message or "")
    exit_code = first.exitcode if first.exitcode and first.exitcode > 0 else 1
    for prefix in ("PhalanxError: ", "ConfigError: "):
        if message.startswith(prefix):
            print(f"phalanx: error: {message[len(prefix):]}", file=sys.stderr)
            return exit_code
    failed = sorted(failure.failures)
    how = f"exit code {first.exitcode}" if first.exitcode >= 0 else f"signal {-first.exitcode}"
    summary = message.splitlines()[-1] if message and not message.startswith("To enable traceback") else "no exception recorded"
    print(f"phalanx: rank {rank} failed first ({how}): {summary}", file=sys.stderr)
    if len(failed) > 1:
        print(f"phalanx: ranks that exited with an error (the others may have failed because rank {rank} did): {', '.join(map(str, failed))}", file=sys.stderr)
    log = plan.run_dir / "logs" / f"rank{rank}.log"
    tail = log.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:] if log.is_file() else []
    if not tail:
        print(f"phalanx: rank {rank} wrote nothing to {log}", file=sys.stderr)
    else:
        print(f"phalanx: last lines of {log}:", file=sys.stderr)
        for line in tail:
            print(f"  | {line}", file=sys.stderr)
    return exit_code if exit_code < 128 else 1


def _new_run_dir(root: Path, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = root / f"{stamp}-{name}"
    n = 1
    while candidate.exists():
        n += 1
        candidate = root / f"{stamp}-{name}-{n}"
    return candidate


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """The elastic agent hands its own environment to the workers, so set it for the launch only."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextlib.contextmanager
def _quiet_elastic(quiet: bool) -> Iterator[None]:
    # The agent logs every worker failure and signal at length; phalanx prints its own summary.
    # Its loggers carry their own levels, so each one is raised, not just the parent.
    if not quiet:
        yield
        return
    names = ["torch.distributed"] + [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.")]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
