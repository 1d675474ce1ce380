"""`phalanx plan`'s bytes per device against the caching allocator's peak of one real step, for every
strategy one GPU can run alone.

The plan is made with its Python API (phalanx.plan) for the model trained here: a deep, narrow MLP
(48 layers of 1024, 50M parameters, SGD with momentum), so model state dominates and FSDP's shard
units (one per layer) are small next to it; the activations of its micro-batch are a few per cent.
The measured figure is ``torch.cuda.max_memory_allocated`` over the third optimizer step (the
first two build the optimizer state and DDP's rebuilt buckets), less what was allocated before
the model was built (cuBLAS's workspaces for forward and backward, allocated by a warm-up), which
the plan leaves to its headroom.
"""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from phalanx.plan import count_parameters, make_plan, measure_activations
from phalanx.util.units import format_bytes
from tests.gpu.acceptance import workloads
from tests.gpu.acceptance.report import Check
from tests.gpu.acceptance.workloads import (
    allocated,
    empty_cache,
    mlp,
    peak_allocated,
    quiet,
    reset_peak,
    session,
    sync,
    teacher_data,
)

WIDTH, DEPTH, MICRO = 1024, 48, 128
TOLERANCE = 0.10
MEASURED_STEP = 2  # 0-based: the third step
# (label, strategy section, the plan's row for it). single holds what ddp's row counts, without DDP's buckets.
CASES = [
    ("single", "single", "ddp"),
    ("ddp alone", "ddp", "ddp"),
    ("zero1 alone", "zero1", "zero1"),
    ("fsdp alone, reshard_after_forward true", {"name": "fsdp", "fsdp": {"reshard_after_forward": True}}, "fsdp-zero3"),
    (
        "fsdp alone, reshard_after_forward false",
        {"name": "fsdp", "fsdp": {"reshard_after_forward": False}},
        "fsdp-zero2",
    ),
]


def factory() -> nn.Module:
    return mlp(WIDTH, WIDTH, DEPTH)


def planned() -> tuple[dict[str, float], int]:
    """The plan's total bytes per device for one device, by row, and the parameter count (runs on a CPU)."""
    with torch.device("meta"):
        n_params = count_parameters(factory())
    activations = measure_activations(factory, {}, (WIDTH,), torch.float32, "fp32")
    plan = make_plan(
        n_params,
        1,
        optimizer="momentum",
        accounting="phalanx",
        micro_batch=MICRO,
        activations=activations,
        checkpointed=None,
        checkpoint_classes=[],
        device_memory=None,
        precision="fp32",
    )
    return {row.strategy: row.total for row in plan.rows if not row.checkpointing}, n_params


def warm_up_cublas() -> None:
    """cuBLAS allocates a workspace per handle from the caching allocator at its first matmul; the
    backward runs on the autograd engine's thread, with a handle of its own."""
    layer = nn.Linear(WIDTH, WIDTH, device=workloads.DEVICE)
    x = torch.randn(MICRO, WIDTH, device=workloads.DEVICE, requires_grad=True)
    layer(x).sum().backward()
    sync()


def measured(strategy: str | dict) -> tuple[int, int]:
    """(peak bytes of one step above the baseline, the baseline)."""
    warm_up_cublas()
    gc.collect()
    empty_cache()
    baseline = allocated()
    peak = None
    with quiet():
        run = session(strategy, batch={"global_batch_size": MICRO})
        model = factory()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model, optimizer = run.setup(model, optimizer)
        data = teacher_data(MICRO * (MEASURED_STEP + 1), features=WIDTH)
        loader = run.setup_loader(DataLoader(data, batch_size=MICRO, shuffle=False), train=True)
        for i, (x, y) in enumerate(loader):
            if i == MEASURED_STEP:
                sync()
                reset_peak()
            with run.accumulate(model):
                run.backward(F.cross_entropy(model(x), y))
            if i == MEASURED_STEP:
                sync()
                peak = peak_allocated() - baseline
        run.close()
    del model, optimizer, loader, run
    gc.collect()
    empty_cache()
    return peak, baseline


def run() -> list[Check]:
    plan, n_params = planned()
    checks = []
    for label, strategy, row in CASES:
        peak, baseline = measured(strategy)
        ratio = peak / plan[row]  # (0 on a CPU smoke run, which has no allocator to read)
        checks.append(
            Check(
                label,
                abs(ratio - 1) <= TOLERANCE,
                f"step peak {format_bytes(peak, unit='MiB', decimals=1)} "
                f"(above {format_bytes(baseline, unit='MiB', decimals=1)} held before), plan's {row} row "
                f"{format_bytes(plan[row], unit='MiB', decimals=1)}: {ratio:.3f}x",
                f"measured within {TOLERANCE:.0%} of the plan",
                {
                    "plan_row": row,
                    "planned_bytes": plan[row],
                    "measured_bytes": peak,
                    "baseline_bytes": baseline,
                    "ratio": ratio,
                    "parameters": n_params,
                    "micro_batch": MICRO,
                },
            )
        )
    return checks
