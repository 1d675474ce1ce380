"""What each of phalanx's per-step features costs (issue 26), in microseconds per optimizer step.

One process, a small MLP (its step is a few hundred microseconds, so phalanx's own work shows),
the README's loop (``session.progress``, ``accumulate``, ``backward``) with a run directory, as
under ``phalanx launch``, so the metrics JSONL and TensorBoard files are written. Every variant
turns one feature off (or, for ``train.memory_cap``, on); the variants and a hand-written loop
alternate within each round, and the figure is each variant's median step over the rounds. What a
feature costs is the defaults' step minus the step without it; what is left with every feature off
is the Session's bookkeeping itself (the porting guards, the step agreement, the calls).

    .venv/bin/python benchmarks/step_costs.py --rounds 7      # about 2 min on 2 cores

``--phalanx NAME=SRC`` (repeatable) compares versions of phalanx instead: the raw loop and the
defaults under each version's source (first on PYTHONPATH), each in a process of its own,
alternating launch by launch; a launch's figure is its *mean* step, which counts the steps that
flush the metrics (a median would leave them out).

    git worktree add /tmp/before <rev>
    .venv/bin/python benchmarks/step_costs.py --phalanx before=/tmp/before/src --phalanx now=src --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
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


def raw(data: TensorDataset, skip: int, stat=statistics.median) -> float:
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
    return stat(times[skip:])


def with_phalanx(data: TensorDataset, skip: int, sections: dict, run_dir: Path, stat=statistics.median) -> float:
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
    return stat(times[skip:])


def _version_worker(contender: str, steps: int) -> None:
    """One launch of ``--phalanx``: the mean step of ``contender`` (raw or defaults), printed in us."""
    torch.set_num_threads(1)
    data, skip = _data(steps), steps // 10
    with tempfile.TemporaryDirectory(prefix="phalanx-step-costs-") as tmp:
        if contender == "raw":
            mean = raw(data, skip, statistics.fmean)
        else:
            mean = with_phalanx(data, skip, {}, Path(tmp) / "run", statistics.fmean)
    print(f"mean-step-us {mean * 1e6:.3f}")


def compare_versions(versions: dict[str, str], rounds: int, steps: int) -> int:
    launches = [(name, src, contender) for name, src in versions.items() for contender in ("raw", "defaults")]
    means: dict[tuple[str, str], list[float]] = {(name, c): [] for name, _, c in launches}
    for r in range(rounds):
        for name, src, contender in launches if r % 2 == 0 else launches[::-1]:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", contender, "--steps", str(steps)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            found = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("mean-step-us ")]
            if out.returncode != 0 or not found:
                print(f"{name} {contender}: failed (exit {out.returncode}): {out.stderr.strip()[-500:]}")
                return 1
            means[(name, contender)].append(float(found[0]))
    print(f"MLP 2x{WIDTH}, batch {BATCH}, 1 thread; {rounds} rounds of {steps} steps; mean step per launch, medians")
    print()
    print("| version | raw loop, us per step | phalanx defaults, us per step | phalanx's own cost |")
    print("| --- | ---: | ---: | ---: |")
    for name in versions:
        raw_us = statistics.median(means[(name, "raw")])
        ours = statistics.median(means[(name, "defaults")])
        print(f"| {name} | {raw_us:.1f} | {ours:.1f} | {ours - raw_us:+.1f} us ({ours / raw_us:.3f}x) |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--phalanx",
        action="append",
        metavar="NAME=SRC",
        help="compare phalanx versions: NAME and the directory that holds its `phalanx` package (repeat)",
    )
    parser.add_argument("--worker", choices=("raw", "defaults"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _version_worker(args.worker, args.steps)
        return 0
    if args.phalanx:
        bad = [v for v in args.phalanx if "=" not in v or not Path(v.split("=", 1)[1], "phalanx").is_dir()]
        if bad:
            parser.error(f"--phalanx {bad[0]}: give NAME=SRC, SRC a directory that holds a phalanx package")
        return compare_versions(dict(v.split("=", 1) for v in args.phalanx), args.rounds, args.steps)
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
