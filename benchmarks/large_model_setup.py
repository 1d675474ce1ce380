"""Setting up a model from pretrained weights under fsdp: phalanx (deferred or whole) against torch by hand.

    .venv/bin/python benchmarks/large_model_setup.py                  # 384 MiB model, 3 rounds, 2 CPU processes
    .venv/bin/python benchmarks/large_model_setup.py --mib 64 --rounds 1
    .venv/bin/python benchmarks/large_model_setup.py --cuda           # each rank on its GPU, NCCL
    .venv/bin/python benchmarks/large_model_setup.py --out docs       # its section of docs/benchmarks.md

The model is an nn.Sequential of nn.Linear(1024, 1024) layers (96 by default, about 384 MiB of
fp32; ``--mib`` sets the layer count). Its "pretrained" weights are written once, from a fixed
seed, by ``safetensors.torch.save_file``. Each round runs the contenders, in an order that
rotates every round, each in 2 fresh processes (``phalanx.spawn``; gloo on CPU, NCCL on CUDA),
fsdp with every Linear its own unit:

- ``phalanx deferred``: ``with session.init_module(): build()``, ``session.setup(model,
  optimizer)``, ``session.load_weights(file)`` (rank 0 reads one tensor at a time and broadcasts);
- ``phalanx deferred, no init``: the same under ``init_module(initialize=False)``, which skips
  ``reset_parameters()`` (the weights are loaded next), as torch by hand does;
- ``phalanx whole``: the model built whole in every process, then the same setup and load;
- ``torch by hand``: FSDP2's documented flow, a meta-device build, ``fully_shard`` on each Linear
  and the root, ``to_empty``, ``safetensors.torch.load_file`` on rank 0 and
  ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``.

Measured in each process, from the start of model construction to the weights being in place: the
wall time, the peak growth of resident memory (VmHWM, reset through /proc/self/clear_refs at the
start) and, on CUDA, ``torch.cuda.max_memory_allocated`` above what was allocated at the start.
Every worker first calls ``track_live_memory()`` (glibc returns freed blocks at once), so resident
memory follows live tensors alike for all. Afterwards each rank compares its shard of every tensor
with the same slice of the file's tensor; a contender that loaded other weights stops the run.
About 1.5 minutes at the defaults on 2 cores (12 launches of 2 processes).
"""

from __future__ import annotations

import os
import sys
import time

WIDTH = 1024
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one Linear's fp32 weight and bias
MiB = 1 << 20
CONTENDERS = ["phalanx deferred", "phalanx deferred, no init", "phalanx whole", "torch by hand"]
BASE = "torch by hand"
TITLE = "## Large-model set-up (issue 12)"


def build(layers: int):
    from torch import nn

    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _restart_peak() -> int:
    """Sets VmHWM to the current VmRSS (Linux >= 4.0) and returns that."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def worker(contender: str, path: str, layers: int, cuda: bool) -> dict:
    """One process of one contender: its set-up seconds, host and device peaks (bytes)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict  # noqa: F401  libraries are loaded before measuring
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    from safetensors.torch import load_file

    from phalanx import Config, Session
    from phalanx.runtime.memory_cap import track_live_memory

    track_live_memory()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    session = None
    if contender.startswith("phalanx"):
        session = Session(
            Config(),
            strategy={"name": "fsdp", "fsdp": {"wrap": ["Linear"]}},
            train={"progress": False, "metrics": False, "seed": 0},
        )
        device = session.device
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    if cuda:
        torch.zeros(1, device=device)  # the CUDA context's host memory is not the model's
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        device_base = torch.cuda.memory_allocated(device)
    dist.barrier()
    host_base = _restart_peak()
    started = time.perf_counter()
    if session is not None:
        if contender.startswith("phalanx deferred"):
            # no init: the weights are loaded next, so reset_parameters() is skipped (as torch by hand skips it)
            with session.init_module(initialize=not contender.endswith("no init")):
                model = build(layers)
        else:
            torch.manual_seed(5)  # its own init, overwritten by the load
            model = build(layers)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer = session.setup(model, optimizer)
        session.load_weights(path)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = build(layers)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device=device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        full = load_file(path) if rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)
        del full
    if cuda:
        torch.cuda.synchronize()
    out = {"seconds": time.perf_counter() - started, "host": _status_bytes("VmHWM") - host_base}
    if cuda:
        out["device"] = torch.cuda.max_memory_allocated(device) - device_base
    _check(model, path, rank, world, contender)
    if session is not None:
        session.close()
    return out


def _check(model, path: str, rank: int, world: int, contender: str) -> None:
    """Each tensor this rank holds must be its slice of the file's: FSDP2 shards dim 0 as
    torch.chunk does."""
    import torch
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, Shard

    wrong: list[str] = []
    with safe_open(path, "pt") as f:
        state = model.state_dict()
        if set(state) != set(f.keys()):
            raise AssertionError(f"{contender}: the model's keys are not the file's")
        for name, value in state.items():
            expected = f.get_tensor(name)
            if isinstance(value, DTensor):
                if tuple(value.placements) != (Shard(0),):
                    raise AssertionError(f"{contender}: {name} is placed {value.placements}, expected Shard(0)")
                chunks = expected.chunk(world, dim=0)
                expected, value = (chunks[rank] if rank < len(chunks) else expected[:0]), value.to_local()
            if not torch.equal(value.detach().cpu(), expected):
                wrong.append(name)
    if wrong:
        raise AssertionError(f"{contender}, rank {rank}: {len(wrong)} tensors differ from the file ({wrong[:3]} ...)")


# -- the driver ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    import argparse
    import statistics
    from pathlib import Path

    import sections
    import torch

    import phalanx
    from phalanx.errors import PhalanxError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=384, help="model size in MiB of fp32 (default 384: 96 layers)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the contenders (default 3)")
    parser.add_argument("--cuda", action="store_true", help="each rank on its GPU (NCCL); adds the device peak")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one contender's 2 processes may take")
    sections.add_out_argument(parser)
    args = parser.parse_args(argv)
    layers = max(1, round(args.mib * MiB / LAYER_BYTES))
    nprocs = 2
    runs: dict[str, list[list[dict]]] = {c: [] for c in CONTENDERS}
    started = time.monotonic()
    try:
        with sections.scratch_directory("phalanx-large-setup-") as tmp:  # the weights file and the run directories
            from safetensors.torch import save_file

            path = str(tmp / "weights.safetensors")
            torch.manual_seed(0)
            save_file({k: v.contiguous() for k, v in build(layers).state_dict().items()}, path)
            for r in range(args.rounds):
                for name in CONTENDERS[r % len(CONTENDERS) :] + CONTENDERS[: r % len(CONTENDERS)]:
                    ranks = phalanx.spawn(
                        worker, nprocs, args=(name, path, layers, args.cuda), cpu=not args.cuda, timeout=args.timeout
                    )
                    runs[name].append(ranks)
                    print(
                        f"round {r + 1}/{args.rounds}, {name}: {max(x['seconds'] for x in ranks):.2f} s, "
                        f"host peak {max(x['host'] for x in ranks) / MiB:.0f} MiB (max over ranks)",
                        flush=True,
                    )
    except PhalanxError as err:
        print(f"large_model_setup: error: {err}", file=sys.stderr)
        return 2

    size = layers * LAYER_BYTES
    gpu = torch.cuda.get_device_name(0) if args.cuda else "none (CPU processes on gloo)"
    # (key, column label, ratio label, format, unit)
    measures = [("seconds", "set-up s", "time", ".2f", 1), ("host", "host peak MiB", "host memory", ".0f", MiB)]
    if args.cuda:
        measures.append(("device", "device peak MiB", "device memory", ".0f", MiB))
    summary: dict[str, dict] = {}
    for name in CONTENDERS:
        summary[name] = {}
        for key, *_, unit in measures:
            for who in ("rank 0", "max"):
                values = [
                    (ranks[0][key] if who == "rank 0" else max(x[key] for x in ranks)) / unit for ranks in runs[name]
                ]
                stats = {"median": statistics.median(values), "min": min(values), "max": max(values)}
                summary[name][f"{key} {who}"] = {**stats, "runs": values}
    printed = sections.Printed()  # what is printed from here on, for --out
    say = printed.say

    say(
        f"\nmodel: {layers} x nn.Linear({WIDTH}, {WIDTH}), {size / MiB:.1f} MiB of fp32 weights; one rank's fp32 "
        f"shard {size / nprocs / MiB:.1f} MiB; {nprocs} processes ({'NCCL, ' + gpu if args.cuda else 'gloo, CPU'}), "
        f"fsdp, each Linear a unit; {args.rounds} round(s), {time.monotonic() - started:.0f} s in all"
    )
    say("set-up: from the start of model construction to the weights being in place; median (min-max) over rounds\n")
    header = ["contender"] + [f"{m[1]}, {who}" for m in measures for who in ("rank 0", "max over ranks")]
    header += [f"{m[2]} vs {BASE}" for m in measures]
    say("| " + " | ".join(header) + " |")
    say("| " + " | ".join(["---"] + ["---:"] * (len(header) - 1)) + " |")
    for name in CONTENDERS:
        cells = [
            sections.spread(summary[name][f"{m[0]} {who}"]["runs"], m[3]) for m in measures for who in ("rank 0", "max")
        ]
        for key, *_ in measures:
            mine, base = summary[name][f"{key} max"]["median"], summary[BASE][f"{key} max"]["median"]
            cells.append(f"x{mine / base:.2f}" if base > 0 else "-")
        say(f"| {name} | " + " | ".join(cells) + " |")
    say("\nratios: medians of the max over ranks, against torch by hand")
    if args.out:
        settings = f"{args.rounds} interleaved rounds; {layers} x nn.Linear({WIDTH}, {WIDTH}), {nprocs} processes, fsdp"
        sections.write_section(
            Path(args.out),
            "large_model_setup",
            TITLE,
            script=__file__,
            argv=argv,
            settings=settings,
            lines=printed.lines,
            figures=summary,
            gpu=gpu,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
