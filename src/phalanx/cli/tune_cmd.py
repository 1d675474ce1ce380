"""``phalanx tune``."""

from __future__ import annotations

import argparse

from phalanx.cli.console import console
from phalanx.cli.trial_args import TrialArguments, trial_options
from phalanx.tune.report import TABLE_NOTE, tune_table
from phalanx.tune.runner import TuneFailed, TuneOptions, parse_search, run_tune


def register(commands) -> None:
    tune = commands.add_parser(
        "tune",
        help=(
            "short trial runs: largest micro-batch that fits, loader workers, DDP bucket size; "
            "writes the winners into the config"
        ),
        description=(
            "Run short trainings of SCRIPT (or the demo) through `phalanx launch` to find, for this machine, "
            "the largest micro-batch that fits in device memory, the loader workers that stop the data wait "
            "and the DDP bucket size; print every trial and write the winners into the config file "
            "(phalanx.yaml, or --config; the previous version is kept as FILE.bak). "
            "Options go before SCRIPT; everything after it is passed to the script. See docs/tune.md."
        ),
    )
    shared = TrialArguments(tune, verb="tune", unit="trial")
    shared.add("--demo")
    tune.add_argument("--nproc", type=int, metavar="N", help="processes (default: what `phalanx launch` would use)")
    shared.add("--config", also="the trials read it and the winners go into it (created when absent)")
    shared.add("--set", also="for every trial, not written into the file")
    tune.add_argument(
        "--memory-cap",
        metavar="SIZE",
        help="memory each rank may use, e.g. 2GiB (train.memory_cap for the trials; on CPU this is what limits memory)",
    )
    shared.add("--steps", default=20)
    shared.add("--warmup")
    tune.add_argument(
        "--max-micro-batch",
        type=int,
        metavar="N",
        help=(
            "largest micro-batch to try (default: the global batch per process; with --allow-global-batch 8 times that)"
        ),
    )
    tune.add_argument(
        "--allow-global-batch",
        action="store_true",
        help="let the global batch grow past the script's (then the learning-rate scaling is written too)",
    )
    tune.add_argument(
        "--search", metavar="LIST", help="stages to run, from micro-batch,workers,bucket (default: all three)"
    )
    tune.add_argument(
        "--objective",
        choices=("throughput", "time"),
        default="throughput",
        help=(
            "what the micro-batch stage maximises: throughput (samples/s), or time (samples/s x the statistical "
            "efficiency of the global batch, from the gradient noise scale the trials measure; docs/goodput.md)"
        ),
    )
    tune.add_argument("--dry-run", action="store_true", help="run the trials and print the choice, but write nothing")
    shared.add("--run-dir")
    shared.add("--cpu")
    shared.add_script()
    tune.set_defaults(run=_run_tune)


def _run_tune(args: argparse.Namespace) -> int:
    options = TuneOptions(
        nproc=args.nproc,
        memory_cap=args.memory_cap,
        max_micro_batch=args.max_micro_batch,
        allow_global_batch=args.allow_global_batch,
        search=parse_search(args.search),
        dry_run=args.dry_run,
        objective=args.objective,
        **trial_options(args),
    )
    result = run_tune(options, say=lambda line: print(line, flush=True))
    out = console()
    out.print(tune_table(result.trials))
    out.print(TABLE_NOTE)
    for stage in result.stages:
        print(f"phalanx: {stage.summary}")
    for warning in result.warnings:
        print(f"phalanx: warning: {warning}")
    if result.failure is not None:
        raise TuneFailed(f"{result.failure}; nothing written (trials in {result.directory})")
    settings = ", ".join(f"{key}={value}" for key, value in result.values.items())
    if not result.values:
        print(f"phalanx: nothing to write (trials in {result.directory})")
    elif result.written is None:
        print(f"phalanx: --dry-run: would write {settings} into {result.config_path} (trials in {result.directory})")
    else:
        w = result.written
        kept = "previous version in " + str(w.backup) if w.backup else "new file"
        comments = (
            "" if w.comments_kept else "; its comments could not be kept (flow-style YAML): they are in the backup"
        )
        removed = "".join(f"; {key} removed: the limit replaces it" for key in w.removed)
        print(f"phalanx: wrote {settings} into {w.path} ({kept}{comments}{removed}); trials in {result.directory}")
    return 0
