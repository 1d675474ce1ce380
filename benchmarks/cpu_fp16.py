"""What precision.mode costs per training step on a CPU: fp16 autocast against fp32 and bf16.

A small GPT-like model (token embedding, causal self-attention blocks, a vocabulary head: the
shape of nanoGPT), one process, no phalanx: the forward under ``torch.autocast("cpu", dtype)``
as phalanx's precision wraps it (fp16 with a GradScaler, as phalanx does), backward, AdamW step.
The three modes alternate inside each round (rotating who goes first) so that other jobs on the
machine slow all of them alike; each round times ``--steps`` steps per mode after ``--warmup``,
and the table shows the median step over rounds and the ratio to fp32. The figure is quoted by
the warning phalanx prints for fp16 on a CPU (runtime/precision.py) and in docs/precision.md.

    .venv/bin/python benchmarks/cpu_fp16.py --rounds 5 --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

MODES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        return self.head(self.blocks(x))


def run_steps(mode: str, args: argparse.Namespace, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Median seconds per step of a fresh model (same seed for every mode) trained ``args.steps`` steps."""
    torch.manual_seed(0)
    model = TinyGPT(args.vocab, args.width, args.layers, args.heads, args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    dtype = MODES[mode]
    scaler = torch.amp.GradScaler("cpu") if mode == "fp16" else None
    x, y = data
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, args.vocab), y.view(-1))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(args.vocab, (args.batch, args.context + 1), generator=generator)
    data = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    order = list(MODES)
    for round_index in range(args.rounds):
        for mode in order[round_index % len(order) :] + order[: round_index % len(order)]:
            results[mode].append(run_steps(mode, args, data))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, TinyGPT {args.layers}x{args.width}, "
        f"batch {args.batch}x{args.context}, {args.rounds} rounds x {args.steps} steps"
    )
    base = statistics.median(results["fp32"])
    print(f"{'mode':<6} {'median step (s)':>16} {'min-max over rounds (s)':>26} {'x fp32':>8}")
    for mode, values in results.items():
        median = statistics.median(values)
        spread = f"{min(values):.4f}-{max(values):.4f}"
        print(f"{mode:<6} {median:>16.4f} {spread:>26} {median / base:>8.2f}")
    ratios = [f / b for f, b in zip(results["fp16"], results["fp32"])]
    print(f"fp16 / fp32 per round: {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
