"""``phalanx env`` and ``phalanx doctor``."""

from __future__ import annotations

import argparse
import json

import phalanx.strategies  # noqa: F401 - they add their own sections (strategy.ddp, ...) to the config
from phalanx.cli import options
from phalanx.cli.console import console
from phalanx.config.loader import load_config
from phalanx.diagnose.doctor import DoctorOptions, run_doctor
from phalanx.diagnose.facts import gather_facts
from phalanx.diagnose.printout import doctor_json, doctor_renderables, env_report, env_text
from phalanx.errors import PhalanxError
from phalanx.topology import LaunchContext


def register(commands) -> None:
    env = commands.add_parser(
        "env",
        help="print this machine's setup for a bug report",
        description=(
            "Print phalanx, Python, torch, OS, CPUs, memory, GPUs, the resolved config "
            "and the distributed environment variables, as one block to paste into a bug report."
        ),
    )
    options.add_config(env)
    options.add_set(env)
    options.add_json(env)
    env.set_defaults(run=_run_env)

    doctor = commands.add_parser(
        "doctor",
        help="check this machine for multi-GPU work and measure all-reduce bandwidth",
        description=(
            "Check GPUs, links, shared memory, limits and environment variables, each with a verdict and a fix, "
            "then measure all-reduce bandwidth between local processes. "
            "Exit code 1 when a check finds a problem."
        ),
    )
    doctor.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="processes for the live check (default: one per GPU; 2 CPU processes without a GPU)",
    )
    doctor.add_argument(
        "--cpu", action="store_true", help="live check on CPU processes (gloo) even when GPUs are present"
    )
    doctor.add_argument(
        "--sizes",
        metavar="LIST",
        help="message sizes for the live check, e.g. 4K,1M,64M (default 4K..64M on CPU, 4K..1G on GPU)",
    )
    doctor.add_argument(
        "--iters", type=int, metavar="N", help="timed iterations per size (default 10 on CPU, 20 on GPU)"
    )
    doctor.add_argument("--no-live", dest="live", action="store_false", help="skip the live all-reduce")
    options.add_json(doctor)
    doctor.set_defaults(run=_run_doctor)


def _run_env(args: argparse.Namespace) -> int:
    facts = gather_facts()
    try:
        config, error = load_config(args.config, overrides=args.overrides, context=LaunchContext()), None
    except PhalanxError as err:  # the rest of the block is still worth pasting
        config, error = None, str(err)
    report = env_report(facts, config, error)
    print(json.dumps(report, indent=2) if args.json else env_text(report))
    return 0


def _run_doctor(args: argparse.Namespace) -> int:
    options = DoctorOptions(live=args.live, nproc=args.nproc, cpu=args.cpu, sizes=args.sizes, iters=args.iters)
    report = run_doctor(options)
    if args.json:
        print(json.dumps(doctor_json(report), indent=2))
    else:
        out = console(width=140)  # the doctor's findings are long: wide pipes and logs
        for part in doctor_renderables(report):
            out.print(part)
    return report.exit_code
