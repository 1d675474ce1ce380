"""What ``session.backward(loss, items=n)`` costs per optimizer step against the plain backward.

    .venv/bin/python benchmarks/items_step.py                         # 8 rounds, ddp and fsdp
    .venv/bin/python benchmarks/items_step.py --rounds 2 --steps 6    # a smoke run
    .venv/bin/python benchmarks/items_step.py --out docs              # its section of docs/benchmarks.md

The workload is a small next-token model (embedding 4096 x 256, two 256 x 256 layers, a 4096-way
head; 1.3 M parameters) on padded sequences of 8 to 64 tokens, micro-batch 8, 2 CPU processes
(gloo), 2 micro-steps per optimizer step. Both contenders run in the same two processes,
interleaved: each round trains ``--steps`` optimizer steps plain, then ``--steps`` with items (the
order alternates every round), so machine noise hits both alike. A step is timed from its first
forward to the end of its ``accumulate`` block on every rank, and counts as the slowest rank's
time. Per contender: the median over rounds (min-max) of each round's median step; the ratio is
each round's items median over the same round's plain median. The collectives are counted too:
those of session/items.py: one ``all_reduce`` (of two numbers) per optimizer step, and one more
for the whole run (the ranks agree on the scale unit); none in the plain steps.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

VOCAB, WIDTH, LENGTH, MICRO, ACCUMULATION, PROCESSES = 4096, 256, 64, 8, 2, 2
TITLE = "## Token-weighted loss: cost per step (issue 22)"
CONTENDERS = ("plain", "items")


def worker(strategy: str, rounds: int, steps: int) -> dict:
    """Both contenders, interleaved, in this process: per round and contender, each step's seconds."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from phalanx import Config, Session

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // PROCESSES))
    calls = {"all_reduce": 0}
    original = dist.all_reduce

    def counted(*args, **kwargs):
        # Only the item weighting's: the Session makes other, periodic ones (its fault checks).
        if sys._getframe(1).f_globals.get("__name__") == "phalanx.session.items":
            calls["all_reduce"] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted  # what the items step adds is counted, not guessed
    global_batch = MICRO * PROCESSES * ACCUMULATION
    session = Session(
        Config(),
        strategy=strategy,
        batch={"global_batch_size": global_batch, "micro_batch_size": MICRO},
        train={"progress": False, "metrics": False, "seed": 0},
        checkpoint={"resume": "never"},
    )
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, VOCAB)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = global_batch * steps * 2 * rounds
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    labels = ids.roll(-1, dims=1)
    lengths = torch.randint(8, LENGTH + 1, (n,), generator=g)
    labels[torch.arange(LENGTH) >= lengths.unsqueeze(1)] = -100
    loader = DataLoader(TensorDataset(ids, labels), batch_size=global_batch, shuffle=True)
    model, optimizer, loader = session.setup(model, optimizer, loader)
    batches = iter(loader)
    times: dict[str, list[list[float]]] = {name: [] for name in CONTENDERS}
    reduces: dict[str, int] = dict.fromkeys(CONTENDERS, 0)
    for r in range(rounds):
        for name in CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]:
            spent = []
            before = calls["all_reduce"]
            for _ in range(steps):
                start = time.perf_counter()
                for _ in range(ACCUMULATION):
                    x, y = next(batches)
                    with session.accumulate(model):
                        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
                        session.backward(loss, items=(y != -100).sum() if name == "items" else None)
                spent.append(time.perf_counter() - start)
            reduces[name] += calls["all_reduce"] - before
            times[name].append(spent)
    out = {"times": times, "all_reduce": reduces, "steps": session.step_count, "threads": torch.get_num_threads()}
    session.close()
    dist.all_reduce = original
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import platform

    import sections
    import torch

    import phalanx
    from phalanx.errors import PhalanxError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds of both contenders (default 8)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per contender and round (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each round left out (default 2)")
    parser.add_argument("--strategies", default="ddp,fsdp", help="comma-separated strategies (default ddp,fsdp)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one strategy's run may take")
    sections.add_out_argument(parser)
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be below --steps ({args.steps}), got {args.warmup}")
    strategies = args.strategies.split(",")
    started = time.monotonic()
    results: dict[str, list[dict]] = {}
    try:
        with sections.scratch_directory("phalanx-items-step-"):
            for strategy in strategies:
                results[strategy] = phalanx.spawn(
                    worker, PROCESSES, args=(strategy, args.rounds, args.steps), cpu=True, timeout=args.timeout
                )
    except PhalanxError as err:
        print(f"items_step: error: {err}", file=sys.stderr)
        return 2

    printed = sections.Printed()
    say = printed.say
    say(
        f"\nnext-token model {VOCAB}x{WIDTH}, 2 layers, fp32, AdamW; micro-batch {MICRO} x {ACCUMULATION} "
        f"micro-steps x {PROCESSES} processes (gloo); {args.steps} steps per contender and round, the first "
        f"{args.warmup} left out; {args.rounds} rounds, {time.monotonic() - started:.0f} s in all; {platform.node()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}"
    )
    say(
        "step: ms, the slowest rank, median over rounds (min-max) of each round's median; "
        "ratio: items / plain, per round\n"
    )
    say("| strategy | plain step ms | items step ms | items / plain | all_reduce per step, plain | items |")
    say("| --- | ---: | ---: | ---: | ---: | ---: |")
    summary: dict[str, dict] = {}
    for strategy, ranks in results.items():
        medians = {}
        for name in CONTENDERS:
            per_round = []
            for r in range(args.rounds):
                slowest = [max(step) * 1e3 for step in zip(*(rank["times"][name][r] for rank in ranks))]
                per_round.append(statistics.median(slowest[args.warmup :]))
            medians[name] = per_round
        ratios = [i / p for i, p in zip(medians["items"], medians["plain"])]
        steps = args.rounds * args.steps
        per_step = {name: ranks[0]["all_reduce"][name] / steps for name in CONTENDERS}
        # One per step, and the run's one agreement on the unit (made in the first items step).
        expected = 1 + 1 / steps
        if per_step["plain"] != 0 or abs(per_step["items"] - expected) > 1e-9:
            print(f"items_step: {strategy}: all_reduce calls per step {per_step}, expected 0 and {expected}")
            return 1
        summary[strategy] = {"plain_ms": medians["plain"], "items_ms": medians["items"], "ratios": ratios}
        summary[strategy]["all_reduce_per_step"] = per_step
        say(
            f"| {strategy} | {sections.spread(medians['plain'], '.2f')} | {sections.spread(medians['items'], '.2f')} | "
            f"{sections.spread(ratios, '.3f')} | {per_step['plain']:.0f} | 1 (+1 per run) |"
        )
    if args.out:
        sections.write_section(
            Path(args.out),
            "items_step",
            TITLE,
            script=__file__,
            argv=argv,
            settings=f"--rounds {args.rounds} --steps {args.steps} --warmup {args.warmup}",
            lines=printed.lines,
            figures=summary,
        )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
