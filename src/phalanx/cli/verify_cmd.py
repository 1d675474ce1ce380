"""``phalanx verify``."""

from __future__ import annotations

import argparse

from phalanx.cli import options
from phalanx.verify import TOLERANCE, VerifyOptions, plain_script_lines, run_verify, uses_phalanx
from phalanx.verify.report import summary, table


def register(commands) -> None:
    verify = commands.add_parser(
        "verify",
        help="prove on your script that N processes train like one, and that a resume changes nothing",
        description=(
            "Run SCRIPT for a few optimizer steps at 1 process and at N, on CPU processes, with the same global "
            "batch and seed, and compare every weight after every step; then resume the N-process run from its "
            "middle step and compare again. Exit 0 when both hold to the tolerance, 1 when not (the first step "
            "and tensor that differ, and the likely causes), 2 when it cannot run. "
            "Options go before SCRIPT; everything after it is passed to the script."
        ),
    )
    verify.add_argument("--nproc", type=int, default=2, metavar="N", help="processes to compare with one (default 2)")
    verify.add_argument(
        "--steps", type=int, default=8, metavar="K", help="optimizer steps per run; the resume is at K/2 (default 8)"
    )
    verify.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        metavar="T",
        help=f"largest relative difference of a weight tensor that counts as equal (default {TOLERANCE:g}, for fp32)",
    )
    verify.add_argument(
        "--fp64",
        action="store_true",
        help="compare in float64 (precision.mode fp64: weights, buffers and inputs), where fp32 rounding that a "
        "deep network amplifies cannot look like a difference",
    )
    options.add_config(verify, "for every run")
    options.add_set(verify, "for every run")
    verify.add_argument(
        "--run-dir", metavar="DIR", help="keep the runs (logs, weights, checkpoints) under DIR (default: not kept)"
    )
    verify.add_argument("script", help="the Python training script (it must train through phalanx.Session)")
    verify.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    verify.set_defaults(run=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    if not uses_phalanx(args.script):
        for line in plain_script_lines(args.script):
            print(line)
        return 2
    result = run_verify(
        VerifyOptions(
            script=args.script,
            script_args=tuple(args.script_args),
            nproc=args.nproc,
            steps=args.steps,
            tolerance=args.tolerance,
            config_file=args.config,
            overrides=tuple(args.overrides),
            run_dir=args.run_dir,
            fp64=args.fp64,
        ),
        say=lambda line: print(line, flush=True),
    )
    for line in [*table(result), *summary(result)]:
        print(line)
    if result.directory is not None:
        print(f"phalanx: verify: the runs are in {result.directory}")
    return result.exit_code
