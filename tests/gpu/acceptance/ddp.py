"""The default multi-GPU path, strategy ddp, in bf16 and fp16 (autocast; fp16 with the GradScaler):

- alone (one process: a one-rank NCCL group and torch's DistributedDataParallel on cuda:0), against
  ddp alone in fp32 on the same batches;
- 2 processes sharing cuda:0 over gloo (NCCL refuses two ranks on one GPU), against one process in
  the same precision on the same global batches: the gradients of two halves averaged by the
  all-reduce, unscaled by the GradScaler after it.

The precision part checks the precisions on strategy single in more depth; this one checks that DDP's
wrapper, its all-reduce and the mixed-precision objects work together on a GPU.
"""

from __future__ import annotations

import statistics

import phalanx
from tests.gpu.acceptance.processes import GLOBAL, TIMEOUT_S, spawn_takes_gloo, worker
from tests.gpu.acceptance.report import Check
from tests.gpu.acceptance.workloads import train_mlp, window_gap

STEPS = 30
MODES = ("bf16", "fp16")
# As precision.py's loss-curve tolerance (5-step window means against fp32's); SGD here, so looser
# than its Adam figure would need, never tighter.
CURVE_TOLERANCE = 0.10
# Two processes against one in the same precision: the same samples, rounded in other groupings, so
# the losses agree closely but not bit for bit; last-5 mean within 2% + 0.01, as precision.py's.
SHARED_TOLERANCE = 0.02


def alone_checks() -> list[Check]:
    base = train_mlp(STEPS, GLOBAL, strategy="ddp", precision="fp32")
    checks = []
    for mode in MODES:
        run = train_mlp(STEPS, GLOBAL, strategy="ddp", precision=mode)
        gap = window_gap(run.losses, base.losses)
        scaler = run.session.precision.scaler
        dtype = str(run.dtype).removeprefix("torch.")
        ok = dtype == {"bf16": "bfloat16", "fp16": "float16"}[mode] and gap <= CURVE_TOLERANCE
        ok = ok and (scaler is not None) == (mode == "fp16") and run.stepped > STEPS // 2
        figure = f"autocast {dtype}, loss {run.losses[0]:.3f} -> {run.losses[-1]:.3f} (fp32 -> {base.losses[-1]:.3f})"
        figure += f", 5-step means at most {gap:.1%} from fp32's, {STEPS - run.stepped} step(s) skipped"
        checks.append(
            Check(
                f"ddp alone {mode} vs ddp fp32, {STEPS} steps",
                ok,
                figure,
                f"autocast {mode}; every 5-step mean within {CURVE_TOLERANCE:.0%} of fp32's; GradScaler iff fp16",
                {"losses": run.losses, "fp32_losses": base.losses, "max_window_gap": gap, "stepped": run.stepped},
            )
        )
    return checks


def shared_checks() -> list[Check]:
    if not spawn_takes_gloo():
        reason = "not available in this phalanx: phalanx.spawn has no backend='gloo'"
        return [Check(f"ddp {mode}, 2 processes on cuda:0", None, reason, "-") for mode in MODES]
    checks = []
    for mode in MODES:
        one = train_mlp(STEPS, GLOBAL, precision=mode)
        ranks = phalanx.spawn(worker, 2, ("ddp", STEPS, mode), cpu=False, backend="gloo", timeout=TIMEOUT_S)
        # Each rank's loss is its half's mean; the two halves' mean is the global batch's.
        losses = [statistics.mean(pair) for pair in zip(*(r["losses"] for r in ranks))]
        last, base = statistics.mean(losses[-5:]), statistics.mean(one.losses[-5:])
        placed = all(r["device"] == "cuda:0" and r["backend"] == "gloo" and r["steps"] > STEPS // 2 for r in ranks)
        typed = all(r["dtype"] == str(one.dtype).removeprefix("torch.") for r in ranks)
        scaled = all(r["scaler"] == (mode == "fp16") for r in ranks)
        ok = placed and typed and scaled and abs(last - base) <= SHARED_TOLERANCE * base + 0.01
        checks.append(
            Check(
                f"ddp {mode}, 2 processes on cuda:0 (gloo) vs one process",
                ok,
                f"ranks on {', '.join(r['device'] for r in ranks)}, autocast {ranks[0]['dtype']}, "
                f"last-5 loss {last:.4f} (one process {base:.4f}), {ranks[0]['steps']} optimizer steps",
                f"both ranks on cuda:0 over gloo; GradScaler iff fp16; last-5 loss within {SHARED_TOLERANCE:.0%} + .01",
                {"losses": losses, "one_process_losses": one.losses, "steps": [r["steps"] for r in ranks]},
            )
        )
    return checks


def run() -> list[Check]:
    return alone_checks() + shared_checks()
