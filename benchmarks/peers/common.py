"""What every contender's worker shares: its command line, the timed loop, the time-to-target loop,
and the result file. A contender only says how it prepares a model, optimizer and loader and how
it takes one training step (see ``Prepared``); everything that is measured is measured here, the
same way for all.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from peers.targets import TASKS, Task, hits
from peers.turns import Turns
from peers.workloads import DATA_SEED, EVAL_SEED, WORKLOADS, Workload, tiny


@dataclass
class Job:
    """One thing to train, as a contender sees it."""

    name: str
    recipe: Workload | Task
    train: TensorDataset
    micro_batch: int  # per process, for the contenders that take a per-process batch
    global_batch: int  # micro_batch x processes, for phalanx (whose loader batch is the global batch)
    lr_multiplier: Callable[[int], float] | None = None  # raw loop, time to target: phalanx's lr rule by hand


@dataclass
class Prepared:
    """A contender's answer to a Job."""

    model: torch.nn.Module  # as the contender wrapped it; evaluation calls it on every rank
    loader: Iterable  # yields (input, target) per micro-step, this process's share
    step: Callable[[torch.Tensor, torch.Tensor], None]  # one micro-step (it steps the optimizer when due)
    set_epoch: Callable[[int], None]
    global_batch: int  # samples per optimizer step over all processes (phalanx's config may change it)
    info: dict = field(default_factory=dict)  # what the contender chose: batch split, precision, ...
    close: Callable[[], None] = lambda: None
    accumulation: int = 1  # micro-steps per optimizer step (phalanx's plan; 1 for the others)
    # Whether the micro-step just taken ended an optimizer step; None: every ``accumulation``-th
    # does. phalanx's says so itself: under batch.adaptive the accumulation changes as it trains.
    stepped: Callable[[], bool] | None = None


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _sync() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _agree(flag: bool) -> bool:
    """Rank 0's decision for everyone (all ranks evaluate identical weights; this only makes sure)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    value = torch.tensor([1.0 if flag else 0.0])
    dist.broadcast(value, 0)
    return bool(value.item())


@functools.cache
def _turns(contender: str) -> Turns | None:
    """This process's place in the turns (one count for all its workloads), or None when the
    contenders do not take turns."""
    return Turns.from_env(contender, world()[0])


class OwnClock:
    """A contender's own training time: taking turns, the waits for a turn are left out."""

    def __init__(self):
        self.spent, self.since = 0.0, time.perf_counter()

    def seconds(self) -> float:
        return self.spent + time.perf_counter() - self.since

    def in_turn(self) -> float:
        return time.perf_counter() - self.since

    def wait(self, turns: Turns) -> None:
        self.spent += time.perf_counter() - self.since
        turns.wait()
        self.since = time.perf_counter()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contender", required=True)
    parser.add_argument("--result", required=True, help="JSON file rank 0 writes")
    parser.add_argument(
        "--workloads", default="", help="throughput mode: comma-separated workloads, trained one after another"
    )
    parser.add_argument("--tiny", action="store_true", help="a few steps each (the test suite)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: the workload's)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: the workload's)")
    parser.add_argument(
        "--blocks", type=int, default=8, help="taking turns (peers/turns.py): the turns a workload's timed steps take"
    )
    parser.add_argument(
        "--turn-seconds",
        type=float,
        default=1.0,
        help="time to target, taking turns: training seconds a turn lasts at least (it ends at an evaluation)",
    )
    parser.add_argument("--task", default=None, help=f"time-to-target mode: {' | '.join(TASKS)}")
    parser.add_argument("--target", type=float, default=None, help="held-out accuracy to reach")
    parser.add_argument("--eval-every", type=int, default=None, help="training samples between evaluations")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="give up after this much training time")
    parser.add_argument("--max-samples", type=int, default=None, help="give up after this many training samples")
    parser.add_argument(
        "--lr-scale",
        type=float,
        default=1.0,
        help="raw loop: lr multiplier after warm-up (phalanx's rule, computed by the driver)",
    )
    parser.add_argument("--warmup-steps", type=int, default=0, help="raw loop: linear lr warm-up steps")
    parser.add_argument(
        "--warmup-start", type=float, default=0.0, help="raw loop: warm-up starts at this fraction of the scaled lr"
    )
    return parser.parse_args()


def lr_rule(args: argparse.Namespace) -> Callable[[int], float] | None:
    """The multiplier per optimizer step for a LambdaLR: linear warm-up to ``lr_scale``."""
    scale, steps, start = args.lr_scale, args.warmup_steps, args.warmup_start
    if scale == 1.0 and steps == 0:
        return None
    return lambda step: scale if step >= steps else scale * (start + (1.0 - start) * (step + 1) / steps)


def main(contender_prepare: Callable[[Job], Prepared], *, versions: dict[str, str]) -> None:
    args = parse_args()
    _, size = world()
    result: dict = {
        "contender": args.contender,
        "world_size": size,
        "threads_per_process": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "python": platform.python_version(), **versions},
    }
    if args.task:
        result["task"] = _to_target(args, contender_prepare, size)
    else:
        result["workloads"] = {
            name: _throughput(args, name, contender_prepare, size) for name in args.workloads.split(",") if name
        }
    rank, _ = world()
    turns = _turns(args.contender)
    if turns is not None:
        turns.done()
    if rank == 0:
        Path(args.result).write_text(json.dumps(result, indent=1), encoding="utf-8")
        print(f"result written to {args.result}", flush=True)
    if dist.is_available() and dist.is_initialized():  # leave together, as every contender's docs ask
        dist.barrier()
        dist.destroy_process_group()


def _throughput(args: argparse.Namespace, name: str, contender_prepare: Callable[[Job], Prepared], size: int) -> dict:
    workload = WORKLOADS[name]
    if args.tiny:
        workload = tiny(workload)
    warmup = args.warmup if args.warmup is not None else workload.warmup
    steps = args.steps if args.steps is not None else workload.steps
    turns = _turns(args.contender)
    if turns is not None:
        turns.wait()  # set-up and warm-up take a turn too: they must not overlap another's timed steps
    data = workload.make_data(workload.micro_batch * size * (warmup + steps), DATA_SEED)
    job = Job(name, workload, data, workload.micro_batch, workload.micro_batch * size)
    prepared = contender_prepare(job)
    prepared.set_epoch(0)
    global_batch = prepared.global_batch
    # Taking turns, the timed steps come in blocks, one per turn; a block's first step, right
    # after the wait, is not counted (its caches went cold while others ran).
    per_block = max(2, -(-steps // args.blocks)) if turns is not None else steps + 1

    # Timing starts at an optimizer-step boundary after `warmup` optimizer steps and covers every
    # later micro-step, data loading included; a step's time is taken when its last micro-step ends.
    samples, micro, timing, last, counted, at_last = 0, 0, False, 0.0, 0, 0
    step_times: list[float] = []
    blocks: list[list[float]] = [[]]
    iterator = iter(prepared.loader)
    while True:
        boundary = micro % prepared.accumulation == 0
        if not timing and micro == warmup * prepared.accumulation:
            _sync()
            timing, taken, at_last = True, 0, samples
            last = time.perf_counter()
        if timing and boundary and turns is not None and taken % per_block == 0:
            blocks.append([])
            turns.wait()  # the first block too: it must not share the turn with set-up
            last = time.perf_counter()
        try:
            x, y = next(iterator)
        except StopIteration:
            break
        prepared.step(x, y)
        samples += x.shape[0] * size
        micro += 1
        if timing and micro % prepared.accumulation == 0:
            now = time.perf_counter()
            if turns is None or taken % per_block:
                step_times.append(now - last)
                blocks[-1].append(now - last)
                counted += samples - at_last
            taken, last, at_last = taken + 1, now, samples
    if not step_times:
        raise SystemExit(
            f"{name}: the data ran out before a timed optimizer step ({micro} micro-steps of {prepared.accumulation} "
            "per step); raise --steps"
        )
    if turns is not None:
        turns.wait()  # evaluation and clean-up, off the others' clocks
    seconds = sum(step_times)
    loss = _eval_loss(prepared.model, workload)
    parameters = sum(p.numel() for p in prepared.model.parameters())
    prepared.close()
    return {
        "title": workload.title,
        "parameters": parameters,
        "global_batch": global_batch,
        "warmup_steps": warmup,
        "timed_steps": len(step_times),
        "timed_samples": counted,
        "seconds": seconds,
        "samples_per_s": counted / seconds,
        "step_time_median_s": statistics.median(step_times),
        "step_times_s": step_times,
        # Taking turns: each turn's median step, in turn order (the conductor's rounds).
        "block_medians_s": [statistics.median(b) for b in blocks if b] if turns is not None else [],
        "final_loss": loss,
        "choices": prepared.info,
    }


def _eval_loss(model: torch.nn.Module, workload: Workload) -> float:
    """Mean loss on a fixed held-out batch, on every rank (identical weights, so identical results;
    running it everywhere keeps any collective inside a wrapped forward matched)."""
    data = workload.make_data(workload.eval_samples, EVAL_SEED)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(data), 256):
            x, y = data[i : i + 256]
            total += workload.loss(model(x).float(), y).item() * len(x)
    model.train()
    return total / len(data)


def _accuracy(model: torch.nn.Module, held_out: TensorDataset) -> float:
    """Argmax accuracy: per sample for a classifier, per token for a language model (targets.hits)."""
    model.eval()
    correct = scored = 0
    with torch.no_grad():
        for i in range(0, len(held_out), 512):
            x, y = held_out[i : i + 512]
            right, total = hits(model(x), y)
            correct, scored = correct + right, scored + total
    model.train()
    return correct / scored


def _to_target(args: argparse.Namespace, contender_prepare: Callable[[Job], Prepared], size: int) -> dict:
    task = TASKS[args.task]
    train, held_out = task.data()
    job = Job(task.name, task, train, task.micro_batch, task.micro_batch * size, lr_rule(args))
    turns = _turns(args.contender)
    if turns is not None:
        turns.wait()  # set-up takes a turn too: it must not overlap another's training
    prepared = contender_prepare(job)
    if job.lr_multiplier is not None and "lr" not in prepared.info:
        warmup = f", linear warm-up over {args.warmup_steps} steps" if args.warmup_steps else ""
        prepared.info["lr"] = f"lr x {args.lr_scale:.4g} (phalanx's rule, by hand){warmup}"
    target = args.target if args.target is not None else task.target
    every = args.eval_every or task.eval_every
    max_samples = args.max_samples or task.max_samples

    _sync()
    clock = OwnClock()
    samples, micro, next_eval, eval_seconds, curve = 0, 0, every, 0.0, []
    reached, epoch, accuracy = False, 0, 0.0
    while not reached and samples < max_samples and clock.seconds() < args.max_seconds:
        prepared.set_epoch(epoch)
        took = micro
        for x, y in prepared.loader:
            prepared.step(x, y)
            # The rows this micro-step trained on, over all processes: right whatever the batch
            # per optimizer step is (batch.adaptive changes it during the run).
            samples += x.shape[0] * size
            micro += 1
            stepped = prepared.stepped() if prepared.stepped else micro % prepared.accumulation == 0
            if samples >= next_eval and stepped:  # between optimizer steps
                # Evaluation time counts in the wall time of both contenders alike.
                began = time.perf_counter()
                accuracy = _accuracy(prepared.model, held_out)
                reached = _agree(accuracy >= target)
                eval_seconds += time.perf_counter() - began
                curve.append({"seconds": clock.seconds(), "samples": samples, "accuracy": accuracy})
                # The next multiple of `every`: a step larger than `every` evaluates once, and the
                # schedule does not fall behind when a larger batch later shrinks again.
                next_eval = (samples // every + 1) * every
                if reached or samples >= max_samples or clock.seconds() >= args.max_seconds:
                    break
                # Taking turns, a turn ends at the first evaluation past --turn-seconds; the ranks
                # agree (rank 0's clock), so that all of them wait for the same turn.
                if turns is not None and _agree(clock.in_turn() >= args.turn_seconds):
                    clock.wait(turns)
        if micro == took:  # the loader ended at once: phalanx's train.max_steps (a `phalanx tune` trial)
            break
        epoch += 1
    seconds = clock.seconds()
    prepared.close()
    return {
        "task": task.name,
        "title": task.title,
        "target_accuracy": target,
        "reached": reached,
        "seconds": seconds,
        "eval_seconds": eval_seconds,
        "samples": samples,
        "epochs": samples / len(train),
        "final_accuracy": accuracy,
        "curve": curve,
        "choices": prepared.info,
    }
