"""phalanx side by side with a raw PyTorch DDP loop, Accelerate and Lightning Fabric.

Throughput (the default): the same workloads (a communication-bound 3.4M-parameter MLP, a small
conv net, a small GPT), with the same seeds, data, sample order, global batch and threads per
process, under each contender, on 1 and 2 processes; launches alternate between contenders, and
each figure is the median of the repeats, with its ratio to raw DDP in the same run, scaling
efficiency and the final held-out loss.

Time to target (--time-to-target): how long each contender takes to reach a held-out accuracy on
the digits demo, the MLP with teacher labels and the small GPT on Markov tokens (next-token
accuracy), from one invocation: the raw loop at naive settings (micro-batch per process, the task's
learning rate unscaled), phalanx defaults, phalanx with the config `phalanx tune` wrote for
throughput (--tuned-config) and with the one `phalanx tune --objective time` wrote (--time-config),
phalanx defaults with `batch.adaptive: goodput`, and with a scheduled batch warm-up (`batch.schedule`,
per task). Each config file is its contender's alone, one
FILE for every task or task=FILE pairs; a contender whose option is not given is skipped. The
readings say each phalanx contender's ratio to the raw loop and whether issue 13's targets are met.

Both write DIR/benchmarks.json, DIR/benchmarks.md and a chart under DIR/images (default DIR:
docs). Accelerate and Fabric are benchmark-only dependencies: pip install -e '.[peers]'.

    .venv/bin/python benchmarks/compare.py                      # full throughput run, ~10 min on a quiet 2-core machine
    .venv/bin/python benchmarks/compare.py --time-to-target --tuned-config T.yaml --time-config G.yaml  # ~30 min
    .venv/bin/python benchmarks/compare.py --quick --out /tmp/cmp   # smoke run, a few minutes
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from peers import report, summary
from peers.driver import (
    CONTENDERS,
    Outcome,
    Spec,
    config_file,
    end_on_sigterm,
    launch,
    launch_together,
    missing_dependency,
    threads_per_process,
)
from peers.targets import TASKS
from peers.workloads import WORKLOADS
from sections import put_section

THROUGHPUT_CONTENDERS = "raw,phalanx,phalanx-preset,accelerate,fabric"
TARGET_CONTENDERS = "raw,phalanx,phalanx-tuned,phalanx-time,phalanx-adaptive,phalanx-schedule"
CONFIG_OPTIONS = ("--tuned-config", "--time-config")  # the contenders' own config files (driver.Contender)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-to-target", action="store_true", help="time-to-target mode instead of throughput")
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"throughput workloads (default {','.join(WORKLOADS)})"
    )
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"time-to-target tasks (default {','.join(TASKS)})")
    parser.add_argument(
        "--contenders",
        default=None,
        help=f"from {','.join(CONTENDERS)} (default {THROUGHPUT_CONTENDERS}; time to target: {TARGET_CONTENDERS})",
    )
    parser.add_argument("--nproc-list", default=None, help="process counts (default 1,2; time to target: 2)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="launches per contender and process count (default 3; --quick: 1)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per workload (default: each workload's own)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps before them (default: each workload's own)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 repeat, 2 warm-up + 8 timed steps; time to target: 30 s per run",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="the test suite's size: 1 warm-up + 3 timed steps, a small eval batch"
    )
    parser.add_argument(
        "--tuned-config",
        default=None,
        metavar="FILE|TASK=FILE,...",
        help="the phalanx-tuned contender's config (from `phalanx tune`): one file for every task, or one per task "
        "(time to target), e.g. digits=d.yaml,teacher=t.yaml,gpt=g.yaml; without it phalanx-tuned is skipped",
    )
    parser.add_argument(
        "--time-config",
        default=None,
        metavar="FILE|TASK=FILE,...",
        help="the phalanx-time contender's config (from `phalanx tune --objective time`), as --tuned-config",
    )
    parser.add_argument(
        "--targets",
        default=None,
        help="time to target: accuracies per task, e.g. digits=0.98,teacher=0.72,gpt=0.27 (default: each task's own)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="time to target: give up a run after this much training (default 240; --quick: 30)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds before a launch is killed (default 600)")
    parser.add_argument(
        "--turn-seconds",
        type=float,
        default=1.0,
        help="time to target, taking turns: training a turn lasts at least, to the next evaluation (default 1)",
    )
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="launch the contenders one after another (before 2026-12-07) instead of all at once, taking turns",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="where benchmarks.json, benchmarks.md and images/ go (default docs for a whole run; a run of part of "
        "the workloads or tasks, or of fewer steps, goes to a directory of its own unless --out says otherwise)",
    )
    parser.add_argument(
        "--keep-runs",
        default=None,
        metavar="DIR",
        help="keep every launch's directory (log, result, phalanx run dir) under DIR",
    )
    args = parser.parse_args(argv)
    target = args.time_to_target
    # A run of part of the table would replace the whole published section with its part.
    partial = (
        (args.tasks != ",".join(TASKS) if target else args.workloads != ",".join(WORKLOADS))
        or args.quick
        or args.tiny
        or args.steps is not None
        or args.warmup is not None
    )
    args.contenders = (args.contenders or (TARGET_CONTENDERS if target else THROUGHPUT_CONTENDERS)).split(",")
    args.nprocs = [int(n) for n in (args.nproc_list or ("2" if target else "1,2")).split(",")]
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.workloads = args.workloads.split(",")
    args.tasks = args.tasks.split(",")
    if args.quick and not args.tiny:
        args.warmup = 2 if args.warmup is None else args.warmup
        args.steps = 8 if args.steps is None else args.steps
    args.max_seconds = args.max_seconds or (30.0 if args.quick else 240.0)
    args.timeout = args.timeout or 600.0
    if args.turn_seconds < 0:
        parser.error(f"--turn-seconds must be 0 or more, got {args.turn_seconds:g}")
    for name, known, what in (
        (args.contenders, CONTENDERS, "contender"),
        (args.workloads, WORKLOADS, "workload"),
        (args.tasks, TASKS, "task"),
    ):
        unknown = [n for n in name if n not in known]
        if unknown:
            parser.error(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
    try:
        args.targets = (
            {task: float(value) for task, value in (item.split("=") for item in args.targets.split(","))}
            if args.targets
            else {}
        )
    except ValueError:
        parser.error(f"--targets expects task=accuracy pairs such as digits=0.985,teacher=0.8; got {args.targets}")
    if set(args.targets) - set(TASKS):
        parser.error(f"--targets names an unknown task; choose from {', '.join(TASKS)}")
    if target and "raw" not in args.contenders:
        parser.error("time to target compares against the raw loop: keep raw in --contenders")
    args.files = {}
    for option in CONFIG_OPTIONS:
        value = getattr(args, option[2:].replace("-", "_"))
        if value:
            args.files[option] = config_files(value, option, args.tasks if target else None, parser.error)
    args.contenders, args.skipped = runnable(args.contenders, args.files)
    if args.out is None:  # only once the arguments are known good: no directory, no line, for a refused run
        args.out = tempfile.mkdtemp(prefix="phalanx-compare-out-") if partial else "docs"
        if partial:
            print(f"compare: a partial run: its figures go to {args.out}, not docs/ (--out docs puts them there)")
    return args


def config_files(value: str, option: str, tasks: list[str] | None, error) -> dict[str | None, str]:
    """``FILE`` (every task: {None: FILE}) or ``task=FILE,...`` ({task: FILE}), which must name a
    file for every task run; ``tasks`` None: the throughput mode, which takes one file."""
    items = value.split(",")
    pairs = [item.split("=", 1) for item in items]
    if not all(len(pair) == 2 and pair[0] in TASKS for pair in pairs):
        return {None: value}
    if tasks is None:
        error(f"{option} {value}: one config file per task is for --time-to-target; give one FILE")
    files = dict(pairs)
    missing = [task for task in tasks if task not in files]
    if missing:
        error(f"{option} names no file for {', '.join(missing)}; give task=FILE for each task run, or one FILE for all")
    return files


def runnable(contenders: list[str], files: dict) -> tuple[list[str], list[str]]:
    """The contenders that can run, and one line for each one skipped because its config option
    (e.g. --time-config) was not given: not a failure, a contender not asked for."""
    kept, skipped = [], []
    for name in contenders:
        option = CONTENDERS[name].config_option
        if option is not None and option not in files:
            skipped.append(f"{name}: skipped, no {option} given")
        else:
            kept.append(name)
    return kept, skipped


def rotated(items: list[str], k: int) -> list[str]:
    """A B C, then B C A, then C A B: launches alternate, and no contender always goes first."""
    k %= len(items)
    return items[k:] + items[:k]


def run_all(args: argparse.Namespace, scratch: Path, worker_args) -> tuple[list[Outcome], list[str]]:
    """Every launch; returns the outcomes and one line per failure. For each repeat, unit and
    process count the contenders are launched at once and take turns (peers/turns.py), or, with
    --one-at-a-time, one after another in rotated order."""
    outcomes, failures, given_up, configs = [], [], {}, {}
    units = args.tasks if args.time_to_target else [None]
    files = getattr(args, "files", {})
    for name in args.contenders:
        reason = missing_dependency(CONTENDERS[name])
        for unit in units:
            try:
                configs[name, unit] = config_file(CONTENDERS[name], files, scratch, TASKS[unit] if unit else None)
            except Exception as err:  # noqa: BLE001 - an unreadable config file: that contender cannot run
                reason = reason or str(err).splitlines()[0]  # phalanx's own message names the file
        if reason:
            given_up[name] = reason
            failures.append(f"{name}: skipped, {reason}")
    count = 0
    for repeat in range(args.repeats):
        for unit in units:
            for n in args.nprocs:
                specs = []
                for name in rotated(args.contenders, repeat):
                    if name in given_up:  # recorded, so its rows say why
                        outcomes.append(
                            Outcome(name, n, repeat, 0.0, None, f"not run: {given_up[name]}", None, "", unit)
                        )
                        continue
                    count += 1
                    contender = CONTENDERS[name]
                    run_dir = scratch / f"{count:03d}-{name}-x{n}"
                    specs.append(Spec(contender, run_dir, worker_args(contender, unit, n), configs[name, unit]))
                if args.one_at_a_time:
                    ran = (
                        launch(
                            s.contender,
                            n,
                            repeat,
                            s.run_dir,
                            s.worker_args,
                            timeout=args.timeout,
                            config_file=s.config_file,
                        )
                        for s in specs
                    )
                else:
                    turns_dir = scratch / f"{count:03d}-turns-x{n}"
                    ran = launch_together(specs, n, repeat, turns_dir, timeout=args.timeout) if specs else []
                for out in ran:
                    out.unit = unit
                    outcomes.append(out)
                    print(_progress(out, repeat, args.repeats, unit), file=sys.stderr, flush=True)
                    if out.error:
                        log = f" (log: {out.log})" if args.keep_runs else ""
                        failures.append(
                            f"{out.contender} x{n}, repeat {repeat + 1}{f', {unit}' if unit else ''}: {out.error}{log}"
                        )
                        if out.exit_code == 2:  # a usage or config error: the same every time
                            given_up[out.contender] = out.error
    return outcomes, failures


def _progress(out: Outcome, repeat: int, repeats: int, unit: str | None) -> str:
    head = f"repeat {repeat + 1}/{repeats} {out.contender:15s} x{out.nproc} {unit or ''}"
    if out.error:
        return f"{head} FAILED ({out.wall_s:.1f} s): {out.error}"
    if "task" in out.result:
        t = out.result["task"]
        verdict = "reached" if t["reached"] else "missed"
        return f"{head} {verdict} accuracy {t['target_accuracy']:g} in {t['seconds']:.1f} s ({out.wall_s:.1f} s launch)"
    figures = "  ".join(f"{w} {f['samples_per_s']:,.0f}/s" for w, f in out.result["workloads"].items())
    return f"{head} {figures}  ({out.wall_s:.1f} s launch)"


def throughput(args: argparse.Namespace, scratch: Path) -> dict:
    worker_args = ["--workloads", ",".join(args.workloads)]
    if args.tiny:
        worker_args.append("--tiny")
    if args.steps is not None:
        worker_args += ["--steps", str(args.steps)]
    if args.warmup is not None:
        worker_args += ["--warmup", str(args.warmup)]
    outcomes, failures = run_all(args, scratch, lambda contender, unit, n: worker_args)
    rows = summary.throughput_rows(outcomes, args.workloads, args.contenders, args.nprocs)
    return {
        "workloads": args.workloads,
        "rows": rows,
        "launches": summary.launch_rows(outcomes, args.contenders, args.nprocs),
        "readings": summary.readings(rows),
        "failures": failures,
        "settings": f"repeats {args.repeats}; processes {','.join(map(str, args.nprocs))} with "
        f"{', '.join(f'{threads_per_process(n)} thread(s) each at {n}' for n in args.nprocs)}; "
        + ("tiny sizes; " if args.tiny else "")
        + "warm-up/timed steps: "
        f"{args.warmup if args.warmup is not None else 'per workload'}/"
        f"{args.steps if args.steps is not None else 'per workload'}",
    }


def phalanx_lr(contender, cwd: Path, files: dict | None = None) -> tuple[object | None, str | None]:
    """The optim section phalanx resolves for ``contender``, so the raw loop can apply the same
    learning-rate rule by hand; (None, why) when the config does not validate."""
    import phalanx.strategies  # noqa: F401 - they add strategy.ddp, ... to the config (a tuned file sets them)
    from phalanx.config.loader import load_config

    try:
        return load_config(config_file(contender, files, cwd) if contender else None, cwd=cwd).optim, None
    except Exception as err:  # noqa: BLE001 - reported in the report, the run goes on
        return None, str(err).splitlines()[0]


def raw_lr_args(optim, global_batch: int, reference: int) -> list[str]:
    """phalanx's lr rule (phalanx/runtime/lr.py) as the raw loop's LambdaLR arguments: scale, warm-up."""
    from phalanx.runtime.lr import LRScaling

    scaling = LRScaling(optim.lr_scaling, global_batch, reference, optim.warmup_steps, optim.warmup_start_factor)
    start = optim.warmup_start_factor
    if start is None:  # phalanx's default start: the unscaled lr when scaling up, else zero
        start = 1.0 / scaling.scale if scaling.scale > 1 else 0.0
    return ["--lr-scale", repr(scaling.scale), "--warmup-steps", str(optim.warmup_steps), "--warmup-start", repr(start)]


def time_to_target(args: argparse.Namespace, scratch: Path) -> dict:
    # phalanx defaults' rule (no scaling: the naive user's rate), whichever files the other
    # contenders have, so the baseline is the same in every invocation; a tuned config that
    # changes the batch brings its own scaling to its contender.
    optim, why = phalanx_lr(CONTENDERS["phalanx"], scratch)
    notes = []
    if optim is None:
        notes.append(f"phalanx's config did not resolve ({why}); the raw loop keeps the task's learning rate unscaled")

    def worker_args(contender, task: str, n: int) -> list[str]:
        out = ["--task", task, "--max-seconds", str(args.max_seconds), "--turn-seconds", str(args.turn_seconds)]
        if task in args.targets:
            out += ["--target", str(args.targets[task])]
        if contender.launcher == "torchrun" and optim is not None:
            out += raw_lr_args(optim, TASKS[task].micro_batch * n, TASKS[task].reference_batch)
        return out

    outcomes, failures = run_all(args, scratch, worker_args)
    rows = summary.target_rows(outcomes, args.tasks, args.contenders, args.nprocs)
    given = [
        f"{name} from {', '.join(f'{t}={f}' if t else f for t, f in args.files[option].items())}"
        for name in args.contenders
        if (option := CONTENDERS[name].config_option) in args.files
    ]
    return {
        "rows": rows,
        "readings": summary.target_readings(rows) + notes,
        "failures": failures,
        "settings": f"repeats {args.repeats}; processes {','.join(map(str, args.nprocs))}; give up after "
        f"{args.max_seconds:g} s of training; config files: {'; '.join(given) or 'none'}"
        + "".join(f"; {line}" for line in args.skipped),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    end_on_sigterm()
    for line in args.skipped:
        print(f"compare: {line}", file=sys.stderr)
    out = Path(args.out)
    scratch = Path(args.keep_runs) if args.keep_runs else Path(tempfile.mkdtemp(prefix="phalanx-compare-"))
    scratch.mkdir(parents=True, exist_ok=True)
    key = "time_to_target" if args.time_to_target else "throughput"
    try:
        section = time_to_target(args, scratch) if args.time_to_target else throughput(args, scratch)
    finally:
        if not args.keep_runs:
            shutil.rmtree(scratch, ignore_errors=True)
    section.update(
        date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        machine=report.machine(),
        command=" ".join(
            shlex.quote(a)
            for a in [".venv/bin/python", "benchmarks/compare.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    )
    chart = (report.TARGET_CHART if args.time_to_target else report.THROUGHPUT_CHART).format(
        device="cpu"
    )  # CPU processes only
    try:
        (report.target_chart if args.time_to_target else report.throughput_chart)(section, out / chart)
        section["chart"] = chart
    except ImportError:
        print("compare: matplotlib is not installed, so there is no chart (pip install -e '.[peers]')", file=sys.stderr)

    out.mkdir(parents=True, exist_ok=True)
    data_file = out / "benchmarks.json"
    data = json.loads(data_file.read_text(encoding="utf-8")) if data_file.is_file() else {}
    data[key] = section
    data_file.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    lines = report.section_lines(key, section)
    put_section(out / "benchmarks.md", lines[0], "\n".join(lines) + "\n", lambda: report.render(data))
    readings = section["readings"]
    for line in (
        [f"{w}, {line}" for w, lines in readings.items() for line in lines] if isinstance(readings, dict) else readings
    ):
        print(line)
    print(f"wrote {out / 'benchmarks.md'}, {data_file}" + (f", {out / chart}" if "chart" in section else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
