"""Samples/s and MFU of phalanx (strategy single, its defaults) against a hand-written single-GPU
loop on the same model, data and batches, in the same run: contenders interleaved, medians.

The workload is compute-bound on purpose (an MLP of 8 layers of 4096, 134M parameters, 2048
samples per step, loaded a whole batch per fetch), so the GPU sets the pace and what phalanx
adds per step shows as lost samples/s only where it makes the GPU wait.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import phalanx
from phalanx.metrics.flops import flops_per_sample, peak_flops_per_s
from tests.gpu.acceptance import workloads
from tests.gpu.acceptance.report import Check
from tests.gpu.acceptance.workloads import batched_loader, device_name, mlp, on_cuda, quiet, sync, teacher_data

FEATURES, WIDTH, DEPTH, MICRO = 256, 4096, 8, 2048
STEPS = {"bf16": 150, "fp32": 40}  # timed steps: about half a second (bf16) and a second (fp32) on an H200
WARMUP = 5
TOLERANCE = 0.98  # phalanx at least 98% of the raw loop's samples/s: at most 2% overhead
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16}


def loader(steps: int):
    # Shuffled, pinned, in the training process: what both contenders are given.
    pool = teacher_data(8 * MICRO, features=FEATURES)
    return batched_loader(pool, MICRO * (WARMUP + steps), MICRO, shuffle=True, pin_memory=on_cuda())


def raw(mode: str, steps: int) -> float:
    """What a careful user writes by hand for one GPU."""
    device = workloads.DEVICE
    model = mlp(FEATURES, WIDTH, DEPTH).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dtype = AUTOCAST[mode]

    def step(x, y):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        optimizer.step()

    return timed(loader(steps), step, steps)


def with_phalanx(mode: str, steps: int) -> float:
    with quiet():  # its start-up line and end-of-run summary
        session = phalanx.Session(
            phalanx.Config(),
            strategy="single",
            precision=mode,
            train={"progress": False},  # metrics on, as by default
            checkpoint={"resume": "never"},
        )
        model = mlp(FEATURES, WIDTH, DEPTH)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model, optimizer, data = session.setup(model, optimizer, loader(steps))

        def step(x, y):
            with session.accumulate(model):
                session.backward(F.cross_entropy(model(x), y))

        rate = timed(data, step, steps)
        session.close()
    return rate


def timed(data, step, steps: int) -> float:
    start = None
    for i, (x, y) in enumerate(data):
        if i == WARMUP:
            sync()
            start = time.perf_counter()
        step(x, y)
    sync()
    return steps * MICRO / (time.perf_counter() - start)


def run(repeats: int) -> list[Check]:
    name = device_name()
    flops = flops_per_sample(mlp(FEATURES, WIDTH, DEPTH), torch.randn(2, FEATURES))
    checks = []
    for mode, steps in STEPS.items():
        rates = {"raw": [], "phalanx": []}
        for repeat in range(repeats):
            order = [("raw", raw), ("phalanx", with_phalanx)]
            for contender, fn in order if repeat % 2 == 0 else order[::-1]:  # alternate who goes first
                rates[contender].append(fn(mode, steps))
        r, p = statistics.median(rates["raw"]), statistics.median(rates["phalanx"])
        peak = peak_flops_per_s(name, mode)
        mfu = {k: statistics.median(v) * flops / peak if peak else None for k, v in rates.items()}
        shown = f"MFU {mfu['phalanx']:.1%} (raw {mfu['raw']:.1%})" if peak else f"MFU unknown (no peak for {name})"
        checks.append(
            Check(
                f"{mode} phalanx vs hand-written loop",
                p / r >= TOLERANCE,
                f"{p:,.0f} samples/s vs {r:,.0f} ({p / r:.3f}x), {shown}; median of {repeats}",
                f"phalanx at least {TOLERANCE:.2f}x the raw loop (overhead at most {1 - TOLERANCE:.0%})",
                {
                    "samples_per_s": rates,
                    "ratio": p / r,
                    "mfu": mfu,
                    "flops_per_sample": flops,
                    "peak_flops_per_s": peak,
                    "micro_batch": MICRO,
                    "timed_steps": steps,
                },
            )
        )
    return checks
