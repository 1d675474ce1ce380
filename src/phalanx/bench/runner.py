"""Runs the bench: one short ``phalanx launch`` per device count (see harness/launching.py), each in its
own run directory under ``<run dir>/<stamp>-bench/``, then the figures, bench.json and bench.png.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from phalanx.bench.chart import have_matplotlib, write_chart
from phalanx.bench.reading import reading
from phalanx.bench.report import bench_json, machine_facts, machine_label
from phalanx.bench.scaling import Scaling, scaling
from phalanx.errors import PhalanxError
from phalanx.harness.figures import RunFigures, measure
from phalanx.harness.launching import TrialOptions, failure_reason, quiet_overrides, stop_note
from phalanx.launch.launcher import new_run_dir, prepare
from phalanx.session.facts import read_run_facts
from phalanx.topology import cpu_count, user_omp_threads


class RunFailed(PhalanxError):
    """A bench run that failed: not bad input, so not exit code 2."""

    exit_code = 1


@dataclass(frozen=True)
class BenchOptions(TrialOptions):
    nproc_list: str | None = None
    steps: int = 30

    def command(self) -> str:
        """The command line that repeats this bench."""
        return self.command_line("bench", first=["--nproc-list", self.nproc_list] if self.nproc_list else [])


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
        raise PhalanxError(
            f"--nproc-list expects comma-separated process counts of at least 1, such as 1,2,4; got '{text}'"
        )
    return sorted(counts | {1})


def run_bench(options: BenchOptions, say: Callable[[str], None] = print) -> BenchResult:
    script, script_args, cap = options.target("bench")
    options.check_steps()
    base = prepare(options.request(script, script_args, None))
    counts = parse_nproc_list(options.nproc_list, base.devices.nproc)
    configured_batch = base.config.batch.global_batch_size
    fixed = base.config.batch.fixed_layout  # or the script says so in code: known after its first run
    for n in counts:  # every count is checked before any process starts
        prepare(options.request(script, script_args, n, _weak_scaling(None if fixed else configured_batch, n)))

    directory = new_run_dir(Path(options.run_dir or base.config.launch.run_dir).resolve(), "bench")
    directory.mkdir(parents=True)
    device = base.devices.kind
    unit, units = ("process", "processes") if device == "cpu" else ("device", "devices")
    say(
        f"phalanx: bench of {'the demo' if options.demo else script} on {', '.join(map(str, counts))} {units}, "
        f"{options.steps} steps each ({options.warmup} warm-up), in {directory}"
    )

    threads = _threads_per_process(device, counts)
    figures: list[RunFigures] = []
    run_dirs: dict[int, str] = {}
    for n in counts:
        batch = figures[0].global_batch if figures and not fixed else None
        overrides = (*quiet_overrides(base.config, directory / f"n{n}"), *_weak_scaling(batch, n))
        name = f"the {n}-{unit} run"
        run_dir, seconds = _run_one(
            options, script, script_args, cap, n, overrides, directory / f"n{n}", name, threads, say
        )
        run_dirs[n] = str(run_dir)
        if not figures and (fixed or _layout_fixed(run_dir)):
            fixed = True
            say(
                "phalanx: the script fixes its batch layout (batch.fixed_layout), so every run keeps its global "
                "batch (strong scaling) instead of growing it with the devices (weak scaling)"
            )
        _check_metrics(run_dir, name)
        figures.append(measure(run_dir, n, options.warmup, f"{name} ({run_dir})", options.steps))
        say(f"phalanx: {name}: {figures[-1].samples_per_s:,.0f} samples/s, {seconds:.0f}s, run dir {run_dir}")

    rows = scaling(figures, strong=fixed)
    text = reading(rows, cpu=device == "cpu", cores=cpu_count(), threads=threads, fixed_layout=fixed)
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
        "scaling": (
            "strong: the script fixes its batch layout; every run keeps the 1-device run's global batch"
            if fixed
            else "weak: every run keeps the 1-device run's micro-batch per device; "
            "the global batch grows with the devices"
        ),
    }
    document = bench_json(
        rows,
        command=options.command(),
        device=device,
        settings=settings,
        runs=run_dirs,
        reading=text,
        machine=machine_facts(),
    )
    (directory / "bench.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    chart = None
    if have_matplotlib():
        chart = directory / "bench.png"
        title = (
            f"phalanx bench, {'demo' if options.demo else Path(script).name}: "
            f"{machine_label(document['machine'], device)}"
        )
        write_chart(rows, chart, title=title, units=units)
    return BenchResult(directory, rows, device, text, chart)


def _threads_per_process(device: str, counts: list[int]) -> int | None:
    """On CPU one process stands for one device only if it gets the same cores at every count: each
    gets cores // largest count, in every run (the launcher would give a lone process them all).
    A value the user exported wins, as it does in the launcher; None leaves the launcher's choice."""
    exported = user_omp_threads()
    if device != "cpu" or exported is not None:
        return int(exported) if exported and exported.isascii() and exported.isdigit() else None
    return max(1, cpu_count() // max(counts))


def _layout_fixed(run_dir: Path) -> bool:
    facts = read_run_facts(run_dir)
    return facts is not None and facts.fixed_layout


def _weak_scaling(batch: int | None, n: int) -> tuple[str, ...]:
    """Same micro-batch per device at every count, so the 1-device compute time holds for each."""
    return (f"batch.global_batch_size={batch * n}",) if batch and n > 1 else ()


def _run_one(
    options: BenchOptions,
    script: str,
    script_args,
    cap: int | None,
    n: int,
    overrides: tuple[str, ...],
    parent: Path,
    name: str,
    threads: int | None,
    say: Callable[[str], None],
) -> tuple[Path, float]:
    parent.mkdir()
    # The environment passes through unread; the launcher takes OMP_NUM_THREADS as the user's.
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    run = options.launch(script, script_args, nproc=n, parent=parent, extra=overrides, cap=cap, env=env)
    note = stop_note(run, name, cap)
    if note:
        say(note)
    if not run.complete:
        reason = failure_reason(run.log)
        raise RunFailed(
            f"{name} failed (exit code {run.returncode}){': ' + reason if reason else ''}; its output is in {run.log}"
        )
    if run.run_dir is None:
        raise RunFailed(f"{name} made no run directory; its output is in {run.log}")
    return run.run_dir, run.seconds


def _check_metrics(run_dir: Path, name: str) -> None:
    if not any((run_dir / "metrics").glob("rank*.jsonl")):
        raise PhalanxError(
            f"{name} ({run_dir}) wrote no metrics/rank<N>.jsonl; bench reads the per-step metrics "
            "that phalanx.Session writes, so the script must train through a Session"
        )
