"""What each performance knob (docs/performance.md) does to samples/s on this machine.

Trains the communication-bound MLP of benchmarks/mlp_workload.py (256 -> 4 hidden layers of 1024 ->
10, 3.4M parameters, fp32, Adam) with phalanx on N processes, once per variant of a study,
alternating the variants (A B C A B C ...) and reporting samples/s from the median and from the
10th-percentile step time of all repeats, with each variant's ratio to the first one.

    .venv/bin/python benchmarks/knobs.py --study buckets --nproc 2 --repeats 3
    .venv/bin/python benchmarks/knobs.py --study optimizer --nproc 1
    .venv/bin/python benchmarks/knobs.py --set strategy.ddp.bucket_cap_mb=4 --set compute.optimizer_impl=fused
    .venv/bin/python benchmarks/knobs.py --optimizer-steps     # optimizer.step() alone, per implementation
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

import phalanx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mlp_workload import make_data, make_model  # noqa: E402  (the same MLP workload)

STUDIES: dict[str, list[tuple[str, list[str]]]] = {
    "buckets": [
        # Since issue 26 the default is 25 MiB with DDP's own 1 MiB first bucket.
        ("bucket 25 MiB, every bucket alike", ["strategy.ddp.first_bucket_cap_mb=25"]),
        ("bucket 8 MiB", ["strategy.ddp.bucket_cap_mb=8", "strategy.ddp.first_bucket_cap_mb=8"]),
        ("bucket 4 MiB", ["strategy.ddp.bucket_cap_mb=4", "strategy.ddp.first_bucket_cap_mb=4"]),
        ("bucket 1 MiB", ["strategy.ddp.bucket_cap_mb=1"]),
        ("bucket 25, first 1 MiB (default)", []),
        ("bucket 4, first 1 MiB", ["strategy.ddp.bucket_cap_mb=4", "strategy.ddp.first_bucket_cap_mb=1"]),
    ],
    "unused": [
        ("find_unused_parameters auto (default)", []),
        ("find_unused_parameters true", ["strategy.ddp.find_unused_parameters=true"]),
        ("find_unused_parameters false", ["strategy.ddp.find_unused_parameters=false"]),
    ],
    "optimizer": [
        ("optimizer as built (for-loop on CPU)", []),
        ("optimizer_impl foreach", ["compute.optimizer_impl=foreach"]),
        ("optimizer_impl fused", ["compute.optimizer_impl=fused"]),
    ],
    "hooks": [
        ("no compression (default)", []),
        ("comm_hook fp16", ["strategy.ddp.comm_hook=fp16"]),
    ],
    "compile": [
        ("eager (default)", []),
        ("compute.compile", ["compute.compile=true"]),
    ],
    "preset": [
        ("preset none (default)", []),
        ("preset throughput", ["preset=throughput"]),
    ],
}


def measure(overrides: list[str], micro: int, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` optimizer steps after ``warmup`` (runs in every process)."""
    # Checkpoints away from the working directory, never resumed: a SIGTERM'd run saves one
    # (pre-emption), which the next run would otherwise resume from.
    elsewhere = f"checkpoint.dir={tempfile.gettempdir()}/phalanx-knobs-checkpoints"
    quiet = ["train.progress=false", "train.metrics=false", "checkpoint.resume=never", elsewhere]
    session = phalanx.Session(phalanx.Config.load(overrides=[*quiet, *overrides]))
    world = session.world_size
    n = micro * world * (warmup + steps)
    data = make_data(n)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = session.setup(model, optimizer)
    loader = session.setup_loader(DataLoader(data, batch_size=micro * world, shuffle=True), train=True)
    times, last = [], None
    for i, (x, y) in enumerate(loader):
        if i == warmup and world > 1:
            dist.barrier()
        with session.accumulate(model):
            session.backward(F.cross_entropy(model(x), y))
        now = time.perf_counter()
        if i >= warmup and last is not None:
            times.append(now - last)
        last = now
    session.close()
    return times


def optimizer_steps(repeats: int = 40) -> None:
    """optimizer.step() alone on the MLP's 3.4M parameters, one thread, per implementation: the
    fastest of ``repeats`` steps (what the kernels cost; other jobs only ever add) and the median."""
    torch.set_num_threads(1)
    print("| optimizer | loop | foreach | fused |\n| --- | ---: | ---: | ---: |")
    for name, build in [
        ("Adam", lambda params, **kw: torch.optim.Adam(params, lr=1e-3, **kw)),
        ("SGD (momentum)", lambda params, **kw: torch.optim.SGD(params, lr=0.1, momentum=0.9, **kw)),
        ("RMSprop", lambda params, **kw: torch.optim.RMSprop(params, lr=1e-3, **kw)),
    ]:
        cells = []
        for flags in ({"foreach": False}, {"foreach": True}, {"fused": True}):
            model = make_model()
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            try:
                optimizer = build(model.parameters(), **flags)
            except (TypeError, RuntimeError):
                cells.append("-")  # no such implementation
                continue
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                optimizer.step()
                times.append(time.perf_counter() - start)
            times = times[5:]
            cells.append(f"{min(times) * 1e3:.1f} ms ({statistics.median(times) * 1e3:.1f})")
        print(f"| {name} | {' | '.join(cells)} |")
    print("\nfastest step (median step in parentheses)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", choices=sorted(STUDIES), help="a set of variants to compare")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one variant against the defaults (repeatable)",
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--optimizer-steps", action="store_true", help="time optimizer.step() alone per implementation, in this process"
    )
    args = parser.parse_args()
    if args.optimizer_steps:
        optimizer_steps()
        return
    variants = (
        STUDIES[args.study]
        if args.study
        else [("defaults", []), (" ".join(args.overrides) or "defaults", args.overrides)]
    )
    # On a shared machine other jobs stretch some steps: the median step of all repeats, and the
    # 10th percentile (the steps nothing else slowed down), are reported side by side.
    steps: dict[str, list[float]] = {label: [] for label, _ in variants}
    samples = args.micro_batch * args.nproc
    for repeat in range(args.repeats):
        for label, overrides in variants:
            times = phalanx.spawn(
                measure,
                nprocs=args.nproc,
                args=(overrides, args.micro_batch, args.warmup, args.steps),
                timeout=900,
                cpu=True,
            )[0]
            steps[label].extend(times)
            print(f"  repeat {repeat + 1}: {label}: median step {statistics.median(times) * 1e3:.1f} ms", flush=True)
    rates = {label: (samples / statistics.median(t), samples / _quantile(t, 0.1)) for label, t in steps.items()}
    base = rates[variants[0][0]]
    print(
        f"\n{args.nproc} process(es), micro-batch {args.micro_batch}, {args.repeats} x {args.steps} steps after "
        f"{args.warmup} of warm-up each:\n"
    )
    print(
        "| variant | samples/s (median step) | vs first | samples/s (10th-percentile step) | vs first |\n| --- | ---: "
        "| ---: | ---: | ---: |"
    )
    for label, (median, fast) in rates.items():
        print(f"| {label} | {median:,.0f} | {median / base[0]:.2f}x | {fast:,.0f} | {fast / base[1]:.2f}x |")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


if __name__ == "__main__":
    main()
