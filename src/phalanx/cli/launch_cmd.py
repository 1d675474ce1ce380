"""``phalanx launch`` and ``phalanx demo``."""

from __future__ import annotations

import argparse
import re

from phalanx.cli import options
from phalanx.launch.launcher import LAUNCH_FLAGS, LaunchRequest, launch
from phalanx.metrics.profile import profile_overrides


def _add_launch_options(parser: argparse.ArgumentParser) -> None:
    # Each flag but --config, --set and the --profile pair is a shorthand for --set launch.<key>=VALUE.
    parser.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="processes per node (default: one per visible GPU; 2 on a CPU-only machine)",
    )
    parser.add_argument(
        "--gpus", metavar="LIST", help="GPU indices to use, e.g. 0,2 (indices into CUDA_VISIBLE_DEVICES when it is set)"
    )
    parser.add_argument("--cpu", action="store_true", help="run CPU processes on gloo even when GPUs are present")
    options.add_config(parser)
    options.add_set(parser)
    parser.add_argument(
        "--ranks",
        choices=["0", "all"],
        help="terminal shows rank 0's output (0, default) or every rank's, prefixed [rank N] (all)",
    )
    parser.add_argument(
        "--run-dir", metavar="DIR", help="parent directory of the run directory (default: launch.run_dir, 'runs')"
    )
    parser.add_argument("--verbose", action="store_true", help="also show torch elastic's own log lines")
    parser.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="launch even when `phalanx check` finds an error in the script (as --set launch.check=false)",
    )
    parser.add_argument(
        "--profile",
        metavar="steps=A:B",
        help=(
            "torch.profiler trace of optimizer steps A to B-1, into <run dir>/profile/ "
            "(as --set train.profile=steps=A:B)"
        ),
    )
    parser.add_argument("--profile-ranks", metavar="LIST", help="ranks that --profile traces, e.g. 0,1 (default 0)")
    faults = parser.add_argument_group("faults and multi-node (docs/faults.md, docs/multinode.md)")
    faults.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        help=(
            "restart the job up to N times after a failure, resuming from the latest checkpoint "
            "(default: launch.max_restarts, 0)"
        ),
    )
    faults.add_argument(
        "--nnodes",
        type=_node_count,
        metavar="N|MIN:MAX",
        help="machines in the job (default 1); MIN:MAX: an elastic job, nodes may leave and join (docs/multinode.md)",
    )
    faults.add_argument("--node-rank", type=int, metavar="I", help="this machine's index 0..N-1, with --master")
    faults.add_argument(
        "--master",
        metavar="HOST:PORT",
        help="node 0's address and a free port on it (static rendezvous, as torchrun's --master-addr/--master-port)",
    )
    faults.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="torch elastic c10d rendezvous endpoint; node ranks are assigned on arrival",
    )
    faults.add_argument(
        "--rdzv-id",
        metavar="ID",
        help="job id every node passes with --rdzv-endpoint (default: SLURM_JOB_ID, else 'phalanx')",
    )


def register(commands) -> None:
    launch_parser = commands.add_parser(
        "launch",
        help="run a training script on every device (torchrun-compatible)",
        description=(
            "Run SCRIPT on every device of this machine through torch's elastic launcher. "
            "Options go before SCRIPT; everything after it is passed to the script."
        ),
    )
    _add_launch_options(launch_parser)
    launch_parser.add_argument("script", help="the Python training script")
    launch_parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    launch_parser.set_defaults(run=_run_launch)

    demo = commands.add_parser(
        "demo",
        help="train the built-in digits CNN on every device",
        description=(
            "Train a small CNN on the built-in UCI digits on every device and report test accuracy and samples/s."
        ),
    )
    _add_launch_options(demo)
    demo.add_argument("--epochs", type=int, metavar="N", help="training epochs (default 12)")
    demo.set_defaults(run=_run_demo)


def _request(args: argparse.Namespace, script: str, script_args: list[str], name: str | None = None) -> LaunchRequest:
    return LaunchRequest(
        script=script,
        script_args=script_args,
        config_file=args.config,
        overrides=[*args.overrides, *profile_overrides(args.profile, args.profile_ranks)],  # the flags win over --set
        name=name,
        check=args.check,
        **{key: getattr(args, key) for key in LAUNCH_FLAGS},  # the request turns them into launch.* lines
    )


def _run_launch(args: argparse.Namespace) -> int:
    return launch(_request(args, args.script, list(args.script_args)))


def _run_demo(args: argparse.Namespace) -> int:
    from phalanx.demo import TRAIN_SCRIPT

    extra = ["--epochs", str(args.epochs)] if args.epochs else []
    return launch(_request(args, TRAIN_SCRIPT, extra, name="demo"))


def _node_count(text: str) -> int | str:
    """``4`` a number, ``1:4`` a node range (checked with launch.nnodes's rules)."""
    return int(text) if re.fullmatch(r"\s*[-+]?[0-9]+\s*", text) else text
