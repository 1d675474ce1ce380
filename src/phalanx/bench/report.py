"""What bench writes and prints: the machine facts, bench.json and the table."""

from __future__ import annotations

import datetime
import platform

import torch
from rich.table import Table

from phalanx.bench.scaling import Scaling
from phalanx.diagnose.facts import torch_gpus
from phalanx.topology import cpu_count
from phalanx.util.units import format_bytes
from phalanx.version import __version__

SPLIT_METHOD = (
    "data wait is measured (time each rank waited for its loader; a step counts its longest-waiting rank); "
    "compute is the 1-device run's step time minus its data wait, assumed unchanged at N devices because "
    "every run keeps the same micro-batch per device; communication wait is step time - compute - data wait, "
    "at least 0, so it also holds whatever else slowed a step (a straggler, processes contending for CPU cores "
    "or memory bandwidth)"
)

SPLIT_NOTE = (
    "step split: data wait is measured; compute is the 1-device step time minus its data wait; "
    "comm wait is the rest of the step (at least 0)."
)


def machine_facts() -> dict:
    gpus, _ = torch_gpus()
    return {
        "cpu": cpu_model(),
        "cpus_usable": cpu_count(),
        "gpus": [g.name for g in gpus],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "phalanx": __version__,
        "os": platform.platform(),
    }


def machine_label(machine: dict, device: str) -> str:
    if device == "cuda" and machine["gpus"]:
        return f"{machine['gpus'][0]}, torch {machine['torch']}"
    return f"{machine['cpu']} ({machine['cpus_usable']} cores), torch {machine['torch']}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or "unknown"


def bench_json(
    rows: list[Scaling], *, command: str, device: str, settings: dict, runs: dict[int, str], reading: str, machine: dict
) -> dict:
    """``runs``: run directory per device count."""
    return {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": device,
        "machine": machine,
        "settings": settings,
        "split_method": SPLIT_METHOD,
        "runs": [
            {
                "nproc": row.nproc,
                "run_dir": runs.get(row.nproc),
                "global_batch": row.run.global_batch,
                "steps_measured": row.run.steps,
                "samples_per_s": row.run.samples_per_s,
                "speedup": row.speedup,
                "efficiency": row.efficiency,
                "step_time_s": row.run.step_time,
                "compute_s": row.compute,
                "comm_wait_s": row.comm_wait,
                "data_wait_s": row.run.data_wait,
                "peak_mem_bytes": row.run.peak_mem_bytes,
            }
            for row in rows
        ],
        "reading": reading,
    }


def bench_table(rows: list[Scaling], *, units: str) -> Table:
    table = Table(title="phalanx bench: medians over the measured steps of each run", title_justify="left")
    memory = any(row.run.peak_mem_bytes for row in rows)  # CPU runs record none
    for name in (
        units,
        "global batch",
        "samples/s",
        "speed-up",
        "efficiency",
        "step",
        "compute",
        "comm wait",
        "data wait",
        *(["peak memory"] if memory else []),
    ):
        table.add_column(name, justify="right")
    for row in rows:
        cells = [
            str(row.nproc),
            str(row.run.global_batch),
            f"{row.run.samples_per_s:,.0f}",
            f"{row.speedup:.2f}x",
            f"{row.efficiency:.0%}",
            ms(row.run.step_time),
            ms(row.compute),
            ms(row.comm_wait),
            ms(row.run.data_wait),
        ]
        table.add_row(*cells, *([format_bytes(row.run.peak_mem_bytes)] if memory else []))
    return table


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"
