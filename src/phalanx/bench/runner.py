"""Runs the bench: one short ``phalanx launch`` per device count, each in its own run directory
under ``<run dir>/<stamp>-bench/``, then the figures, bench.json and bench.png.

Each run is a ``python -m phalanx launch`` subprocess rather than an in-process launch: its output
(progress, rank 0's prints, failure summaries) goes to its own ``launch.log`` instead of the bench's
table, and a script with no step cap of its own can be stopped like Ctrl-C stops it. The launch
stays in the bench's process group, so a Ctrl-C at the terminal reaches both at once.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from phalanx.bench.chart import have_matplotlib, write_chart
from phalanx.bench.figures import RunFigures, Scaling, read_metrics, run_figures, scaling, steps_recorded
from phalanx.bench.reading import reading
from phalanx.bench.report import bench_json, machine_facts, machine_label
from phalanx.errors import PhalanxError
from phalanx.launch.launcher import LaunchPlan, LaunchRequest, new_run_dir, prepare
from phalanx.topology import cpu_count, user_omp_threads

_POLL_S = 0.25
_INTERRUPT_GRACE_S = 3  # a terminal Ctrl-C reached the launch too; give it this long to notice
_SHUTDOWN_S = 60  # torch elastic gives its workers 30 s after a signal before it kills them


class RunFailed(PhalanxError):
    """A bench run that failed: not bad input, so not exit code 2."""

    exit_code = 1


@dataclass(frozen=True)
class BenchOptions:
    script: str | None = None
    script_args: tuple[str, ...] = ()
    demo: bool = False
    nproc_list: str | None = None
    steps: int = 30
    warmup: int = 5
    overrides: tuple[str, ...] = ()
    config_file: str | None = None
    run_dir: str | None = None
    cpu: bool = False

    def command(self) -> str:
        """The command line that repeats this bench."""
        parts = ["phalanx", "bench"]
        if self.nproc_list:
            parts += ["--nproc-list", self.nproc_list]
        parts += ["--steps", str(self.steps), "--warmup", str(self.warmup)]
        for override in self.overrides:
            parts += ["--set", override]
        if self.config_file:
            parts += ["--config", self.config_file]
        if self.run_dir:
            parts += ["--run-dir", self.run_dir]
        if self.cpu:
            parts.append("--cpu")
        parts += ["--demo"] if self.demo else [self.script or "", *self.script_args]
        return shlex.join(parts)


@dataclass(frozen=True)
class BenchResult:
    directory: Path
    rows: list[Scaling]
    device: str  # "cpu" or "cuda"
    reading: str
    chart: Path | None  # None without matplotlib


def parse_nproc_list(text: str | None, most: int) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; None -> 1..most. The 1-device run is always included: every
    efficiency is measured against it."""
    if text is None:
        return list(range(1, most + 1))
    try:
        counts = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise PhalanxError(f"--nproc-list expects comma-separated process counts such as 1,2,4; got '{text}'") from None
    if not counts or min(counts) < 1:
        raise PhalanxError(f"--nproc-list expects comma-separated process counts of at least 1, such as 1,2,4; got '{text}'")
    return sorted(counts | {1})


def run_bench(options: BenchOptions, say: Callable[[str], None] = print) -> BenchResult:
    script, script_args = _target(options)
    if options.steps < 1 or options.warmup < 0 or options.warmup >= options.steps:
        raise PhalanxError(f"--steps must be at least 1 and above --warmup; got --steps {options.steps} --warmup {options.warmup}")
    base = prepare(_request(options, script, script_args, None, ()))
    counts = parse_nproc_list(options.nproc_list, base.devices.nproc)
    configured_batch = base.config.batch.global_batch_size
    for n in counts:  # every count is checked before any process starts
        prepare(_request(options, script, script_args, n, _weak_scaling(configured_batch, n)))

    directory = new_run_dir(Path(options.run_dir or base.config.launch.run_dir).resolve(), "bench")
    directory.mkdir(parents=True)
    device = base.devices.kind
    unit, units = ("process", "processes") if device == "cpu" else ("device", "devices")
    say(f"phalanx: bench of {'the demo' if options.demo else script} on {', '.join(map(str, counts))} {units}, {options.steps} steps each ({options.warmup} warm-up), in {directory}")

    threads = _threads_per_process(device, counts)
    figures: list[RunFigures] = []
    run_dirs: dict[int, str] = {}
    for n in counts:
        batch = figures[0].global_batch if figures else None
        overrides = (*_quiet_overrides(base, directory / f"n{n}"), *_weak_scaling(batch, n))
        name = f"the {n}-{unit} run"
        run_dir, seconds = _run_one(options, script, script_args, n, overrides, directory / f"n{n}", name, threads)
        run_dirs[n] = str(run_dir)
        figures.append(run_figures(n, read_metrics(_metrics_dir(run_dir, name)), options.warmup, f"{name} ({run_dir})", options.steps))
        say(f"phalanx: {name}: {figures[-1].samples_per_s:,.0f} samples/s, {seconds:.0f}s, run dir {run_dir}")

    rows = scaling(figures)
    text = reading(rows, cpu=device == "cpu", cores=cpu_count(), threads=threads)
    settings = {
        "script": script,
        "script_args": list(script_args),
        "demo": options.demo,
        "nproc_list": counts,
        "steps": options.steps,
        "warmup": options.warmup,
        "config_file": options.config_file,
        "overrides": list(options.overrides),
        "threads_per_process": threads,
        "scaling": "weak: every run keeps the 1-device run's micro-batch per device; the global batch grows with the devices",
    }
    document = bench_json(rows, command=options.command(), device=device, settings=settings, runs=run_dirs, reading=text, machine=machine_facts())
    (directory / "bench.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    chart = None
    if have_matplotlib():
        chart = directory / "bench.png"
        title = f"phalanx bench, {'demo' if options.demo else Path(script).name}: {machine_label(document['machine'], device)}"
        write_chart(rows, chart, title=title, units=units)
    return BenchResult(directory, rows, device, text, chart)


def _target(options: BenchOptions) -> tuple[str, tuple[str, ...]]:
    if options.demo and options.script:
        raise PhalanxError("give either a script or --demo, not both")
    if options.demo:
        from phalanx.demo import TRAIN_SCRIPT

        # The demo ends itself after --steps steps; a script of the user's is stopped from outside.
        return TRAIN_SCRIPT, ("--max-steps", str(options.steps))
    if not options.script:
        raise PhalanxError("give the training script to bench, or --demo for the built-in example")
    return options.script, tuple(options.script_args)


def _request(options: BenchOptions, script: str, script_args, nproc: int | None, extra: tuple[str, ...]) -> LaunchRequest:
    return LaunchRequest(
        script=script,
        script_args=script_args,
        config_file=options.config_file,
        overrides=(*options.overrides, *extra),
        nproc=nproc,
        cpu=options.cpu,
        run_dir=options.run_dir,
    )


def _threads_per_process(device: str, counts: list[int]) -> int | None:
    """On CPU one process stands for one device only if it gets the same cores at every count: each
    gets cores // largest count, in every run (the launcher would give a lone process them all).
    A value the user exported wins, as it does in the launcher; None leaves the launcher's choice."""
    exported = user_omp_threads()
    if device != "cpu" or exported is not None:
        return int(exported) if exported and exported.isdigit() else None
    return max(1, cpu_count() // max(counts))


def _weak_scaling(batch: int | None, n: int) -> tuple[str, ...]:
    """Same micro-batch per device at every count, so the 1-device compute time holds for each."""
    return (f"batch.global_batch_size={batch * n}",) if batch and n > 1 else ()


def _quiet_overrides(base: LaunchPlan, parent: Path) -> tuple[str, ...]:
    """Per-step metrics on (bench reads them); no progress bar (it syncs to read the loss) and no
    profiler; no checkpoints read from or written to the user's checkpoint directory. Each only
    where the config has the key."""
    keys = base.config.flat()
    out = ["train.progress=false"]
    if "train.metrics" in keys:
        out.append("train.metrics=true")
    if "train.profile" in keys:
        out.append("train.profile=null")
    if "checkpoint.resume" in keys:
        out.append("checkpoint.resume=never")
    if "checkpoint.dir" in keys:
        out.append(f"checkpoint.dir={parent / 'checkpoints'}")
    if "checkpoint.save_every" in keys:
        out.append("checkpoint.save_every=null")
    return tuple(out)


def _run_one(options: BenchOptions, script: str, script_args, n: int, overrides: tuple[str, ...], parent: Path, name: str, threads: int | None) -> tuple[Path, float]:
    parent.mkdir()
    command = [sys.executable, "-m", "phalanx", "launch", "--nproc", str(n), "--run-dir", str(parent)]
    if options.cpu:
        command.append("--cpu")
    if options.config_file:
        command += ["--config", options.config_file]
    for override in (*options.overrides, *overrides):
        command += ["--set", override]
    command += [script, *script_args]
    cap = None if options.demo else options.steps
    log = parent / "launch.log"
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        # The environment passes through unread; the launcher takes OMP_NUM_THREADS as the user's.
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        stopped = False
        try:
            while proc.poll() is None:
                if cap is not None and not stopped and _steps_so_far(parent) >= cap:
                    proc.send_signal(signal.SIGINT)  # what Ctrl-C does: the launcher stops its workers
                    stopped = True
                try:
                    proc.wait(timeout=_POLL_S)
                except subprocess.TimeoutExpired:
                    pass
        except KeyboardInterrupt:
            _interrupt(proc)
            raise
    seconds = time.perf_counter() - started
    runs = _run_dirs(parent)
    if proc.returncode != 0 and not (stopped and _steps_so_far(parent) >= cap):
        raise RunFailed(f"{name} failed (exit code {proc.returncode}){_reason(log)}; its output is in {log}")
    if not runs:
        raise RunFailed(f"{name} made no run directory; its output is in {log}")
    return runs[0], seconds


def _run_dirs(parent: Path) -> list[Path]:
    # The launcher names the run directory itself (<stamp>-<script>); it writes config.yaml first.
    return sorted(d for d in parent.iterdir() if (d / "config.yaml").is_file())


def _steps_so_far(parent: Path) -> int:
    runs = _run_dirs(parent)
    return steps_recorded(runs[0] / "metrics") if runs else 0


def _metrics_dir(run_dir: Path, name: str) -> Path:
    metrics = run_dir / "metrics"
    if not any(metrics.glob("rank*.jsonl")):
        raise PhalanxError(
            f"{name} ({run_dir}) wrote no metrics/rank<N>.jsonl; bench reads the per-step metrics "
            "that phalanx.Session writes, so the script must train through a Session"
        )
    return metrics


def _reason(log: Path) -> str:
    """The launcher's own summary of the failure, when it wrote one."""
    lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.startswith("phalanx: ")]
    for line in reversed(lines):
        if line.startswith("phalanx: error: "):
            return ": " + line.removeprefix("phalanx: error: ")
        if " failed first " in line or line.startswith("phalanx: stopped by signal"):
            return ": " + line.removeprefix("phalanx: ")
    return ""


def _interrupt(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=_INTERRUPT_GRACE_S)
        return
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the interrupt came to the bench alone
    try:
        proc.wait(timeout=_SHUTDOWN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
