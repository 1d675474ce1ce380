"""What a training framework costs per optimizer step (issue 26): the same MLP, sized for steps of
about 1, 3, 10, 30 and 100 ms, trained by a hand-written loop (raw DDP; a plain loop at one
process), phalanx with its defaults (the README's loop: ``session.progress``, ``accumulate``,
``backward``), Hugging Face Accelerate and Lightning Fabric, at 1 and 2 processes.

Each launch trains every step size in turn (peers/common.py times each optimizer step, data
loading included, after untimed warm-up steps); launches alternate between contenders and the
order rotates each repeat (reversed every other one), so drift in the machine's load favours no
one; a second launch of the raw loop ("raw loop again") shows what this machine's noise alone
makes of a ratio. A launch's figure is
its median step time; the table gives the median over repeats, the ratio to raw in the same
repeat (median, and min-max over repeats) and the extra milliseconds per step. The verdict
checks issue 26's targets: phalanx within 1% of raw at 10 ms steps and within 3% at 1 ms, and no
slower than Accelerate or Fabric at any size.

    .venv/bin/python benchmarks/overhead.py --out docs      # about 10 min on 2 cores
    .venv/bin/python benchmarks/overhead.py --quick          # a smoke run: 1 repeat, few steps
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sections  # noqa: E402
from peers import driver  # noqa: E402
from peers.workloads import STEP_SIZES, WORKLOADS  # noqa: E402

TITLE = "## Per-step overhead: phalanx, Accelerate and Fabric against a hand-written loop (issue 26)"
TARGETS = {10: 0.01, 1: 0.03}  # step size (ms) -> the most phalanx may add


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, STEP_SIZES)), help="step sizes in ms")
    parser.add_argument("--nproc-list", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--contenders",
        default="raw,raw-again,phalanx,accelerate,fabric",
        help="raw-again: the raw loop in a launch of its own, whose ratio to raw is this machine's noise",
    )
    parser.add_argument("--quick", action="store_true", help="1 repeat of a few steps (a smoke run)")
    parser.add_argument(
        "--blocks", type=int, default=8, help="taking turns: the blocks (turns) each step size's timed steps take"
    )
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="launch the contenders one after another instead of all at once, taking turns",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    sections.add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.blocks < 1:
        parser.error(f"--blocks must be at least 1, got {args.blocks}")
    driver.end_on_sigterm()
    sizes = [int(s) for s in args.sizes.split(",")]
    unknown = [s for s in sizes if s not in STEP_SIZES]
    if unknown:
        parser.error(f"--sizes: no workload for {unknown} ms; choose from {sorted(STEP_SIZES)}")
    nprocs = [int(n) for n in args.nproc_list.split(",")]
    names = args.contenders.split(",")
    again = dataclasses.replace(driver.CONTENDERS["raw"], name="raw-again", label="raw loop again")
    known = {**driver.CONTENDERS, "raw-again": again}
    unknown_names = [n for n in names if n not in known]
    if unknown_names:
        parser.error(f"--contenders: unknown {unknown_names}; choose from {sorted(known)}")
    contenders = [known[n] for n in names]
    printed = sections.Printed()
    say = printed.say
    for contender in contenders:
        missing = driver.missing_dependency(contender)
        if missing:
            say(f"{contender.name}: skipped, {missing}")
    contenders = [c for c in contenders if driver.missing_dependency(c) is None]
    if "raw" not in [c.name for c in contenders]:
        parser.error("--contenders must include raw: every ratio is to it")
    repeats = 1 if args.quick else args.repeats
    workloads = ",".join(f"step-{s}ms" for s in sizes)
    worker_args = ["--workloads", workloads, *(["--tiny"] if args.quick else [])]
    together = not args.one_at_a_time
    if together:
        worker_args += ["--blocks", str(args.blocks)]

    # (contender, nproc, ms) -> {repeat: figures to pair}: taking turns, the median step of each
    # turn (paired with raw's turn of the same round); one at a time, the launch's median step.
    figures_by: dict[tuple[str, int, int], dict[int, list[float]]] = {}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="phalanx-overhead-") as tmp:
        for repeat in range(repeats):
            for nproc in nprocs:
                run = _together if together else _one_at_a_time
                for outcome in run(contenders, nproc, repeat, Path(tmp), worker_args, args.timeout):
                    measured = (outcome.result or {}).get("workloads", {})
                    for ms in sizes:
                        figure = measured.get(f"step-{ms}ms", {})
                        values = figure.get("block_medians_s") if together else None
                        if not values and figure.get("step_time_median_s") is not None:
                            values = [figure["step_time_median_s"]]
                        if values:
                            figures_by.setdefault((outcome.contender, nproc, ms), {})[repeat] = values
                    status = "ok" if outcome.error is None else outcome.error
                    print(f"repeat {repeat + 1}/{repeats}, {nproc} proc, {outcome.contender}: {status}", flush=True)
                    if outcome.error is not None:
                        where = f"{outcome.contender} at {nproc} processes, repeat {repeat + 1}"
                        failures.append(f"{where}: {outcome.error}")

    figures = report(say, figures_by, contenders, nprocs, sizes, repeats, together)
    for failure in failures:
        say(f"- failed: {failure}")
    if args.out:
        how = (
            f"every contender launched at once, taking turns of {args.blocks} blocks per step size (peers/turns.py)"
            if together
            else "contenders launched one at a time, interleaved and rotated"
        )
        settings = f"{repeats} repeats, {how}; per launch, every step size in turn; " + "; ".join(
            f"{ms} ms: {WORKLOADS[f'step-{ms}ms'].title}" for ms in sizes
        )
        sections.write_section(
            Path(args.out),
            "step_overhead",
            TITLE,
            script=__file__,
            argv=argv,
            settings=settings,
            lines=printed.lines,
            figures=figures,
        )
    return 1 if failures else 0


def _one_at_a_time(contenders: list, nproc: int, repeat: int, tmp: Path, worker_args: list[str], timeout: float):
    """Launch after launch, rotated each repeat and reversed every other one, so that no contender
    always follows the same one (a launch can leave the machine warmer or colder for the next)."""
    shift = (repeat + nproc) % len(contenders)
    order = contenders[shift:] + contenders[:shift]
    for contender in reversed(order) if repeat % 2 else order:
        run_dir = tmp / f"{contender.name}-{nproc}-{repeat}"
        config = driver.config_file(contender, None, tmp)
        yield driver.launch(contender, nproc, repeat, run_dir, worker_args, timeout=timeout, config_file=config)


def _together(contenders: list, nproc: int, repeat: int, tmp: Path, worker_args: list[str], timeout: float):
    specs = [
        driver.Spec(c, tmp / f"{c.name}-{nproc}-{repeat}", worker_args, driver.config_file(c, None, tmp))
        for c in contenders
    ]
    return driver.launch_together(specs, nproc, repeat, tmp / f"turns-{nproc}-{repeat}", timeout=timeout)


def _paired(ours: dict[int, list[float]], raw: dict[int, list[float]]) -> list[tuple[float, float]]:
    """(ours, raw) per round of every repeat both have: each contender's figure beside raw's,
    measured next to it (the same round of turns, or the launch beside it)."""
    return [pair for repeat in sorted(set(ours) & set(raw)) for pair in zip(ours[repeat], raw[repeat]) if pair[1]]


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def report(
    say, figures_by: dict, contenders: list, nprocs: list[int], sizes: list[int], repeats: int, together: bool
) -> dict:
    others = [c for c in contenders if c.name != "raw"]
    figures: dict = {}
    verdicts: list[str] = []
    for nproc in nprocs:
        say(f"### {nproc} process{'es' if nproc > 1 else ''}")
        say()
        head = ["step size", "raw loop: ms per step"] + [f"{c.label}: ratio (range), extra ms" for c in others]
        say("| " + " | ".join(head) + " |")
        say("|" + " --- |" * len(head))
        for ms in sizes:
            raw = figures_by.get(("raw", nproc, ms), {})
            measured = [v for values in raw.values() for v in values]
            if not measured:
                say(f"| {ms} ms | failed |" + " |" * len(others))
                continue
            raw_ms = statistics.median(measured) * 1e3
            cells = [f"{ms} ms", f"{raw_ms:.2f}"]
            for contender in others:
                pairs = _paired(figures_by.get((contender.name, nproc, ms), {}), raw)
                if not pairs:
                    cells.append("failed")
                    continue
                ratios = [a / b for a, b in pairs]
                ratio = statistics.median(ratios)
                low, high = _quartiles(ratios) if together else (min(ratios), max(ratios))
                extra = statistics.median([(a - b) * 1e3 for a, b in pairs])
                cells.append(f"{ratio:.3f} ({low:.3f}-{high:.3f}), {extra:+.3f}")
                figures.setdefault(str(nproc), {}).setdefault(str(ms), {})[contender.name] = {
                    "ratio": ratio,
                    "ratios": ratios,
                    "extra_ms": extra,
                    "raw_ms": raw_ms,
                }
            say("| " + " | ".join(cells) + " |")
        say()
        verdicts += _verdicts(figures.get(str(nproc), {}), nproc, others)
    say("Targets (issue 26), on the medians:")
    for line in verdicts:
        say(f"- {line}")
    say()
    if together:
        say(
            f"A ratio is the median, over every round of turns ({repeats} launches of all contenders at once, each "
            "step size in blocks taken in turn), of a contender's median step in its turn over the raw loop's in "
            "the same round; the range is the middle half of those rounds (quartiles). The raw loop's second "
            "launch (raw loop again) runs the same program, so its ratio is what noise alone gives."
        )
    else:
        say(
            f"A ratio is a contender's median step time over the raw loop's in the same repeat ({repeats} repeats); "
            "the range is over repeats, so a difference inside it is noise; the raw loop's second launch (raw loop "
            "again) runs the same program, so its ratio is what noise alone gives."
        )
    return figures


def _verdicts(rows: dict, nproc: int, others: list) -> list[str]:
    out = []
    for ms, allowed in sorted(TARGETS.items(), reverse=True):
        phalanx = rows.get(str(ms), {}).get("phalanx")
        if phalanx is None:
            continue
        met = phalanx["ratio"] <= 1 + allowed
        out.append(
            f"{nproc} proc, {ms} ms steps: phalanx {phalanx['ratio']:.3f}x raw, "
            f"{'within' if met else 'OVER'} the {allowed:.0%} allowed"
        )
    for ms, row in sorted(rows.items(), key=lambda kv: int(kv[0])):
        if "phalanx" not in row:
            continue
        slower = [
            f"{c.label} {row[c.name]['ratio']:.3f}x{_rounds_won(row[c.name]['ratios'], row['phalanx']['ratios'])}"
            for c in others
            if c.name in row
            and c.name not in ("phalanx", "raw-again")
            and row[c.name]["ratio"] < row["phalanx"]["ratio"]
        ]
        if slower:
            ours = row["phalanx"]["ratio"]
            out.append(f"{nproc} proc, {ms} ms steps: phalanx {ours:.3f}x, faster: {', '.join(slower)}")
    return out


def _rounds_won(theirs: list[float], ours: list[float]) -> str:
    """In how many rounds the other was the faster, where the rounds pair up: near half of them
    says the difference of the medians is noise."""
    if len(theirs) != len(ours) or len(ours) < 2:
        return ""
    won = sum(a < b for a, b in zip(theirs, ours))
    return f" (faster in {won} of {len(ours)} rounds)"


if __name__ == "__main__":
    sys.exit(main())
