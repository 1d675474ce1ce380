"""``phalanx bench``."""

from __future__ import annotations

import argparse

from phalanx.bench.chart import CHART_HINT
from phalanx.bench.report import SPLIT_NOTE, bench_table
from phalanx.bench.runner import BenchOptions, run_bench
from phalanx.cli.console import console
from phalanx.cli.trial_args import TrialArguments, trial_options


def register(commands) -> None:
    bench = commands.add_parser(
        "bench",
        help="scaling report: short runs on 1..N devices, samples/s, efficiency, step-time split, chart",
        description=(
            "Run short trainings of SCRIPT (or the demo) on 1, 2, ..., N devices through `phalanx launch`, "
            "then report samples/s, scaling efficiency and where each step's time goes, "
            "into <run dir>/<stamp>-bench/bench.json and bench.png. "
            "Options go before SCRIPT; everything after it is passed to the script."
        ),
    )
    shared = TrialArguments(bench, verb="bench", unit="run")
    shared.add("--demo")
    bench.add_argument(
        "--nproc-list",
        metavar="LIST",
        help="device counts to run, e.g. 1,2,4 (default: 1 to what `phalanx launch` would use; 1 is always added)",
    )
    shared.add("--steps", default=30)
    shared.add("--warmup", help="first steps of each run left out of the figures (default 5)")
    shared.add("--set")
    shared.add("--config")
    shared.add("--run-dir")
    shared.add("--cpu")
    shared.add_script()
    bench.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    options = BenchOptions(nproc_list=args.nproc_list, **trial_options(args))
    result = run_bench(options, say=lambda line: print(line, flush=True))
    out = console()
    out.print(bench_table(result.rows, units="processes" if result.device == "cpu" else "devices"))
    out.print(SPLIT_NOTE)
    out.print(result.reading)
    written = ", ".join(p.name for p in (result.directory / "bench.json", result.chart) if p is not None)
    print(f"phalanx: wrote {written} in {result.directory}")
    if result.chart is None:
        print(CHART_HINT)
    return 0
