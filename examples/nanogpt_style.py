"""A loop shaped like nanoGPT's ``train.py``, on phalanx: no DataLoader, its own counter and learning rate.

    phalanx launch --cpu --nproc 2 examples/nanogpt_style.py --out runs/nanogpt
    python examples/nanogpt_style.py --out runs/nanogpt          # one process

What it keeps from nanoGPT, and what phalanx does for it:

- **Data.** The token stream (``phalanx.demo.text.Corpus``, generated, nothing downloaded) is written
  once as ``train.bin`` / ``val.bin`` (uint16, ``np.memmap``) into ``--out`` by rank 0, the others
  waiting at ``session.barrier()``. Each batch is ``--batch-size`` random positions drawn with
  torch's global generator, as nanoGPT's ``get_batch`` draws them. phalanx seeds that generator with
  ``train.seed + rank`` at ``setup()``, so every rank draws its own positions, and a checkpoint saves
  and restores it per rank, so a resumed run draws what the uninterrupted one would have.
- **Counter and learning rate.** ``iter_num`` and ``best_val_loss`` live in
  ``session.keep(...)``: every checkpoint holds them, and a resumed run starts from the checkpoint's
  values. The cosine schedule with linear warm-up is nanoGPT's ``get_lr``, written into
  ``optimizer.param_groups`` before every step (no LR scheduler is set up).
- **Batch sizes.** ``--batch-size`` is nanoGPT's ``batch_size``: the sequences of one forward, per
  process. ``--grad-accum`` is nanoGPT's ``gradient_accumulation_steps`` as it is configured: the
  micro-steps of one iteration over all processes together (nanoGPT divides it by the world size,
  and asserts that it divides). So the iteration trains ``batch_size * grad_accum`` sequences at any
  number of processes, which is phalanx's global batch: ``batch.global_batch_size = batch_size *
  grad_accum`` and ``batch.micro_batch_size = batch_size``, and each process runs
  ``session.accumulation_steps = grad_accum / world_size`` micro-steps (phalanx refuses a count that
  does not divide, in one line). The default, 2, is two micro-steps in one process and one in each of
  two.
- **The update.** With one micro-step per iteration, ``session.backward(loss)`` then
  ``session.step()``: nanoGPT's ``scaler.scale(loss).backward()`` and ``optimizer.step()`` lines,
  unindented. With more, each micro-step in ``with session.accumulate(model):``, which skips the
  gradient all-reduce on all but the last (nanoGPT's ``model.require_backward_grad_sync``) and steps
  at the end of the last. The loss is **not** divided by the accumulation steps, as nanoGPT divides
  it: ``session.backward`` divides once already.
- **Evaluation** every ``--eval-interval`` iterations: ``eval_iters`` batches of random positions per
  rank from each split, under ``torch.no_grad()``, averaged over the ranks with ``session.reduce``.
- **Checkpoints.** ``session.save()`` every ``--save-interval`` iterations (every rank: it is a
  collective), and a pre-emption: a SIGTERM to ``phalanx launch`` makes every rank checkpoint at the
  end of a step and exit 75 (docs/faults.md). The same command again resumes, in ``setup()``, to the
  same weights an uninterrupted run ends with. At the end rank 0 writes ``session.model_state_dict()``
  to ``OUT/final.pt`` and the counters to ``OUT/final.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import phalanx
from phalanx.demo.gpt import TinyGPT
from phalanx.demo.text import Corpus

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--out", type=Path, default=Path("out-nanogpt"))
p.add_argument("--max-iters", type=int, default=40)
p.add_argument("--eval-interval", type=int, default=20)
p.add_argument("--eval-iters", type=int, default=4)
p.add_argument("--save-interval", type=int, default=20)
p.add_argument("--log-interval", type=int, default=10)
p.add_argument("--batch-size", type=int, default=8, help="sequences per forward, per process (nanoGPT's)")
p.add_argument("--grad-accum", type=int, default=2, help="micro-steps per iteration, all processes together")
p.add_argument("--block-size", type=int, default=32)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--min-lr", type=float, default=3e-4)
p.add_argument("--warmup-iters", type=int, default=5)
args = p.parse_args()

session = phalanx.Session(
    batch={"global_batch_size": args.batch_size * args.grad_accum, "micro_batch_size": args.batch_size},
    checkpoint={"dir": str(args.out / "checkpoints")},
    train={"progress": False},
)

# The token files, once: rank 0 writes them (to a temporary name, renamed when complete, so a run
# stopped mid-write never leaves a short file behind), the others wait for it.
if session.is_main:
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.out / "val.bin").exists():
        corpus = Corpus()  # vocab 400: fits uint16, as GPT-2's 50257 does
        for split, tokens in (("train", corpus.train), ("val", corpus.valid)):
            part = args.out / f"{split}.bin.part"
            arr = np.memmap(part, dtype=np.uint16, mode="w+", shape=(len(tokens),))
            arr[:] = tokens.numpy()
            arr.flush()
            del arr
            os.replace(part, args.out / f"{split}.bin")
session.barrier()
VOCAB = 400


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    # A new memmap per batch, as nanoGPT does (a long-lived one grows the process's memory).
    data = np.memmap(args.out / f"{split}.bin", dtype=np.uint16, mode="r")
    # The global generator: per rank, seeded by phalanx and restored per rank at a resume.
    ix = torch.randint(len(data) - args.block_size, (session.batch.micro_batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + args.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + args.block_size].astype(np.int64)) for i in ix])
    return x.to(session.device), y.to(session.device)


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def get_lr(it: int) -> float:
    """nanoGPT's: linear warm-up, then cosine decay to min_lr at max_iters."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (args.lr - args.min_lr)


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.stack([loss_of(model(x), y) for x, y in (get_batch(split) for _ in range(args.eval_iters))])
        out[split] = session.reduce(losses.mean()).item()  # every rank's own batches, averaged
    model.train()
    return out


# Built after the Session, which seeded every rank alike: every rank starts from the same weights.
model = TinyGPT(vocab=VOCAB, dim=64, layers=2, heads=4, seq=args.block_size)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
model, optimizer = session.setup(model, optimizer)  # a resumed run is restored here
progress = session.keep(iter_num=0, best_val_loss=float("inf"))  # the checkpoint's values after a resume

while progress.iter_num < args.max_iters:
    lr = get_lr(progress.iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if progress.iter_num % args.eval_interval == 0:
        losses = estimate_loss()
        progress.best_val_loss = min(progress.best_val_loss, losses["val"])
        session.print(f"iter {progress.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")

    if session.accumulation_steps == 1:
        x, y = get_batch("train")
        loss = loss_of(model(x), y)
        session.backward(loss)  # no division: one micro-step
        progress.iter_num += 1  # before or after session.step(): a checkpoint holds it either way (data.md)
        session.step()
    else:
        for _ in range(session.accumulation_steps):
            x, y = get_batch("train")
            with session.accumulate(model):  # steps at the end of the last micro-step
                loss = loss_of(model(x), y)
                session.backward(loss)  # not loss / grad_accum: session.backward divides once
                if session.sync_gradients:
                    progress.iter_num += 1  # before or after the step, as above

    if progress.iter_num % args.log_interval == 0:
        session.print(f"iter {progress.iter_num}: loss {loss.item():.4f}, lr {lr:.2e}")
    if args.save_interval and progress.iter_num % args.save_interval == 0:
        # After the step: a resume from here evaluates at the top of the next iteration, as the
        # uninterrupted run does, so both draw the same positions.
        session.save()

state = session.model_state_dict()  # every rank
if session.is_main:
    torch.save(state, args.out / "final.pt")
    summary = {
        "iter_num": progress.iter_num,
        "step_count": session.step_count,
        "best_val_loss": progress.best_val_loss,
        "world_size": session.world_size,
        "accumulation_steps": session.accumulation_steps,
    }
    (args.out / "final.json").write_text(json.dumps(summary) + "\n")
session.close()
