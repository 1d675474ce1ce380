"""``phalanx tune``."""

from __future__ import annotations

import argparse

from phalanx.cli.console import console
from phalanx.tune.report import TABLE_NOTE, tune_table
from phalanx.tune.runner import TuneFailed, TuneOptions, parse_search, run_tune


def register(commands) -> None:
    tune = commands.add_parser(
        "tune",
        help="short trial runs: largest micro-batch that fits, loader workers, DDP bucket size; writes the winners into the config",
        description=(
            "Run short trainings of SCRIPT (or the demo) through `phalanx launch` to find, for this machine, the largest micro-batch "
            "that fits in device memory, the loader workers that stop the data wait and the DDP bucket size; print every trial "
            "and write the winners into the config file (phalanx.yaml, or --config; the previous version is kept as FILE.bak). "
            "Options go before SCRIPT; everything after it is passed to the script. See docs/tune.md."
        ),
    )
    tune.add_argument("--demo", action="store_true", help="tune the built-in digits demo instead of a script")
    tune.add_argument("--nproc", type=int, metavar="N", help="processes (default: what `phalanx launch` would use)")
    tune.add_argument("--config", metavar="FILE", help="config file the trials read and the winners go into (default: ./phalanx.yaml, created when absent)")
    tune.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override one config value for every trial (repeatable; not written)")
    tune.add_argument("--memory-cap", metavar="SIZE", help="memory each rank may use, e.g. 2GiB (train.memory_cap for the trials; on CPU this is what limits memory)")
    tune.add_argument("--steps", type=int, default=20, metavar="N", help="optimizer steps per trial, warm-up included (default 20)")
    tune.add_argument("--warmup", type=int, default=5, metavar="N", help="first steps of each trial left out of its figures (default 5)")
    tune.add_argument("--max-micro-batch", type=int, metavar="N", help="largest micro-batch to try (default: the global batch per process; with --allow-global-batch 8 times that)")
    tune.add_argument("--allow-global-batch", action="store_true", help="let the global batch grow past the script's (then the learning-rate scaling is written too)")
    tune.add_argument("--search", metavar="LIST", help="stages to run, from micro-batch,workers,bucket (default: all three)")
    tune.add_argument("--dry-run", action="store_true", help="run the trials and print the choice, but write nothing")
    tune.add_argument("--run-dir", metavar="DIR", help="parent of the tune directory (default: launch.run_dir, 'runs')")
    tune.add_argument("--cpu", action="store_true", help="run CPU processes on gloo even when GPUs are present")
    tune.add_argument("script", nargs="?", help="the Python training script (it must train through phalanx.Session)")
    tune.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    tune.set_defaults(run=_run_tune)


def _run_tune(args: argparse.Namespace) -> int:
    options = TuneOptions(
        script=args.script,
        script_args=tuple(args.script_args),
        demo=args.demo,
        nproc=args.nproc,
        config_file=args.config,
        overrides=tuple(args.overrides),
        memory_cap=args.memory_cap,
        steps=args.steps,
        warmup=args.warmup,
        max_micro_batch=args.max_micro_batch,
        allow_global_batch=args.allow_global_batch,
        search=parse_search(args.search),
        dry_run=args.dry_run,
        cpu=args.cpu,
        run_dir=args.run_dir,
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
        comments = "" if w.comments_kept else "; its comments could not be kept (flow-style YAML): they are in the backup"
        print(f"phalanx: wrote {settings} into {w.path} ({kept}{comments}); trials in {result.directory}")
    return 0
