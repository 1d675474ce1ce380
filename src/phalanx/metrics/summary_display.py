"""How the summary is shown: a rich table per rank and the straggler verdict after a launch, one
line for a single process run without the launcher."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.metrics.straggler import SLOW_FACTOR, SLOW_SHARE
from phalanx.metrics.summary import read_flops, read_records, summarize, write_summary
from phalanx.runtime.noise_scale import describe

if TYPE_CHECKING:
    from rich.table import Table

# Above this share of step time spent waiting for data the summary says what to do about it.
DATA_WAIT_HINT = 0.10


def report_run(run_dir: Path) -> dict[str, Any] | None:
    """After a successful launch: summarise ``<run dir>/metrics``, write ``summary.json``, print it,
    and say where profile traces are."""
    metrics = run_dir / "metrics"
    try:
        summary = summarize(read_records(metrics), read_flops(metrics)) if metrics.is_dir() else None
    except (KeyError, TypeError, ValueError) as err:  # records some other writer left: the run itself succeeded
        print(f"phalanx: no run summary: a record in {metrics} lacks a field or value ({err!r})", flush=True)
        summary = None
    if summary is not None:
        # rich only once there is a table to draw: the launcher imports this module at start-up.
        from rich.console import Console

        write_summary(summary, run_dir / "summary.json")
        console = Console() if sys.stdout.isatty() else Console(width=120)
        console.print(headline(summary), highlight=False)
        console.print(summary_table(summary))
        for line in [*verdict(summary), data_wait_hint(summary), noise_line(summary)]:
            if line:
                console.print(line, highlight=False, soft_wrap=True)
    traces = sorted((run_dir / "profile").glob("rank*.json"))
    if traces:
        print(f"phalanx: profile traces: {', '.join(map(str, traces))}", flush=True)
    return summary


def headline(summary: dict[str, Any]) -> str:
    left_out = summary["warmup_steps_left_out"]
    return f"phalanx: {summary['steps']} steps on {summary['world_size']} rank(s)" + (
        f"; the first {left_out} are left out as warm-up" if left_out else ""
    )


def summary_table(summary: dict[str, Any]) -> Table:
    from rich.table import Table

    rows = summary["ranks"]
    table = Table()
    columns = ["rank", "steps", "samples/s", "step p50", "p90", "max", "work p50", "data wait", "loss first → last"]
    memory = any(r["peak_mem_bytes"] is not None for r in rows)
    mfu = any(r["mfu"] is not None for r in rows)
    columns += ["peak memory"] * memory + ["MFU"] * mfu
    for name in columns:
        table.add_column(name, justify="left" if name.startswith("loss") else "right")
    straggler = (summary["straggler"] or {}).get("rank")
    for r in rows:
        cells = [
            str(r["rank"]),
            str(r["steps"]),
            f"{r['samples_per_s']:,.0f}" if r["samples_per_s"] is not None else "-",
            _ms(r["step_time_p50"]),
            _ms(r["step_time_p90"]),
            _ms(r["step_time_max"]),
            _ms(r["work_p50"]),
            f"{100 * r['data_wait_share']:.0f}%",
            _losses(r) if r["loss_first"] is not None else "-",
        ]
        cells += [_gib(r["peak_mem_bytes"])] * memory + [
            f"{100 * r['mfu']:.0f}%" if r["mfu"] is not None else "-"
        ] * mfu
        table.add_row(*cells, style="bold red" if r["rank"] == straggler else None)
    return table


def verdict(summary: dict[str, Any]) -> list[str]:
    """The straggler line (several ranks only)."""
    if summary["world_size"] < 2:
        return []
    found = summary["straggler"]
    if found is None:
        return [
            f"phalanx: no straggler: no rank's own work was over {SLOW_FACTOR - 1:.0%} above the others' "
            f"in {SLOW_SHARE:.0%} of the steps"
        ]
    rows = {r["rank"]: r for r in summary["ranks"]}
    mine = rows[found["rank"]]
    others = sorted(r["data_wait_p50"] for rank, r in rows.items() if rank != found["rank"])
    # On CUDA the work is the device's time before the sync (summary.py): the host's waits mix in the peers'.
    measured = "device time before" if summary.get("work_from") == "device" else "step time outside"
    line = (
        f"phalanx: straggler: rank {found['rank']}: its own work ({measured} the gradient sync) "
        f"was over {SLOW_FACTOR - 1:.0%} above the other ranks' in {found['slow_share']:.0%} "
        f"of {found['steps']} steps, by {_ms(found['excess_s'])} a step (median)"
    )
    wait_excess = mine["data_wait_p50"] - others[len(others) // 2]
    if wait_excess >= found["excess_s"] / 2:
        line += f"; mostly waiting for its data loader ({_ms(mine['data_wait_p50'])} a step)"
    return [line]


def data_wait_hint(summary: dict[str, Any]) -> str | None:
    """Advice when some rank spent more than :data:`DATA_WAIT_HINT` of its step time waiting for data."""
    worst = max(summary["ranks"], key=lambda r: r["data_wait_share"])
    share = worst["data_wait_share"]
    if share <= DATA_WAIT_HINT:
        return None
    who = f"rank {worst['rank']} spent" if summary["world_size"] > 1 else "the run spent"
    return (
        f"phalanx: the input pipeline holds training back: {who} {100 * share:.0f}% of its step time waiting for data; "
        "raise data.num_workers or run `phalanx tune`"
    )


def noise_line(summary: dict[str, Any]) -> str | None:
    """What the gradient noise scale says about this run's global batch (docs/goodput.md)."""
    noise, batch = summary.get("noise_scale"), summary.get("global_batch")
    if not noise or not batch:
        return None
    return "phalanx: " + describe(batch, noise)


def one_line(summary: dict[str, Any]) -> str:
    """A single process's summary at ``session.close()``."""
    r = summary["ranks"][0]
    parts = [f"{r['steps']} steps"]
    if r["samples_per_s"] is not None:
        parts.append(f"{r['samples_per_s']:,.0f} samples/s")
    parts.append(f"step {_ms(r['step_time_p50'])} p50 / {_ms(r['step_time_p90'])} p90 / {_ms(r['step_time_max'])} max")
    parts.append(f"data wait {100 * r['data_wait_share']:.0f}%")
    if r["loss_first"] is not None:
        parts.append(f"loss {_losses(r)}")
    if r["peak_mem_bytes"] is not None:
        parts.append(f"peak memory {_gib(r['peak_mem_bytes'])}")
    if r["mfu"] is not None:
        parts.append(f"MFU {100 * r['mfu']:.0f}%")
    return "phalanx: " + ", ".join(parts)


def _ms(seconds: float) -> str:
    # One unit for every time, so a column compares at a glance.
    return f"{seconds * 1e3:,.1f} ms"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _losses(row: dict[str, Any]) -> str:
    return f"{row['loss_first']:.4g} → {row['loss_last']:.4g}"
