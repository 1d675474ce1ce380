"""What one comparison of the data-parallel replicas' weights (``faults.replica_check_every``) costs,
against the optimizer step it follows.

    .venv/bin/python benchmarks/replica_check.py                        # 7 rounds
    .venv/bin/python benchmarks/replica_check.py --rounds 2 --steps 6   # a smoke run
    .venv/bin/python benchmarks/replica_check.py --out docs             # its section of docs/benchmarks.md

The workload is the MLP of ``mlp_workload.py`` (3.4 M fp32 parameters, AdamW) under ddp on 2 CPU
processes (gloo), one thread each, micro-batch ``--micro``: a light step for its parameter count,
so the worst case for a check, which reads every parameter and both Adam moments twice (the sum
of their bits and the float64 sum of their values) and all-gathers two numbers per tensor. In the
same two processes, interleaved in rounds: ``--steps`` optimizer steps of the Session (the check
off), then ``--checks`` calls of the check itself (``faults/replicas.ReplicaCheck``, built as the
Session builds it: parameters and optimizer state, over the replica group), then as many
fingerprints alone (no collective). Each step and check counts as the slowest rank's time. Per
round: the median step, the median check, their ratio; printed: the median over rounds (min-max).
The cost at an interval of K steps is the ratio / K.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mlp_workload import make_data, make_model  # noqa: E402  (the same MLP workload)

PROCESSES = 2
TITLE = "## Replica check: cost per check (faults.replica_check_every)"
PARTS = ("step", "check", "fingerprint")


def worker(rounds: int, steps: int, checks: int, micro: int) -> dict:
    """Per round and part, each call's seconds on this rank."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from phalanx import Config, Session
    from phalanx.faults.replicas import ReplicaCheck, fingerprint

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // PROCESSES))
    session = Session(
        Config(),
        strategy="ddp",
        batch={"global_batch_size": micro * PROCESSES, "micro_batch_size": micro},
        train={"progress": False, "metrics": False, "seed": 0},
        faults={"replica_check_every": 0},  # this script calls the check itself, between the timed steps
        checkpoint={"resume": "never"},
    )
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n = micro * PROCESSES * (steps * rounds + 1)
    loader = DataLoader(make_data(n), batch_size=micro * PROCESSES, shuffle=True)
    model, optimizer, loader = session.setup(model, optimizer, loader)
    strategy = session.strategy
    check = ReplicaCheck.create(
        1, strategy.replica_group(), session.topology.comm_device, [model], [optimizer], strategy.unwrap
    )
    batches = iter(loader)

    def step() -> None:
        x, y = next(batches)
        with session.accumulate(model):
            session.backward(F.cross_entropy(model(x), y))

    step()  # the Adam moments exist from here: the check reads them as it will in training
    times: dict[str, list[list[float]]] = {part: [] for part in PARTS}
    for _ in range(rounds):
        calls = {
            "step": (step, steps),
            "check": (lambda: check.check(session.step_count), checks),
            "fingerprint": (lambda: fingerprint(check.tensors()[1]), checks),
        }
        for part in PARTS:
            call, count = calls[part]
            dist.barrier()
            spent = []
            for _ in range(count):
                start = time.perf_counter()
                call()
                spent.append(time.perf_counter() - start)
            times[part].append(spent)
    tensors = len(check.tensors()[1])
    session.close()
    return {"times": times, "tensors": tensors, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import platform

    import sections
    import torch

    import phalanx
    from phalanx.config.sections import FaultsConfig
    from phalanx.errors import PhalanxError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of steps and checks (default 7)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per round (default 20)")
    parser.add_argument("--checks", type=int, default=10, help="checks (and fingerprints) per round (default 10)")
    parser.add_argument("--micro", type=int, default=32, help="micro-batch size per process (default 32)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds the run may take")
    sections.add_out_argument(parser)
    args = parser.parse_args(argv)
    default = FaultsConfig().replica_check_every
    started = time.monotonic()
    try:
        with sections.scratch_directory("phalanx-replica-check-"):
            ranks = phalanx.spawn(
                worker,
                PROCESSES,
                args=(args.rounds, args.steps, args.checks, args.micro),
                cpu=True,
                timeout=args.timeout,
            )
    except PhalanxError as err:
        print(f"replica_check: error: {err}", file=sys.stderr)
        return 2

    per_round: dict[str, list[float]] = {part: [] for part in PARTS}
    for part in PARTS:
        for r in range(args.rounds):
            slowest = [max(call) * 1e3 for call in zip(*(rank["times"][part][r] for rank in ranks))]
            per_round[part].append(statistics.median(slowest))
    ratios = [c / s for c, s in zip(per_round["check"], per_round["step"])]
    at_default = [100 * ratio / default for ratio in ratios]

    printed = sections.Printed()
    say = printed.say
    say(
        f"\nMLP of mlp_workload.py (3.4 M fp32 parameters), AdamW, ddp on {PROCESSES} processes (gloo, "
        f"{ranks[0]['threads']} thread each), micro-batch {args.micro}; {ranks[0]['tensors']} tensors compared "
        f"(parameters and both Adam moments); {args.rounds} rounds of {args.steps} steps, {args.checks} checks and "
        f"{args.checks} fingerprints, {time.monotonic() - started:.0f} s in all; {platform.node()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}"
    )
    say("ms: the slowest rank, median over rounds (min-max) of each round's median; ratio: per round\n")
    say(
        f"| step ms | check ms | fingerprint alone ms | check / step | cost at the default interval ({default} steps) |"
    )
    say("| ---: | ---: | ---: | ---: | ---: |")
    say(
        f"| {sections.spread(per_round['step'], '.2f')} | {sections.spread(per_round['check'], '.2f')} | "
        f"{sections.spread(per_round['fingerprint'], '.2f')} | {sections.spread(ratios, '.3f')} | "
        f"{sections.spread(at_default, '.3f')} % |"
    )
    worst = max(at_default)
    say(
        f"\nAt the default faults.replica_check_every ({default}) a check adds {statistics.median(at_default):.2f} % "
        f"to the steps (at most {worst:.2f} % in a round): {'under' if worst < 0.5 else 'over'} the 0.5 % target. "
        "The step is light for its parameters here (one thread, a small batch), so this is near the worst case; "
        "on a GPU both the step and the check's reductions run on the device."
    )
    if args.out:
        sections.write_section(
            Path(args.out),
            "replica_check",
            TITLE,
            script=__file__,
            argv=argv,
            settings=f"--rounds {args.rounds} --steps {args.steps} --checks {args.checks} --micro {args.micro}",
            lines=printed.lines,
            figures={**{f"{part}_ms": per_round[part] for part in PARTS}, "ratios": ratios, "default": default},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
