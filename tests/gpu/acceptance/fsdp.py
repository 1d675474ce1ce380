"""FSDP2 alone on the GPU (strategy fsdp, one process: phalanx makes an in-memory process group on
NCCL): fp32 against strategy single, the bf16 MixedPrecisionPolicy against fp32, and cpu_offload."""

from __future__ import annotations

import torch

from tests.gpu.acceptance.report import Check
from tests.gpu.acceptance.workloads import max_relative, relative, train_mlp

STEPS, MICRO = 30, 256
# One process: the reduce-scatter is a copy and the gradient divisor 1, so FSDP computes what
# single computes; only the order of floating-point operations may differ.
SAME_TOLERANCE = 1e-5
OFFLOAD_TOLERANCE = 1e-4  # the optimizer steps on the CPU's kernels instead of CUDA's
UPDATE_TOLERANCE = 0.15  # bf16 parameters against fp32: as autocast's (precision.py)
OFFLOAD = True  # False on run.py --cpu-smoke: phalanx refuses cpu_offload without CUDA


def fsdp(**fsdp_settings) -> dict:
    return {"name": "fsdp", "fsdp": fsdp_settings}


def run() -> list[Check]:
    single = train_mlp(STEPS, MICRO, precision="fp32")
    checks = []

    same = train_mlp(STEPS, MICRO, strategy=fsdp(), precision="fp32")
    diff = max_relative(same.weights, single.weights)
    checks.append(
        Check(
            "fp32 alone vs strategy single",
            diff <= SAME_TOLERANCE and same.stepped == STEPS,
            f"{STEPS} steps: weights differ by {diff:.1e} at most (relative to each tensor's largest)",
            f"within {SAME_TOLERANCE:g}",
            {"max_relative_weight_diff": diff},
        )
    )

    mixed = train_mlp(STEPS, MICRO, strategy=fsdp(), precision="bf16")
    gap = relative(mixed.update, single.update)
    last, base = sum(mixed.losses[-5:]) / 5, sum(single.losses[-5:]) / 5
    stored = sorted(f"{device} {str(dtype).removeprefix('torch.')}" for device, dtype in mixed.held)
    ok = (
        mixed.dtype == torch.bfloat16
        and mixed.held == {("cuda", torch.float32)}
        and gap <= UPDATE_TOLERANCE
        and abs(last - base) <= 0.02 * base + 0.01
    )
    checks.append(
        Check(
            "bf16 MixedPrecisionPolicy vs fp32",
            ok,
            f"layers compute in {str(mixed.dtype).removeprefix('torch.')}, shards stored {', '.join(stored)}, "
            f"weight update {gap:.2%} from fp32's, "
            f"loss {last:.4f} (fp32 {base:.4f})",
            f"bf16 compute, cuda float32 shards; update within {UPDATE_TOLERANCE:.0%}; last-5 loss within 2% + 0.01",
            {"update_gap": gap, "loss": last, "fp32_loss": base},
        )
    )

    if not OFFLOAD:
        checks.append(Check("cpu_offload fp32 vs strategy single", None, "skipped: needs CUDA", "-"))
        return checks
    offload = train_mlp(STEPS, MICRO, strategy=fsdp(cpu_offload=True), precision="fp32")
    diff = max_relative(offload.weights, single.weights)
    checks.append(
        Check(
            "cpu_offload fp32 vs strategy single",
            diff <= OFFLOAD_TOLERANCE and offload.stepped == STEPS and offload.held == {("cpu", torch.float32)},
            f"{STEPS} steps, shards (and their gradients and optimizer state) on "
            f"{'/'.join(sorted(d for d, _ in offload.held))}: weights differ by {diff:.1e}",
            f"shards on the CPU; weights within {OFFLOAD_TOLERANCE:g}",
            {"max_relative_weight_diff": diff},
        )
    )
    return checks
