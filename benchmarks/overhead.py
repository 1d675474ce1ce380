"""phalanx against a hand-written loop on the same workload: what does the framework cost?

Runs the communication-bound MLP (4 hidden layers of 1024, fp32) with the same seeds, data and
global batch under a raw PyTorch loop (DDP with DistributedSampler when several processes; a plain
loop for one) and under phalanx with default settings, alternating the contenders (A B A B ...)
and reporting the median samples/s of several repeats, each contender's ratio to the raw loop at
the same process count, and scaling efficiency (N processes against 1).

    .venv/bin/python benchmarks/overhead.py --nprocs 1,2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import phalanx

IN, HIDDEN, OUT = 256, 1024, 10


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers, width = [], IN
    for _ in range(4):
        layers += [nn.Linear(width, HIDDEN), nn.ReLU()]
        width = HIDDEN
    return nn.Sequential(*layers, nn.Linear(width, OUT))


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


def raw(micro: int, warmup: int, steps: int) -> dict:
    """The floor: what a careful user writes by hand."""
    world = int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo")
    model = make_model()
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = make_data(micro * world * (warmup + steps))
    sampler = DistributedSampler(data, shuffle=True, seed=0) if world > 1 else None
    loader = DataLoader(data, batch_size=micro, sampler=sampler, shuffle=sampler is None)
    return _timed(loader, warmup, lambda x, y: _raw_step(model, optimizer, x, y), world)


def _raw_step(model, optimizer, x, y) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def with_phalanx(micro: int, warmup: int, steps: int) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    session = phalanx.Session(phalanx.Config(), batch={"global_batch_size": micro * world}, train={"progress": False})
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(make_data(micro * world * (warmup + steps)), batch_size=micro * world, shuffle=True)
    model, optimizer, loader = session.setup(model, optimizer, loader)

    def step(x, y):
        with session.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            session.backward(loss)
        return loss

    return _timed(loader, warmup, step, world)


def _timed(loader, warmup: int, step, world: int) -> dict:
    start, loss = None, None
    for i, (x, y) in enumerate(loader):
        if i == warmup:
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
        loss = step(x, y)
    final = loss.item()
    seconds = time.perf_counter() - start
    timed = (len(loader) - warmup) * loader.batch_size * world
    return {"samples_per_s": timed / seconds, "final_loss": final}


CONTENDERS = {"raw": raw, "phalanx": with_phalanx}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", default="1,2", help="process counts to measure (default 1,2)")
    parser.add_argument("--micro-batch", type=int, default=64, help="samples per process per step (default 64)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender and process count (default 3)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    counts = [int(n) for n in args.nprocs.split(",")]

    runs: dict[tuple[str, int], list[dict]] = {}
    for repeat in range(args.repeats):
        for n in counts:
            order = list(CONTENDERS.items())
            if repeat % 2:  # alternate who goes first, so drift and warm caches favour no one
                order.reverse()
            for name, fn in order:
                out = phalanx.spawn(
                    fn, nprocs=n, args=(args.micro_batch, args.warmup, args.steps), timeout=600, cpu=True
                )[0]
                runs.setdefault((name, n), []).append(out)
                print(
                    f"  repeat {repeat + 1}/{args.repeats} {name:8s} x{n}: {out['samples_per_s']:9.1f} samples/s",
                    file=sys.stderr,
                )

    rows = []
    for (name, n), outs in runs.items():
        sps = statistics.median(o["samples_per_s"] for o in outs)
        rows.append({"contender": name, "nprocs": n, "samples_per_s": sps, "final_loss": outs[-1]["final_loss"]})
    by = {(r["contender"], r["nprocs"]): r for r in rows}
    for r in rows:
        r["ratio_to_raw"] = r["samples_per_s"] / by[("raw", r["nprocs"])]["samples_per_s"]
        one = by.get((r["contender"], 1))
        r["scaling_efficiency"] = r["samples_per_s"] / (r["nprocs"] * one["samples_per_s"]) if one else None

    print(
        f"\nMLP 4x{HIDDEN} fp32, micro-batch {args.micro_batch}, {args.steps} timed steps, median of {args.repeats}; "
        f"torch {torch.__version__}, {os.cpu_count()} cores"
    )
    print(f"{'contender':10s} {'procs':>5s} {'samples/s':>10s} {'vs raw':>7s} {'scaling':>8s} {'final loss':>10s}")
    for r in sorted(rows, key=lambda r: (r["nprocs"], r["contender"] != "raw")):
        eff = f"{r['scaling_efficiency']:.2f}" if r["scaling_efficiency"] is not None else "-"
        print(
            f"{r['contender']:10s} {r['nprocs']:5d} {r['samples_per_s']:10.1f} {r['ratio_to_raw']:7.3f} {eff:>8s} "
            f"{r['final_loss']:10.4f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
