"""The end-of-run summary, built from the step records of every rank (see docs/metrics.md)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from statistics import median
from typing import Any, Iterable

from phalanx.metrics.straggler import WARMUP_STEPS, find_straggler

FLOPS_FILE = "flops.json"


def read_records(metrics_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """``rank<N>.jsonl`` files by rank, each sorted by step; a step recorded twice (a restarted
    rank appends) keeps its last record, and an unreadable line (a rank killed mid-write) is skipped."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(metrics_dir.glob("rank*.jsonl")):
        by_step: dict[int, dict[str, Any]] = {}
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
                by_step[int(record["step"])] = record
            except (ValueError, KeyError, TypeError):
                continue
        if by_step:
            out[int(next(iter(by_step.values()))["rank"])] = [by_step[s] for s in sorted(by_step)]
    return out


def read_flops(metrics_dir: Path) -> dict[str, Any] | None:
    path = metrics_dir / FLOPS_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between the nearest values like numpy's default."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def warmup_for(steps: int) -> int:
    """Steps left out of the statistics: the first few, while at least two remain."""
    return WARMUP_STEPS if steps >= WARMUP_STEPS + 2 else 0


def summarize(records: dict[int, list[dict[str, Any]]], flops: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The summary as a JSON-ready dict; None when no rank recorded at least 2 steps."""
    if not records or max(len(r) for r in records.values()) < 2:
        return None
    world = len(records)
    on_device = all(r.get("device_work") is not None for recs in records.values() for r in _kept(recs))
    rows = [_rank_row(rank, recs, flops, world, on_device) for rank, recs in sorted(records.items())]
    work = {rank: {r["step"]: _work(r, on_device) for r in recs} for rank, recs in records.items()}
    straggler = find_straggler(work)
    mfus = [row["mfu"] for row in rows if row["mfu"] is not None]
    # The lowest rank's last step that has one: the estimate is the same on every rank.
    last = next((recs[-1] for _, recs in sorted(records.items()) if recs), {})
    return {
        "world_size": world,
        "steps": max(row["steps"] for row in rows),
        "warmup_steps_left_out": warmup_for(max(row["steps"] for row in rows)),
        "ranks": rows,
        "straggler": asdict(straggler) if straggler else None,
        "work_from": "device" if on_device else "host",
        "flops_per_sample": flops.get("flops_per_sample") if flops else None,
        "peak_flops_per_s": flops.get("peak_flops_per_s") if flops else None,
        "mfu": median(mfus) if mfus else None,
        "noise_scale": last.get("noise_scale"),
        "global_batch": last.get("samples"),
    }


def write_summary(summary: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(summary, indent=2) + "\n")


def _kept(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return recs[warmup_for(len(recs)) :]


def _work(record: dict[str, Any], on_device: bool) -> float:
    """A rank's own work in a step (metrics/straggler.py): on CUDA the device's, where every rank
    measured it; the host's otherwise, which on CUDA mixes in its waits for the other ranks."""
    device = record.get("device_work") if on_device else None
    return device if device is not None else record["step_time"] - record.get("sync_time", 0.0)


def _rank_row(
    rank: int, recs: list[dict[str, Any]], flops: dict[str, Any] | None, world: int, on_device: bool = False
) -> dict[str, Any]:
    kept = _kept(recs)
    times = [r["step_time"] for r in kept]
    rates = [r["samples_per_s"] for r in kept if r.get("samples_per_s") is not None]
    losses = [r["loss"] for r in recs if r.get("loss") is not None]
    peaks = [r["peak_mem_bytes"] for r in recs if r.get("peak_mem_bytes") is not None]
    rate = median(rates) if rates else None
    mfu = None
    if rate is not None and flops and flops.get("flops_per_sample") and flops.get("peak_flops_per_s"):
        # samples_per_s counts every rank's samples; each rank drives one device.
        mfu = flops["flops_per_sample"] * rate / (world * flops["peak_flops_per_s"])
    total = sum(times)
    return {
        "rank": rank,
        "steps": len(recs),
        "samples_per_s": rate,
        "step_time_p50": percentile(times, 50),
        "step_time_p90": percentile(times, 90),
        "step_time_max": max(times),
        "work_p50": percentile([_work(r, on_device) for r in kept], 50),
        "data_wait_p50": percentile([r["data_wait"] for r in kept], 50),
        "data_wait_share": sum(r["data_wait"] for r in kept) / total if total > 0 else 0.0,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "peak_mem_bytes": max(peaks) if peaks else None,
        "mfu": mfu,
    }
