"""A check's verdict, the parts that produce them, the printed table and the JSON document."""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

PASS, FAIL, UNAVAILABLE = "pass", "FAIL", "n/a"


@dataclass
class Check:
    """One measured figure against its stated tolerance. ``passed`` None: the path could not be
    exercised here (a phalanx without the feature), with the reason in ``figure``."""

    name: str
    passed: bool | None
    figure: str
    tolerance: str
    values: dict = field(default_factory=dict)

    @property
    def status(self) -> str:
        return UNAVAILABLE if self.passed is None else PASS if self.passed else FAIL


@dataclass
class Part:
    name: str
    budget_s: float  # what it is designed to take on one H200
    run: Callable[[], list[Check]]
    covers: str  # the CUDA path, for the JSON and docs/gpu-status.md


@dataclass
class PartResult:
    name: str
    covers: str
    budget_s: float
    seconds: float
    checks: list[Check]
    not_run: bool = False  # left out by run.py --time-limit

    @property
    def over_budget(self) -> bool:
        return self.seconds > self.budget_s


def skipped_part(part: Part, reason: str) -> PartResult:
    return PartResult(part.name, part.covers, part.budget_s, 0.0, [Check("not run", None, reason, "-")], True)


def run_part(part: Part) -> PartResult:
    """Run one part; a crash becomes a failed check, so the later parts still run."""
    started = time.perf_counter()
    try:
        checks = part.run()
    except Exception as err:  # noqa: BLE001 - every failure is reported, none stops the script
        checks = [Check("crashed", False, one_line(err), "runs to the end")]
    try:
        reset_device()
    except Exception as err:  # noqa: BLE001
        checks.append(Check("clean-up after the part", False, one_line(err), "the device is usable afterwards"))
    return PartResult(part.name, part.covers, part.budget_s, time.perf_counter() - started, checks)


def one_line(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:300]}"


def reset_device() -> None:
    """What one part leaves must not change the next one's figures: a process group, a memory
    fraction, cached blocks, the peak counter."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def print_table(header: str, results: list[PartResult]) -> None:
    rows = [(f"{r.name}: {c.name}", c.status, c.figure) for r in results for c in r.checks]
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{header}")
    for name, status, figure in rows:
        print(f"{name:<{width}}  {status:4s}  {figure}")
    print()
    for r in (r for r in results if not r.not_run):
        late = f"  OVER its {r.budget_s:.0f}s budget" if r.over_budget else ""
        print(f"{r.name:<20} {r.seconds:6.1f}s (budget {r.budget_s:.0f}s){late}")


def write_json(path: Path, facts: dict, results: list[PartResult]) -> None:
    document = {
        **facts,
        "passed": all(c.passed is not False for r in results for c in r.checks),
        "parts": [
            {
                "name": r.name,
                "covers": r.covers,
                "budget_s": r.budget_s,
                "seconds": round(r.seconds, 2),
                "over_budget": r.over_budget,
                "not_run": r.not_run,
                "checks": [asdict(c) | {"status": c.status} for c in r.checks],
            }
            for r in results
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
