"""Tensor parallelism against data parallelism on 4 CPU processes: step time, bytes each rank sends
per step (measured, and against the formula), and memory per rank (issue 24).

    .venv/bin/python benchmarks/tp_step.py                          # 6 rounds
    .venv/bin/python benchmarks/tp_step.py --rounds 2 --steps 4     # a smoke run
    .venv/bin/python benchmarks/tp_step.py --out docs               # its section of docs/benchmarks.md

Workload: LAYERS of the demo GPT's ``Block(DIM, HEADS)`` (LayerNorm, nn.MultiheadAttention, an MLP
DIM -> 4 DIM -> DIM), an MSE loss on random [GLOBAL, SEQ, DIM] inputs, fp32, AdamW, global batch
GLOBAL. Contenders, all on the same 4 gloo processes: ddp (4 replicas), fsdp (4 shards, one unit
per Block), tp (``strategy.tp.size: 2``: 2 peers x 2 data-parallel replicas) and fsdp x tp (2 peers
x 2 FSDP shards). One spawn holds all four Sessions at once (the worker makes the process group, so
no Session owns it); each round runs every contender's ``--steps`` steps, in an order that rotates
every round, so the machine's noise hits all alike. Building a Session per round instead would
create a new device mesh (new gloo groups) every round, and separate spawns per contender would
interleave only at whole-run granularity.

- Step: from the forward to the end of the ``accumulate`` block (optimizer step included), the
  slowest rank's; median over rounds (min-max) of each round's median; the ratio is per round
  against the same round's ddp.
- Bytes sent: the growth of ``wchar`` in /proc/self/io over the step, i.e. what the process handed
  to write()/writev() -- gloo's TCP sockets, from every thread, whoever called the collective: DDP's
  C++ reducer, FSDP2's all_gather_into_tensor / reduce_scatter_tensor, DTensor's functional
  all-reduces, phalanx's own small ones. Nothing else writes during a step (no progress, metrics or
  checkpoints). Formula, per rank, for a payload of S bytes over n ranks (ring algorithms, which
  gloo uses; checked against single collectives): all-reduce 2(n-1)/n S, all-gather (n-1)/n S (S
  the gathered output), reduce-scatter (n-1)/n S on NCCL but 2(n-1)/n S on gloo, whose
  reduce-scatter is an all-reduce underneath. With P a Block's parameters, P_tp what one tensor
  peer holds of them (the MLP's up weight and bias and down weight halved), A = 4 b SEQ DIM bytes of
  activations at b = GLOBAL / data-parallel size, per Block and step:
  ddp 2(3/4)4P; fsdp two all-gathers (forward, and backward after resharding) 2(3/4)4P plus a
  reduce-scatter of 4P; tp the split MLP's two all-reduces over the 2 peers (the rowwise output
  forward, the colwise input's gradient backward) 2A, plus the replicas' gradient all-reduce of
  4 P_tp over 2; fsdp x tp 2A, plus two all-gathers and a reduce-scatter of 4 P_tp over 2.
- Memory per rank: held, the parameters, gradients and optimizer state the strategy says the rank
  holds (``Strategy.held_bytes``, in a backward); peak, the resident memory the contender added
  from before its model was built to after its warm-up step (after a first pass that builds, steps
  and closes every contender once, so that no contender pays what a process pays once), plus the
  most a round's steps raised the resident peak above their start (activations, gathered
  parameters, buffers), with glibc made to return freed blocks (phalanx's ``track_live_memory``,
  as ``train.memory_cap`` does).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

DIM, HEADS, LAYERS, SEQ, GLOBAL, PROCESSES = 256, 4, 2, 64, 8, 4
TITLE = "## Tensor parallelism: step, bytes sent and memory per rank (issue 24)"
# name: (strategy section, tensor peers, data-parallel ranks)
CONTENDERS = {
    "ddp": ({"name": "ddp"}, 1, 4),
    "fsdp": ({"name": "fsdp", "fsdp": {"wrap": ["Block"]}}, 1, 4),
    "tp": ({"name": "tp", "tp": {"size": 2}}, 2, 2),
    "fsdp x tp": ({"name": "fsdp", "tp": {"size": 2}, "fsdp": {"wrap": ["Block"]}}, 2, 2),
}
MIB = 2**20


def _written() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


def _settle() -> int:
    """Freed heap pages back to the kernel, the resident peak reset to now; returns the resident size."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
    return _status("VmRSS")


def worker(rounds: int, steps: int) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from phalanx import Config, Session
    from phalanx.demo.gpt import Block
    from phalanx.runtime.memory_cap import track_live_memory

    track_live_memory()
    dist.init_process_group("gloo")  # the Sessions find it and keep it: all four live at once
    g = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(GLOBAL, SEQ, DIM, generator=g), torch.randn(GLOBAL, SEQ, DIM, generator=g)

    def build(name: str) -> tuple[tuple, dict]:
        before = _settle()
        session = Session(
            Config(),
            strategy=CONTENDERS[name][0],
            batch={"global_batch_size": GLOBAL},
            train={"progress": False, "metrics": False, "seed": 0},
            checkpoint={"resume": "never"},
        )
        torch.manual_seed(0)
        model = nn.Sequential(*(Block(DIM, HEADS) for _ in range(LAYERS)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = session.setup(model, optimizer)
        dp, rank = session.strategy.data_parallel_size, session.strategy.data_parallel_rank
        share = slice(rank * GLOBAL // dp, (rank + 1) * GLOBAL // dp)  # tensor peers see the same rows
        with session.accumulate(model):  # warm-up step; the optimizer state exists after it
            session.backward(F.mse_loss(model(inputs[share]), targets[share]))
            held = session.strategy.held_bytes(model, optimizer)
        held["optimizer"] = session.strategy.held_bytes(model, optimizer)["optimizer"]
        measured = {"held": held, "resident": _settle() - before, "growth": 0, "ms": [], "sent": []}
        measured["describe"] = session.strategy.describe()
        return (session, model, optimizer, inputs[share], targets[share]), measured

    def close(runs: dict) -> None:
        # Last made, first closed: each Session gives SIGTERM's wake-up pipe back to the one made before it.
        for session, *_ in reversed(runs.values()):
            session.close()

    # A first pass, thrown away: what a process pays once (library pages touched, imports, gloo's
    # buffers: ~100 MiB) would otherwise count as the first contender's resident memory.
    close({name: build(name)[0] for name in CONTENDERS})
    gc.collect()
    runs, out = {}, {}
    for name in CONTENDERS:
        runs[name], out[name] = build(name)
    names = list(CONTENDERS)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            session, model, optimizer, x, y = runs[name]
            start_rss, spent, sent = _settle(), [], []
            for _ in range(steps):
                written, start = _written(), time.perf_counter()
                with session.accumulate(model):
                    session.backward(F.mse_loss(model(x), y))
                spent.append(time.perf_counter() - start)
                sent.append(_written() - written)
            out[name]["growth"] = max(out[name]["growth"], _status("VmHWM") - start_rss)
            out[name]["ms"].append(spent)
            out[name]["sent"].append(sent)
    close(runs)
    dist.barrier()
    dist.destroy_process_group()
    return {"contenders": out, "threads": torch.get_num_threads()}


def block_params() -> tuple[int, int]:
    """A Block's parameters, and what one of 2 tensor peers holds of them."""
    attention = 3 * DIM * DIM + 3 * DIM + DIM * DIM + DIM
    norms = 2 * 2 * DIM
    up, down = 4 * DIM * DIM + 4 * DIM, 4 * DIM * DIM + DIM
    whole = attention + norms + up + down
    return whole, whole - (up + 4 * DIM * DIM) // 2  # colwise up: weight and bias; rowwise down: weight


def formula(name: str, nccl: bool = False) -> float:
    """Bytes one rank sends per step under ``name`` (see the module docstring)."""
    whole, piece = block_params()
    tp, dp = CONTENDERS[name][1:]
    all_reduce = lambda s, n: 2 * (n - 1) / n * s  # noqa: E731
    all_gather = lambda s, n: (n - 1) / n * s  # noqa: E731
    reduce_scatter = all_gather if nccl else all_reduce
    activations = 4 * (GLOBAL // dp) * SEQ * DIM
    held = 4 * (whole if tp == 1 else piece)  # bytes of a Block's parameters on one rank, before sharding
    per_block = {
        "ddp": all_reduce(held, dp),
        "fsdp": 2 * all_gather(held, dp) + reduce_scatter(held, dp),
        "tp": 2 * all_reduce(activations, tp) + all_reduce(held, dp),
        "fsdp x tp": 2 * all_reduce(activations, tp) + 2 * all_gather(held, dp) + reduce_scatter(held, dp),
    }
    return LAYERS * per_block[name]


def held_formula(name: str) -> float:
    whole, piece = block_params()
    strategy, tp, dp = CONTENDERS[name]
    return 16 * LAYERS * (whole if tp == 1 else piece) / (dp if strategy["name"] == "fsdp" else 1)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import platform

    import sections
    import torch

    import phalanx
    from phalanx.errors import PhalanxError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds of all contenders (default 6)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per contender and round (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each round left out (default 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds the run may take")
    sections.add_out_argument(parser)
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be below --steps ({args.steps}), got {args.warmup}")
    started = time.monotonic()
    try:
        with sections.scratch_directory("phalanx-tp-step-"):
            results = phalanx.spawn(worker, PROCESSES, args=(args.rounds, args.steps), cpu=True, timeout=args.timeout)
    except PhalanxError as err:
        print(f"tp_step: error: {err}", file=sys.stderr)
        return 2

    ranks = [result["contenders"] for result in results]
    whole, piece = block_params()
    printed = sections.Printed()
    say = printed.say
    say(
        f"\n{LAYERS} x Block({DIM}, {HEADS}) of phalanx.demo.gpt ({LAYERS * whole / 1e6:.2f} M parameters; a tensor "
        f"peer holds {piece / whole:.0%} of each), sequence {SEQ}, global batch {GLOBAL}, fp32, AdamW; {PROCESSES} "
        f"processes (gloo, {results[0]['threads']} thread(s) each); {args.steps} steps per "
        f"contender and round, the first {args.warmup} left out; {args.rounds} rounds, "
        f"{time.monotonic() - started:.0f} s in all; {platform.node()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}"
    )
    say(
        "step: ms, the slowest rank, median over rounds (min-max) of each round's median; vs ddp: per round. sent: "
        "KiB one rank writes to its sockets per step (median over steps, mean over ranks); formula: the module "
        "docstring's, on gloo and on NCCL (whose reduce-scatter sends half of gloo's). held: parameters + gradients "
        "+ optimizer state per rank (max over ranks); peak: resident memory the contender added, steps' peak included\n"
    )
    say(
        "| contender | layout | step ms | vs ddp | sent KiB | formula KiB (gloo) | sent / formula | on NCCL KiB "
        "| held MiB | held vs ddp | peak MiB | peak vs ddp |"
    )
    say("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    medians, summary = {}, {}
    for name in CONTENDERS:
        per_round = []
        for r in range(args.rounds):
            slowest = [max(step) * 1e3 for step in zip(*(rank[name]["ms"][r] for rank in ranks))]
            per_round.append(statistics.median(slowest[args.warmup :]))
        medians[name] = per_round
    for name, (_, tp, dp) in CONTENDERS.items():
        ratios = [m / d for m, d in zip(medians[name], medians["ddp"])]
        sent = statistics.mean(
            statistics.median(s for rnd in rank[name]["sent"] for s in rnd[args.warmup :]) for rank in ranks
        )
        expected, nccl = formula(name), formula(name, nccl=True)
        held = max(sum(rank[name]["held"].values()) for rank in ranks)
        peak = max(rank[name]["resident"] + rank[name]["growth"] for rank in ranks)
        summary[name] = {
            "step_ms": medians[name], "vs_ddp": ratios, "sent_bytes": sent, "formula_bytes": expected,
            "nccl_formula_bytes": nccl, "held_bytes": held, "peak_bytes": peak, "describe": ranks[0][name]["describe"],
            "held_parts": ranks[0][name]["held"],
        }  # fmt: skip
        base = summary["ddp"]
        say(
            f"| {name} | tp {tp} x dp {dp} | {sections.spread(medians[name], '.1f')} | "
            f"{sections.spread(ratios, '.2f')} | {sent / 1024:,.0f} | {expected / 1024:,.0f} | {sent / expected:.3f} | "
            f"{nccl / 1024:,.0f} | {held / MIB:.2f} | x{held / base['held_bytes']:.2f} | {peak / MIB:.1f} | "
            f"x{peak / base['peak_bytes']:.2f} |"
        )
    say("\nlayouts: " + "; ".join(f"{n}: {s['describe']}" for n, s in summary.items()))
    # 4 bytes of weight, 4 of gradient and 8 of AdamW state per parameter the rank holds.
    held = {n: s["held_bytes"] / held_formula(n) for n, s in summary.items()}
    say("held / (16 bytes x parameters the rank holds): " + ", ".join(f"{n} {r:.3f}" for n, r in held.items()))
    say(NOTE)
    if args.out:
        sections.write_section(
            Path(args.out),
            "tp_step",
            TITLE,
            script=__file__,
            argv=argv,
            settings=f"--rounds {args.rounds} --steps {args.steps} --warmup {args.warmup}",
            lines=printed.lines,
            figures=summary,
        )
    return 0


NOTE = """
What gloo on CPU says about a GPU, and what it does not. The four processes share 2 cores (one
thread each) and their collectives are copies through loopback TCP, so the step times rank the
contenders' arithmetic and copying on this machine and nothing more: on a GPU node, TP's activation
all-reduces sit on the critical path of every split layer (forward and backward) over NVLink, while
DDP's and FSDP's gradient traffic overlaps the backward; neither bandwidth nor overlap is modelled
here, so no step ratio above predicts a GPU's. What carries over: the bytes each rank sends per step
(the same collectives of the same sizes; NCCL's ring all-reduce and all-gather send the same
multiples, its reduce-scatter half of gloo's: the "on NCCL" column), and what each rank holds of
the parameters, gradients and optimizer state. What does not: the peak's activation and buffer
share (CPU kernels' workspaces and glibc are not cuBLAS and the CUDA caching allocator), nor the
cost of the attention TP keeps whole and computes on every peer."""


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
