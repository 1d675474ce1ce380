"""find_unused_parameters: auto, two ways off DDP's search after the first step.

``surgery`` (what phalanx does): the same DistributedDataParallel gets a new reducer without the
search (phalanx._torch_compat.ddp_rebuild_reducer, private DDP names). ``rewrap`` (public API
only): a second DistributedDataParallel around the same module with find_unused_parameters=False;
the user still holds the first wrapper (Session.setup returned it), so its forward is pointed at
the second one, the most favourable public-only form (the first reducer, its autograd hooks and
its gradient buckets stay alive: DDP has no public way to release them). ``false``: DDP without
the search from the start, the floor both should reach.

Plain DDP on 2 gloo CPU processes, the MLP of mlp_workload.py; per repeat each route builds a fresh
model, runs step 1 with the search (``false``: without), switches (timed), then times ``--steps``
steps (each run's median step). The routes alternate inside each repeat (rotating who goes first);
the table shows medians over repeats, the ratio to ``surgery``, the gradient buckets the first
wrapper keeps allocated under ``rewrap`` (extra MB), and whether each route's weights equal
``false``'s bit for bit.

    .venv/bin/python benchmarks/unused_switch.py --repeats 7 --steps 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import phalanx
from phalanx import _torch_compat as compat

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mlp_workload import make_data, make_model  # noqa: E402  (the same MLP workload)

ROUTES = ("surgery", "rewrap", "false")


def _step(handle, optimizer, x, y) -> None:
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(handle(x), y).backward()
    optimizer.step()


def _one(route: str, batches: list, steps: int) -> dict:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ddp = DistributedDataParallel(model, find_unused_parameters=route != "false")
    _step(ddp, optimizer, *batches[0])  # step 1: with the search, except for false
    dist.barrier()
    start = time.perf_counter()
    if route == "surgery":
        compat.ddp_rebuild_reducer(ddp, find_unused_parameters=False)
    elif route == "rewrap":
        second = DistributedDataParallel(model, find_unused_parameters=False)
        ddp.forward = second.forward  # the handle the user holds now runs the second wrapper
    switch = time.perf_counter() - start
    # What stays allocated for the user's handle under rewrap: the first reducer's gradient buckets.
    held = sum(b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets())
    dist.barrier()
    times = []
    for x, y in batches[1 : steps + 1]:
        start = time.perf_counter()
        _step(ddp, optimizer, x, y)  # its all-reduce keeps the processes in step
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)  # a step another process on the machine slowed counts less
    held = held if route == "rewrap" else 0
    return {"switch_s": switch, "step_s": step_s, "held_bytes": held, "state": model.state_dict()}


def worker(repeats: int, steps: int, micro: int) -> dict:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_data(micro * world * (steps + 1))
    batches = [data[(i * world + rank) * micro : (i * world + rank + 1) * micro] for i in range(steps + 1)]
    runs: dict[str, list[dict]] = {route: [] for route in ROUTES}
    for repeat in range(repeats):
        order = ROUTES[repeat % len(ROUTES) :] + ROUTES[: repeat % len(ROUTES)]
        for route in order:
            runs[route].append(_one(route, batches, steps))
    floor = runs["false"][0]["state"]
    same = {
        route: all(torch.equal(run["state"][k], floor[k]) for run in runs[route] for k in floor) for route in ROUTES
    }
    return {
        route: {
            "switch_s": [r["switch_s"] for r in rs],
            "step_s": [r["step_s"] for r in rs],
            "held_bytes": rs[0]["held_bytes"],
            "equal_to_false": same[route],
        }
        for route, rs in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="runs of each route (default 7)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps after the switch (default 30)")
    parser.add_argument("--micro-batch", type=int, default=64, help="samples per process per step (default 64)")
    args = parser.parse_args()
    out = phalanx.spawn(worker, nprocs=2, args=(args.repeats, args.steps, args.micro_batch), timeout=1800, cpu=True)[0]
    med = {route: {k: statistics.median(v[k]) for k in ("switch_s", "step_s")} for route, v in out.items()}
    params = sum(p.numel() for p in make_model().parameters())
    print(
        f"MLP ({params:,} parameters, fp32), 2 gloo processes, micro-batch {args.micro_batch}, "
        f"{args.steps} timed steps, median of {args.repeats}; torch {torch.__version__}, {os.cpu_count()} cores"
    )
    print(
        f"{'route':8s} {'switch ms':>10s} {'x surgery':>10s} {'step ms':>8s} {'x surgery':>10s} {'spread':>7s} "
        f"{'extra MB':>9s}  weights == false"
    )
    for route in ROUTES:
        m, s = med[route], med["surgery"]
        steps = out[route]["step_s"]
        spread = (max(steps) - min(steps)) / m["step_s"]
        switch_ratio = f"{m['switch_s'] / s['switch_s']:10.2f}" if route != "false" else f"{'-':>10s}"
        print(
            f"{route:8s} {m['switch_s'] * 1e3:10.2f} {switch_ratio} "
            f"{m['step_s'] * 1e3:8.2f} {m['step_s'] / s['step_s']:10.3f} "
            f"{spread:7.0%} {out[route]['held_bytes'] / 1e6:9.1f}  {out[route]['equal_to_false']}"
        )


if __name__ == "__main__":
    main()
