"""``phalanx bench``."""

from __future__ import annotations

import argparse

from phalanx.bench.chart import CHART_HINT
from phalanx.bench.report import SPLIT_NOTE, bench_table
from phalanx.bench.runner import BenchOptions, run_bench
from phalanx.cli.console import console


def register(commands) -> None:
    bench = commands.add_parser(
        "bench",
        help="scaling report: short runs on 1..N devices, samples/s, efficiency, step-time split, chart",
        description=(
            "Run short trainings of SCRIPT (or the demo) on 1, 2, ..., N devices through `phalanx launch`, then report samples/s, "
            "scaling efficiency and where each step's time goes, into <run dir>/<stamp>-bench/bench.json and bench.png. "
            "Options go before SCRIPT; everything after it is passed to the script."
        ),
    )
    bench.add_argument("--demo", action="store_true", help="bench the built-in digits demo instead of a script")
    bench.add_argument("--nproc-list", metavar="LIST", help="device counts to run, e.g. 1,2,4 (default: 1 to what `phalanx launch` would use; 1 is always added)")
    bench.add_argument("--steps", type=int, default=30, metavar="N", help="optimizer steps per run, warm-up included (default 30)")
    bench.add_argument("--warmup", type=int, default=5, metavar="N", help="first steps of each run left out of the figures (default 5)")
    bench.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override one config value for every run (repeatable)")
    bench.add_argument("--config", metavar="FILE", help="YAML or TOML config file (default: ./phalanx.yaml when present)")
    bench.add_argument("--run-dir", metavar="DIR", help="parent of the bench directory (default: launch.run_dir, 'runs')")
    bench.add_argument("--cpu", action="store_true", help="run CPU processes on gloo even when GPUs are present")
    bench.add_argument("script", nargs="?", help="the Python training script (it must train through phalanx.Session)")
    bench.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    bench.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    options = BenchOptions(
        script=args.script,
        script_args=tuple(args.script_args),
        demo=args.demo,
        nproc_list=args.nproc_list,
        steps=args.steps,
        warmup=args.warmup,
        overrides=tuple(args.overrides),
        config_file=args.config,
        run_dir=args.run_dir,
        cpu=args.cpu,
    )
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
