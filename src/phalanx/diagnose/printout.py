"""What ``phalanx env`` and ``phalanx doctor`` print: JSON-ready dicts, the plain-text block for bug
reports, and rich tables. Built here from facts and results; the CLI only prints them."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from phalanx.config.schema import Config
from phalanx.config.template import scalar
from phalanx.diagnose.allreduce import warmup_for
from phalanx.diagnose.checks import OK, PROBLEM, SKIPPED, STATUSES, WARNING
from phalanx.diagnose.doctor import DoctorReport, LiveResult
from phalanx.diagnose.facts import UNLIMITED, Facts
from phalanx.util.units import format_bytes, format_rate, format_seconds

STYLE = {OK: "green", WARNING: "yellow", PROBLEM: "bold red", SKIPPED: "dim"}


def env_report(facts: Facts, config: Config | None, config_error: str | None = None) -> dict[str, Any]:
    driver = facts.driver
    gpus = driver.gpus or facts.cuda_gpus
    return {
        "phalanx": facts.phalanx,
        "python": {"version": facts.python, "executable": facts.python_executable},
        "torch": {"version": facts.torch, "cuda": facts.torch_cuda or "none", "nccl": facts.nccl or "none"},
        "os": facts.os,
        "cpus": {"usable": facts.cpus_usable, "total": facts.cpus_total},
        "ram": {"total_bytes": facts.ram_bytes, "available_bytes": facts.ram_available_bytes},
        "shm": {"total_bytes": facts.shm_bytes, "free_bytes": facts.shm_free_bytes},
        "open_files": {"soft": _limit(facts.nofile_soft), "hard": _limit(facts.nofile_hard)},
        "gpus": {
            "driver": driver.driver,
            "driver_cuda": driver.driver_cuda,
            "visible_to_torch": len(facts.cuda_gpus),
            "devices": [
                {"index": g.index, "name": g.name, "memory_bytes": g.memory_bytes, "uuid": g.uuid} for g in gpus
            ],
            "note": None if gpus else _no_gpus(facts),
        },
        "config": _config(config, config_error),
        "environment": dict(facts.env),
    }


def _limit(value: int | None) -> int | str | None:
    return "unlimited" if value == UNLIMITED else value


def _no_gpus(facts: Facts) -> str:
    why = facts.driver.notes.get("nvidia-smi", "nvidia-smi gave no answer")
    build = (
        "torch is a CPU build"
        if facts.torch_cuda is None
        else f"torch sees no CUDA device{f': {facts.cuda_error}' if facts.cuda_error else ''}"
    )
    return f"{why}; {build}"


def _config(config: Config | None, error: str | None) -> dict[str, Any]:
    if config is None:
        return {"error": error}
    return {key: {"value": value, "source": config.sources.get(key, "default")} for key, value in config.flat().items()}


def env_text(report: dict[str, Any]) -> str:
    """The report as aligned plain text: pastes cleanly into an issue, unlike a table."""
    torch_ = report["torch"]
    gpus = report["gpus"]
    lines = [
        ("phalanx", report["phalanx"]),
        ("Python", f"{report['python']['version']}, {report['python']['executable']}"),
        ("torch", f"{torch_['version']} (CUDA {torch_['cuda']}, NCCL {torch_['nccl']})"),
        ("OS", report["os"]),
        ("CPUs", f"{report['cpus']['usable']} usable of {report['cpus']['total']}"),
        (
            "RAM",
            (
                f"{format_bytes(report['ram']['total_bytes'])} "
                f"({format_bytes(report['ram']['available_bytes'])} available)"
            ),
        ),
        (
            "/dev/shm",
            "none"
            if report["shm"]["total_bytes"] is None
            else f"{format_bytes(report['shm']['total_bytes'])} ({format_bytes(report['shm']['free_bytes'])} free)",
        ),
        (
            "open files",
            f"{report['open_files']['soft'] or 'unknown'} (hard limit {report['open_files']['hard'] or 'unknown'})",
        ),
        ("GPUs", _gpu_line(gpus)),
    ]
    width = max(len(name) for name, _ in lines) + 2
    text = ["phalanx env: copy everything below into a bug report", ""]
    text += [f"{name:<{width}}{value}" for name, value in lines]
    text += [
        f"{'':<{width}}GPU {d['index']}: {d['name']}, {format_bytes(d['memory_bytes'])}"
        + (f", {d['uuid']}" if d["uuid"] else "")
        for d in gpus["devices"]
    ]
    text += ["", "config (source shown where it is not the default)"]
    config = report["config"]
    if "error" in config:
        text.append(f"  cannot be resolved: {config['error']}")
    else:
        key_width = max(len(key) for key in config) + 2
        text += [
            f"  {key:<{key_width}}{scalar(item['value'])}"
            + ("" if item["source"] == "default" else f"  [{item['source']}]")
            for key, item in config.items()
        ]
    text += ["", "distributed environment variables"]
    text += [f"  {name}={value}" for name, value in report["environment"].items()] or ["  (none set)"]
    return "\n".join(text)


def _gpu_line(gpus: dict[str, Any]) -> str:
    if not gpus["devices"]:
        return f"none ({gpus['note']})"
    driver = f"driver {gpus['driver']} (CUDA {gpus['driver_cuda'] or '?'})" if gpus["driver"] else "driver unknown"
    return f"{len(gpus['devices'])} on the machine, {gpus['visible_to_torch']} visible to torch; {driver}"


def doctor_json(report: DoctorReport) -> dict[str, Any]:
    counts = {status: sum(v.status == status for v in report.verdicts) for status in STATUSES}
    return {
        "checks": [asdict(v) for v in report.verdicts],
        "live": _live_json(report.live) if report.live else None,
        "summary": counts,
        "exit_code": report.exit_code,
    }


def _live_json(live: LiveResult) -> dict[str, Any]:
    return {
        "backend": live.plan.backend,
        "device": "cuda" if live.plan.cuda else "cpu",
        "nproc": live.plan.nproc,
        "iterations": live.plan.iters,
        "link": live.expectation.link,
        "expected_bytes_per_second": live.expectation.bytes_per_second,
        "expectation": live.expectation.note,
        "latency_seconds": live.latency,
        "results": [
            {
                "bytes": r.bytes,
                "seconds": r.seconds,
                "algorithm_bandwidth": r.algorithm_bandwidth,
                "bus_bandwidth": r.bus_bandwidth,
            }
            for r in live.results
        ],
    }


def doctor_renderables(report: DoctorReport) -> list[RenderableType]:
    out: list[RenderableType] = [checks_table(report)]
    if report.live:
        out.append(live_table(report.live))
    out.append(summary_line(report))
    return out


def checks_table(report: DoctorReport) -> Table:
    table = Table(title="phalanx doctor", show_lines=True)
    table.add_column("check", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    table.add_column("finding", ratio=3)
    table.add_column("fix", ratio=2)
    for v in report.verdicts:
        table.add_row(v.check, Text(v.status, style=STYLE[v.status]), v.detail, v.fix or "-")
    return table


def live_table(live: LiveResult) -> Group:
    table = Table(title=f"all-reduce, {live.plan.describe()}")
    for name in ("size", "time", "algorithm bandwidth", "bus bandwidth"):
        table.add_column(name, justify="right")
    for r in live.results:
        table.add_row(
            format_bytes(r.bytes),
            format_seconds(r.seconds),
            format_rate(r.algorithm_bandwidth),
            format_rate(r.bus_bandwidth),
        )
    n = live.plan.nproc
    notes = Text(
        f"{live.plan.iters} timed iterations per size after {warmup_for(live.plan.iters)} warm-up; "
        "time = mean per all-reduce on the slowest rank\n"
        f"latency {format_seconds(live.latency or 0)} (time of the {format_bytes(live.results[0].bytes)} all-reduce)\n"
        f"bus bandwidth = algorithm bandwidth x 2(n-1)/n = x {2 * (n - 1) / n:g} for n = {n}\n"
        f"link: {live.expectation.link}; {live.expectation.note}"
    )
    return Group(table, notes)


def summary_line(report: DoctorReport) -> Text:
    counts = {status: sum(v.status == status for v in report.verdicts) for status in STATUSES}
    text = ", ".join(f"{counts[s]} {s}" for s in STATUSES)
    verdict = "some checks found a problem (exit code 1)" if report.exit_code else "no problem found"
    return Text(f"{text}: {verdict}", style=STYLE[PROBLEM] if report.exit_code else None)
