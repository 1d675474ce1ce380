"""``phalanx launch``: validates everything it can, then hands the workers to torch's elastic agent
(``torch.distributed.launcher``, the library behind torchrun) and reports how they ended."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from phalanx.checkpoint.lock import DirectoryLock
from phalanx.checkpoint.run_identity import of_launch
from phalanx.config.loader import load_config
from phalanx.config.schema import Config
from phalanx.config.sources import check_overrides
from phalanx.config.template import scalar, write_resolved
from phalanx.errors import PhalanxError
from phalanx.faults import markers
from phalanx.faults.lifeline import ENV_LAUNCHER_PID
from phalanx.launch.devices import DevicePlan, plan_devices
from phalanx.launch.outcome import report_failure, report_preemption
from phalanx.launch.preflight import check_checkpoint_owner, check_output_dirs, check_script
from phalanx.launch.rendezvous import Rendezvous, hosts_store, plan_rendezvous
from phalanx.launch.script_check import check_before_launch
from phalanx.metrics.profile import ProfileWindow
from phalanx.metrics.summary_display import report_run
from phalanx.strategies import check_combination, strategy_class
from phalanx.topology import ENV_ATTEMPT, LaunchContext, cpu_count, slurm_job, user_omp_threads, visible_cuda_devices
from phalanx.util.words import plural

# LaunchRequest fields that are shorthands for `--set launch.<field>=...` (the launch flags).
LAUNCH_FLAGS = (
    "nproc", "gpus", "cpu", "ranks", "run_dir", "verbose",
    "max_restarts", "nnodes", "node_rank", "master", "rdzv_endpoint", "rdzv_id",
)  # fmt: skip


@dataclass
class LaunchRequest:
    """What to launch. The flag fields (LAUNCH_FLAGS) are shorthands for ``--set launch.<field>=...``
    lines applied after ``overrides``, so a flag wins; None (False for ``cpu`` and ``verbose``)
    leaves the config's value."""

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
    check: bool = True  # False: --no-check, a shorthand for --set launch.check=false
    name: str | None = None  # names the run directory (default: the script's file name)
    extra_env: dict[str, str] = field(default_factory=dict)
    max_restarts: int | None = None
    nnodes: int | str | None = None  # N, or MIN:MAX
    node_rank: int | None = None
    master: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None

    def flag_overrides(self) -> list[str]:
        """The flags given, as ``--set`` lines (YAML scalars, so '1' stays text and 4 a number)."""
        given = {key: getattr(self, key) for key in LAUNCH_FLAGS}
        # `is`, not `in (None, False)`: --node-rank 0 and --max-restarts 0 are values to pass on.
        lines = [f"launch.{key}={scalar(v)}" for key, v in given.items() if v is not None and v is not False]
        return lines if self.check else [*lines, "launch.check=false"]

    def check_flags(self) -> None:
        """The flags alone, by the schema's rules for their ``launch.*`` keys (the same validation
        the config gets next), so that a bad one is named as typed: ``--nnodes must be at least 1``."""
        names = {f"launch.{key}": "--" + key.replace("_", "-") for key in LAUNCH_FLAGS}
        check_overrides(Config, self.flag_overrides(), names)


@dataclass(frozen=True)
class LaunchPlan:
    request: LaunchRequest
    config: Config
    devices: DevicePlan
    strategy: str
    run_dir: Path
    context: LaunchContext
    rendezvous: Rendezvous

    def describe(self) -> str:
        nodes = f"; {self.rendezvous.describe()}" if self.rendezvous.multi_node else ""
        return f"phalanx: {self.devices.describe()}, strategy {self.strategy}, run dir {self.run_dir}{nodes}"


def prepare(request: LaunchRequest) -> LaunchPlan:
    """Everything that can be wrong with the user's input is found here, before any process starts."""
    check_script(request.script)
    request.check_flags()
    overrides = (*request.overrides, *request.flag_overrides())
    config = _load(request.config_file, overrides, request.cpu)
    launch = config.launch
    name = config.strategy.name
    fixed = None if name == "auto" else strategy_class(name)  # unknown names fail here
    devices = plan_devices(
        gpus=launch.gpus,
        nproc=launch.nproc,
        cpu=launch.cpu,
        processes_per_node=fixed.processes_per_node if fixed else None,
        cuda_count=0 if launch.cpu else torch.cuda.device_count(),
        visible=visible_cuda_devices(),
        cores=cpu_count(),
    )
    exported = user_omp_threads()
    if exported is not None and exported.isascii() and exported.isdigit():
        devices = replace(devices, omp_num_threads=int(exported))  # the user's value is the one used
    rendezvous = plan_rendezvous(
        nnodes=launch.node_range(),
        node_rank=launch.node_rank,
        master=launch.master,
        rdzv_endpoint=launch.rdzv_endpoint,
        rdzv_id=launch.rdzv_id,
        slurm=slurm_job(),
    )
    world = devices.nproc * rendezvous.nnodes
    strategy_cls = strategy_class(name, world)
    # Late: importing the launcher (spawn, the CLI) should not load the Session and its collaborators.
    from phalanx.session.batch_plan import config_plan

    if rendezvous.elastic:
        check_elastic(config, rendezvous, devices.nproc, devices.kind)
    check_combination(config, world, devices.kind, devices.nproc)
    if config.train.profile is not None:
        ProfileWindow.parse(config.train.profile)
    config_plan(config, strategy_cls, world, devices.nproc)  # refuses sizes the Session would refuse
    # The run as the checkpoints it writes will record it (launch() refuses another run's checkpoint).
    run = of_launch(config, strategy_cls.counted_settings(), request.script, request.script_args)
    # Last, as nothing after it can fail. Absolute, so a script that changes directory still writes
    # into its run directory.
    run_root = check_output_dirs(launch.run_dir, config.checkpoint.dir)
    run_dir = new_run_dir(run_root, request.name or Path(request.script).stem)
    context = LaunchContext(
        config_file=str(Path(request.config_file).resolve()) if request.config_file else None,
        overrides=overrides,  # the workers resolve the same config, launch settings included
        run_dir=str(run_dir),
        show_ranks=launch.ranks,
        force_cpu=devices.kind == "cpu",
        # Several nodes share their rendezvous id, and only rank 0 takes the lock there: no token.
        job=None if rendezvous.multi_node else uuid.uuid4().hex,
        run=run,
    )
    return LaunchPlan(request, config, devices, strategy_cls.name, run_dir, context, rendezvous)


def check_elastic(config: Config, rendezvous: Rendezvous, nproc: int, device: str) -> None:
    """A node range: every size in it must train the same run, so refuse, before any node starts,
    a size the layout cannot serve and a global batch that would follow the node count."""
    from phalanx.session.batch_plan import config_plan

    span = f"--nnodes {rendezvous.min_nodes}:{rendezvous.nnodes}"
    batch = config.batch
    if batch.global_batch_size is None and batch.micro_batch_size is not None:
        raise PhalanxError(
            f"{span}: batch.micro_batch_size alone makes the global batch follow the number of nodes, so a node "
            "leaving or joining would change the training; set batch.global_batch_size (the micro batch and "
            "accumulation then adapt to each size)"
        )
    counts = list(rendezvous.node_counts)
    if len(counts) > 64:  # the rules are divisibility: the ends and a sample between them
        counts = sorted({*counts[:32], *counts[-32:]})
    for nodes in counts:
        world = nproc * nodes
        try:
            check_combination(config, world, device, nproc)
            config_plan(config, strategy_class(config.strategy.name, world), world, nproc)
        except PhalanxError as err:
            raise PhalanxError(
                f"{span}: at {plural(nodes, 'node')} ({plural(world, 'process')}) the job cannot run: {err}; "
                "choose a node range where every size can"
            ) from None


def _load(config_file: str | None, overrides: Sequence[str], cpu_flag: bool) -> Config:
    """The config as the workers will see it. A preset depends on the device kind, and the
    launcher may not initialise CUDA to learn it: launch.cpu, from the flag or the config, says."""
    config = load_config(config_file, overrides=overrides, context=LaunchContext(force_cpu=cpu_flag))
    if config.launch.cpu != cpu_flag:
        config = load_config(config_file, overrides=overrides, context=LaunchContext(force_cpu=config.launch.cpu))
    return config


def launch(request: LaunchRequest) -> int:
    """Run the job; returns the exit code for the CLI."""
    plan = prepare(request)
    if plan.config.launch.check:
        check_before_launch(request.script)
    with checkpoint_lock(plan):  # before the run directory: a refused job leaves nothing behind
        # Under the lock: a job still running in the directory is named as such, and no save moves
        # 'latest' while the check reads it.
        check_checkpoint_owner(plan.config, plan.context.run)
        plan = _make_run_dir(plan)
        write_resolved(plan.config, plan.run_dir / "config.yaml")  # the Session rewrites it with code settings
        if not plan.rendezvous.elastic:  # an elastic job says it once the nodes have joined
            print(plan.describe(), flush=True)
        code = run_workers(plan)
    if code == 0:
        report_run(plan.run_dir)
    return code


def checkpoint_lock(plan: LaunchPlan) -> contextlib.AbstractContextManager:
    """The job's hold on its checkpoint directory, across restarts, when the config says the job
    uses it: it saves on a schedule, restarts from it, or there are checkpoints in it to resume
    (resume: auto). Otherwise rank 0's Session takes it at its first save, so jobs that never
    checkpoint can share a working directory. With several nodes, each node's launcher would lock
    a shared directory against the others: rank 0's Session takes it then too."""
    config = plan.config
    directory = Path(config.checkpoint.dir).resolve()
    uses = config.checkpoint.save_every is not None or config.launch.max_restarts > 0 or directory.is_dir()
    if plan.rendezvous.multi_node or not uses:
        return contextlib.nullcontext()
    return DirectoryLock(directory, plan.context.job, holder=f"phalanx launch {Path(plan.request.script).name}")


def _make_run_dir(plan: LaunchPlan) -> LaunchPlan:
    """Create the run directory; another launch of the same script may have taken its name in the
    same second, and then the next free name is this job's."""
    while True:
        try:
            plan.run_dir.mkdir(parents=True, exist_ok=False)
            return plan
        except FileExistsError:
            run_dir = new_run_dir(plan.run_dir.parent, plan.request.name or Path(plan.request.script).stem)
            plan = replace(plan, run_dir=run_dir, context=replace(plan.context, run_dir=str(run_dir)))


def run_workers(plan: LaunchPlan) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rdzv = plan.rendezvous
    launch = plan.config.launch
    os.environ.pop(ENV_ATTEMPT, None)  # a launch inside an elastic job's worker is a job of its own
    restarts, backend, configs = launch.max_restarts, rdzv.backend, dict(rdzv.configs)
    if rdzv.backend == "c10d" and "is_host" not in configs:
        configs["is_host"] = hosts_store(rdzv.endpoint)
    if rdzv.elastic:
        from phalanx.launch import elastic

        def announce(nodes: int, node: int) -> None:
            print(f"{plan.describe()}; {nodes} joined, this machine is node {node}", flush=True)

        elastic.register(
            plan.run_dir,
            min_nodes=rdzv.min_nodes,
            max_nodes=rdzv.nnodes,
            restarts=restarts,
            grace=plan.config.faults.preempt_grace,
            timeout=launch.rendezvous_timeout,
            announce=announce,
        )
        backend, restarts = elastic.BACKEND, elastic.UNLIMITED_RESTARTS  # the wrapper decides what counts
        configs.update(
            join_timeout=launch.rendezvous_timeout,
            last_call_timeout=launch.late_node_wait,
            # A heartbeat every few seconds (at least 3 missed before a node counts as lost).
            keep_alive_interval=max(1, launch.node_timeout // 5),
            keep_alive_max_attempt=launch.node_timeout // max(1, launch.node_timeout // 5),
        )
    config = LaunchConfig(
        min_nodes=rdzv.min_nodes or rdzv.nnodes,
        max_nodes=rdzv.nnodes,
        nproc_per_node=plan.devices.nproc,
        run_id=rdzv.run_id,
        role="worker",
        rdzv_backend=backend,
        rdzv_endpoint=rdzv.endpoint,
        rdzv_configs=configs,
        local_addr=rdzv.local_addr,
        max_restarts=restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(plan.run_dir / "elastic")),
        # SIGTERM is phalanx's own (pre-emption, see _preemption_handler); the agent then gives the
        # workers the grace period to checkpoint before it kills them.
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",
        shutdown_timeout=int(plan.config.faults.preempt_grace) + 5,
    )
    # The workers watch this pid: whatever kills the launcher, they end too (faults/lifeline.py).
    env = {**plan.context.to_env(), "PYTHONUNBUFFERED": "1", ENV_LAUNCHER_PID: str(os.getpid())}
    if user_omp_threads() is None:  # a value the user exported wins, as with torchrun
        env["OMP_NUM_THREADS"] = str(plan.devices.omp_num_threads)
    if plan.devices.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = plan.devices.cuda_visible_devices
    if rdzv.elastic:
        env.update(elastic.NO_SHARED_STORE)
    env.update(plan.request.extra_env)
    args = ["-u", "-m", "phalanx.launch.worker", plan.request.script, *plan.request.script_args]
    started = time.perf_counter()
    try:
        quiet = not plan.config.launch.verbose
        with _environ(env), _quiet_elastic(quiet), _preemption_handler(plan.run_dir, plan.config.faults.preempt_grace):
            elastic_launch(config, entrypoint=sys.executable)(*args)
    except ChildFailedError as failure:
        return report_failure(plan.run_dir, failure)
    except SignalException as sig:
        if sig.sigval == signal.SIGTERM:
            return report_preemption(plan.run_dir, leaving=plan.rendezvous.elastic)
        print(f"phalanx: stopped by signal {sig.sigval.name}; logs in {plan.run_dir / 'logs'}", file=sys.stderr)
        return 128 + int(sig.sigval)
    except Exception as err:  # noqa: BLE001 - an elastic job's end; anything else goes on up
        code = _elastic_end(plan, err)
        if code is None:
            raise
        return code
    finally:
        os.environ.pop(ENV_ATTEMPT, None)  # set per round by an elastic job's rendezvous
    if plan.config.launch.verbose:
        print(f"phalanx: finished in {time.perf_counter() - started:.1f}s", flush=True)
    return 0


def _elastic_end(plan: LaunchPlan, err: Exception) -> int | None:
    """The exit code and line for how an elastic job's rendezvous ended it; None: not one of those."""
    if not plan.rendezvous.elastic:
        return None
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousConnectionError

    from phalanx.launch.elastic import JobFailed, JobStopped, NodesLost

    if isinstance(err, JobFailed):
        return report_failure(plan.run_dir, err.failure)
    if isinstance(err, (NodesLost, JobStopped)):
        print(str(err), file=sys.stderr, flush=True)
        return 1
    if isinstance(err, RendezvousClosedError):
        print(
            "phalanx: the job's rendezvous is closed: the job ended (finished, or failed on another node) before this "
            "node could join it again; see the first node's output",
            file=sys.stderr,
            flush=True,
        )
        return 1
    if isinstance(err, RendezvousConnectionError):
        print(
            f"phalanx: lost the rendezvous at {plan.rendezvous.endpoint}: the node that hosts it is gone, and the job "
            "cannot re-form without it; launch every node again (it resumes from the latest checkpoint)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return None


def new_run_dir(root: Path, name: str) -> Path:
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
def _preemption_handler(run_dir: Path, grace: float) -> Iterator[None]:
    """SIGTERM (a scheduler pre-empting the job): leave a marker that tells the workers it is a
    pre-emption, then let the agent pass SIGTERM on and wait ``grace`` seconds for them."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    marker = run_dir / markers.PREEMPT_REQUEST

    def handler(signum, frame):
        if marker.exists():
            return  # a second SIGTERM: the workers already have their orders
        marker.write_text(f"{time.time()}\n", encoding="utf-8")
        print(
            "phalanx: SIGTERM: every rank checkpoints at the end of its step and stops "
            f"(faults.preempt_grace {grace:g} s)",
            file=sys.stderr,
            flush=True,
        )
        raise SignalException(f"Process {os.getpid()} got signal: SIGTERM", sigval=signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
