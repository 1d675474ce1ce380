"""From the launches' results to the figures the report shows: medians, spreads, ratios to raw DDP
in the same invocation, scaling efficiency, readings. Pure functions over JSON-able data."""

from __future__ import annotations

import statistics
from typing import Iterable

from peers.driver import CONTENDERS, Outcome

# The targets, measured here and stated in the readings, never asserted.
WITHIN_RAW = 0.02  # phalanx defaults within 2% of raw DDP samples/s
# Issue 13: phalanx tuned for time or adaptive (issue 26: or scheduled; the best of them) reaches the
# target in at most 0.6x the raw loop's time on every task, and no phalanx contender is above 1.0x on any task.
TIME_TO_TARGET_RATIO = 0.6
NEVER_ABOVE = 1.0
# Issue 26 adds the scheduled batch warm-up (batch.schedule) to the contenders of the 0.6x target.
GOODPUT_CONTENDERS = ("phalanx-time", "phalanx-adaptive", "phalanx-schedule")


def _errors(outcomes: Iterable[Outcome], contender: str, nproc: int) -> list[str]:
    return sorted({o.error for o in outcomes if o.contender == contender and o.nproc == nproc and o.error})


def throughput_rows(
    outcomes: list[Outcome], workloads: list[str], contenders: list[str], nprocs: list[int]
) -> list[dict]:
    rows = []
    for workload in workloads:
        for n in nprocs:
            for name in contenders:
                runs = [o for o in outcomes if o.contender == name and o.nproc == n and o.result]
                figures = [o.result["workloads"][workload] for o in runs if workload in o.result["workloads"]]
                row = {
                    "workload": workload,
                    "contender": name,
                    "label": CONTENDERS[name].label,
                    "nproc": n,
                    "runs": len(figures),
                    "errors": _errors(outcomes, name, n),
                }
                if figures:
                    rates = [f["samples_per_s"] for f in figures]
                    median = statistics.median(rates)
                    row.update(
                        title=figures[0]["title"],
                        global_batch=figures[0]["global_batch"],
                        threads_per_process=runs[0].result["threads_per_process"],
                        samples_per_s=median,
                        samples_per_s_runs=rates,
                        spread=(max(rates) - min(rates)) / median,
                        step_time_ms=1000 * statistics.median(f["step_time_median_s"] for f in figures),
                        final_loss=statistics.median(f["final_loss"] for f in figures),
                        choices=figures[-1]["choices"],
                    )
                rows.append(row)
    _ratios(rows)
    return rows


def _ratios(rows: list[dict]) -> None:
    """Ratio to raw DDP at the same workload and process count, and scaling efficiency against the
    same contender on one process; both None where a figure is missing."""
    by = {(r["workload"], r["contender"], r["nproc"]): r for r in rows}
    for r in rows:
        raw = by.get((r["workload"], "raw", r["nproc"]))
        one = by.get((r["workload"], r["contender"], 1))
        rate = r.get("samples_per_s")
        r["ratio_to_raw"] = rate / raw["samples_per_s"] if rate and raw and raw.get("samples_per_s") else None
        r["scaling_efficiency"] = (
            rate / (r["nproc"] * one["samples_per_s"]) if rate and one and one.get("samples_per_s") else None
        )


def launch_rows(outcomes: list[Outcome], contenders: list[str], nprocs: list[int]) -> list[dict]:
    """Whole-launch wall time (process start to exit, every workload included): start-up cost."""
    rows = []
    for n in nprocs:
        for name in contenders:
            walls = [o.wall_s for o in outcomes if o.contender == name and o.nproc == n and o.result]
            if walls:
                rows.append(
                    {
                        "contender": name,
                        "label": CONTENDERS[name].label,
                        "nproc": n,
                        "wall_s": statistics.median(walls),
                        "launches": len(walls),
                    }
                )
    return rows


def readings(rows: list[dict]) -> dict[str, list[str]]:
    """Per workload, one sentence per process count on phalanx defaults against raw DDP and the peers."""
    out: dict[str, list[str]] = {}
    by = {(r["workload"], r["contender"], r["nproc"]): r for r in rows}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        lines = []
        for n in sorted({r["nproc"] for r in rows if r["workload"] == workload}):
            ph, raw = by.get((workload, "phalanx", n)), by.get((workload, "raw", n))
            if not ph or not raw or ph.get("ratio_to_raw") is None:
                lines.append(
                    f"{n} process{'es' if n > 1 else ''}: no phalanx-against-raw figure (a contender failed or was not "
                    "run)."
                )
                continue
            ratio = ph["ratio_to_raw"]
            spread = (
                f"spread over {ph['runs']} runs: raw {raw['spread']:.0%}, phalanx {ph['spread']:.0%}"
                if min(ph["runs"], raw["runs"]) > 1
                else "one run each, no spread"
            )
            text = (
                f"{n} process{'es' if n > 1 else ''}: phalanx defaults run at {ratio:.3f}x raw DDP's samples/s "
                f"(target: at most 2% slower, {'met' if ratio >= 1 - WITHIN_RAW else 'missed'}; {spread})"
            )
            peers = []
            for peer in ("accelerate", "fabric"):
                other = by.get((workload, peer, n))
                if other and other.get("samples_per_s"):
                    rel = ph["samples_per_s"] / other["samples_per_s"]
                    peers.append(
                        f"{rel:.3f}x {other['label']} (target: not slower, 2% allowed for noise, "
                        f"{'met' if rel >= 1 - WITHIN_RAW else 'missed'})"
                    )
            if peers:
                text += "; against the peers: " + ", ".join(peers)
            losses = [
                r["final_loss"]
                for r in rows
                if r["workload"] == workload and r["nproc"] == n and r.get("final_loss") is not None
            ]
            if len(losses) > 1:
                text += f"; final losses of all contenders {min(losses):.4f} to {max(losses):.4f}"
            lines.append(text + ".")
        out[workload] = lines
    return out


def target_rows(outcomes: list[Outcome], tasks: list[str], contenders: list[str], nprocs: list[int]) -> list[dict]:
    rows = []
    for task in tasks:
        for n in nprocs:
            for name in contenders:
                mine = [o for o in outcomes if o.unit == task]
                runs = [o for o in mine if o.contender == name and o.nproc == n and o.result]
                row = {
                    "task": task,
                    "contender": name,
                    "label": CONTENDERS[name].label,
                    "nproc": n,
                    "runs": len(runs),
                    "errors": _errors(mine, name, n),
                }
                if runs:
                    figures = [o.result["task"] for o in runs]
                    reached = [f for f in figures if f["reached"]]
                    row.update(
                        title=figures[0]["title"],
                        target_accuracy=figures[0]["target_accuracy"],
                        reached=len(reached),
                        seconds=statistics.median(f["seconds"] for f in reached) if reached else None,
                        seconds_runs=[f["seconds"] if f["reached"] else None for f in figures],
                        eval_seconds=statistics.median(f["eval_seconds"] for f in figures),
                        samples=statistics.median(f["samples"] for f in reached) if reached else None,
                        final_accuracy=statistics.median(f["final_accuracy"] for f in figures),
                        launch_wall_s=statistics.median(o.wall_s for o in runs),
                        choices=figures[-1]["choices"],
                        curves=[f["curve"] for f in figures],
                    )
                rows.append(row)
    by = {(r["task"], r["contender"], r["nproc"]): r for r in rows}
    for r in rows:
        raw = by.get((r["task"], "raw", r["nproc"]))
        # Only runs that all reached the target compare: a median over some misses would flatter.
        ok = (
            r.get("seconds")
            and r["reached"] == r["runs"]
            and raw
            and raw.get("seconds")
            and raw["reached"] == raw["runs"]
        )
        r["ratio_to_raw"] = r["seconds"] / raw["seconds"] if ok else None
    return rows


def _no_ratio(r: dict, raw: dict | None) -> str:
    if not raw or not raw.get("seconds") or raw["reached"] != raw["runs"]:
        return "the raw loop has no time to target to compare with"
    if not r["runs"]:
        return "no run finished: " + ("; ".join(r["errors"]) or "no result")
    return f"it reached the target in {r['reached']} of {r['runs']} runs"


def _verdict(met: bool) -> str:
    return "met" if met else "not met"


def target_readings(rows: list[dict]) -> list[str]:
    """Per task and process count: each phalanx contender's ratio to the raw loop with the
    never-above-1.0x verdict, then (when phalanx-time, phalanx-adaptive or phalanx-schedule ran) the
    0.6x verdict for the best of them; then both targets over all tasks. A contender without a ratio (a
    failed launch, a missed target) does not meet a target."""
    lines, fast, capped = [], {}, {}  # (task, n) -> the 0.6x verdict; label -> where it is above the cap
    by = {(r["task"], r["contender"], r["nproc"]): r for r in rows}
    cells = list(dict.fromkeys((r["task"], r["nproc"]) for r in rows))
    goodput_ran = any(r["contender"] in GOODPUT_CONTENDERS for r in rows)
    for task, n in cells:
        raw = by.get((task, "raw", n))
        where = f"{task}, {n} process{'es' if n > 1 else ''}"
        mine = [
            r for r in rows if (r["task"], r["nproc"]) == (task, n) and CONTENDERS[r["contender"]].launcher == "phalanx"
        ]
        for r in mine:
            ratio = r["ratio_to_raw"]
            misses = capped.setdefault(r["label"], [])
            if ratio is None:
                misses.append(f"{task}: no ratio")
                lines.append(
                    f"{where}: {r['label']}: no ratio ({_no_ratio(r, raw)}); never above {NEVER_ABOVE}x: not met."
                )
                continue
            if ratio > NEVER_ABOVE:
                misses.append(f"{task}: {ratio:.2f}x")
            lines.append(
                f"{where}: {r['label']} reaches accuracy {r['target_accuracy']:g} in {ratio:.2f}x the raw DDP loop's "
                f"time ({r['seconds']:.1f} s against {raw['seconds']:.1f} s); never above {NEVER_ABOVE}x: "
                f"{_verdict(ratio <= NEVER_ABOVE)}."
            )
        if not goodput_ran:
            continue
        contenders = [r for r in mine if r["contender"] in GOODPUT_CONTENDERS]
        measured = [r for r in contenders if r["ratio_to_raw"] is not None]
        head = (
            f"{where}: at most {TIME_TO_TARGET_RATIO}x the raw loop's time (phalanx tuned for time, adaptive or "
            "scheduled, the best)"
        )
        if not measured:
            fast[task, n] = False
            why = (
                "none of them ran on this task"
                if not contenders
                else "no ratio for " + " or ".join(r["label"] for r in contenders)
            )
            lines.append(f"{head}: not met, {why}.")
            continue
        best = min(measured, key=lambda r: r["ratio_to_raw"])
        fast[task, n] = best["ratio_to_raw"] <= TIME_TO_TARGET_RATIO
        lines.append(f"{head}: {best['label']} at {best['ratio_to_raw']:.2f}x, {_verdict(fast[task, n])}.")
    tasks = ", ".join(dict.fromkeys(task for task, _ in cells))
    if fast:
        missed = [f"{task} x{n}" for (task, n), ok in fast.items() if not ok]
        lines.append(
            f"over all tasks ({tasks}): at most {TIME_TO_TARGET_RATIO}x on every task: "
            + (f"not met (missed on {', '.join(missed)})." if missed else "met.")
        )
    if capped:
        over = [f"{label} ({', '.join(misses)})" for label, misses in capped.items() if misses]
        lines.append(
            f"over all tasks ({tasks}): never above {NEVER_ABOVE}x for every phalanx contender: "
            + (f"not met, {'; '.join(over)}." if over else "met.")
        )
    return lines
