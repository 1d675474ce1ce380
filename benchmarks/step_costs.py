"""What each of phalanx's per-step features costs (issue 26), in microseconds per optimizer step.

One process, a small MLP (its step is a few hundred microseconds, so phalanx's own work shows),
the README's loop (``session.progress``, ``accumulate``, ``backward``) with a run directory, as
under ``phalanx launch``, so the metrics JSONL and TensorBoard files are written. Every variant
turns one feature off (or, for ``train.memory_cap``, on); the variants and a hand-written loop
alternate within each round, and the figure is each variant's median step over the rounds. What a
feature costs is the defaults' step minus the step without it; what is left with every feature off
is the Session's bookkeeping itself (the porting guards, the step agreement, the calls).

    .venv/bin/python benchmarks/step_costs.py --rounds 7      # about 2 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx

BATCH, WIDTH = 32, 64
ALL_OFF = {"train": {"metrics": False, "progress": False}, "faults": {"hang_timeout": 0}}
VARIANTS = {
    "defaults": {},
    "train.tensorboard: false": {"train": {"tensorboard": False}},
    "train.metrics: false": {"train": {"metrics": False}},
    "train.progress: false": {"train": {"progress": False}},
    "faults.hang_timeout: 0 (no watchdog)": {"faults": {"hang_timeout": 0}},
    "train.memory_cap: 20GiB (on)": {"train": {"memory_cap": "20GiB"}},
    "all of the above off": ALL_OFF,
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))


def _data(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH * steps, 32, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (BATCH * steps,), generator=g))


def raw(data: TensorDataset, skip: int) -> float:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times, last = [], time.perf_counter()
    for x, y in DataLoader(data, batch_size=BATCH, shuffle=True):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return statistics.median(times[skip:])


def with_phalanx(data: TensorDataset, skip: int, sections: dict, run_dir: Path) -> float:
    session = phalanx.Session(**{**sections, "launch": {"run_dir": str(run_dir)}})
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer, loader = session.setup(model, optimizer, DataLoader(data, batch_size=BATCH, shuffle=True))
    times, last = [], time.perf_counter()
    for x, y in session.progress(loader):
        with session.accumulate(model):
            session.backward(F.cross_entropy(model(x), y))
        now = time.perf_counter()
        times.append(now - last)
        last = now
    session.close()
    return statistics.median(times[skip:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one thread: less noise from the other core's load
    data, skip = _data(args.steps), args.steps // 10
    medians: dict[str, list[float]] = {"raw loop": [], **{name: [] for name in VARIANTS}}
    with tempfile.TemporaryDirectory(prefix="phalanx-step-costs-") as tmp:
        for r in range(args.rounds):
            names = list(medians)
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                if name == "raw loop":
                    medians[name].append(raw(data, skip))
                else:
                    place = Path(tmp) / f"{list(VARIANTS).index(name)}-{r}"
                    medians[name].append(with_phalanx(data, skip, VARIANTS[name], place))
    step = {name: statistics.median(values) * 1e6 for name, values in medians.items()}
    raw_us, default_us = step["raw loop"], step["defaults"]
    print(f"MLP 2x{WIDTH}, batch {BATCH}, 1 thread; {args.rounds} rounds of {args.steps} steps, medians")
    print()
    print("| variant | us per step | vs raw loop | what the feature costs per step |")
    print("| --- | ---: | ---: | ---: |")
    for name, us in step.items():
        # An "off" variant saves what the feature costs; an "(on)" one adds it.
        cost = (us - default_us) if "(on)" in name else (default_us - us)
        cost = "" if name in ("raw loop", "defaults") else f"{cost:+.1f}"
        print(f"| {name} | {us:.1f} | {us - raw_us:+.1f} | {cost} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
