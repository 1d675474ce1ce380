"""Starting the contenders' workers, one process launch at a time or several at once (``start``,
then ``finish``), and collecting what they wrote.

raw DDP, Accelerate and Fabric start under torchrun (``python -m torch.distributed.run
--standalone``), phalanx under ``phalanx launch``; every launch gets the same malloc thresholds
(STEADY_MALLOC) and OMP_NUM_THREADS (phalanx's rule: the machine's cores divided by the
processes) and runs in a fresh directory of
its own, with its output in ``launch.log`` there. A launch that fails, times out or writes no
result is recorded with the reason, and the benchmark goes on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from peers import turns

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent


# glibc's malloc hands a freed heap top back to the system once it passes a threshold that it moves
# as the process frees large blocks, so whether a step's tensors come back as fresh pages (thousands
# of page faults a step, 5-8 ms on a 60 ms step) depends on the order of each process's earlier
# allocations: one launch ran 10% slower than another with the same code. Fixed thresholds keep the
# freed memory for the next step in every launch alike (glibc reads them at start; others ignore them).
STEADY_MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


@dataclass(frozen=True)
class Contender:
    name: str
    label: str  # for tables and charts
    launcher: str  # "torchrun" | "phalanx"
    script: str
    # phalanx config entries (dotted keys), passed in a config file, on top of the contender's file
    settings: tuple[tuple[str, object], ...] = ()
    needs: str | None = None  # module that must be importable (benchmark-only dependencies)
    # The compare.py option that gives this contender its config file (one file for all tasks, or
    # one per task); without it the contender does not run.
    config_option: str | None = None
    # (config key, Task attribute): entries that differ per time-to-target task
    task_settings: tuple[tuple[str, str], ...] = ()
    # (compare.py option, config key): an entry taken from another contender's file, where it has
    # one for the task; nothing else of that file reaches this contender.
    borrows: tuple[tuple[str, str], ...] = ()


class NoConfigFile(Exception):
    """A contender that runs from a config file was given none (for this task)."""


CONTENDERS = {
    c.name: c
    for c in (
        Contender("raw", "raw DDP", "torchrun", "raw_ddp.py"),
        Contender("phalanx", "phalanx defaults", "phalanx", "phalanx_run.py"),
        Contender(
            "phalanx-preset",
            "phalanx preset=throughput",
            "phalanx",
            "phalanx_run.py",
            settings=(("preset", "throughput"),),
        ),
        Contender("accelerate", "Accelerate", "torchrun", "accelerate_run.py", needs="accelerate"),
        Contender("fabric", "Lightning Fabric", "torchrun", "fabric_run.py", needs="lightning_fabric"),
        # A config `phalanx tune` wrote (the default objective, throughput), and one it wrote with
        # `--objective time`; each file is this contender's alone.
        Contender(
            "phalanx-tuned", "phalanx tuned (throughput)", "phalanx", "phalanx_run.py", config_option="--tuned-config"
        ),
        Contender("phalanx-time", "phalanx tuned (time)", "phalanx", "phalanx_run.py", config_option="--time-config"),
        Contender(
            "phalanx-adaptive",
            "phalanx adaptive",
            "phalanx",
            "phalanx_run.py",
            settings=(("batch.adaptive", "goodput"),),
            task_settings=(("batch.adapt_every", "adapt_every"),),
            # The memory a forward may use, as `phalanx tune` found it: batch.adaptive joins
            # micro-batches up to that size when it grows the batch (docs/goodput.md).
            borrows=(("--tuned-config", "batch.max_micro_batch_size"),),
        ),
        # phalanx defaults with a scheduled batch warm-up (batch.schedule per task), the robust
        # mode: no noise scale; forwards join micro-batches up to the tuned limit, as adaptive's do.
        Contender(
            "phalanx-schedule",
            "phalanx scheduled",
            "phalanx",
            "phalanx_run.py",
            task_settings=(("batch.schedule", "schedule"),),
            borrows=(("--tuned-config", "batch.max_micro_batch_size"),),
        ),
    )
}


@dataclass
class Outcome:
    contender: str
    nproc: int
    repeat: int
    wall_s: float  # the whole launch, process start to exit
    result: dict | None  # the worker's result file, None when it failed
    error: str | None  # why it failed
    exit_code: int | None
    log: str
    unit: str | None = None  # the time-to-target task it ran


def missing_dependency(contender: Contender) -> str | None:
    if contender.needs and importlib.util.find_spec(contender.needs) is None:
        return f"{contender.needs} is not installed (pip install -e '.[peers]')"
    return None


def threads_per_process(nproc: int) -> int:
    """What `phalanx launch` gives each CPU process: the cores shared out, at least one."""
    from phalanx.topology import cpu_count  # the cores this process may use, as phalanx counts them

    return max(1, cpu_count() // nproc)


def command(
    contender: Contender, nproc: int, run_dir: Path, worker_args: list[str], config_file: str | None
) -> list[str]:
    script = str(HERE / contender.script)
    args = ["--contender", contender.name, "--result", str(run_dir / "result.json"), *worker_args]
    if contender.launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            script,
            *args,
        ]
    cmd = [
        sys.executable,
        "-m",
        "phalanx",
        "launch",
        "--cpu",
        "--nproc",
        str(nproc),
        "--run-dir",
        str(run_dir / "runs"),
    ]
    if config_file:
        cmd += ["--config", str(Path(config_file).resolve())]
    return [*cmd, script, *args]


def contender_file(contender: Contender, files: dict[str, dict[str | None, str]], task: str | None) -> str | None:
    """The file the contender's own option gave, for ``task`` (``files``: option -> {task or None
    for every task: path}); None for a contender that takes none. Raises NoConfigFile when its
    option was not given, or names no file for this task."""
    if contender.config_option is None:
        return None
    given = files.get(contender.config_option) or {}
    path = given.get(task, given.get(None))
    if path is None:
        raise NoConfigFile(
            f"{contender.name}: skipped, no {contender.config_option} given"
            if not given
            else f"{contender.name}: skipped on {task}, {contender.config_option} names no file for it"
        )
    return path


def config_file(
    contender: Contender,
    files: dict[str, dict[str | None, str]] | None,
    directory: Path,
    task: object | None = None,
) -> str | None:
    """The config file a phalanx contender launches with: its own file (``contender_file``; a
    contender's file never reaches another) with the contender's entries and ``task``'s (a
    targets.Task, or None) on top, written as YAML; None when there is nothing to set."""
    name = getattr(task, "name", None)
    own = contender_file(contender, files or {}, name)
    entries = [*contender.settings, *((key, getattr(task, attr)) for key, attr in contender.task_settings if task)]
    if contender.launcher != "phalanx" or not (entries or own):
        return None
    import yaml

    from phalanx.config.loader import read_file  # YAML or TOML, as phalanx reads it
    from phalanx.config.sections import flatten

    for option, key in contender.borrows:
        given = (files or {}).get(option) or {}
        source = given.get(name, given.get(None))
        value = flatten(read_file(source) or {}).get(key) if source else None
        if value is not None:
            entries.append((key, value))
    tree = dict(read_file(own) or {}) if own else {}
    for key, value in entries:
        *sections, last = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[last] = value
    path = directory / (f"{contender.name}-{name}.yaml" if name else f"{contender.name}.yaml")
    path.write_text(yaml.safe_dump(tree, sort_keys=False), encoding="utf-8")
    return str(path)


@dataclass
class Running:
    """A launch under way (``start``), until ``finish`` collects it."""

    contender: Contender
    nproc: int
    repeat: int
    run_dir: Path
    proc: subprocess.Popen
    token: str
    started: float
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None


def start(
    contender: Contender,
    nproc: int,
    repeat: int,
    run_dir: Path,
    worker_args: list[str],
    *,
    config_file: str | None = None,
    env: dict[str, str] | None = None,
) -> Running:
    """Starts one launch in the background; ``env``: entries added to its environment."""
    run_dir.mkdir(parents=True)
    log = run_dir / "launch.log"
    # torch elastic starts each worker in a session of its own, out of reach of a signal to the
    # launcher's group; this token in their environment finds them if they outlive the launch.
    token = f"phalanx-compare-{uuid.uuid4().hex}"
    environ = {**os.environ, "OMP_NUM_THREADS": str(threads_per_process(nproc)), "PHALANX_COMPARE_LAUNCH": token}
    environ.update(STEADY_MALLOC)
    environ.update(env or {})
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCHMARKS), environ.get("PYTHONPATH", "")) if p)
    cmd = command(contender, nproc, run_dir, worker_args, config_file)
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n", encoding="utf-8")
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=run_dir,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=environ,
            start_new_session=True,
        )
    return Running(contender, nproc, repeat, run_dir, proc, token, time.perf_counter(), log)


def stop(running: Running) -> None:
    """Kills whatever is left of the launch (also on Ctrl-C): nothing of it outlives it."""
    _kill_group(running.proc)
    _kill_carriers(running.token)


def finish(running: Running, *, timeout: float) -> Outcome:
    """Waits for the launch (at most ``timeout`` seconds from its start), then reads its result."""
    error = None
    try:
        running.proc.wait(timeout=max(0.0, timeout - (time.perf_counter() - running.started)))
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout:.0f} s"
    finally:
        stop(running)
    proc, log = running.proc, running.log
    wall = time.perf_counter() - running.started
    result_file = running.run_dir / "result.json"
    result = (
        json.loads(result_file.read_text(encoding="utf-8")) if result_file.is_file() and proc.returncode == 0 else None
    )
    if result is None and error is None:
        error = f"exit code {proc.returncode}: {failure_reason(log)}"
    name = running.contender.name
    return Outcome(name, running.nproc, running.repeat, wall, result, error, proc.returncode, str(log))


def launch(
    contender: Contender,
    nproc: int,
    repeat: int,
    run_dir: Path,
    worker_args: list[str],
    *,
    timeout: float,
    config_file: str | None = None,
) -> Outcome:
    running = start(contender, nproc, repeat, run_dir, worker_args, config_file=config_file)
    return finish(running, timeout=timeout)


@dataclass(frozen=True)
class Spec:
    """One launch of ``launch_together``."""

    contender: Contender
    run_dir: Path
    worker_args: list[str]
    config_file: str | None = None


def launch_together(specs: list[Spec], nproc: int, repeat: int, directory: Path, *, timeout: float) -> list[Outcome]:
    """Every launch started at once; they take turns (peers/turns.py), so one runs at a time and
    each turn's steps are seconds from the others' of the same round. ``directory``: the turns'
    files (new). ``timeout``: a launch's whole time, and the longest a turn may take."""
    directory.mkdir(parents=True)
    env = {turns.ENV: str(directory)}
    launches: dict[str, Running] = {}
    conductor = turns.Conductor(directory, {spec.contender.name: nproc for spec in specs})  # before the workers
    try:
        for spec in specs:
            launches[spec.contender.name] = start(
                spec.contender, nproc, repeat, spec.run_dir, spec.worker_args, config_file=spec.config_file, env=env
            )
        names = list(launches)
        shift = repeat % len(names)
        conductor.run(
            lambda round_: turns.rotation(names[shift:] + names[:shift], round_),
            lambda name: launches[name].alive(),
            turn_timeout=timeout,
            on_stuck=lambda name: stop(launches[name]),
        )
        return [finish(running, timeout=timeout) for running in launches.values()]
    finally:  # also on Ctrl-C: nothing of these launches outlives them
        for running in launches.values():
            stop(running)
        conductor.close()


def end_on_sigterm() -> None:
    """SIGTERM ends a driver through its clean-up, as Ctrl-C does: no launch of it outlives it."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _kill_carriers(token: str) -> None:
    """SIGKILL every process whose environment holds ``token``: only this launch's processes."""
    needle = token.encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def failure_reason(log: Path) -> str:
    """phalanx's own one-line error when there is one, else the exception that ended a worker."""
    lines = [line.strip() for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("phalanx: error:"):
            return line.removeprefix("phalanx: error:").strip()[:400]
    for line in reversed(lines):
        head = line.split(":", 1)[0].split(" ")[-1]
        # torchrun's own ChildFailedError only says that a worker failed; the worker says why.
        if head.endswith(("Error", "Exception", "Interrupt")) and ":" in line and "ChildFailedError" not in head:
            return line[:400]
    return lines[-1][:400] if lines else "no output"
